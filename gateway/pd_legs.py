"""Prefill/decode-disaggregated requests: the two legs over vLLM's KV-transfer protocol and their failures.

P/D is a profile of the one placement step (policies/placement.py): while a model has healthy prefill or
decode workers (roles from config or registration), its requests are placed by `PdPolicy` (policies/pd.py),
through the dispatcher's placement, reservations and admission queue like any other request. Here, as vLLM's
toy proxy and llm-d's sidecar drive them (docs/reference/vllm-interface.md §4.2; shapes in
engine_adapters/vllm/kv_transfer.py):

    place    (the dispatcher) the decode worker and, unless the prompt is short or mostly cached on a
             decode-capable worker, a prefill worker; both reserved (the prefill worker for its prompt tokens,
             until its leg ends; the decode worker for the request, until the answer ends)
    prefill  POST the prefill leg (max_tokens 1, no stream, do_remote_decode) with the request's
             X-Request-Id; read `kv_transfer_params` from the JSON answer.
    decode   POST the client's body plus those params (opaque) to the decode worker and relay its
             answer, streamed or not, to the client as the one response it sees.

Failures never reach the client while capacity remains:
- the prefill leg fails (connect, timeout, 5xx): the next prefill worker; none left, or any other
  answer (4xx, no params): the decode worker prefills locally (the toy proxy's fallback);
- the params are stale (older than `pd.kv_hold_s`, or past vLLM 0.33's `remote_blocks_expiry_time`):
  local prefill on the decode worker;
- the decode leg fails before its first byte: another decode worker, which prefills locally.
Metrics: fleetgate_pd_phase_seconds{model,phase} (prefill, transfer_wait: decode leg sent -> first
token, decode: first -> last token) and fleetgate_pd_decisions_total{model,decision}.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import CollectorRegistry, Counter, Histogram

from engine_adapters.vllm.kv_transfer import (
    decode_body,
    extract_kv_transfer_params,
    params_expired,
    prefill_body,
)
from gateway import errors, observe
from gateway.config import GatewayConfig
from gateway.registry import WorkerState
from gateway.relay import RelayResult, UpstreamFailure
from gateway.request import Route
from gateway.upstream import ClientConnectorError
from policies.pd import PdPolicy
from policies.prefix import CHUNK_CHARS
from policies.types import ROLE_DECODE, ROLE_MIXED, ROLE_PREFILL

if TYPE_CHECKING:
    from gateway.dispatch import Dispatcher, RequestContext

log = logging.getLogger("fleetgate.pd")

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
class _Pair:
    """The workers one request holds reservations on."""

    decode: WorkerState
    prefill: WorkerState | None
    decision: str
    params_at: float = 0.0      # unix time the prefill answer (and its kv_transfer_params) arrived
    remote_kv: bool = False     # the decode leg that answered was given the producer's params


class _PrefillFailed(Exception):
    def __init__(self, detail: str, retryable: bool) -> None:
        super().__init__(detail)
        self.retryable = retryable


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
                        prefix_chunk_tokens=CHUNK_CHARS / 4,  # ~4 bytes per token (gateway/request.py estimates)
                        slo_ttft_s=ttft_ms / 1000, prefill_overflow=cfg.prefill_overflow)

    return build


class PdLegs:
    """Runs a request the placement step placed through its P/D profile: the prefill leg (if it has a prefill
    worker), then the decode leg relayed to the client. Placement, reservations and the admission queue are the
    dispatcher's (the one pipeline); this module owns only the two legs and their failures."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.d = dispatcher
        self.cfg = dispatcher.config.pd
        self.metrics = PdMetrics.for_registry(dispatcher.metrics.registry)

    async def run(self, ctx: RequestContext) -> RelayResult:
        rt, feats = ctx.rt, ctx.feats
        assert ctx.worker is not None and ctx.decision is not None
        self.metrics.decision(rt.model, ctx.decision.reason)
        pair = _Pair(ctx.worker, ctx.prefill, ctx.decision.reason)
        body = orjson.loads(ctx.payload)
        out, met = 0, None
        try:
            params = None
            if pair.prefill is not None:
                params = await self._prefill(ctx, body, pair)
            result = await self._decode(ctx, body, params, pair)
            if result.status == 200 and result.midstream_error is None:
                out = result.usage.completion_tokens if result.usage is not None else result.tokens
            met = self.d.slo.judge(feats, ctx.stream, ctx.t0, result, time.perf_counter())
            return result
        finally:
            if pair.prefill is not None:
                await self.d.release(rt, feats, pair.prefill, feedback=False)
            ctx.worker = ctx.prefill = None
            await self.d.release(rt, feats, pair.decode, out, slo_met=met)

    # --- the prefill leg ---------------------------------------------------------------------------------
    async def _prefill(self, ctx: RequestContext, body: dict[str, Any], pair: _Pair) -> dict[str, Any] | None:
        """Run the prefill leg, retrying other prefill workers; the params, or None for a local prefill.
        Releases the prefill reservation(s) as each attempt ends; `pair.prefill` is None afterwards."""
        rt, feats = ctx.rt, ctx.feats
        leg = prefill_body(body)
        tried: list[str] = []
        try:
            for attempt in range(self.d.attempts):
                ws = pair.prefill
                if ws is None:
                    break
                if attempt:
                    self.metrics.decision(rt.model, PREFILL_RETRY)
                t0 = time.perf_counter()
                try:
                    params = await self._prefill_once(ws, ctx.route, leg,
                                                      observe.leg("prefill", ws.id, ctx.upstream_headers))
                except _PrefillFailed as f:
                    observe.leg_failed("pd_prefill", str(f))
                    tried.append(ws.id)
                    self.d.metrics.upstream_error(ws.id, "pd_prefill")
                    log.debug("prefill leg of %s failed on %s: %s", feats.request_id, ws.id, f)
                    pair.prefill = None
                    await self.d.release(rt, feats, ws, feedback=False)
                    if not f.retryable:
                        break
                    pair.prefill = await self._another_prefill(ctx, tried)
                    continue
                self.metrics.observe(rt.model, "prefill", time.perf_counter() - t0)
                pair.params_at = time.time()
                if params is None:
                    self.metrics.decision(rt.model, NO_PARAMS)
                return params
            self.metrics.decision(rt.model, PREFILL_FALLBACK)
            return None
        finally:
            if pair.prefill is not None:
                ws, pair.prefill = pair.prefill, None
                await self.d.release(rt, feats, ws, feedback=False)

    async def _prefill_once(self, ws: WorkerState, route: Route, leg: bytes,
                            headers: bytes) -> dict[str, Any] | None:
        url = getattr(ws, route.url_attr)
        try:  # the one client to workers (gateway/upstream.py), as the relay
            r = await self.d.relay.upstream.fetch(url, self.cfg.prefill_timeout_s, method=b"POST", body=leg,
                                                  headers=headers)
            answer, status = r.body, r.status
        except (TimeoutError, OSError) as e:
            if isinstance(e, (ClientConnectorError, ConnectionRefusedError)):
                self.d.registry.report_failure(ws.id)
            raise _PrefillFailed(f"{type(e).__name__}: {e}", retryable=True) from None
        if status >= 500:
            raise _PrefillFailed(f"prefill worker answered {status}", retryable=True)
        if status != 200:  # the request itself is refused: the decode worker will answer it the same way
            raise _PrefillFailed(f"prefill worker answered {status}", retryable=False)
        return extract_kv_transfer_params(answer)

    async def _another_prefill(self, ctx: RequestContext, tried: list[str]) -> WorkerState | None:
        views, by_id = self.d.views(ctx.rt.model, tried, (ROLE_PREFILL,))
        while views:
            wid = ctx.rt.placement.retry_prefill(ctx.feats, views)
            ws = by_id.get(wid) if wid is not None else None
            if ws is None:
                return None
            if await self.d.reserve(ctx, ws, ctx.feats.prompt_tokens):
                return ws
            views = [v for v in views if v.id != ws.id]
        return None

    # --- the decode leg ----------------------------------------------------------------------------------
    async def _decode(self, ctx: RequestContext, body: dict[str, Any], params: dict[str, Any] | None,
                      pair: _Pair) -> RelayResult:
        rt = ctx.rt
        if params is not None and params_expired(params, pair.params_at, time.time(), self.cfg.kv_hold_s):
            self.metrics.decision(rt.model, EXPIRED)
            params = None
        failure: UpstreamFailure | None = None
        for attempt in range(self.d.attempts):
            if attempt:
                self.metrics.decision(rt.model, DECODE_RETRY)
                params = None  # the new decode worker prefills locally
                if not await self._another_decode(ctx, pair):
                    break
            leg = decode_body(body, params) if params is not None or "kv_transfer_params" in body else ctx.payload
            ws = pair.decode
            pair.remote_kv = params is not None
            t0 = time.perf_counter()
            try:
                result = await self.d.relay.forward(ctx.send, getattr(ws, ctx.route.url_attr), leg,
                                                    observe.leg("decode", ws.id, ctx.upstream_headers),
                                                    ctx.client_headers, ctx.stream,
                                                    ctx.strip_usage, attempt + 1 < self.d.attempts, ctx.state)
            except UpstreamFailure as f:
                observe.leg_failed(f.kind, f.detail)
                failure = f
                ctx.tried.append(ws.id)
                self.d.metrics.upstream_error(ws.id, f.kind)
                if f.kind == "connect":
                    self.d.registry.report_failure(ws.id)
                log.debug("decode leg of %s failed on %s: %s", ctx.feats.request_id, ws.id, f.detail)
                continue
            if result.midstream_error is not None:
                self.d.metrics.upstream_error(ws.id, "midstream")
            self._observe_decode(rt.model, pair, t0, result)
            return result
        if failure is None:
            raise errors.no_worker(rt.model, self.d.retry_after_s)
        return await self.d.answer_failure(ctx, failure)

    async def _another_decode(self, ctx: RequestContext, pair: _Pair) -> bool:
        """Move the request's decode reservation to another decode-capable worker (it prefills locally)."""
        rt, feats = ctx.rt, ctx.feats
        old = pair.decode
        views, by_id = self.d.views(rt.model, ctx.tried, (ROLE_DECODE, ROLE_MIXED))
        while views:
            wid = rt.placement.retry_decode(feats, views, time.time())
            ws = by_id.get(wid) if wid is not None else None
            if ws is None:
                return False
            if await self.d.reserve(ctx, ws, feats.prompt_tokens + int(feats.predicted_output_tokens)):
                rt.placement.moved(feats, old.id, ws.id, time.time())
                await self.d.release(rt, feats, old, feedback=False)
                pair.decode = ws
                return True
            views = [v for v in views if v.id != ws.id]
        return False

    def _observe_decode(self, model: str, pair: _Pair, t0: float, result: RelayResult) -> None:
        if not pair.remote_kv:
            return
        if result.first_token_at is not None:
            self.metrics.observe(model, "transfer_wait", result.first_token_at - t0)
            if result.last_token_at is not None:
                self.metrics.observe(model, "decode", result.last_token_at - result.first_token_at)
        elif result.status == 200:
            self.metrics.observe(model, "decode", time.perf_counter() - t0)
