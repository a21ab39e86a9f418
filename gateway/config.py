"""Gateway configuration: a YAML file, overridden by FLEETGATE_* environment variables.

Precedence (highest first): explicit keyword arguments, environment (prefix FLEETGATE_, nesting with
`__`, e.g. FLEETGATE_LIMITS__QUEUE_SIZE=64 or FLEETGATE_API_KEYS='["k1"]'), the YAML file, defaults.
`fleetgate config check FILE` runs the same validation and explains every problem it finds.
"""

from __future__ import annotations

import contextvars
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from gateway.keys import digest
from gateway.priors import known_profile, prior_from_mapping
from gateway.responses_config import ResponsesConfig
from policies.admission import DEFAULT_QUEUE_LOOKAHEAD, DEFAULT_QUEUE_SIZE, DEFAULT_QUEUE_TIMEOUT_S
from policies.base import DEFAULT_POLICY
from policies.pace import EjectionSettings, PaceSettings
from policies.pooling.aegaeon import Q_MAX_S
from policies.pooling.turns import RECOMPUTE_OFF_REMOVED
from policies.rebalance import INTERVAL_S as REBALANCE_INTERVAL_S
from policies.rebalance import MAX_MOVES_PER_S, SLOW_RATIO

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
    host: str = Field("127.0.0.1", description="Address the gateway listens on.")
    port: int = Field(8000, ge=0, le=65535, description="Port the gateway listens on; 0 picks a free one.")


