"""Prefill/decode-disaggregated requests: the two legs over vLLM's KV-transfer protocol and their failures.

Active for a model while it has healthy prefill or decode workers (roles from config or registration).
One request, as vLLM's toy proxy and llm-d's sidecar drive it (vllm-interface.md 4.2; shapes in
engine_adapters/vllm/pd.py; the pairing in policies/pd.py):

    place    PdPolicy.plan picks the decode worker and, unless the prompt is short or mostly cached on
             a decode-capable worker, a prefill worker; both are reserved in the state store (the
             prefill worker for its prompt tokens, until its leg ends; the decode worker for the
             request, until the answer ends). No capacity: the model's admission queue.
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

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from prometheus_client import CollectorRegistry, Counter, Histogram

from engine_adapters.vllm.pd import decode_body, extract_kv_transfer_params, params_expired, prefill_body
from gateway import errors, observe
from gateway.registry import WorkerState
from gateway.relay import RelayResult, ResponseState, UpstreamFailure
from gateway.upstream import header_pairs
from policies.pd import PdPlan, PdPolicy
from policies.prefix import CHUNK_CHARS, prompt_chunk_hashes
from policies.types import ROLE_DECODE, ROLE_MIXED, ROLE_PREFILL, RequestFeatures

if TYPE_CHECKING:
    from gateway.dispatch import Dispatcher, ModelRuntime, Route

log = logging.getLogger("fleetgate.pd")

# Decisions counted besides PdPolicy's plan decisions (policies/pd.py).
PREFILL_RETRY = "prefill_retry"              # a prefill leg failed; another prefill worker took it
PREFILL_FALLBACK = "prefill_fallback_local"  # no prefill worker could do it: local prefill on the decode worker
NO_PARAMS = "no_params"                      # the prefill answer carried no usable kv_transfer_params
EXPIRED = "expired_params"                   # the params were stale: local prefill
DECODE_RETRY = "decode_retry_local"          # the decode leg failed before any byte: another decode worker

PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                 40.0, 80.0, 160.0)
_PD_ROLES = (ROLE_PREFILL, ROLE_DECODE, ROLE_MIXED)


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
    plan: PdPlan
    params_at: float = 0.0      # unix time the prefill answer (and its kv_transfer_params) arrived
    remote_kv: bool = False     # the decode leg that answered was given the producer's params


class _PrefillFailed(Exception):
    def __init__(self, detail: str, retryable: bool) -> None:
        super().__init__(detail)
        self.retryable = retryable


class PdRouter:
    """The P/D path of the dispatcher (which owns admission, parsing and the client connection)."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.d = dispatcher
        self.cfg = dispatcher.config.pd
        self.metrics = PdMetrics.for_registry(dispatcher.metrics.registry)
        self.policies: dict[str, PdPolicy] = {}
        t = dispatcher.config.timeouts
        self._prefill_timeout = aiohttp.ClientTimeout(total=None, connect=t.connect_s, sock_connect=t.connect_s,
                                                      sock_read=self.cfg.prefill_timeout_s)

    # --- when and with what policy ----------------------------------------------------------------
    def active(self, model: str) -> bool:
        reg = self.d.registry
        return bool(reg.pool(model, ROLE_PREFILL) or reg.pool(model, ROLE_DECODE))

    def policy(self, rt: ModelRuntime) -> PdPolicy:
        pol = self.policies.get(rt.model)
        if pol is None:
            name, params, slo = self.d.config.model_settings(rt.model)
            if self.cfg.decode_policy is not None:
                name, params = self.cfg.decode_policy, self.cfg.decode_policy_params
            pol = PdPolicy(name, params, local_prefill_tokens=self.cfg.local_prefill_tokens,
                           prefix_chunk_tokens=CHUNK_CHARS / 4,  # ~4 bytes per token (dispatch estimates)
                           slo_ttft_s=(slo.ttft_ms or getattr(self.d.config, "slo", slo).ttft_ms or 600.0) / 1000,
                           prefill_overflow=self.cfg.prefill_overflow)
            self.policies[rt.model] = pol
        return pol

    # --- one request ----------------------------------------------------------------------------------
    async def run(self, rt: ModelRuntime, feats: RequestFeatures, route: Route, payload: bytes,
                  strip_usage: bool, stream: bool, upstream_headers: bytes,
                  client_headers: list[tuple[bytes, bytes]], send, state: ResponseState) -> RelayResult:  # noqa: ANN001
        """`upstream_headers`: the worker-bound request headers as encoded lines (gateway/upstream.py)."""
        body = orjson.loads(payload)
        if not feats.prefix_hashes:
            feats = replace(feats, prefix_hashes=_prefix_hashes(body, route))
        pol = self.policy(rt)
        pair = await self._place(rt, pol, feats)
        self.metrics.decision(rt.model, pair.plan.decision)
        try:
            params = None
            if pair.prefill is not None:
                params = await self._prefill(rt, pol, feats, route, body, pair, upstream_headers)
            return await self._decode(rt, pol, feats, route, body, payload, params, pair, strip_usage, stream,
                                      upstream_headers, client_headers, send, state)
        finally:
            if pair.prefill is not None:
                await self._release(rt, pair.prefill, feats.request_id)
            await self._release(rt, pair.decode, feats.request_id)
            pol.on_complete(feats, pair.decode.id, time.time())

    # --- placement --------------------------------------------------------------------------------------
    async def _place(self, rt: ModelRuntime, pol: PdPolicy, feats: RequestFeatures) -> _Pair:
        if not rt.queue.waiters:
            pair = await self._try_place(rt, pol, feats)
            if pair is not None:
                return pair
        if not self._any_worker(rt.model):
            raise errors.no_worker(rt.model, self.d.retry_after_s)
        return await self._wait_in_queue(rt, pol, feats)

    def _any_worker(self, model: str) -> bool:
        reg = self.d.registry
        return bool(reg.pool(model, ROLE_DECODE) or reg.pool(model, ROLE_MIXED))

    def _views(self, model: str, roles: Collection[str], exclude: Collection[str] = ()) -> tuple[list, dict]:
        inflight = self.d.store.inflight()
        views, by_id = [], {}
        for role in roles:
            for ws in self.d.registry.pool(model, role):
                if ws.id in exclude:
                    continue
                f = inflight.get(ws.id)
                n = f.requests if f is not None else 0
                if ws.rec.cap is not None and n >= ws.rec.cap:
                    continue
                views.append(ws.view(n, f.tokens if f is not None else 0))
                by_id[ws.id] = ws
        return views, by_id

    async def _try_place(self, rt: ModelRuntime, pol: PdPolicy, feats: RequestFeatures) -> _Pair | None:
        t = time.perf_counter()
        views, by_id = self._views(rt.model, _PD_ROLES)
        store, rid = self.d.store, feats.request_id
        pair = None
        full: set[str] = set()
        while views:
            plan = pol.plan(feats, views, time.time(), exclude_prefill=full, exclude_decode=full)
            decode = by_id.get(plan.decode_worker_id) if plan.decode_worker_id is not None else None
            if decode is None:
                break
            if not await store.try_reserve(decode.id, rid, decode.rec.cap, _tokens(feats)):
                full.add(decode.id)  # another replica took its last slot
                continue
            prefill = by_id.get(plan.prefill_worker_id) if plan.prefill_worker_id is not None else None
            if prefill is not None and not await store.try_reserve(prefill.id, rid, prefill.rec.cap,
                                                                   feats.prompt_tokens):
                full.add(prefill.id)
                await store.release(decode.id, rid)
                continue
            pol.on_dispatch(feats, decode.id, time.time())
            pair = _Pair(decode, prefill, plan)
            observe.note_placement(decode.id, plan.decision, time.perf_counter() - t, prefill and prefill.id)
            break
        self.d.metrics.observe_routing(rt.model, time.perf_counter() - t)
        return pair

    async def _wait_in_queue(self, rt: ModelRuntime, pol: PdPolicy, feats: RequestFeatures) -> _Pair:
        """The model's admission queue (gateway/dispatch.py AdmissionQueue), placing with `_try_place`."""
        q = rt.queue
        if q.full():
            raise errors.overloaded(rt.model, self.d.retry_after_s, "admission queue full")
        t0 = time.perf_counter()
        deadline = t0 + self.d.queue_timeout
        ev = q.enter()
        self.d.metrics.set_queue_depth(rt.model, len(q.waiters))
        try:
            while True:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    raise errors.overloaded(rt.model, self.d.retry_after_s,
                                            f"waited {self.d.queue_timeout:g}s in the admission queue")
                if not ev.is_set():
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(min(remaining, self.d.poll_s)):
                            await ev.wait()
                ev.clear()
                if not q.is_head(ev):
                    continue
                if not self._any_worker(rt.model):
                    raise errors.no_worker(rt.model, self.d.retry_after_s)
                pair = await self._try_place(rt, pol, feats)
                if pair is not None:
                    self.d.metrics.observe_queue_wait(rt.model, time.perf_counter() - t0)
                    observe.note_queue(time.perf_counter() - t0)
                    return pair
        finally:
            q.leave(ev)
            self.d.metrics.set_queue_depth(rt.model, len(q.waiters))

    async def _release(self, rt: ModelRuntime, ws: WorkerState, request_id: str) -> None:
        try:
            if self.d.shield_release:
                await asyncio.shield(self.d.store.release(ws.id, request_id))
            else:
                await self.d.store.release(ws.id, request_id)
        finally:
            for m in ws.models:
                other = self.d.runtimes.get(m)
                if other is not None:
                    other.queue.wake_head()

    # --- the prefill leg ---------------------------------------------------------------------------------
    async def _prefill(self, rt: ModelRuntime, pol: PdPolicy, feats: RequestFeatures, route: Route,
                       body: dict[str, Any], pair: _Pair, headers: bytes) -> dict[str, Any] | None:
        """Run the prefill leg, retrying other prefill workers; the params, or None for a local prefill.
        Releases the prefill reservation(s) as each attempt ends; `pair.prefill` is None afterwards."""
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
                    params = await self._prefill_once(ws, route, leg, observe.leg("prefill", ws.id, headers))
                except _PrefillFailed as f:
                    observe.leg_failed("pd_prefill", str(f))
                    tried.append(ws.id)
                    self.d.metrics.upstream_error(ws.id, "pd_prefill")
                    log.debug("prefill leg of %s failed on %s: %s", feats.request_id, ws.id, f)
                    pair.prefill = None
                    await self._release(rt, ws, feats.request_id)
                    if not f.retryable:
                        break
                    pair.prefill = await self._another_prefill(rt, pol, feats, tried)
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
                await self._release(rt, ws, feats.request_id)

    async def _prefill_once(self, ws: WorkerState, route: Route, leg: bytes,
                            headers: bytes) -> dict[str, Any] | None:
        url = getattr(ws, route.url_attr)
        try:
            async with self.d.relay.session.post(url, data=leg, headers=header_pairs(headers),
                                                 timeout=self._prefill_timeout) as r:
                answer = await r.read()
                status = r.status
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            if isinstance(e, (aiohttp.ClientConnectorError, ConnectionRefusedError)):
                self.d.registry.report_failure(ws.id)
            raise _PrefillFailed(f"{type(e).__name__}: {e}", retryable=True) from None
        if status >= 500:
            raise _PrefillFailed(f"prefill worker answered {status}", retryable=True)
        if status != 200:  # the request itself is refused: the decode worker will answer it the same way
            raise _PrefillFailed(f"prefill worker answered {status}", retryable=False)
        return extract_kv_transfer_params(answer)

    async def _another_prefill(self, rt: ModelRuntime, pol: PdPolicy, feats: RequestFeatures,
                               tried: list[str]) -> WorkerState | None:
        views, by_id = self._views(rt.model, (ROLE_PREFILL,), tried)
        while views:
            wid, _ = pol.choose_prefill(feats, views)
            ws = by_id.get(wid) if wid is not None else None
            if ws is None:
                return None
            if await self.d.store.try_reserve(ws.id, feats.request_id, ws.rec.cap, feats.prompt_tokens):
                return ws
            views = [v for v in views if v.id != ws.id]
        return None

    # --- the decode leg ----------------------------------------------------------------------------------
    async def _decode(self, rt: ModelRuntime, pol: PdPolicy, feats: RequestFeatures, route: Route,
                      body: dict[str, Any], payload: bytes, params: dict[str, Any] | None, pair: _Pair,
                      strip_usage: bool, stream: bool, headers: bytes,
                      client_headers: list[tuple[bytes, bytes]], send, state: ResponseState) -> RelayResult:  # noqa: ANN001
        if params is not None and params_expired(params, pair.params_at, time.time(), self.cfg.kv_hold_s):
            self.metrics.decision(rt.model, EXPIRED)
            params = None
        tried: list[str] = []
        failure: UpstreamFailure | None = None
        for attempt in range(self.d.attempts):
            if attempt:
                self.metrics.decision(rt.model, DECODE_RETRY)
                params = None  # the new decode worker prefills locally
                if not await self._another_decode(rt, pol, feats, pair, tried):
                    break
            leg = decode_body(body, params) if params is not None or "kv_transfer_params" in body else payload
            ws = pair.decode
            pair.remote_kv = params is not None
            t0 = time.perf_counter()
            try:
                result = await self.d.relay.forward(send, getattr(ws, route.url_attr), leg,
                                                    observe.leg("decode", ws.id, headers), client_headers,
                                                    stream, strip_usage, attempt + 1 < self.d.attempts, state)
            except UpstreamFailure as f:
                observe.leg_failed(f.kind, f.detail)
                failure = f
                tried.append(ws.id)
                self.d.metrics.upstream_error(ws.id, f.kind)
                if f.kind == "connect":
                    self.d.registry.report_failure(ws.id)
                log.debug("decode leg of %s failed on %s: %s", feats.request_id, ws.id, f.detail)
                continue
            if result.midstream_error is not None:
                self.d.metrics.upstream_error(ws.id, "midstream")
            self._observe_decode(rt.model, pair, t0, result)
            return result
        if failure is None:
            raise errors.no_worker(rt.model, self.d.retry_after_s)
        if failure.status is not None:  # the last worker's own error answer, unchanged (as the dispatcher)
            state.started = state.ended = True
            await send({"type": "http.response.start", "status": failure.status,
                        "headers": [(b"content-type", failure.content_type), *client_headers]})
            await send({"type": "http.response.body", "body": failure.body, "more_body": False})
            return RelayResult(status=failure.status)
        raise errors.upstream_failed(failure.detail)

    async def _another_decode(self, rt: ModelRuntime, pol: PdPolicy, feats: RequestFeatures, pair: _Pair,
                              tried: list[str]) -> bool:
        """Move the request's decode reservation to another decode-capable worker (it prefills locally)."""
        old = pair.decode
        views, by_id = self._views(rt.model, (ROLE_DECODE, ROLE_MIXED), tried)
        while views:
            wid = pol.choose_decode(feats, views, time.time()).worker_id
            ws = by_id.get(wid) if wid is not None else None
            if ws is None:
                return False
            if await self.d.store.try_reserve(ws.id, feats.request_id, ws.rec.cap, _tokens(feats)):
                now = time.time()
                pol.on_complete(feats, old.id, now)
                await self._release(rt, old, feats.request_id)
                pol.on_dispatch(feats, ws.id, now)
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


def _tokens(feats: RequestFeatures) -> int:
    return feats.prompt_tokens + int(feats.predicted_output_tokens)


def _prefix_hashes(body: dict[str, Any], route: Route) -> tuple[int, ...]:
    from gateway.dispatch import chat_text  # noqa: PLC0415 - dispatch imports this module

    if route.kind == "chat":
        return prompt_chunk_hashes(chat_text(body["messages"]))
    prompt = body.get("prompt")
    return prompt_chunk_hashes(prompt) if isinstance(prompt, str) else ()
