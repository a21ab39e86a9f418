"""Prefill/decode-disaggregated requests: the two legs over vLLM's KV-transfer protocol and their failures.

P/D is a profile of the one placement step (policies/placement.py): while a model has healthy prefill or
decode workers (roles from config or registration), its requests are placed by `PdPolicy` (policies/pd.py),
through the attempt loop's placement, reservations and admission queue like any other request. Here, as vLLM's
toy proxy and llm-d's sidecar drive them (docs/reference/vllm-interface.md §4.2; shapes in
engine_adapters/vllm/kv_transfer.py):

    place    (gateway/pipeline/attempts.py) the decode worker and, unless the prompt is short or mostly cached on a
             decode-capable worker, a prefill worker; both reserved (the prefill worker for its prompt tokens,
             until its leg ends; the decode worker for the request, until the answer ends)
    prefill  POST the prefill leg (max_tokens 1, no stream, do_remote_decode) with the request's
             X-Request-Id; read `kv_transfer_params` from the JSON answer.
    decode   POST the client's body plus those params (opaque) to the decode worker and relay its
             answer, streamed or not, to the client as the one response it sees.

Both legs run through the one leg runner (gateway/pipeline/legs.py) inside the attempt loop (gateway/pipeline/attempts.py), which
decides what follows each and re-places either leg through its one `place_again`, so they have what a plain
request has: the stall rule, outlier ejection, learning, hooks, the admission queue and resume. This module
only says what the legs send and counts what they did. Failures never reach the client while capacity remains:
- the prefill leg fails (connect, 5xx) or stalls (no answer within the stall rule's limit: its predicted
  prefill time on that worker, or the worker's pace; not a fixed timeout): the request's prefill is planned
  again on another prefill worker; none left, or any other answer (4xx, no params): the decode worker
  prefills locally (the toy proxy's fallback);
- the params are stale (older than `pd.kv_hold_s`, or past vLLM 0.33's `remote_blocks_expiry_time`):
  local prefill on the decode worker;
- the decode leg fails or stalls before its first byte: another decode-capable worker, which prefills locally;
- the decode worker dies or stalls mid-stream: the stream is continued on another decode-capable worker
  (gateway/wire/resume.py), which prefills the prompt and the text sent so far locally.
Metrics: fleetgate_pd_phase_seconds{model,phase} (prefill, transfer_wait: decode leg sent -> first
token, decode: first -> last token) and fleetgate_pd_decisions_total{model,decision}.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from engine_adapters.vllm.kv_transfer import decode_body, params_expired
from gateway.config import GatewayConfig
from policies.pd import PdPolicy
from policies.prefix import CHUNK_CHARS

if TYPE_CHECKING:
    from gateway.request.context import RequestContext
    from gateway.wire.results import RelayResult

# Decisions counted besides PdPolicy's plan decisions (policies/pd.py).
PREFILL_RETRY = "prefill_retry"              # a prefill leg failed; another prefill worker took it
PREFILL_FALLBACK = "prefill_fallback_local"  # no prefill worker could do it: local prefill on the decode worker
NO_PARAMS = "no_params"                      # the prefill answer carried no usable kv_transfer_params
EXPIRED = "expired_params"                   # the params were stale: local prefill
DECODE_RETRY = "decode_retry_local"          # the decode leg failed before any byte: another decode worker

PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                 40.0, 80.0, 160.0)


class PdMetrics:
    """The P/D series, once per metrics registry (`for_registry`), so a restarted gateway reuses them."""

    _by_registry: weakref.WeakKeyDictionary[CollectorRegistry, PdMetrics] = weakref.WeakKeyDictionary()

    @classmethod
    def for_registry(cls, registry: CollectorRegistry) -> PdMetrics:
        m = cls._by_registry.get(registry)
        if m is None:
            m = cls._by_registry[registry] = cls(registry)
        return m

    def __init__(self, registry: CollectorRegistry) -> None:
        self.phase = Histogram("fleetgate_pd_phase_seconds",
                               "P/D requests: prefill leg, transfer wait (decode leg sent -> first token), "
                               "decode (first -> last token).", ["model", "phase"], buckets=PHASE_BUCKETS,
                               registry=registry)
        self.decisions = Counter("fleetgate_pd_decisions", "P/D routing decisions and fallbacks.",
                                 ["model", "decision"], registry=registry)
        self._children: dict[tuple[str, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (metric._name, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def decision(self, model: str, decision: str) -> None:
        self._child(self.decisions, model, decision).inc()

    def observe(self, model: str, phase: str, seconds: float) -> None:
        self._child(self.phase, model, phase).observe(seconds)


@dataclass(slots=True)
class PdPlan:
    """A P/D request's plan: its first decode leg takes the prefill leg's KV (if it has a prefill worker)."""

    decision: str
    params_at: float = 0.0      # unix time the prefill answer (and its kv_transfer_params) arrived
    started: bool = False       # the first decode leg was sent (later ones prefill locally)


def pd_policy_factory(config: GatewayConfig, model: str) -> Callable[[], PdPolicy]:
    """The P/D profile's policy of `model` (policies/pd.py) from the config: the model's policy (or
    `pd.decode_policy`) places decode legs; built when the fleet first has prefill or decode workers."""
    cfg = config.pd

    def build() -> PdPolicy:
        name, params, slo = config.model_settings(model)
        if cfg.decode_policy is not None:
            name, params = cfg.decode_policy, cfg.decode_policy_params
        ttft_ms = slo.ttft_ms or config.slo.ttft_ms or 600.0
        return PdPolicy(name, params, local_prefill_tokens=cfg.local_prefill_tokens,
                        prefix_chunk_tokens=CHUNK_CHARS / 4,  # ~4 bytes per token (gateway/request/parse.py estimates)
                        slo_ttft_s=ttft_ms / 1000, prefill_overflow=cfg.prefill_overflow)

    return build


class PdLegs:
    """What the legs of a P/D request send and what they teach: the plan's decision counted, the prefill
    answer's params (expired ones dropped), the decode leg's body, the phase timings. The attempt loop
    (gateway/pipeline/attempts.py) runs both legs, re-places either, and writes the request's placement state."""

    def __init__(self, config: GatewayConfig, metrics_registry: CollectorRegistry) -> None:
        self.cfg = config.pd
        self.metrics = PdMetrics.for_registry(metrics_registry)

    def plan(self, ctx: RequestContext) -> PdPlan:
        assert ctx.worker is not None and ctx.decision is not None
        self.metrics.decision(ctx.rt.model, ctx.decision.reason)
        return PdPlan(ctx.decision.reason)

    def decision(self, model: str, decision: str) -> None:
        self.metrics.decision(model, decision)

    def prefilled(self, model: str, plan: PdPlan, result: RelayResult, t0: float) -> dict[str, Any] | None:
        """A prefill leg answered (it started at perf_counter() `t0`): its kv_transfer_params, if any."""
        self.metrics.observe(model, "prefill", result.first_token_at - t0)
        plan.params_at = time.time()
        if result.kv_params is None:
            self.metrics.decision(model, NO_PARAMS)
        return result.kv_params

    def decode_body(self, ctx: RequestContext, body: dict[str, Any], params: dict[str, Any] | None,
                    plan: PdPlan) -> tuple[bytes, bool]:
        """The first decode leg's body (the client's plus the params, unless stale) and whether it carries the
        producer's KV; without params, `ctx.payload` as it is (the decode worker prefills locally)."""
        if params is not None and params_expired(params, plan.params_at, time.time(), self.cfg.kv_hold_s):
            self.metrics.decision(ctx.rt.model, EXPIRED)
            params = None
        if params is not None or "kv_transfer_params" in body:
            return decode_body(body, params), params is not None
        return ctx.payload, False

    def observe_decode(self, model: str, remote_kv: bool, t0: float, result: RelayResult) -> None:
        if not remote_kv:
            return
        if result.first_token_at is not None:
            self.metrics.observe(model, "transfer_wait", result.first_token_at - t0)
            if result.last_token_at is not None:
                self.metrics.observe(model, "decode", result.last_token_at - result.first_token_at)
        elif result.status == 200:
            self.metrics.observe(model, "decode", time.perf_counter() - t0)