class KvEventsSource(_Strict):
    """Where one worker publishes vLLM's KV-cache events (its --kv-events-config, as the gateway reaches it)."""

    endpoint: str = Field(description="The publisher's ZMQ address, tcp://host:port; a * or 0.0.0.0 host "
                                      "means the worker URL's host.")
    replay_endpoint: str | None = Field(
        None, description="The publisher's replay ROUTER, asked for the events of a gap.")
    topic: str = Field("", description="ZMQ topic to subscribe to (empty: every topic).")

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_address(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^(tcp://\S+:\d{1,5}|ipc://\S+|inproc://\S+)$", v):
            raise ValueError("must be a ZMQ address such as tcp://10.0.0.5:5557")
        return v


class WorkerConfig(_Strict):
    id: str = Field(description="Unique worker id: 1-128 characters from A-Z a-z 0-9 . _ : - (used in metric"
                                " labels and Redis keys).")
    url: str = Field(description="The worker's base URL, http(s)://host[:port][/prefix].")
    role: Literal["mixed", "prefill", "decode"] = Field(
        "mixed", description="mixed serves whole requests; prefill and decode are the two legs of P/D "
                             "disaggregation.")
    models: list[str] = Field(default_factory=list,
                              description="Models it serves; empty: discovered from the worker's /v1/models.")
    labels: dict[str, str] = Field(default_factory=dict,
                                   description="Free-form labels; `pool` names its autoscaling pool "
                                               "(interactive, mixed, batch), `weight` its share for weighted"
                                               " policies.")
    profile: str = Field("",
                         description="Its performance profile (a built-in simulator profile, a profile file "
                                     "or a learning.priors entry); SLO-aware policies need it.")
    cap: int | None = Field(None, ge=1,
                            description="Most requests the gateway puts on it at once (None: no gateway "
                                        "cap).")
    kv_events: KvEventsSource | None = Field(
        None, description="Its KV-event publisher (else discovered, see kv_events.discover).")

    @field_validator("id")
    @classmethod
    def _id_chars(cls, v: str) -> str:
        return check_worker_id(v)

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        return check_worker_url(v)


class WorkerDiscoveryConfig(_Strict):
    """Workers found by DNS (gateway/dns_discovery.py): every address a name resolves to (A/AAAA) is a worker.

    Not `discovery_interval_s`: that one re-reads the /v1/models of workers already known; this one finds the
    workers. A worker found here starts with no models and gets them from its /v1/models the same way, re-read
    every `discovery_interval_s`."""

    dns: str = Field(description="Host name resolved on every round, e.g. a compose service (`sim`) or a "
                                 "Kubernetes headless Service (`vllm-mixed`); each A/AAAA address is a worker")
    port: int = Field(ge=1, le=65535, description="Port of the workers' HTTP server at every address")
    scheme: Literal["http", "https"] = Field("http", description="Worker URL scheme (https: see upstream.tls)")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels of every worker found (e.g. pool)")
    role: Literal["mixed", "prefill", "decode"] = Field("mixed", description="Role of every worker found")
    cap: int | None = Field(None, ge=1, description="Requests in flight the gateway puts on each worker found, "
                                                    "across all replicas (None: no cap)")
    interval_s: float = Field(5.0, gt=0, description="Seconds between two resolutions of `dns`")
    family: Literal["any", "ipv4", "ipv6"] = Field(
        "any", description="Which records make workers: A and AAAA (any), A only or AAAA only. On a dual-stack "
                           "network a worker has both: choose one there, else each worker counts twice")
    nameservers: list[str] = Field(
        default_factory=list,
        description="DNS servers to ask, `IP` or `IP:PORT` ([IPv6]:PORT), e.g. Consul's DNS on 127.0.0.1:8600; "
                    "empty: the system resolver (/etc/hosts, /etc/resolv.conf, search domains). Needs dnspython")
    id_prefix: str | None = Field(
        None, description="Worker ids are `PREFIX-ADDRESS:PORT` (stable per address); default: the first label "
                          "of `dns`")
    drain_timeout_s: float = Field(60.0, gt=0, description="An address gone from DNS is drained (no new "
                                   "requests); its in-flight requests get this long before it leaves the registry")

    @field_validator("dns")
    @classmethod
    def _host_name(cls, v: str) -> str:
        if not re.match(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_-]{1,63})*\.?$", v):
            raise ValueError("must be a DNS name such as `sim` or `vllm-mixed.fleetgate.svc.cluster.local`")
        return v

    @field_validator("nameservers")
    @classmethod
    def _addresses(cls, v: list[str]) -> list[str]:
        for ns in v:
            parse_nameserver(ns)
        return v

    @field_validator("id_prefix")
    @classmethod
    def _prefix_chars(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^[A-Za-z0-9._:-]{1,64}$", v):
            raise ValueError("must be 1-64 characters from A-Z a-z 0-9 . _ : -")
        return v

    def prefix(self) -> str:
        return self.id_prefix or self.dns.split(".")[0]

    def worker_id(self, address: str) -> str:
        return f"{self.prefix()}-{address}:{self.port}"

    def worker_url(self, address: str) -> str:
        host = f"[{address}]" if ":" in address else address
        return f"{self.scheme}://{host}:{self.port}"


def parse_nameserver(v: str) -> tuple[str, int]:
    """`IP`, `IP:PORT`, `[IPv6]:PORT` or a bare IPv6 address -> (ip, port)."""
    import ipaddress

    m = re.match(r"^\[([0-9A-Fa-f:.]+)\](?::(\d{1,5}))?$", v) or re.match(r"^([0-9.]+)(?::(\d{1,5}))?$", v)
    host, port = (m.group(1), int(m.group(2) or 53)) if m else (v, 53)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"nameserver {v!r}: expected an IP address, IP:PORT or [IPv6]:PORT") from None
    if not 0 < port < 65536:
        raise ValueError(f"nameserver {v!r}: port must be 1-65535")
    return host, port


def check_worker_url(v: str) -> str:
    """A worker base URL: http(s)://host[:port][/prefix], returned without a trailing slash."""
    m = re.match(r"^https?://([^/:\s]+|\[[0-9a-fA-F:]+\])(:(\d{1,5}))?(/\S*)?$", v)
    if not m:
        raise ValueError("must be an http:// or https:// URL such as http://10.0.0.5:8000")
    if m.group(3) and not 0 < int(m.group(3)) < 65536:
        raise ValueError("port must be 1-65535")
    return v.rstrip("/")


class SloConfig(_Strict):
    ttft_ms: float | None = Field(None, gt=0,
                                  description="Time-to-first-token target in milliseconds (None: not "
                                              "judged).")
    tpot_ms: float | None = Field(None, gt=0,
                                  description="Time-per-output-token target in milliseconds, after the first"
                                              " token (None: not judged).")


SloClassName = Literal["interactive", "batch"]  # RequestFeatures.request_class (X-Request-Class header)


class AdapterConfig(_Strict):
    """A LoRA adapter of the model: requests name it as their `model` (gateway/adapters.py)."""

    name: str = Field(min_length=1, description="The adapter's model name, as clients send it and vLLM serves "
                                                "it (vLLM's lora_name).")
    path: str = Field(min_length=1, description="Where a worker reads it from when the gateway loads it "
                                                "(POST /v1/load_lora_adapter's lora_path, on the worker's disk).")


class RebalanceConfig(_Strict):
    """Rebalancing live (gateway/rebalancer.py): Aladdin's Algorithm 2 (appendix C) moves requests that still
    wait in a worker's queue, without a first token (streamed or not), to another worker; a worker observed slower
    than its performance model beyond `slow_ratio` has its queued requests moved off it."""

    enabled: bool = Field(False, description="Move queued requests between workers (off by default: see "
                                             "bench/results/rebalance.md).")
    interval_s: float = Field(REBALANCE_INTERVAL_S, gt=0, description="How often the rebalancer looks for moves.")
    max_moves_per_s: float = Field(MAX_MOVES_PER_S, gt=0, description="Budget of moves per second per model (a token "
                                                          "bucket holding at most one second of moves).")
    slow_ratio: float = Field(SLOW_RATIO, gt=1, description="A worker whose decode steps are measured more than this "
                                                     "many times its performance model's prediction is slow: its "
                                                     "queued requests move off it (healthy workers measured up to "
                                                     "2.2x on a loaded machine).")


class ModelConfig(_Strict):
    policy: str | None = Field(None, description="Routing policy for this model (None: default_policy).")
    params: dict[str, Any] = Field(default_factory=dict, description="Parameters of the policy.")
    slo: SloConfig = Field(default_factory=SloConfig,
                           description="This model's SLO (else the top-level slo).")
    slo_classes: dict[SloClassName, SloConfig] = Field(
        default_factory=dict, description="Per request class (interactive, batch; header X-Request-Class) "
                                          "overrides of `slo`.")
    adapters: list[AdapterConfig] = Field(
        default_factory=list, description="LoRA adapters of this base model: listed in /v1/models with `parent`, "
                                          "routed among the model's workers and loaded on demand where they are "
                                          "not served yet (the workers need runtime LoRA updating).")
    max_adapters_per_worker: int | None = Field(
        None, ge=1, description="Adapters of this model the gateway keeps loaded on one worker: loading one more "
                                "first unloads the least recently used idle one it loaded (None: never unload).")
    # the models that take a request this model cannot serve before the client saw a byte, in order
    fallbacks: list[str] = Field(
        default_factory=list, description="Models tried in order when this one has no worker in rotation, "
                                          "refuses the request (429: the gateway's admission or the workers'), "
                                          "answers 5xx or times out before its first byte, after its retries. "
                                          "A request that streamed bytes never falls back.")
    # the models that take a prompt longer than this model's context, in order
    context_window_fallbacks: list[str] = Field(
        default_factory=list, description="Models tried in order for a request longer than this model's context "
                                          "(which would be refused with vLLM's 400).")
    rebalance: RebalanceConfig | None = Field(None, description="This model's rebalancing (else the top-level "
                                                                "rebalance).")


class LearningConfig(_Strict):
    """Online performance models and output-length prediction (gateway/learning.py)."""

    enabled: bool = Field(True,
                          description="Fit performance models and predict output lengths from the traffic "
                                      "seen.")
    interval_s: float = Field(0.5, gt=0,
                              description="Control loop tick: observations, progress reports, gauges.")
    refit_interval_s: float = Field(10.0, gt=0,
                                    description="Refit a profile's performance model at most this often, "
                                                "once refit_min_new observations arrived.")
    refit_min_new: int = Field(16, ge=1,
                               description="New observations a profile needs before it is refitted.")
    sync_interval_s: float = Field(5.0, gt=0,
                                   description="Publish to and read from the state store this often.")
    max_samples: int = Field(512, ge=8, description="Observations kept per profile and phase (this replica).")
    prior_weight: float = Field(20.0, ge=0,
                                description="Pseudo-observations of the declared profile in a fit.")
    time_scale: float = Field(1.0, gt=0,
                              description="Workers run K x faster than their profiles (simulated fleets).")
    priors: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Profile name -> performance-model coefficients (see "
                                          "gateway/learning.py), for workers whose profile is no built-in "
                                          "one.")

    @field_validator("priors")
    @classmethod
    def _priors_build(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name, data in v.items():
            try:
                prior_from_mapping(data)
            except (TypeError, ValueError, KeyError) as e:
                raise ValueError(f"priors.{name}: {e}") from None
        return v


class LimitsConfig(_Strict):
    max_body_bytes: int = Field(4 * MiB, ge=1024, description="Largest request body accepted; beyond: 413.")
    queue_size: int = Field(DEFAULT_QUEUE_SIZE, ge=0,
                            description="Requests per model that may wait in the admission queue "
                                        "(policies/admission.py); 0 disables queueing (429 at once).")
    queue_timeout_s: float = Field(DEFAULT_QUEUE_TIMEOUT_S, ge=0,
                                   description="Longest wait in the admission queue for a request without a "
                                               "TTFT target.")
    queue_lookahead: int = Field(DEFAULT_QUEUE_LOOKAHEAD, ge=1,
                                 description="A drain tries waiting requests until this many found no worker"
                                             " (1: head-of-line FIFO); a new request tries at once while "
                                             "fewer than this many wait.")
    queue_poll_s: float | None = Field(
        None, gt=0, description="How often the queue drains besides on every release (this replica's, and "
                                "other replicas' announced through Redis while requests wait), on a registry"
                                " change, after each engine scrape and when a policy asked (None: 0.5 s). A "
                                "request that found no worker is tried again only after a release, registry "
                                "change or scrape, or when its policy asked.")
    retries: int = Field(2, ge=0, le=10,
                         description="Extra workers tried when one fails before any byte was sent.")


class TimeoutsConfig(_Strict):
    connect_s: float = Field(3.0, gt=0, description="Connecting to a worker.")
    first_byte_s: float = Field(300.0, gt=0, description=(
        "Until the worker's response headers. vLLM sends them at once for streams, but only with the finished "
        "answer for non-streaming requests, so this bounds a non-streaming generation. For a stream it is only "
        "the upper cap: a stream that has not started is judged by the stall rule (resume.stall_factor x its "
        "predicted time to first token on that worker, or its pace), as are P/D prefill legs."))
    idle_s: float = Field(60.0, gt=0, description="Between two chunks of a stream.")


class ResumeConfig(_Strict):
    """Streams that survive their worker (gateway/resume.py), stall detection (policies/pace.py) and outlier
    ejection (gateway/registry.py)."""

    max_attempts: int = Field(2, ge=0, le=10,
                              description="Continuations per stream after mid-stream failures; 0: off.")
    hung_detection: bool = Field(True, description="Judge legs by the stall rule and eject a worker that stalls "
                                                   "(its exchanges resumed or placed again elsewhere).")
    stall_factor: float = Field(4.0, gt=1, description=(
        "k of the stall rule: a request that has not started stalls after max(first_token_floor_s, k x its "
        "predicted time to first token on the worker), and never before the worker's own pace allows; a "
        "started stream stalls when its next token is later than k x the worker's recent p99 gap "
        "(at least gap_floor_s)."))
    gap_floor_s: float = Field(2.0, gt=0,
                               description="Smallest gap between two tokens that counts as a stall.")
    first_token_floor_s: float = Field(2.0, gt=0, description=(
        "The floor of a not-started request's stall limit (predicted or paced)."))
    cold_gap_s: float = Field(30.0, gt=0,
                              description="Gap between two tokens that counts as a stall before the worker "
                                          "has a pace.")
    cold_first_token_s: float = Field(60.0, gt=0, description=(
        "The first-token stall limit of a worker with neither a pace (too few requests seen) nor a predicted "
        "time to first token (its profile unknown to the learner, or learning off). Workers the learner knows "
        "are judged by stall_factor x the predicted time instead."))
    suspect_hold_s: float | None = Field(None, ge=0, description=(
        "Deprecated: read as ejection_base_s (an ejected worker now stays out base x times ejected, and returns "
        "only after a probe generation succeeds)."))
    eject_after_errors: int = Field(5, ge=0,
                                    description="This many failed requests in a row eject a worker (0: "
                                                "never).")
    ejection_base_s: float = Field(10.0, ge=0, description=(
        "Envoy's base_ejection_time: a worker that stalled, or failed eject_after_errors requests in a row, is "
        "out of rotation this long times the number of times it was ejected (the count drops by one for every "
        "base time it then stays healthy)."))
    ejection_max_s: float = Field(300.0, ge=0, description="Envoy's max_ejection_time: the cap of one ejection.")
    max_ejected_fraction: float = Field(0.75, gt=0, le=1, description=(
        "Envoy's max_ejection_percent / 100: at most this fraction of a pool (workers of one role sharing a "
        "model) is ejected at once; one worker always may be."))
    probe_timeout_s: float = Field(10.0, gt=0, description=(
        "An ejected worker returns only when a probe generation (a max_tokens=1 completion) answers within "
        "this long: a zombie engine answers /health but never generates."))

    @model_validator(mode="after")
    def _deprecated(self) -> ResumeConfig:
        if self.suspect_hold_s is not None:
            _deprecated_key("resume.suspect_hold_s", "resume.ejection_base_s")
            if "ejection_base_s" not in self.model_fields_set:
                self.ejection_base_s = self.suspect_hold_s
        return self

    def pace(self) -> PaceSettings:
        return PaceSettings(factor=self.stall_factor, gap_floor_s=self.gap_floor_s,
                            first_floor_s=self.first_token_floor_s, cold_gap_s=self.cold_gap_s,
                            cold_first_s=self.cold_first_token_s)

    def ejection(self) -> EjectionSettings:
        return EjectionSettings(self.ejection_base_s, max(self.ejection_max_s, self.ejection_base_s),
                                self.max_ejected_fraction)


def _deprecated_key(key: str, instead: str) -> None:
    warnings.warn(f"config key {key} is deprecated: {instead}", DeprecationWarning, stacklevel=2)
    logging.getLogger("fleetgate.config").warning("config key %s is deprecated: %s", key, instead)


class UpstreamTlsConfig(_Strict):
    """TLS to `https://` workers (gateway/upstream.py TlsSettings)."""

    verify: bool = Field(True, description="Check the worker's certificate and host name.")
    ca_bundle: str | None = Field(None, description="PEM file of the CAs to trust (default: the system's).")
    client_cert: str | None = Field(None,
                                    description="PEM certificate to present to workers that ask for one.")
    client_key: str | None = Field(None, description="Its private key, when not in client_cert.")

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

    max_connections: int | None = Field(
        None, ge=1, description="Connections to all workers together; None: no limit.")
    max_connections_per_host: int | None = Field(
        None, ge=1, description="Connections per worker (scheme, host, port); None: no limit.")
    pool_timeout_s: float = Field(10.0, gt=0,
                                  description="A request waits this long for a connection at the limit.")
    keepalive_expiry_s: float = Field(
        4.0, gt=0, description="Idle connections are not reused after this long: below the worker's own "
                               "keep-alive (vLLM's uvicorn: 5 s).")
    dns_cache_ttl_s: float = Field(300.0, ge=0,
                                   description="A host name is resolved once per this long; 0: on every "
                                               "connect.")
    tls: UpstreamTlsConfig = Field(default_factory=UpstreamTlsConfig, description="TLS to https:// workers.")


class PdConfig(_Strict):
    """Prefill/decode disaggregation, active for a model while it has prefill or decode workers (gateway/pd.py)."""

    local_prefill_tokens: int = Field(
        256, ge=0, description="Prompts with at most this many tokens not cached on a decode-capable worker "
                               "are prefilled there, without a prefill worker (vLLM Router's "
                               "pd_uncached_token_threshold).")
    decode_policy: str | None = Field(
        None, description="Placement of the decode leg; None: the model's policy.")
    decode_policy_params: dict[str, Any] = Field(
        default_factory=dict, description="Parameters of decode_policy.")
    kv_hold_s: float = Field(120.0, gt=0,
                             description="Prefill workers keep the KV this long for its decode worker "
                                         "(vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT).")
    prefill_timeout_s: float | None = Field(None, gt=0, description=(
        "Deprecated: a prefill leg is judged by the stall rule as any leg (resume.stall_factor x its predicted "
        "prefill time on that worker, or the worker's pace); when set, only the upper cap of that wait "
        "(default cap: timeouts.first_byte_s)."))
    prefill_overflow: bool = Field(True,
                                   description="A prompt the prefill pool's backlog would make miss its TTFT"
                                               " SLO is prefilled by its decode worker.")

    @model_validator(mode="after")
    def _deprecated(self) -> PdConfig:
        if self.prefill_timeout_s is not None:
            _deprecated_key("pd.prefill_timeout_s", "prefill legs are judged by the stall rule (resume:)")
        return self


class KvEventsConfig(_Strict):
    """The exact prefix-cache view from the workers' KV-cache events (gateway/kv_events.py, policies/kv_index.py).

    The gateway subscribes to every worker's publisher (its `kv_events:` entry, else GET /kv_event_sources of a
    vLLM >= 0.33 worker when `discover`), keeps an index block hash -> workers, and hashes each request's prompt
    the way the engines do, so policies that ask for it (`precise_prefix`) know each worker's cached prefix.
    The hashing settings must match the engines': block size, --prefix-caching-hash-algo, PYTHONHASHSEED and
    the vLLM version's cache_salt keys (`hash_style`); or key the index on the events' token ids."""

    enabled: bool = Field(False,
                          description="Subscribe to the workers' KV-cache events and keep the exact "
                                      "prefix-cache index.")
    discover: bool = Field(True,
                           description="Ask GET /kv_event_sources of workers without a kv_events entry.")
    block_size: int = Field(16, ge=1, description="The engines' --block-size.")
    hash_algo: Literal["sha256", "sha256_cbor"] = Field(
        "sha256_cbor", description="The engines' --prefix-caching-hash-algo.")
    hash_seed: str | None = Field(None,
                                  description="The engines' PYTHONHASHSEED; None: vLLM >= 0.32's fixed seed.")
    hash_style: Literal["0.11", "0.32"] = Field(
        "0.11", description="How the engines' vLLM version hashes cache_salt: untagged (0.11) or tagged "
                            "(0.32 and later).")
    key_on: Literal["block_hash", "token_ids"] = Field(
        "block_hash", description="Key the index on the engines' block hashes, or on the token ids the "
                                  "events carry.")
    tokenizer: str = Field("sim",
                           description="How prompts are tokenized for hashing: sim (the simulator's "
                                       "tokenizer), a model directory with tokenizer.json, or none.")
    max_blocks: int = Field(1_000_000, ge=1,
                            description="Index bound (distinct block hashes); least recently used beyond it.")
    replay_timeout_s: float = Field(2.0, gt=0,
                                    description="A replay request for missed events gets this long.")
    reconnect_s: float = Field(2.0, gt=0, description="Retry discovery and re-subscribe this often.")


ServiceSource = Literal["header", "tenant", "model"]


class ServicePriorityConfig(_Strict):
    """Service-aware priority across the services sharing a model's workers (gateway/services.py,
    policies/service_priority.py)."""

    order: Literal["off", "fcfs", "round_robin", "seallm", "vtc"] = Field(
        "off", description="How services sharing a model's workers take turns: off, fcfs, round_robin, "
                           "seallm or vtc (fair sharing by the Virtual Token Counter).")
    engine_priority: bool = Field(False,
                                  description="Also set vLLM's `priority` field (workers must run "
                                              "`--scheduling-policy priority`, else vLLM answers 400).")
    service_from: list[ServiceSource] = Field(
        default_factory=lambda: ["header", "tenant", "model"], min_length=1, description="Where a request's "
                                                                                         "service comes "
                                                                                         "from, first match "
                                                                                         "wins: the "
                                                                                         "X-Service header, "
                                                                                         "the tenant (API "
                                                                                         "key), the model.")
    starvation_s: dict[str, float] = Field(
        default_factory=dict, description="Per service, the longest wait before it goes first; others: "
                                          "default_starvation_s.")
    default_starvation_s: float = Field(
        10.0, gt=0, description="The longest wait before a service goes first, for services not in "
                                "starvation_s.")
    prompt_token_cost: float = Field(
        1.0 / 256.0, ge=0, description="Decode iterations one prompt token costs in a service's share.")
    weights: dict[str, float] = Field(
        default_factory=dict, description="vtc: a tenant's share relative to others (an X-Service name or an API "
                                          "key's name; others: 1).")
    input_token_weight: float = Field(1.0, ge=0,
                                      description="vtc: counter charge per prompt token (the paper's 1).")
    output_token_weight: float = Field(2.0, ge=0,
                                       description="vtc: counter charge per generated token (the paper's 2).")

    @field_validator("starvation_s")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        return _all_positive(v, "starvation thresholds must be > 0 seconds")

    @field_validator("weights")
    @classmethod
    def _positive_weights(cls, v: dict[str, float]) -> dict[str, float]:
        return _all_positive(v, "vtc weights must be > 0")


def _all_positive(v: dict[str, float], what: str) -> dict[str, float]:
    bad = [k for k, x in v.items() if not x > 0]
    if bad:
        raise ValueError(f"{what} (services {', '.join(bad)})")
    return v


SharedSleepLevel = Literal[1, 2]


class SharedEngineConfig(_Strict):
    """One model's engine on a shared host: a vLLM server started with --enable-sleep-mode (dev-mode endpoints
    /sleep, /wake_up, /is_sleeping: docs/reference/vllm-interface.md §6.1)."""

    url: str = Field(description="The engine's base URL.")
    id: str | None = Field(None, description="Its worker id; default `<host>:<model with / as _>`.")
    profile: str = Field("", description="The engine's performance profile (as workers[].profile).")
    cap: int | None = Field(None, ge=1,
                            description="Most requests the gateway puts on it at once (None: no gateway "
                                        "cap).")
    weight_gb: float | None = Field(None, gt=0,
                                    description="The model's weights in GB, for the derived swap cost.")
    load_s: float | None = Field(None, ge=0, description="Overrides the derived wake-up (swap in) seconds.")
    offload_s: float | None = Field(None, ge=0, description="Overrides the derived sleep (swap out) seconds.")

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
    them as requests arrive (request-level swapping), or with `scheduling: turns` runs one engine at a time in Aegaeon's
    decode turns (gateway/turns.py)."""

    id: str = Field(description="The host's id (as a worker id).")
    engines: dict[str, SharedEngineConfig | str] = Field(
        min_length=1, description="Model -> its engine (or just its URL).")
    max_awake: int = Field(1, ge=1, description="Engines awake at once (what the host's memory holds).")
    link_gb_per_s: float = Field(25.0, gt=0, description="Host <-> GPU bandwidth (PCIe 4.0 x16 ~ 25 GB/s).")
    wake_overhead_s: float = Field(0.0, ge=0,
                                   description="The engine's fixed wake-up cost on top of the weight copy.")
    sleep_level: SharedSleepLevel = Field(
        1, description="/sleep?level=: 1 offloads the weights to CPU, 2 discards them.")
    swap_timeout_s: float = Field(60.0, gt=0,
                                  description="A /sleep or /wake_up answering nothing this long has failed.")
    drain_after_s: float | None = Field(
        1.0, ge=0, description="With no idle engine: once a model has waited this long, the least busy "
                               "engine stops taking requests and is swapped out when its last one ends "
                               "(policies/pooling/swapping.py); null: only idle engines are swapped out "
                               "(ServerlessLLM's rule).")
    scheduling: Literal["request", "turns"] = Field(
        "request", description="request: an engine is swapped only once idle or drained "
                               "(policies/pooling/swapping.py). turns: Aegaeon's decode turns "
                               "(gateway/turns.py): one engine runs at a time, each model with requests in "
                               "flight gets a time quota per round (eq. 2-3, at most q_max_s) and the others"
                               " are paused (/sleep?mode=keep) meanwhile.")
    q_max_s: float = Field(Q_MAX_S, gt=0, description="turns: the largest quota of a turn (Aegaeon's Q_MAX).")
    tbt_ms: float | None = Field(None, gt=0,
                                 description="turns: the TBT target d of eq. 2-3; default slo.tpot_ms.")
    recompute_quota: bool = Field(True,
                                  description="turns at sleep level >= 1: stock vLLM dropped the paused "
                                              "requests' KV, so a turn first recomputes it; that estimate "
                                              "counts as switching (in eq. 3's c, and the quota starts after "
                                              "it). Always on: false (the stock rule) is refused, its turns "
                                              "starve (bench/results/pooling.md, 2026-12-07).")

    @field_validator("id")
    @classmethod
    def _id_chars(cls, v: str) -> str:
        return check_worker_id(v)

    @field_validator("recompute_quota")
    @classmethod
    def _recompute_on(cls, v: bool) -> bool:
        if not v:
            raise ValueError(RECOMPUTE_OFF_REMOVED)
        return v

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
    interval_s: float = Field(2.0, gt=0, description="Each worker's health is checked this often.")
    timeout_s: float = Field(1.0, gt=0, description="A health check answering nothing this long failed.")
    failures_to_eject: int = Field(2, ge=1,
                                   description="Failed checks in a row that take a worker out of rotation.")
    successes_to_restore: int = Field(2, ge=1, description="Passed checks in a row that bring it back.")


class LoggingConfig(_Strict):
    """Process logs (gateway/logs.py) and the per-request access log (gateway/access_log.py)."""

    level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level: debug, info, warning or error.")
    format: Literal["text", "logfmt", "json"] = Field("text", description="Log lines: text, logfmt or json.")
    access_log: bool = Field(True, description="One line per request (gateway/access_log.py).")
    rate_limit_window_s: float = Field(
        10.0, gt=0, description="The same message is logged at most `rate_limit_burst` times per window.")
    rate_limit_burst: int = Field(5, ge=1,
                                  description="Repeats of one message logged per rate_limit_window_s.")


class TracingConfig(_Strict):
    """OpenTelemetry spans per request (gateway/tracing.py; needs the `tracing` extra)."""

    enabled: bool = Field(False, description="Export OpenTelemetry spans (needs the `tracing` extra).")
    service_name: str = Field("fleetgate", description="The spans' service.name.")
    otlp_endpoint: str | None = Field(
        None, description="Where spans go, e.g. http://otel-collector:4318/v1/traces (OTLP/HTTP); None: "
                          "spans are made but not exported.")
    headers: dict[str, str] = Field(default_factory=dict,
                                    description="Extra HTTP headers sent with every export.")
    timeout_s: float = Field(10.0, gt=0, description="An export answering nothing this long has failed.")
    sample_ratio: float = Field(1.0, ge=0, le=1,
                                description="Fraction of the traces the gateway starts that are sampled (a "
                                            "sampled parent wins).")


class ApiKeyConfig(_Strict):
    """One inference key and its limits (gateway/auth.py, gateway/ratelimit.py). `key` is the secret itself or
    `sha256:<64 hex digits>` of it (the config then holds no secret). Limits left out are not enforced."""

    key: str = Field(min_length=8,
                     description="The key, or `sha256:` and the 64 hex digits of its SHA-256 (the config "
                                 "then holds no secret).")
    name: str = Field("",
                      description="The tenant's name in logs and the admin API (default: key- and the start "
                                  "of its hash).")
    rpm: int | None = Field(None, ge=1, description="Requests per minute.")
    tpm: int | None = Field(None, ge=1,
                            description="Tokens per minute: prompt + max_tokens reserved, settled at the "
                                        "end.")
    max_concurrency: int | None = Field(None, ge=1, description="Requests in flight at once (all replicas).")
    models: list[str] = Field(default_factory=list, description="Models the key may use; empty: every model.")

    @field_validator("key")
    @classmethod
    def _key_form(cls, v: str) -> str:
        if v.startswith("sha256:") and not re.fullmatch(r"sha256:[0-9a-fA-F]{64}", v):
            raise ValueError("a hashed key is `sha256:` and 64 hex digits")
        return v


class AuthConfig(_Strict):
    """Who may call what. `admin_key` (or env FLEETGATE_ADMIN_KEY) guards /admin/*; without it the admin API is
    off. Inference keys: `keys` (with limits) and the top-level `api_keys` (no limits); none at all: open."""

    admin_key: str | None = Field(None, min_length=16,
                                  description="Guards /admin/* (or env FLEETGATE_ADMIN_KEY); at least 16 "
                                              "characters, or `sha256:<64 hex digits>`. None: the admin API "
                                              "is off.")
    keys: list[ApiKeyConfig] = Field(default_factory=list, description="Inference keys with limits.")

    @field_validator("admin_key")
    @classmethod
    def _admin_form(cls, v: str | None) -> str | None:
        if v is not None and v.startswith("sha256:") and not re.fullmatch(r"sha256:[0-9a-fA-F]{64}", v):
            raise ValueError("a hashed key is `sha256:` and 64 hex digits")
        return v


class AdminConfig(_Strict):
    worker_hosts: list[str] = Field(default_factory=list,
                                    description="Hosts a worker added through the admin API may be on: names"
                                                " (`gpu-1.internal`), wildcards (`*.svc`), addresses and "
                                                "networks (`10.0.0.0/8`). Always allowed too: loopback and "
                                                "the configured workers' hosts.")


class MetricsConfig(_Strict):
    auth: bool = Field(False,
                       description="/metrics requires `Authorization: Bearer <metrics.key or the admin "
                                   "key>`.")
    key: str | None = Field(None, min_length=16,
                            description="A key for /metrics only (at least 16 characters).")


class StatusConfig(_Strict):
    """The status page's numbers and history (gateway/status_history.py): a fixed-size ring buffer in memory,
    sampled from the gateway's own counters; no other service."""

    sample_s: float = Field(5.0, gt=0, description="Seconds between two history samples (one sparkline point).")
    history_s: float = Field(900.0, gt=0, description="How far back the sparklines reach; history_s / sample_s "
                             "points are kept per model and worker (at most 3600).")
    window_s: float = Field(60.0, gt=0, description="The current request rate, latency percentiles, error "
                            "counts and worker throughput cover the last this many seconds.")

    @model_validator(mode="after")
    def _bounded(self) -> StatusConfig:
        if max(self.history_s, self.window_s) / self.sample_s > 3600:
            raise ValueError("history_s / sample_s and window_s / sample_s must be at most 3600 samples (memory is "
                             "kept bounded)")
        return self


class ServerConfig(_Strict):
    """Limits on what clients can make the gateway hold (gateway/client_limits.py)."""

    header_timeout_s: float = Field(10.0, gt=0,
                                    description="From a request's first byte to the end of its headers.")
    body_timeout_s: float = Field(30.0, gt=0,
                                  description="The longest gap between two pieces of a request body.")
    keepalive_s: float = Field(5.0, gt=0,
                               description="An idle client connection (new, or between requests) is closed "
                                           "after this long.")
    max_header_bytes: int = Field(64 * 1024, ge=1024, description="Request line plus headers; beyond: 431.")
    max_headers: int = Field(100, ge=8, description="Header lines; beyond: 431.")
    max_connections: int = Field(4096, ge=1, description="Open client connections; beyond: closed at once.")
    drain_timeout_s: float = Field(30.0, ge=0, description=(
        "On SIGTERM, how long requests in flight may take to finish (/ready answers 503 at once, new requests "
        "get 503 with Retry-After); those still running then end with an error event. Give the orchestrator's "
        "grace period more than this."))
    trusted_proxies: list[str] = Field(
        default_factory=list, description="Peers (addresses or networks) whose X-Forwarded-For is kept (the "
                                          "client address is appended to it); others' is replaced.")

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

    enabled: bool = Field(True,
                          description="Serve the OpenAI Files and Batches API and run queued batch requests.")
    max_file_bytes: int = Field(100 * MiB, ge=1024, description="Largest uploaded JSONL file.")
    max_requests: int = Field(50_000, ge=1, description="Lines in one batch input file.")
    poll_s: float = Field(0.1, gt=0, description="The runner looks for spare capacity this often.")
    lease_s: float = Field(10.0, gt=0,
                           description="A claimed request returns to the queue if not renewed within this "
                                       "long.")
    slots_per_worker: int = Field(8, ge=1, description="Batch requests per worker that has no cap.")
    max_inflight: int = Field(256, ge=1, description="Batch requests this replica runs at once.")
    file_ttl_s: float = Field(30 * 86_400.0, gt=0,
                              description="Files expire this long after upload unless the upload sets "
                                          "expires_after.")
    storage_per_key_bytes: int = Field(
        1024 * MiB, ge=1024, description="Bytes of files one key may keep (uploads beyond: refused).")


class SimActuatorConfig(_Strict):
    """`sim`: workers are simulated vLLM servers started in this process (simulator/fleet.py)."""

    profile: str = Field("llama3-8b-h100", description="Simulator profile of new workers.")
    model: str | None = Field(None, description="Served model name (default: the profile's).")
    time_scale: float = Field(1.0, gt=0, description="New workers run K x faster than their profile.")
    cold_start_s: float = Field(30.0, ge=0, description="Wall seconds before a new worker takes traffic.")
    initial: dict[Literal["interactive", "mixed", "batch"], int] = Field(
        default_factory=dict, description="Workers per pool (interactive, mixed, batch) started at once, "
                                          "without a cold start.")
    seed: int = Field(0, description="Random seed of the simulated workers.")
    cap: int | None = Field(None, ge=1, description="New workers' cap (None: the local autoscaler's, if on).")
    base_port: int = Field(0, ge=0, le=65535,
                           description="Worker n (sim-n, the lowest n not in use) listens on base_port + n; "
                                       "0: any free port.")


class WebhookActuatorConfig(_Strict):
    """`webhook`: POST the desired state to `url`, read back the fleet (gateway/actuators.py)."""

    url: str | None = Field(None,
                            description="Where the desired state is POSTed (required with kind: webhook).")
    timeout_s: float = Field(5.0, gt=0, description="A webhook call answering nothing this long has failed.")
    headers: dict[str, str] = Field(default_factory=dict,
                                    description="Extra HTTP headers of every webhook call (e.g. "
                                                "Authorization).")


class DockerActuatorConfig(_Strict):
    """`docker`: scale compose services by creating and removing their containers (gateway/docker_actuator.py)."""

    socket: str = Field("/var/run/docker.sock", description="The Docker Engine API's unix socket (mounted into "
                                                            "the gateway's container)")
    project: str | None = Field(None, description="The compose project (`-p`); default: the project of the "
                                                  "gateway's own container, read from its labels")
    services: dict[Literal["mixed", "batch"], str] = Field(
        default_factory=dict, description="The compose service whose containers are a pool's workers, e.g. "
                                          "{mixed: sim}; the interactive pool takes its workers from mixed")
    port: int = Field(8000, ge=1, le=65535, description="The workers' HTTP port inside their containers")
    start_timeout_s: float = Field(300.0, gt=0, description="A new container not healthy in the gateway by then "
                                                            "is removed (and counted as failed)")
    stop_timeout_s: int = Field(30, ge=0, description="Seconds between SIGTERM and SIGKILL when a drained "
                                                      "container is stopped")


class ActuatorConfig(_Strict):
    kind: Literal["none", "sim", "webhook", "docker"] = Field(
        "none", description="What acts on scale decisions: none (export the numbers only, e.g. for KEDA), "
                            "sim, webhook or docker.")
    sim: SimActuatorConfig = Field(default_factory=SimActuatorConfig,
                                   description="The sim actuator: simulated workers started in this process.")
    webhook: WebhookActuatorConfig = Field(
        default_factory=WebhookActuatorConfig, description="The webhook actuator.")
    docker: DockerActuatorConfig = Field(
        default_factory=DockerActuatorConfig,
        description="The docker actuator: containers of a compose service through the Docker Engine API.")

    @model_validator(mode="after")
    def _webhook_url(self) -> ActuatorConfig:
        if self.kind == "webhook":
            if not self.webhook.url:
                raise ValueError("webhook.url is required with kind: webhook")
            check_worker_url(self.webhook.url)
        if self.kind == "docker" and not self.docker.services:
            raise ValueError("docker.services is required with kind: docker (e.g. {mixed: sim})")
        return self


class AutoscaleConfig(_Strict):
    """Chiron's local caps and global pool sizes with a leader lease (gateway/autoscaler.py)."""

    enabled: bool = Field(False,
                          description="Run the autoscaler (Chiron's local caps and global pool sizes; one "
                                      "leader among the replicas).")
    interval_s: float = Field(5.0, gt=0, description="Global decision period.")
    local_interval_s: float = Field(2.0, gt=0, description="Local cap window (Chiron Algorithm 1).")
    sample_s: float = Field(0.25, gt=0, description="In-flight sampling period for busy and cap-binding.")
    local_caps: bool = Field(True, description="Enforce per-worker caps from Chiron Algorithm 1.")
    itl_slo_ms: float | None = Field(
        None, gt=0, description="Inter-token latency target of interactive and mixed workers; default "
                                "slo.tpot_ms, else 200.")
    batch_itl_slo_ms: float = Field(2000.0, gt=0,
                                    description="Inter-token latency target of batch workers (Chiron section"
                                                " 6: 2 s).")
    busy_cap: int = Field(16, ge=1, description="The busy denominator of a worker without a cap.")
    local: dict[str, Any] = Field(default_factory=dict, description="policies.autoscale.LocalConfig fields.")
    scaler: dict[str, Any] = Field(default_factory=dict,
                                   description="policies.autoscale.GlobalConfig fields.")
    lease_ttl_s: float = Field(10.0, gt=0,
                               description="Leader lease; a dead leader is replaced after this long.")
    drain_timeout_s: float = Field(60.0, gt=0,
                                   description="In-flight requests of a removed worker get this long.")
    rate_window_s: float = Field(60.0, gt=0, description="Arrival rates are measured over this window.")
    throughput_window_s: float = Field(
        60.0, gt=0, description="Token throughputs (per worker, batch) are measured over this window.")
    actuator: ActuatorConfig = Field(
        default_factory=ActuatorConfig, description="What starts and stops workers.")

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

    enabled: bool = Field(False,
                          description="Re-plan the fleet from observed traffic (needs autoscale.enabled and "
                                      "slo.ttft_ms and slo.tpot_ms).")
    gpus: list[str] = Field(default_factory=list,
                            description="The GPU stock, TYPE:COUNT[:PRICE] as `fleetgate plan --gpus`.")
    interval_s: float = Field(60.0, gt=0, description="I_0, the first interval between two plans.")
    min_interval_s: float = Field(10.0, gt=0, description="Shortest interval between two plans.")
    max_interval_s: float = Field(600.0, gt=0, description="Longest interval between two plans.")
    beta: float = Field(0.1, gt=0, lt=1, description="SeaLLM eq. 8's smoothing (0.1 in its section 6.1).")
    target: float = Field(0.95, gt=0, le=1,
                          description="SLO attainment a covered plan is estimated to reach.")
    objective: Literal["cost", "throughput"] = Field(
        "cost", description="Cheapest plan that covers the traffic (cost), or most throughput within the "
                            "stock and budget (throughput).")
    budget_per_hour: float | None = Field(
        None, gt=0, description="Most a plan may cost per hour (None: no budget).")
    headroom: float = Field(1.0, ge=1.0, description="Plan for this multiple of the observed rates.")
    min_saving: float = Field(0.1, ge=0, lt=1,
                              description="Move to a cheaper plan only when it saves this fraction.")
    min_finished: int = Field(10, ge=1, description="Finished requests a window needs for its length means.")
    time_scale: float | None = Field(
        None, gt=0, description="Model seconds per wall second (default: the sim actuator's).")

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

    model: str = Field(description="Short model name (policies/hardware.py: llama3-8b, llama2-70b, ...).")
    gpu: str = Field(description="GPU type: a100, h100, l4, v100, a800 (or the full names).")
    tp: Literal[1, 2, 4, 8] = Field(description="Tensor-parallel GPUs per instance.")
    role: Literal["mixed", "prefill", "decode"] = Field(
        "mixed", description="mixed, prefill or decode instances.")
    count: int = Field(ge=0, description="Instances.")
    gpus: int | None = Field(None, ge=0, description="tp x count, as the plan prints it.")
    price_per_gpu_hour: float | None = Field(
        None, ge=0, description="Price of one GPU per hour, as the plan prints it.")
    cost_per_hour: float | None = Field(
        None, ge=0, description="The group's cost per hour, as the plan prints it.")


class DeploymentServiceConfig(_Strict):
    model: str = Field(description="Short model name of the service.")
    share: float = Field(1.0, gt=0, description="Its fraction of the traffic (normalised over the services).")


class DeploymentConfig(_Strict):
    """A deployment from `fleetgate plan` (the `deployment` section of its JSON, as YAML here); `fleetgate simulate
    --deployment FILE` replays traffic on it."""

    groups: list[DeploymentGroupConfig] = Field(min_length=1, description="The plan's instance groups.")
    services: list[DeploymentServiceConfig] = Field(
        default_factory=list, description="The services (models) the plan serves and their traffic shares.")
    policy: str | None = Field(None, description="The routing policy the plan was scored with.")
    slo: SloConfig = Field(default_factory=SloConfig, description="The SLO the plan was sized for.")


class GatewayConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLEETGATE_", env_nested_delimiter="__", extra="forbid")

    listen: ListenConfig = Field(default_factory=ListenConfig, description="Where the gateway listens.")
    workers: list[WorkerConfig] = Field(
        default_factory=list, description="The workers (vLLM servers) behind the gateway.")
    models: dict[str, ModelConfig] = Field(
        default_factory=dict, description="Per model name: policy, parameters and SLO.")
    # stable names for served models: a request for the alias is served by its target
    aliases: dict[str, str] = Field(
        default_factory=dict, description="Model aliases, name -> served model (e.g. chat-default: "
                                          "meta-llama/Llama-3.1-8B-Instruct): a request for the alias is served by "
                                          "the target, whose name the answer's `model` carries; /v1/models lists "
                                          "the alias with `root` and `parent` = the target. The target must be a "
                                          "configured model and the alias no model's name.")
    slo: SloConfig = Field(default_factory=SloConfig,
                           description="Every model's SLO unless models.<name> sets one.")
    slo_classes: dict[SloClassName, SloConfig] = Field(
        default_factory=dict, description="Per request class (interactive, batch) overrides of `slo`.")
    slo_window_s: float = Field(300.0, gt=0,
                                description="fleetgate_slo_attainment_ratio and the status page's attainment"
                                            " cover this many seconds.")
    learning: LearningConfig = Field(
        default_factory=LearningConfig, description="Online performance models and output-length prediction.")
    default_policy: str = Field(DEFAULT_POLICY,
                                description="Routing policy of models without their own (`fleetgate config "
                                            "check` lists them).")
    default_policy_params: dict[str, Any] = Field(
        default_factory=dict, description="Parameters of default_policy.")
    redis_url: str | None = Field(None,
                                  description="Share state between gateway replicas through Redis (redis://,"
                                              " rediss:// or unix://); None: in-memory state, one replica.")
    redis_key_prefix: str = Field("fg:", min_length=1,
                                  description="Prefix of every Redis key: several fleets (or tests) can "
                                              "share one Redis.")
    redis_lease_block: int = Field(8, ge=1,
                                   description="Slots a replica leases from Redis per worker at a time and "
                                               "hands out locally (gateway/state/redis_store.py \"Leases\");"
                                               " 1: one Redis call per reservation and one per release.")
    replica_id: str | None = Field(None,
                                   description="This replica's id in shared state and on the status page "
                                               "(default: host name and process id).")
    api_keys: list[str] = Field(default_factory=list,
                                description="Inference keys without limits (see auth.keys); none at all: "
                                            "open.")
    auth: AuthConfig = Field(default_factory=AuthConfig,
                             description="Who may call what: the admin key and inference keys with limits.")
    admin: AdminConfig = Field(default_factory=AdminConfig, description="The admin API.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Access to /metrics.")
    server: ServerConfig = Field(default_factory=ServerConfig,
                                 description="Limits on what clients can make the gateway hold.")
    status: StatusConfig = Field(default_factory=StatusConfig,
                                 description="The status page's numbers and history.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig,
                                 description="Request body size, the admission queue and retries.")
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig, description="Talking to workers.")
    resume: ResumeConfig = Field(default_factory=ResumeConfig,
                                 description="Streams that survive their worker, and hung-worker detection.")
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig,
                                       description="The Responses API's stored conversations (previous_response_id).")
    rebalance: RebalanceConfig = Field(default_factory=RebalanceConfig,
                                       description="Moving queued requests between workers (Aladdin's "
                                                   "Algorithm 2), for every model unless models.<name> sets "
                                                   "its own.")
    upstream: UpstreamConfig = Field(
        default_factory=UpstreamConfig, description="The HTTP client to workers.")
    health: HealthConfig = Field(default_factory=HealthConfig, description="Health checks of the workers.")
    pd: PdConfig = Field(default_factory=PdConfig, description="Prefill/decode disaggregation.")
    batch: BatchConfig = Field(default_factory=BatchConfig, description="The OpenAI Files and Batches API.")
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig, description="Autoscaling.")
    replan: ReplanConfig = Field(default_factory=ReplanConfig,
                                 description="Re-planning the fleet from observed traffic.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Process and access logs.")
    tracing: TracingConfig = Field(default_factory=TracingConfig, description="OpenTelemetry tracing.")
    kv_events: KvEventsConfig = Field(
        default_factory=KvEventsConfig, description="The exact prefix-cache view from the workers' KV-cache "
                                                    "events.")
    deployment: DeploymentConfig | None = Field(
        None, description="A `fleetgate plan` result (capacity plan of the fleet).")
    service_priority: ServicePriorityConfig = Field(
        default_factory=ServicePriorityConfig, description="Priority across the services sharing a model's "
                                                           "workers.")
    shared_hosts: list[SharedHostConfig] = Field(
        default_factory=list, description="Hosts holding several models' engines, swapped through sleep mode"
                                          " (gateway/pooling.py).")
    scrape_interval_s: float = Field(0.5, gt=0, description="Each worker's /metrics is read this often.")
    discovery_interval_s: float = Field(
        10.0, gt=0, description="Seconds between two reads of the /v1/models of a worker without configured "
                                "models (configured, added, or found by `worker_discovery`); it finds no workers.")
    worker_discovery: list[WorkerDiscoveryConfig] = Field(
        default_factory=list,
        description="Names whose DNS addresses are the workers, re-resolved every `interval_s` "
                    "(gateway/dns_discovery.py): a new address joins after its health check and model "
                    "discovery, a gone one drains and leaves. `discovery_interval_s` is another thing: how "
                    "often the /v1/models of known workers is re-read.")

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
        adapters: set[str] = set()
        for base, mc in self.models.items():
            for j, a in enumerate(mc.adapters):
                if a.name in adapters or a.name in self.models:
                    raise ValueError(f"models.{base}.adapters[{j}].name: {a.name!r} is already a model or adapter")
                adapters.add(a.name)
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

    def adapter_limits(self) -> dict[str, int]:
        """Base model -> max_adapters_per_worker, for the models that set it."""
        return {m: mc.max_adapters_per_worker for m, mc in self.models.items() if mc.max_adapters_per_worker}

    def adapter_parents(self) -> dict[str, tuple[str, str]]:
        """Every configured LoRA adapter's name -> (its base model, its path)."""
        return {a.name: (base, a.path) for base, mc in self.models.items() for a in mc.adapters}

    def rebalance_for(self, model: str) -> RebalanceConfig:
        """The model's rebalancing settings (its own, else the top-level ones)."""
        mc = self.models.get(model)
        return mc.rebalance if mc is not None and mc.rebalance is not None else self.rebalance

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

    problems: list[str] = (key_problems(cfg) + deployment_problems(cfg) + replan_problems(cfg)
                           + discovery_problems(cfg) + alias_problems(cfg) + engine_problems(cfg))
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


def configured_models(cfg: GatewayConfig) -> set[str]:
    """The model names a configuration names: `models`, the workers' and shared hosts' models, the deployment
    groups' models, and the LoRA adapters."""
    names = set(cfg.models) | set(cfg.adapter_parents())
    names.update(m for w in cfg.all_workers() for m in w.models)
    names.update(g.model for g in (cfg.deployment.groups if cfg.deployment is not None else ()))
    return names


def alias_problems(cfg: GatewayConfig) -> list[str]:
    """An alias names a configured model and is no model's own name; fallbacks name other configured models."""
    known = configured_models(cfg)
    problems = []
    for alias, target in cfg.aliases.items():
        if alias in known:
            problems.append(f"aliases.{alias}: shadows the served model {alias!r} (an alias needs a name of its own)")
        if target not in known:
            problems.append(f"aliases.{alias}: unknown model {target!r} (name it under `models` or in a worker's "
                            "`models`)")
    for model, mc in cfg.models.items():
        for key in ("fallbacks", "context_window_fallbacks"):
            for j, other in enumerate(getattr(mc, key)):
                target = cfg.aliases.get(other, other)
                if target == model:
                    problems.append(f"models.{model}.{key}[{j}]: {other!r} is the model itself")
                elif target not in known:
                    problems.append(f"models.{model}.{key}[{j}]: unknown model {other!r} (name it under `models` "
                                    "or in a worker's `models`)")
    return problems


def engine_problems(cfg: GatewayConfig) -> list[str]:
    """No engine listed twice (gateway/engine_identity.py)."""
    from gateway.engine_identity import duplicate_engine_problems

    entries = [(f"workers[{i}]", w.id, w.url) for i, w in enumerate(cfg.workers)]
    entries += [(f"shared_hosts[{i}].engines.{m}", h.worker_id(m), h.engine(m).url)
                for i, h in enumerate(cfg.shared_hosts) for m in h.engines]
    return duplicate_engine_problems(entries)


def discovery_problems(cfg: GatewayConfig) -> list[str]:
    """`worker_discovery` entries with `nameservers` need dnspython (the `dns` extra)."""
    import importlib.util

    if importlib.util.find_spec("dns") is not None:
        return []
    return [f"worker_discovery[{i}].nameservers: needs dnspython (pip install 'fleetgate[dns]')"
            for i, e in enumerate(cfg.worker_discovery) if e.nameservers]


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
    out = []
    for i, w in enumerate(cfg.workers):
        if not known_profile(w.profile, cfg.learning.priors):
            out.append(f"workers[{i}].profile: {where} {policy!r} needs each worker's performance model, and "
                       f"{w.profile or '(none)'!r} is no built-in profile, profile file or learning.priors entry "
                       "(fleetgate sim --list-profiles lists the built-in ones)")
    return out
def key_problems(cfg: GatewayConfig) -> list[str]:
    """The same key twice, or the admin key also an inference key (it would then not be an admin-only key)."""
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
