"""Gateway configuration: a YAML file, overridden by FLEETGATE_* environment variables.

Precedence (highest first): explicit keyword arguments, environment (prefix FLEETGATE_, nesting with
`__`, e.g. FLEETGATE_LIMITS__QUEUE_SIZE=64 or FLEETGATE_API_KEYS='["k1"]'), the YAML file, defaults.
`fleetgate config check FILE` runs the same validation and explains every problem it finds.
"""

from __future__ import annotations

import contextvars
import os
import re
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from policies.admission import DEFAULT_QUEUE_LOOKAHEAD, DEFAULT_QUEUE_SIZE, DEFAULT_QUEUE_TIMEOUT_S
from policies.pace import PaceSettings
from policies.pooling.aegaeon import Q_MAX_S

WORKER_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def check_worker_id(v: str) -> str:
    """A worker or shared-host id: safe in Redis keys, metric labels and URLs."""
    if not WORKER_ID_RE.match(v):
        raise ValueError("must be 1-128 characters from A-Z a-z 0-9 . _ : -")
    return v
MiB = 1024 * 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ListenConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)


class KvEventsSource(_Strict):
    """Where one worker publishes vLLM's KV-cache events (its --kv-events-config, as the gateway reaches it)."""

    endpoint: str                       # tcp://host:port; a * / 0.0.0.0 host means the worker URL's host
    replay_endpoint: str | None = None  # the publisher's replay ROUTER, for gaps
    topic: str = ""

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_address(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^(tcp://\S+:\d{1,5}|ipc://\S+|inproc://\S+)$", v):
            raise ValueError("must be a ZMQ address such as tcp://10.0.0.5:5557")
        return v


class WorkerConfig(_Strict):
    id: str
    url: str
    role: Literal["mixed", "prefill", "decode"] = "mixed"
    models: list[str] = Field(default_factory=list)  # empty: discovered from the worker's /v1/models
    labels: dict[str, str] = Field(default_factory=dict)
    profile: str = ""
    cap: int | None = Field(None, ge=1)  # max concurrent requests the gateway puts on it
    kv_events: KvEventsSource | None = None  # its KV-event publisher (else discovered, see KvEventsConfig)

    @field_validator("id")
    @classmethod
    def _id_chars(cls, v: str) -> str:
        return check_worker_id(v)

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        return check_worker_url(v)


def check_worker_url(v: str) -> str:
    """A worker base URL: http(s)://host[:port][/prefix], returned without a trailing slash."""
    m = re.match(r"^https?://([^/:\s]+|\[[0-9a-fA-F:]+\])(:(\d{1,5}))?(/\S*)?$", v)
    if not m:
        raise ValueError("must be an http:// or https:// URL such as http://10.0.0.5:8000")
    if m.group(3) and not 0 < int(m.group(3)) < 65536:
        raise ValueError("port must be 1-65535")
    return v.rstrip("/")


class SloConfig(_Strict):
    ttft_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)


SloClassName = Literal["interactive", "batch"]  # RequestFeatures.request_class (X-Request-Class header)


class ModelConfig(_Strict):
    policy: str | None = None  # None: default_policy
    params: dict[str, Any] = Field(default_factory=dict)
    slo: SloConfig = Field(default_factory=SloConfig)
    slo_classes: dict[SloClassName, SloConfig] = Field(default_factory=dict)  # per-class overrides of `slo`


class LearningConfig(_Strict):
    """Online performance models and output-length prediction (gateway/learning.py)."""

    enabled: bool = True
    interval_s: float = Field(0.5, gt=0)           # control loop tick: observations, progress reports, gauges
    refit_interval_s: float = Field(10.0, gt=0)    # refit a profile's PerfModel at most this often...
    refit_min_new: int = Field(16, ge=1)           # ...once this many new observations arrived
    sync_interval_s: float = Field(5.0, gt=0)      # publish to / read from the state store
    max_samples: int = Field(512, ge=8)            # observations kept per profile and phase (this replica)
    prior_weight: float = Field(20.0, ge=0)        # pseudo-observations of the declared profile in a fit
    time_scale: float = Field(1.0, gt=0)           # workers run K x faster than their profiles (simulated fleets)
    priors: dict[str, dict[str, Any]] = Field(default_factory=dict)  # profile -> coefficients (see learning.py)

    @field_validator("priors")
    @classmethod
    def _priors_build(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        from gateway.learning import prior_from_mapping

        for name, data in v.items():
            try:
                prior_from_mapping(data)
            except (TypeError, ValueError, KeyError) as e:
                raise ValueError(f"priors.{name}: {e}") from None
        return v


class LimitsConfig(_Strict):
    max_body_bytes: int = Field(4 * MiB, ge=1024)
    # The admission queue (policies/admission.py; the simulator runs the same one):
    queue_size: int = Field(DEFAULT_QUEUE_SIZE, ge=0)  # per model; 0 disables queueing (429 at once)
    queue_timeout_s: float = Field(DEFAULT_QUEUE_TIMEOUT_S, ge=0)  # longest wait without a TTFT target
    # A drain tries waiting requests until this many found no worker (1: head-of-line FIFO); a new request
    # tries at once while fewer than this many wait.
    queue_lookahead: int = Field(DEFAULT_QUEUE_LOOKAHEAD, ge=1)
    # How often the queue retries besides on every release (this replica's, and other replicas' announced
    # through Redis while requests wait), on a registry change and when a policy asked (None: 0.5 s).
    queue_poll_s: float | None = Field(None, gt=0)
    retries: int = Field(2, ge=0, le=10)  # extra workers tried when one fails before any byte was sent


class TimeoutsConfig(_Strict):
    connect_s: float = Field(3.0, gt=0)
    # Until the worker's response headers. vLLM sends them at once for streams, but only with the
    # finished answer for non-streaming requests, so this also bounds a non-streaming generation.
    first_byte_s: float = Field(300.0, gt=0)
    idle_s: float = Field(60.0, gt=0)  # between two chunks of a stream


class ResumeConfig(_Strict):
    """Streams that survive their worker (gateway/resume.py) and hung-worker detection (policies/pace.py)."""

    max_attempts: int = Field(2, ge=0, le=10)  # continuations per stream after mid-stream failures; 0: off
    # A worker is suspect (out of rotation, its exchanges resumed elsewhere) when a stream's first token or next
    # token is later than stall_factor x its recent p99, at least the floors; cold_*: before it has a pace.
    hung_detection: bool = True
    stall_factor: float = Field(4.0, gt=1)
    gap_floor_s: float = Field(2.0, gt=0)
    first_token_floor_s: float = Field(5.0, gt=0)
    cold_gap_s: float = Field(30.0, gt=0)
    cold_first_token_s: float = Field(60.0, gt=0)
    suspect_hold_s: float = Field(10.0, ge=0)  # a suspect worker stays out of rotation at least this long
    eject_after_errors: int = Field(5, ge=0)  # this many failed requests in a row eject a worker (0: never)

    def pace(self) -> PaceSettings:
        return PaceSettings(factor=self.stall_factor, gap_floor_s=self.gap_floor_s,
                            first_floor_s=self.first_token_floor_s, cold_gap_s=self.cold_gap_s,
                            cold_first_s=self.cold_first_token_s)


class UpstreamTlsConfig(_Strict):
    """TLS to `https://` workers (gateway/upstream.py TlsSettings)."""

    verify: bool = True                  # check the worker's certificate and host name
    ca_bundle: str | None = None         # PEM file of the CAs to trust (default: the system's)
    client_cert: str | None = None       # PEM certificate to present to workers that ask for one
    client_key: str | None = None        # its private key, when not in client_cert

    @field_validator("ca_bundle", "client_cert", "client_key")
    @classmethod
    def _readable(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).is_file():
            raise ValueError(f"no such file: {v!r}")
        return v

    @model_validator(mode="after")
    def _key_needs_cert(self) -> UpstreamTlsConfig:
        if self.client_key is not None and self.client_cert is None:
            raise ValueError("client_key is set without client_cert")
        return self


class UpstreamConfig(_Strict):
    """The one HTTP client to workers (gateway/upstream.py): relaying, health checks, scrapes, discovery, webhooks."""

    max_connections: int | None = Field(None, ge=1)           # all hosts together; None: no limit
    max_connections_per_host: int | None = Field(None, ge=1)  # per worker (scheme, host, port); None: no limit
    pool_timeout_s: float = Field(10.0, gt=0)       # a request waits this long for a connection at the limit
    # Idle connections are not reused after this long: below the worker's own keep-alive (vLLM's uvicorn: 5 s).
    keepalive_expiry_s: float = Field(4.0, gt=0)
    dns_cache_ttl_s: float = Field(300.0, ge=0)     # a host name is resolved once per this long; 0: every connect
    tls: UpstreamTlsConfig = Field(default_factory=UpstreamTlsConfig)


class PdConfig(_Strict):
    """Prefill/decode disaggregation, active for a model while it has prefill or decode workers (gateway/pd.py)."""

    # Prompts whose tokens not cached on a decode-capable worker are at most this many are prefilled
    # there, without a prefill worker (vLLM Router's pd_uncached_token_threshold, docs/reference/peer-routers.md §8.4).
    local_prefill_tokens: int = Field(256, ge=0)
    decode_policy: str | None = None            # placement of the decode leg; None: the model's policy
    decode_policy_params: dict[str, Any] = Field(default_factory=dict)
    kv_hold_s: float = Field(120.0, gt=0)       # producers keep KV this long (VLLM_NIXL_ABORT_REQUEST_TIMEOUT)
    prefill_timeout_s: float = Field(60.0, gt=0)  # a prefill leg that answers nothing this long has failed
    # A prompt the prefill pool's backlog would make miss its TTFT SLO is prefilled by its decode worker.
    prefill_overflow: bool = True


class KvEventsConfig(_Strict):
    """The exact prefix-cache view from the workers' KV-cache events (gateway/kv_events.py, policies/kv_index.py).

    The gateway subscribes to every worker's publisher (its `kv_events:` entry, else GET /kv_event_sources of a
    vLLM >= 0.33 worker when `discover`), keeps an index block hash -> workers, and hashes each request's prompt
    the way the engines do, so policies that ask for it (`precise_prefix`) know each worker's cached prefix.
    The hashing settings must match the engines': block size, --prefix-caching-hash-algo, PYTHONHASHSEED and
    the vLLM version's cache_salt keys (`hash_style`); or key the index on the events' token ids."""

    enabled: bool = False
    discover: bool = True                      # ask GET /kv_event_sources of workers without a kv_events entry
    block_size: int = Field(16, ge=1)          # the engines' --block-size
    hash_algo: Literal["sha256", "sha256_cbor"] = "sha256_cbor"
    hash_seed: str | None = None               # the engines' PYTHONHASHSEED; None: vLLM >= 0.32's fixed seed
    hash_style: Literal["0.11", "0.32"] = "0.11"   # cache_salt untagged (0.11) or tagged (0.32+)
    key_on: Literal["block_hash", "token_ids"] = "block_hash"
    tokenizer: str = "sim"                     # sim | a model directory with tokenizer.json | none
    max_blocks: int = Field(1_000_000, ge=1)   # index bound (distinct block hashes), LRU beyond it
    replay_timeout_s: float = Field(2.0, gt=0)
    reconnect_s: float = Field(2.0, gt=0)      # retry discovery / re-subscribe this often


ServiceSource = Literal["header", "tenant", "model"]


class ServicePriorityConfig(_Strict):
    """Service-aware priority across the services sharing a model's workers (gateway/services.py,
    policies/service_priority.py)."""

    order: Literal["off", "fcfs", "round_robin", "seallm"] = "off"
    # Also set vLLM's `priority` field (workers must run `--scheduling-policy priority`, else vLLM answers 400).
    engine_priority: bool = False
    # Where a request's service comes from, first match wins: the X-Service header, the tenant (API key), the model.
    service_from: list[ServiceSource] = Field(default_factory=lambda: ["header", "tenant", "model"], min_length=1)
    starvation_s: dict[str, float] = Field(default_factory=dict)   # per service; others: default_starvation_s
    default_starvation_s: float = Field(10.0, gt=0)
    prompt_token_cost: float = Field(1.0 / 256.0, ge=0)             # decode iterations per prompt token

    @field_validator("starvation_s")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [k for k, x in v.items() if not x > 0]
        if bad:
            raise ValueError(f"starvation thresholds must be > 0 seconds (services {', '.join(bad)})")
        return v


SharedSleepLevel = Literal[1, 2]


class SharedEngineConfig(_Strict):
    """One model's engine on a shared host: a vLLM server started with --enable-sleep-mode (dev-mode endpoints
    /sleep, /wake_up, /is_sleeping: docs/reference/vllm-interface.md §6.1)."""

    url: str
    id: str | None = None           # its worker id; default `<host>:<model with / as _>`
    profile: str = ""               # the engine's performance profile (as workers[].profile)
    cap: int | None = Field(None, ge=1)
    weight_gb: float | None = Field(None, gt=0)   # the model's weights, for the derived swap cost
    load_s: float | None = Field(None, ge=0)      # overrides the derived wake-up (swap in) seconds
    offload_s: float | None = Field(None, ge=0)   # overrides the derived sleep (swap out) seconds

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        return check_worker_url(v)

    @field_validator("id")
    @classmethod
    def _id_chars(cls, v: str | None) -> str | None:
        return v if v is None else check_worker_id(v)


class SharedHostConfig(_Strict):
    """A worker host (one GPU or TP group) holding several models' engines, at most `max_awake` of them awake
    at once (its memory); the gateway's swap controller (gateway/pooling.py) puts engines to sleep and wakes
    them as requests arrive (issue 20), or with `scheduling: turns` runs one engine at a time in Aegaeon's
    decode turns (gateway/turns.py)."""

    id: str
    engines: dict[str, SharedEngineConfig | str] = Field(min_length=1)   # model -> engine (or just its URL)
    max_awake: int = Field(1, ge=1)
    link_gb_per_s: float = Field(25.0, gt=0)      # host <-> GPU bandwidth (PCIe 4.0 x16 ~ 25 GB/s)
    wake_overhead_s: float = Field(0.0, ge=0)     # the engine's fixed wake-up cost on top of the weight copy
    sleep_level: SharedSleepLevel = 1             # /sleep?level=: 1 offloads the weights to CPU, 2 discards them
    swap_timeout_s: float = Field(60.0, gt=0)     # a /sleep or /wake_up answering nothing this long has failed
    # With no idle engine: once a model has waited this long, the least busy engine stops taking requests and is
    # swapped out when its last one ends (policies/pooling/swapping.py); null: only idle engines are swapped out
    # (ServerlessLLM's rule: a model with steady traffic then keeps its host while others wait until refused;
    # both attained 1.000 on bench/results/pooling.md's "Live" point).
    drain_after_s: float | None = Field(1.0, ge=0)
    # request: an engine is swapped only once idle or drained (policies/pooling/swapping.py). turns: Aegaeon's
    # decode turns (gateway/turns.py): one engine runs at a time, each model with requests in flight gets a
    # time quota per round (eq. 2-3, at most q_max_s) and the others are paused (/sleep?mode=keep) meanwhile
    scheduling: Literal["request", "turns"] = "request"
    q_max_s: float = Field(Q_MAX_S, gt=0)             # turns: the largest quota of a turn (Aegaeon's Q_MAX)
    tbt_ms: float | None = Field(None, gt=0)      # turns: the TBT target d of eq. 2-3; default slo.tpot_ms
    # turns at sleep level >= 1: stock vLLM dropped the paused requests' KV, so a turn first recomputes it; count
    # that estimate as switching (in eq. 3's c, and the quota starts after it), else a quota shorter than the
    # recomputation decodes nothing (simulator/pooled.py `recompute_quota`, bench/results/pooling_seeds.md)
    recompute_quota: bool = True

    @field_validator("id")
    @classmethod
    def _id_chars(cls, v: str) -> str:
        return check_worker_id(v)

    @field_validator("engines", mode="after")
    @classmethod
    def _engine_objects(cls, v: dict[str, SharedEngineConfig | str]) -> dict[str, SharedEngineConfig | str]:
        return {m: SharedEngineConfig(url=e) if isinstance(e, str) else e for m, e in v.items()}

    def engine(self, model: str) -> SharedEngineConfig:
        e = self.engines[model]
        assert isinstance(e, SharedEngineConfig)
        return e

    def worker_id(self, model: str) -> str:
        e = self.engine(model)
        return e.id or f"{self.id}:{re.sub(r'[^A-Za-z0-9._:-]', '_', model)}"[:128]

    def workers(self) -> list[WorkerConfig]:
        """One worker per engine, labelled with its host."""
        return [WorkerConfig(id=self.worker_id(m), url=self.engine(m).url, models=[m], profile=self.engine(m).profile,
                             cap=self.engine(m).cap, labels={"shared_host": self.id}) for m in self.engines]


class HealthConfig(_Strict):
    interval_s: float = Field(2.0, gt=0)
    timeout_s: float = Field(1.0, gt=0)
    failures_to_eject: int = Field(2, ge=1)
    successes_to_restore: int = Field(2, ge=1)


class LoggingConfig(_Strict):
    """Process logs (gateway/logs.py) and the per-request access log (gateway/access_log.py)."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["text", "logfmt", "json"] = "text"
    access_log: bool = True
    rate_limit_window_s: float = Field(10.0, gt=0)   # the same message at most `rate_limit_burst` times per window
    rate_limit_burst: int = Field(5, ge=1)


class TracingConfig(_Strict):
    """OpenTelemetry spans per request (gateway/tracing.py; needs the `tracing` extra)."""

    enabled: bool = False
    service_name: str = "fleetgate"
    otlp_endpoint: str | None = None                  # e.g. http://otel-collector:4318/v1/traces (OTLP/HTTP)
    headers: dict[str, str] = Field(default_factory=dict)
    timeout_s: float = Field(10.0, gt=0)
    sample_ratio: float = Field(1.0, ge=0, le=1)      # of traces the gateway starts (a sampled parent wins)


class ApiKeyConfig(_Strict):
    """One inference key and its limits (gateway/auth.py, gateway/ratelimit.py). `key` is the secret itself or
    `sha256:<64 hex digits>` of it (the config then holds no secret). Limits left out are not enforced."""

    key: str = Field(min_length=8)
    name: str = ""
    rpm: int | None = Field(None, ge=1)               # requests per minute
    tpm: int | None = Field(None, ge=1)               # tokens per minute: prompt + max_tokens reserved, settled
    max_concurrency: int | None = Field(None, ge=1)   # requests in flight at once (all replicas)
    models: list[str] = Field(default_factory=list)   # empty: every model

    @field_validator("key")
    @classmethod
    def _key_form(cls, v: str) -> str:
        if v.startswith("sha256:") and not re.fullmatch(r"sha256:[0-9a-fA-F]{64}", v):
            raise ValueError("a hashed key is `sha256:` and 64 hex digits")
        return v


class AuthConfig(_Strict):
    """Who may call what. `admin_key` (or env FLEETGATE_ADMIN_KEY) guards /admin/*; without it the admin API is
    off. Inference keys: `keys` (with limits) and the top-level `api_keys` (no limits); none at all: open."""

    admin_key: str | None = Field(None, min_length=16)
    keys: list[ApiKeyConfig] = Field(default_factory=list)

    @field_validator("admin_key")
    @classmethod
    def _admin_form(cls, v: str | None) -> str | None:
        if v is not None and v.startswith("sha256:") and not re.fullmatch(r"sha256:[0-9a-fA-F]{64}", v):
            raise ValueError("a hashed key is `sha256:` and 64 hex digits")
        return v


class AdminConfig(_Strict):
    # Hosts a worker added through the admin API may be on: names (`gpu-1.internal`), wildcards (`*.svc`),
    # addresses and networks (`10.0.0.0/8`). Always allowed too: loopback and the configured workers' hosts.
    worker_hosts: list[str] = Field(default_factory=list)


class MetricsConfig(_Strict):
    auth: bool = False                 # /metrics requires `Authorization: Bearer <metrics.key or the admin key>`
    key: str | None = Field(None, min_length=16)


class ServerConfig(_Strict):
    """Limits on what clients can make the gateway hold (gateway/client_limits.py)."""

    header_timeout_s: float = Field(10.0, gt=0)    # from a request's first byte to the end of its headers
    body_timeout_s: float = Field(30.0, gt=0)      # the longest gap between two pieces of a request body
    keepalive_s: float = Field(5.0, gt=0)          # an idle connection (new, or between requests) is closed
    max_header_bytes: int = Field(64 * 1024, ge=1024)   # request line plus headers; beyond: 431
    max_headers: int = Field(100, ge=8)            # header lines; beyond: 431
    max_connections: int = Field(4096, ge=1)       # open client connections; beyond: closed at once
    # Peers whose X-Forwarded-For is kept (the client address is appended to it); others' is replaced.
    trusted_proxies: list[str] = Field(default_factory=list)

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        import ipaddress

        for item in v:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"{item!r} is not an IP address or network") from None
        return v


class BatchConfig(_Strict):
    """OpenAI Files + Batches API and the runner that feeds queued batch requests to spare capacity
    (gateway/batch_api.py, gateway/batch_runner.py)."""

    enabled: bool = True
    max_file_bytes: int = Field(100 * MiB, ge=1024)   # one uploaded JSONL file
    max_requests: int = Field(50_000, ge=1)           # lines in one batch input file
    poll_s: float = Field(0.1, gt=0)                  # the runner looks for spare capacity this often
    lease_s: float = Field(10.0, gt=0)                # a claimed request returns to the queue if not renewed
    slots_per_worker: int = Field(8, ge=1)            # batch requests per worker that has no cap
    max_inflight: int = Field(256, ge=1)              # batch requests this replica runs at once
    file_ttl_s: float = Field(30 * 86_400.0, gt=0)    # files expire this long after upload unless expires_after
    storage_per_key_bytes: int = Field(1024 * MiB, ge=1024)  # files one key may keep (uploads beyond: refused)


class SimActuatorConfig(_Strict):
    """`sim`: workers are simulated vLLM servers started in this process (simulator/fleet.py)."""

    profile: str = "llama3-8b-h100"
    model: str | None = None                          # served model name (default: the profile's)
    time_scale: float = Field(1.0, gt=0)
    cold_start_s: float = Field(30.0, ge=0)           # wall seconds before a new worker takes traffic
    initial: dict[Literal["interactive", "mixed", "batch"], int] = Field(default_factory=dict)  # at start, no cold start
    seed: int = 0
    cap: int | None = Field(None, ge=1)               # new workers' cap (None: the local autoscaler's, if on)
    # Worker n (sim-n, the lowest n not in use) listens on base_port + n; 0: any free port.
    base_port: int = Field(0, ge=0, le=65535)


class WebhookActuatorConfig(_Strict):
    """`webhook`: POST the desired state to `url`, read back the fleet (gateway/actuators.py)."""

    url: str | None = None
    timeout_s: float = Field(5.0, gt=0)
    headers: dict[str, str] = Field(default_factory=dict)


class ActuatorConfig(_Strict):
    kind: Literal["none", "sim", "webhook"] = "none"  # none: export the numbers only (KEDA reads them)
    sim: SimActuatorConfig = Field(default_factory=SimActuatorConfig)
    webhook: WebhookActuatorConfig = Field(default_factory=WebhookActuatorConfig)

    @model_validator(mode="after")
    def _webhook_url(self) -> ActuatorConfig:
        if self.kind == "webhook":
            if not self.webhook.url:
                raise ValueError("webhook.url is required with kind: webhook")
            check_worker_url(self.webhook.url)
        return self


class AutoscaleConfig(_Strict):
    """Chiron's local caps and global pool sizes with a leader lease (gateway/autoscaler.py)."""

    enabled: bool = False
    interval_s: float = Field(5.0, gt=0)              # global decision period
    local_interval_s: float = Field(2.0, gt=0)        # local cap window (Chiron Algorithm 1)
    sample_s: float = Field(0.25, gt=0)               # in-flight sampling for busy / cap-binding
    local_caps: bool = True                           # enforce per-worker caps from Algorithm 1
    itl_slo_ms: float | None = Field(None, gt=0)      # interactive/mixed workers; default slo.tpot_ms, else 200
    batch_itl_slo_ms: float = Field(2000.0, gt=0)     # batch workers (Chiron section 6: 2 s)
    busy_cap: int = Field(16, ge=1)                   # "busy" denominator for a worker without a cap
    local: dict[str, Any] = Field(default_factory=dict)    # policies.autoscale.LocalConfig fields
    scaler: dict[str, Any] = Field(default_factory=dict)   # policies.autoscale.GlobalConfig fields
    lease_ttl_s: float = Field(10.0, gt=0)            # leader lease; a dead leader is replaced after this
    drain_timeout_s: float = Field(60.0, gt=0)        # in-flight requests of a removed worker get this long
    rate_window_s: float = Field(60.0, gt=0)
    throughput_window_s: float = Field(60.0, gt=0)
    actuator: ActuatorConfig = Field(default_factory=ActuatorConfig)

    @field_validator("local", "scaler")
    @classmethod
    def _policy_params(cls, v: dict[str, Any], info: Any) -> dict[str, Any]:
        from policies.autoscale import GlobalConfig, LocalConfig

        try:
            if info.field_name == "local":
                LocalConfig(itl_slo_s=1.0, **v)
            else:
                GlobalConfig(**v)
        except (TypeError, ValueError) as e:
            raise ValueError(str(e)) from None
        return v

class ReplanConfig(_Strict):
    """Re-planning from observed traffic by the autoscaler's leader (gateway/replanner.py, policies/replan.py):
    the closed-form plan over `gpus` every interval, the interval adapted by SeaLLM eq. 8 (section 4.3)."""

    enabled: bool = False
    gpus: list[str] = Field(default_factory=list)     # the stock, TYPE:COUNT[:PRICE] as `fleetgate plan --gpus`
    interval_s: float = Field(60.0, gt=0)             # I_0, the first interval
    min_interval_s: float = Field(10.0, gt=0)
    max_interval_s: float = Field(600.0, gt=0)
    beta: float = Field(0.1, gt=0, lt=1)              # SeaLLM eq. 8 (0.1 in its section 6.1)
    target: float = Field(0.95, gt=0, le=1)           # SLO attainment a covered plan is estimated to reach
    objective: Literal["cost", "throughput"] = "cost"
    budget_per_hour: float | None = Field(None, gt=0)
    headroom: float = Field(1.0, ge=1.0)              # plan for this multiple of the observed rates
    min_saving: float = Field(0.1, ge=0, lt=1)        # move to a cheaper plan only when it saves this fraction
    min_finished: int = Field(10, ge=1)               # finished requests a window needs for its length means
    time_scale: float | None = Field(None, gt=0)      # model seconds per wall second (default: the sim actuator's)

    @model_validator(mode="after")
    def _bounds(self) -> ReplanConfig:
        if not self.min_interval_s <= self.interval_s <= self.max_interval_s:
            raise ValueError("need min_interval_s <= interval_s <= max_interval_s")
        return self


_FILE_DATA: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("fleetgate_file", default=None)


class _FileSource(PydanticBaseSettingsSource):
    """The YAML file's contents, below the environment in precedence."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return (_FILE_DATA.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_FILE_DATA.get() or {})


class _AliasSource(PydanticBaseSettingsSource):
    """Short environment names for nested settings, between the environment and the file in precedence:
    FLEETGATE_ADMIN_KEY is auth.admin_key."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self().get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        admin = os.environ.get("FLEETGATE_ADMIN_KEY")
        return {"auth": {"admin_key": admin}} if admin else {}


class DeploymentGroupConfig(_Strict):
    """`count` instances of a model on `tp` GPUs of one type (a row of `fleetgate plan`)."""

    model: str                       # short name (policies/hardware.py: llama3-8b, llama2-70b, ...)
    gpu: str                         # a100, h100, l4, v100, a800 (or the full names)
    tp: Literal[1, 2, 4, 8]
    role: Literal["mixed", "prefill", "decode"] = "mixed"
    count: int = Field(ge=0)
    gpus: int | None = Field(None, ge=0)                 # tp x count, as the plan prints it
    price_per_gpu_hour: float | None = Field(None, ge=0)
    cost_per_hour: float | None = Field(None, ge=0)


class DeploymentServiceConfig(_Strict):
    model: str
    share: float = Field(1.0, gt=0)  # its fraction of the traffic (normalised over the services)


class DeploymentConfig(_Strict):
    """A deployment from `fleetgate plan` (the `deployment` section of its JSON, as YAML here); `fleetgate simulate
    --deployment FILE` replays traffic on it."""

    groups: list[DeploymentGroupConfig] = Field(min_length=1)
    services: list[DeploymentServiceConfig] = Field(default_factory=list)
    policy: str | None = None        # the routing policy the plan was scored with
    slo: SloConfig = Field(default_factory=SloConfig)


class GatewayConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLEETGATE_", env_nested_delimiter="__", extra="forbid")

    listen: ListenConfig = Field(default_factory=ListenConfig)
    workers: list[WorkerConfig] = Field(default_factory=list)
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    slo: SloConfig = Field(default_factory=SloConfig)  # every model's SLO unless models.<name> sets one
    slo_classes: dict[SloClassName, SloConfig] = Field(default_factory=dict)
    slo_window_s: float = Field(300.0, gt=0)  # fleetgate_slo_attainment_ratio covers this many seconds
    learning: LearningConfig = Field(default_factory=LearningConfig)
    default_policy: str = "least_requests"
    default_policy_params: dict[str, Any] = Field(default_factory=dict)
    redis_url: str | None = None
    redis_key_prefix: str = Field("fg:", min_length=1)  # several fleets (or tests) can share one Redis
    # Slots a replica leases from Redis per worker at a time and hands out locally (gateway/state/redis_store.py
    # "Leases"); 1: one Redis call per reservation and one per release.
    redis_lease_block: int = Field(8, ge=1)
    replica_id: str | None = None
    api_keys: list[str] = Field(default_factory=list)  # inference keys without limits (see auth.keys)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    resume: ResumeConfig = Field(default_factory=ResumeConfig)
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    pd: PdConfig = Field(default_factory=PdConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)
    replan: ReplanConfig = Field(default_factory=ReplanConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    kv_events: KvEventsConfig = Field(default_factory=KvEventsConfig)
    deployment: DeploymentConfig | None = None  # a `fleetgate plan` result (capacity plan of the fleet)
    service_priority: ServicePriorityConfig = Field(default_factory=ServicePriorityConfig)
    shared_hosts: list[SharedHostConfig] = Field(default_factory=list)   # many models per host (gateway/pooling.py)
    scrape_interval_s: float = Field(0.5, gt=0)
    discovery_interval_s: float = Field(10.0, gt=0)  # re-read /v1/models of workers without configured models

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _AliasSource(settings_cls), _FileSource(settings_cls)

    @model_validator(mode="after")
    def _unique_worker_ids(self) -> GatewayConfig:
        seen: set[str] = set()
        for i, w in enumerate(self.workers):
            if w.id in seen:
                raise ValueError(f"workers[{i}].id: duplicate worker id {w.id!r}")
            seen.add(w.id)
        hosts: set[str] = set()
        for i, h in enumerate(self.shared_hosts):
            if h.id in hosts:
                raise ValueError(f"shared_hosts[{i}].id: duplicate shared host id {h.id!r}")
            hosts.add(h.id)
            for m in h.engines:
                wid = h.worker_id(m)
                if wid in seen:
                    raise ValueError(f"shared_hosts[{i}].engines.{m}: worker id {wid!r} is already taken "
                                     "(give the engine its own `id`)")
                seen.add(wid)
            if h.scheduling == "turns" and self.turn_tbt_s(h) is None:
                raise ValueError(f"shared_hosts[{i}].scheduling: turns needs a TBT target for its quotas "
                                 f"(Aegaeon eq. 2-3): set shared_hosts[{i}].tbt_ms or slo.tpot_ms")
        if self.redis_url is not None and not re.match(r"^(redis|rediss|unix)://", self.redis_url):
            raise ValueError(f"redis_url: expected redis://host:port/db, got {self.redis_url!r}")
        return self

    def turns_workers(self) -> frozenset[str]:
        """Worker ids of the engines on `scheduling: turns` hosts (their silences and timings include other
        models' turns: hung detection and the learner leave them out)."""
        return frozenset(h.worker_id(m) for h in self.shared_hosts if h.scheduling == "turns" for m in h.engines)

    def turn_tbt_s(self, host: SharedHostConfig) -> float | None:
        """A turns host's TBT target in seconds: its `tbt_ms`, else the tightest slo.tpot_ms of its models."""
        if host.tbt_ms is not None:
            return host.tbt_ms / 1000
        tpots = [self.models[m].slo.tpot_ms if m in self.models and self.models[m].slo.tpot_ms is not None
                 else self.slo.tpot_ms for m in host.engines]
        known = [t for t in tpots if t is not None]
        return min(known) / 1000 if known else None

    def all_workers(self) -> list[WorkerConfig]:
        """The configured workers and every shared host's engines."""
        return [*self.workers, *(w for h in self.shared_hosts for w in h.workers())]

    def model_settings(self, model: str) -> tuple[str, dict[str, Any], SloConfig]:
        """(policy name, params, SLO) for a model, falling back to the defaults."""
        mc = self.models.get(model)
        if mc is None or mc.policy is None:
            params = mc.params if mc is not None and mc.params else self.default_policy_params
            return self.default_policy, params, mc.slo if mc is not None else SloConfig()
        return mc.policy, mc.params, mc.slo


class ConfigError(Exception):
    """Every problem found in a configuration, one human-readable line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError([f"{path}: cannot read the file ({e.strerror or e})"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError([f"{path}: YAML syntax error at {where}: {problem}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: the top level must be a mapping of settings, got {type(data).__name__}"])
    return data


def load_config(path: Path | str | None = None, **overrides: Any) -> GatewayConfig:
    """Build the configuration from a YAML file (optional), the environment and `overrides`.

    Raises ConfigError with one line per problem (field path, what was expected, the bad value).
    """
    data = read_yaml(Path(path)) if path is not None else {}
    token = _FILE_DATA.set(data)
    try:
        cfg = GatewayConfig(**overrides)
    except ValidationError as e:
        # Report unknown policy names in the same pass as the schema errors (they need no valid config).
        raw = {**data, **overrides}
        raise ConfigError(describe_validation_error(e, GatewayConfig) + unknown_policy_problems(raw)) from None
    finally:
        _FILE_DATA.reset(token)
    problems = semantic_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def _policy_refs(raw: dict[str, Any]) -> list[tuple[str, Any]]:
    """(where, name) of every policy a raw (unvalidated) config names."""
    refs = [("default_policy", raw.get("default_policy"))]
    models = raw.get("models")
    if isinstance(models, dict):
        refs += [(f"models.{m}.policy", mc.get("policy")) for m, mc in models.items() if isinstance(mc, dict)]
    pd = raw.get("pd")
    if isinstance(pd, dict):
        refs.append(("pd.decode_policy", pd.get("decode_policy")))
    return [(w, n) for w, n in refs if isinstance(n, str)]


def unknown_policy_problems(raw: dict[str, Any]) -> list[str]:
    """Unknown policy names in a raw config, in semantic_problems' words."""
    from policies.base import policy_names

    try:
        known = policy_names()
    except ImportError:
        return []
    return [f"{where}: unknown policy {name!r}; expected one of: {', '.join(known)}"
            for where, name in _policy_refs(raw) if name not in known]


def semantic_problems(cfg: GatewayConfig) -> list[str]:
    """Checks that need more than types: policy names and their parameters."""
    from policies.base import make_policy, policy_names

    problems: list[str] = key_problems(cfg) + deployment_problems(cfg) + replan_problems(cfg)
    try:
        known = policy_names()
    except ImportError as e:  # the policy package is incomplete; report, don't crash
        return [f"cannot load the routing policies to check names: {e}"]
    checks = [("default_policy", cfg.default_policy, cfg.default_policy_params)]
    for name, mc in cfg.models.items():
        if mc.policy is not None:
            checks.append((f"models.{name}.policy", mc.policy, mc.params))
    if cfg.pd.decode_policy is not None:
        checks.append(("pd.decode_policy", cfg.pd.decode_policy, cfg.pd.decode_policy_params))
    for where, name, params in checks:
        if name not in known:
            problems.append(f"{where}: unknown policy {name!r}; expected one of: {', '.join(known)}")
            continue
        try:
            policy = make_policy(name, **params)
        except Exception as e:  # noqa: BLE001 - any constructor complaint is a config problem
            problems.append(f"{where}: policy {name!r} rejects its params {params!r}: {e}")
            continue
        if policy.needs_perf_models:
            problems += unmodelled_workers(cfg, where, name)
    return problems


def replan_problems(cfg: GatewayConfig) -> list[str]:
    """Re-planning runs in the autoscaler's leader, over a GPU stock, against the configured SLO."""
    rc = cfg.replan
    if not rc.enabled:
        return []
    from policies.replan import parse_stock

    problems = []
    if not cfg.autoscale.enabled:
        problems.append("replan.enabled needs autoscale.enabled (the autoscaler's leader re-plans)")
    if cfg.slo.ttft_ms is None or cfg.slo.tpot_ms is None:
        problems.append("replan.enabled needs slo.ttft_ms and slo.tpot_ms (the plan is sized for them)")
    try:
        parse_stock(rc.gpus)
    except ValueError as e:
        problems.append(f"replan.gpus: {e}")
    return problems


def deployment_problems(cfg: GatewayConfig) -> list[str]:
    """Each deployment group's model and GPU are known and the model fits `tp` of those GPUs."""
    from policies.hardware import derive_profile

    problems = []
    for i, g in enumerate(cfg.deployment.groups if cfg.deployment is not None else ()):
        try:
            derive_profile(g.model, g.gpu, g.tp)
        except ValueError as e:
            problems.append(f"deployment.groups[{i}]: {e}")
    return problems


def unmodelled_workers(cfg: GatewayConfig, where: str, policy: str) -> list[str]:
    """An SLO-aware policy needs each worker's own performance model: never another GPU's defaults. A worker
    whose profile is not a built-in profile, a profile file or a `learning.priors` entry is refused."""
    from gateway.learning import known_profile

    out = []
    for i, w in enumerate(cfg.workers):
        if not known_profile(w.profile, cfg.learning.priors):
            out.append(f"workers[{i}].profile: {where} {policy!r} needs each worker's performance model, and "
                       f"{w.profile or '(none)'!r} is no built-in profile, profile file or learning.priors entry "
                       "(fleetgate sim --list-profiles lists the built-in ones)")
    return out
def key_problems(cfg: GatewayConfig) -> list[str]:
    """The same key twice, or the admin key also an inference key (it would then not be an admin-only key)."""
    from gateway.auth import digest

    problems, seen = [], {}
    named = [(f"api_keys[{i}]", k) for i, k in enumerate(cfg.api_keys)]
    named += [(f"auth.keys[{i}].key", k.key) for i, k in enumerate(cfg.auth.keys)]
    for where, key in named:
        d = digest(key)
        if d in seen:
            problems.append(f"{where}: the same key as {seen[d]}")
        seen.setdefault(d, where)
    admin = cfg.auth.admin_key
    if admin is not None and digest(admin) in seen:
        problems.append(f"auth.admin_key: must differ from every inference key (it equals {seen[digest(admin)]})")
    return problems


def describe_validation_error(err: ValidationError, model: type[BaseModel]) -> list[str]:
    lines = []
    for e in err.errors(include_url=False):
        path = format_loc(e["loc"])
        if e["type"] == "extra_forbidden":
            known = _known_fields(model, e["loc"][:-1])
            hint = f" (known fields here: {', '.join(known)})" if known else ""
            lines.append(f"{path}: unknown field{hint}")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "missing":
            lines.append(f"{path}: required field is missing")
        elif path:
            lines.append(f"{path}: {msg} (got {_short(e.get('input'))})")
        else:
            lines.append(msg)
    return lines


def format_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _known_fields(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the sub-model that `loc` points into (for 'unknown field' hints)."""
    cur: Any = model
    for part in loc:
        if cur is None:
            return []
        if isinstance(part, int):
            continue  # a list index: `cur` already is the item model
        if isinstance(cur, _DictOf):
            cur = cur.value_type  # a dict key such as models.<name>
            continue
        field = cur.model_fields.get(part)
        if field is None:
            return []
        cur = _model_type(field.annotation)
    return list(cur.model_fields) if isinstance(cur, type) and issubclass(cur, BaseModel) else []


def _model_type(annotation: Any) -> Any:
    """Model for `Model`, the item model for list[Model], _DictOf(Model) for dict[str, Model], else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    args = getattr(annotation, "__args__", ())
    inner = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
    if inner is not None and getattr(annotation, "__origin__", None) is dict:
        return _DictOf(inner)
    return inner


class _DictOf:
    """Marker for dict[str, Model] while walking an error location."""

    def __init__(self, value_type: type[BaseModel]) -> None:
        self.value_type = value_type


def summarize(cfg: GatewayConfig) -> str:
    models = sorted({m for w in cfg.workers for m in w.models})
    lines = [
        f"listen {cfg.listen.host}:{cfg.listen.port}",
        f"{len(cfg.workers)} worker(s): " + (", ".join(f"{w.id} ({w.role}) {w.url}" for w in cfg.workers) or "none"),
        "models configured on workers: " + (", ".join(models) or "none (discovered from /v1/models)"),
        f"default policy {cfg.default_policy}"
        + "".join(f"; {name}: {mc.policy or cfg.default_policy}" for name, mc in cfg.models.items()),
        f"state: {'redis ' + cfg.redis_url if cfg.redis_url else 'in-memory'}; "
        f"api keys: {len(cfg.api_keys) + len(cfg.auth.keys) or 'none (open)'}; "
        f"admin API: {'on' if cfg.auth.admin_key else 'off (no auth.admin_key)'}",
    ]
    if cfg.shared_hosts:
        lines.append("shared hosts: " + "; ".join(f"{h.id} ({', '.join(h.engines)}; max_awake {h.max_awake}; {h.scheduling})"
                                                  for h in cfg.shared_hosts))
    if cfg.deployment is not None:
        lines.append("deployment: " + ", ".join(f"{g.count}x {g.model} on {g.tp}x {g.gpu} ({g.role})"
                                                for g in cfg.deployment.groups))
    return "\n".join(lines)


def check_config_cli(path: Path) -> int:
    """`fleetgate config check FILE`: 0 and a summary when valid, 1 and one line per problem otherwise."""
    try:
        cfg = load_config(path)
    except ConfigError as e:
        print(f"{path}: invalid configuration ({len(e.problems)} problem(s)):", file=sys.stderr)
        for p in e.problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    print(f"{path}: OK")
    print(summarize(cfg))
    return 0
