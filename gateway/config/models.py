"""Config per model: SLO classes, adapters, rebalancing, learning, resumption, P/D, KV-cache events."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from gateway.config.base import _deprecated_key, _Strict
from gateway.config.priors import prior_from_mapping
from policies.pace import EJECT_AFTER_ERRORS, EjectionSettings, PaceSettings
from policies.rebalance import INTERVAL_S as REBALANCE_INTERVAL_S
from policies.rebalance import MAX_MOVES_PER_S, SLOW_RATIO


class SloConfig(_Strict):
    ttft_ms: float | None = Field(None, gt=0,
                                  description="Time-to-first-token target in milliseconds (None: not "
                                              "judged).")
    tpot_ms: float | None = Field(None, gt=0,
                                  description="Time-per-output-token target in milliseconds, after the first"
                                              " token (None: not judged).")


SloClassName = Literal["interactive", "batch"]  # RequestFeatures.request_class (X-Request-Class header)


class AdapterConfig(_Strict):
    """A LoRA adapter of the model: requests name it as their `model` (gateway/fleet/adapters.py)."""

    name: str = Field(min_length=1, description="The adapter's model name, as clients send it and vLLM serves "
                                                "it (vLLM's lora_name).")
    path: str = Field(min_length=1, description="Where a worker reads it from when the gateway loads it "
                                                "(POST /v1/load_lora_adapter's lora_path, on the worker's disk).")


class RebalanceConfig(_Strict):
    """Rebalancing live (gateway/pipeline/rebalancer.py): Aladdin's Algorithm 2 (appendix C) moves requests that still
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
    """Online performance models and output-length prediction (gateway/pipeline/learning.py)."""

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
                                          "gateway/pipeline/learning.py), for workers whose profile is no built-in "
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


class ResumeConfig(_Strict):
    """Streams that survive their worker (gateway/wire/resume.py), stall detection (policies/pace.py) and outlier
    ejection (gateway/fleet/registry.py)."""

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
    eject_after_errors: int = Field(EJECT_AFTER_ERRORS, ge=0,
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
    """The exact prefix-cache view from the workers' KV-cache events (gateway/fleet/kv_events.py, policies/kv_index.py).

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
