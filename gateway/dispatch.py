"""The request pipeline for /v1/chat/completions and /v1/completions: where every request is placed.

    handle    read and check the request (gateway/request.py) into its RequestContext (gateway/context.py),
              which carries it to the end; the request hooks (gateway/hooks.py) hear it arrive
    place     the model's placement step (policies/placement.py: pool filter, plain or P/D profile, policy)
              plus reservations in the state store; no room: the model's admission queue
              (gateway/admission.py over policies/admission.py), until placed or refused with 429
    run       the plan's legs through the one leg runner (gateway/legs.py: pace, stalls, ejection, learning):
              one leg, or a prefill leg then a decode leg (gateway/pd_legs.py); a leg that fails or stalls
              before the client saw a byte places the request again elsewhere (`place_again`), a stream that
              breaks after it is continued on another worker (gateway/resume.py)
    finish    release the reservations, tell the placement step (feedback to the policy and the length
              predictor), count metrics; the hooks hear it finish (the SLO book, the service order, the
              access log and tracing)

The virtual-time simulator (simulator/cluster.py) drives the same placement step and admission queue with
its own clock, so an experiment there runs this pipeline's decisions.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from engine_adapters.base import EngineAdapter, Usage
from gateway import errors, observe
from gateway.adapters import AdapterRouter
from gateway.admission import ModelQueue
from gateway.auth import Authenticator
from gateway.config import GatewayConfig
from gateway.context import UNKNOWN_MODEL_LABEL, ModelRuntime, Outcome, RequestContext
from gateway.drain import Drain, end_request
from gateway.errors import GatewayError, sse_error_event
from gateway.forwarding import ForwardedFor
from gateway.hooks import RequestHook, RequestHooks
from gateway.kv_events import KvEventsService, cached_prefix_for
from gateway.learning import Learner
from gateway.legs import DECODE, PLAIN, LegRunner
from gateway.metrics import GatewayMetrics
from gateway.observer import RequestObserver
from gateway.pd_legs import PdLegs, pd_policy_factory
from gateway.ratelimit import RateLimited
from gateway.rebalancer import Moved, Rebalancer
from gateway.registry import Registry, WorkerState
from gateway.relay import TOO_LONG as WORKER_TOO_LONG
from gateway.relay import Relay, RelayResult, ResponseState, UpstreamFailure
from gateway.request import (
    CHAT,
    ROUTES,
    ClientHeaders,
    ParsedRequest,
    Route,
    chat_text,
    parse_request,
    read_headers,
)
from gateway.request_metrics import RequestMetrics
from gateway.resume import StreamResume, continuation_body, resumable, text_tokenize_body, tokenize_body
from gateway.services import ServiceOrder
from gateway.slo import SloBook
from gateway.state.base import StateStore
from gateway.tickets import Tickets
from policies.admission import AdmissionQueue
from policies.base import make_policy
from policies.fallbacks import CONTEXT_WINDOW, NO_WORKER, failure_reason, fallback_targets, refusal_reason
from policies.placement import (
    TOO_LONG,
    ModelPlacement,
    context_limit,
    has_room,
    reserved_tokens,
    too_long_message,
)
from policies.prefix import prompt_chunk_hashes
from policies.tokens import estimate_chat_tokens, estimate_prompt_tokens
from policies.types import ROLE_DECODE, ROLE_PREFILL, RequestFeatures, WorkerView

if TYPE_CHECKING:
    from gateway.pooling import SwapController

__all__ = ["PLACE_AGAIN", "ROUTES", "Dispatcher", "NoRoom"]

log = logging.getLogger("fleetgate.dispatch")

STATUS_CLIENT_GONE = 499  # nginx's convention for "client closed the request"
STATUS_BROKEN_STREAM = 502  # a stream that ended with an error event is counted as the bad gateway it was
MOVED = "moved by rebalancing before its first token"
TOKENIZE_TIMEOUT_S = 2.0

# Why a request that has not started is placed again (`Dispatcher.place_again`), in the order the rules act.
RETRY = "retry"          # its leg failed or stalled before the first token
MOVE = "move"            # rebalancing: a better worker for a request still queued (gateway/rebalancer.py)
FALL_BACK = "fall_back"  # model fallbacks: the next of its model's fallbacks serves it
PLACE_AGAIN = (RETRY, MOVE, FALL_BACK)
SERVED_MODEL = b"x-served-model"    # response header: the model that served the request


# Before a request waits in its model's admission queue (the Batch API's class router, gateway/batch_runner.py):
# may evict batch work for it, or refuse it (a GatewayError).
NoRoom = Callable[[ModelRuntime, RequestFeatures], Awaitable[None]]


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


class Dispatcher:
    """The request pipeline (module docstring). It is given every collaborator it uses; those that hear requests
    register as request hooks (gateway/hooks.py), in this order: the `hooks` given (the Batch API's class
    router), the service order (while on), the rate-limit tickets (gateway/tickets.py), the learner, the SLO
    book, the request metrics (gateway/request_metrics.py), the observer (access log and tracing)."""

    def __init__(self, config: GatewayConfig, store: StateStore, registry: Registry, relay: Relay,
                 adapter: EngineAdapter, metrics: GatewayMetrics, *, slo: SloBook, learner: Learner,
                 auth: Authenticator, shared_state: bool = False, observer: RequestObserver | None = None,
                 kv_events: KvEventsService | None = None, pooling: SwapController | None = None,
                 no_room: NoRoom | None = None, rebalancer: Rebalancer | None = None,
                 hooks: Sequence[RequestHook] = (), drain: Drain | None = None) -> None:
        self.config = config
        self.drain = drain or Drain()   # SIGTERM's drain (gateway/drain.py): it may cut a request in flight
        self.store = store
        self.registry = registry
        self.relay = relay
        self.adapter = adapter
        self.metrics = metrics
        self.max_body = config.limits.max_body_bytes
        self.attempts = config.limits.retries + 1
        self.max_resumes = config.resume.max_attempts
        self.auth = auth
        self.forwarded_for = ForwardedFor(config.server.trusted_proxies)
        # The admission queue's safety-net poll: releases here and on other replicas (announced through the
        # shared store while requests wait) wake it anyway.
        self.poll_s = config.limits.queue_poll_s or 0.5
        self.shield_release = shared_state
        self.retry_after_s = max(1.0, config.health.interval_s)
        self.runtimes: dict[str, ModelRuntime] = {}
        self.slo = slo
        self.learner = learner
        registry.on_change(self._wake_all)
        store.on_remote_release(self._wake_for)   # another replica freed a slot (a networked store tells)
        # Before a request waits: the Batch API's class router may evict batch work for it (its per-worker class
        # counts are its request hooks; the pool filter itself is part of the placement step).
        self.no_room = no_room
        self.observer = observer      # access log / tracing (gateway/observer.py), None when both are off
        self.kv_events = kv_events    # the exact prefix-cache view (gateway/kv_events.py)
        self.pooling = pooling        # shared hosts (gateway/pooling.py), None when none is configured
        self.services = ServiceOrder(config.service_priority)   # service-aware priority (gateway/services.py)
        self.adapters = AdapterRouter(config, registry, relay.upstream.fetch, metrics.registry)  # LoRA adapters
        self.hooks = RequestHooks([*hooks, *([self.services] if self.services.enabled else []), Tickets(store),
                                   learner, slo, RequestMetrics(metrics), *([observer] if observer is not None else [])])
        # every leg of every request (gateway/legs.py), and the P/D plan of a request placed as P/D
        self.legs = LegRunner(config, relay, registry, learner, metrics, self.services, self.adapters)
        self.pd = PdLegs(config, metrics.registry, self.legs, self, self.attempts)
        self.rebalancer = rebalancer  # rebalancing (gateway/rebalancer.py), None when no model has it on

    # --- per-model state ------------------------------------------------------------------------
    def runtime(self, model: str) -> ModelRuntime:
        rt = self.runtimes.get(model)
        if rt is None:
            name, params, _ = self.config.model_settings(model)
            policy = make_policy(name, **params)
            self.learner.attach(model, policy)

            def pd_factory() -> Any:
                pd = pd_policy_factory(self.config, model)()
                self.learner.attach(model, pd.decode_policy)
                return pd

            placement = ModelPlacement(policy, pd_factory, self.learner.observe_length)
            lim = self.config.limits
            queue = ModelQueue(model, AdmissionQueue(lim.queue_size, lim.queue_lookahead, lim.queue_timeout_s),
                               self._place_queued, self.poll_s, self.retry_after_s,
                               lambda n, m=model: self._queue_depth(m, n),
                               self.services.queue_order(model) if self.services.enabled else None)
            rt = ModelRuntime(model, policy, name, policy.needs_prefix_hashes, placement, queue)
            self.runtimes[model] = rt
        return rt

    def _wake_all(self) -> None:
        for rt in self.runtimes.values():
            rt.queue.kick()

    def kick(self, model: str) -> None:
        """Try the model's waiting requests again (e.g. a shared host's engine failed to wake)."""
        rt = self.runtimes.get(model)
        if rt is not None:
            rt.queue.kick()

    def _wake_for(self, worker_id: str | None) -> None:
        """A slot freed on `worker_id` (None: maybe anywhere): the queues of the models it serves try again."""
        if worker_id is None:
            self._wake_all()
            return
        ws = self.registry.workers.get(worker_id)
        for m in ws.models if ws is not None else ():
            rt = self.runtimes.get(m)
            if rt is not None:
                rt.queue.kick()

    def _queue_depth(self, model: str, depth: int) -> None:
        self.metrics.set_queue_depth(model, depth)
        self.store.set_waiting(sum(len(rt.queue) for rt in self.runtimes.values()))

    # --- ASGI entry -------------------------------------------------------------------------------
    async def handle(self, scope: dict, receive, send, route: Route) -> None:  # noqa: ANN001
        t0 = time.perf_counter()
        state = ResponseState()
        model_label, policy_label, status = UNKNOWN_MODEL_LABEL, "", 0
        task = asyncio.current_task()
        gone: list[bool] = []
        watcher: asyncio.Task | None = None
        hdrs = read_headers(scope["headers"])
        rid = hdrs.request_id
        ctx = RequestContext(rid, route, send, state, t0, [(b"x-request-id", rid)], scope["headers"])
        client_headers = ctx.client_headers
        if self.observer is not None:
            ctx.record = self.observer.begin(rid.decode(), scope["path"], scope["headers"])
        feats: RequestFeatures | None = None
        result: RelayResult | None = None
        error: GatewayError | None = None
        t_end: float | None = None
        try:
            try:
                if hdrs.content_length == -1:
                    raise errors.bad_request("Invalid Content-Length header.")
                tenant = self.auth.tenant_of_scope(scope, hdrs.auth)
                raw = await self._read_body(receive, hdrs.content_length)
                watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, task, state, gone))
                req = parse_request(raw, route)
                model, changed = self._resolve_model(req)
                client_headers.append((SERVED_MODEL, model.encode()))
                rt = self.runtime(model)
                model_label, policy_label = model, rt.policy_name
                shaped = self.adapter.shape_request(raw, req.body, req.stream, changed)
                feats = self._features(req, route, rt, rid.decode(), hdrs)
                ctx.req, ctx.rt, ctx.feats, ctx.payload, ctx.strip_usage = req, rt, feats, shaped.body, shaped.strip_usage
                ctx.upstream_headers = b"".join((b"Content-Type: application/json\r\nX-Request-Id: ", rid, b"\r\n",
                                                 hdrs.forward, self.forwarded_for.line(scope, hdrs.xff)))
                ctx.hdrs, ctx.tenant, ctx.models = hdrs, tenant, [model]
                self.hooks.arrived(ctx)   # the service order, the caller's rate-limit ticket: may refuse it
                try:
                    result = await self._run(ctx)
                finally:   # the serving model counts the request (another one when it fell back)
                    model_label, policy_label = ctx.rt.model, ctx.rt.policy_name
                status = result.status if result.midstream_error is None else STATUS_BROKEN_STREAM
                t_end = time.perf_counter()
            except GatewayError as e:
                status, error = e.status, e
                if not state.started:
                    await _send_error(send, e, client_headers)
        except ClientGone:
            status = STATUS_CLIENT_GONE
        except asyncio.CancelledError:
            if not gone and not self.drain.was_cut(task):
                raise
            task.uncancel()  # the client left (nothing more to send), or the drain ends the request
            status = STATUS_CLIENT_GONE if gone else await end_request(send, state, client_headers)
        except Exception:
            log.exception("unexpected error handling %s (request id %s)", scope.get("path"), rid.decode())
            status = 500
            with contextlib.suppress(Exception):
                if not state.started:
                    await _send_error(send, errors.internal_error(), client_headers)
                elif not state.ended:
                    state.ended = True
                    await send({"type": "http.response.body", "more_body": False,
                                "body": sse_error_event("internal gateway error", "internal_error", "internal_error")})
        finally:
            if watcher is not None:
                watcher.cancel()
            self.hooks.finished(ctx, Outcome(status, result, model_label, policy_label, feats,
                                             t_end if t_end is not None else time.perf_counter(), error))
            # The exception kept in a local ties this frame (and the body it read, up to server.max_body_bytes)
            # into a cycle through its traceback and chained exceptions: let go of it here, or refused
            # requests pile up until a full collection.
            error = None

    async def _read_body(self, receive, content_length: int | None) -> bytes:  # noqa: ANN001
        if content_length is not None and content_length > self.max_body:
            raise errors.body_too_large(self.max_body)
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientGone
        body = msg.get("body", b"")
        if not msg.get("more_body"):
            if len(body) > self.max_body:
                raise errors.body_too_large(self.max_body)
            return body
        parts = [body]
        size = len(body)
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise ClientGone
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise errors.body_too_large(self.max_body)
            parts.append(chunk)
            if not msg.get("more_body"):
                return b"".join(parts)

    def _resolve_model(self, req: ParsedRequest) -> tuple[str, bool]:
        model = req.model
        if model:
            changed = False
            target = self.config.aliases.get(model)
            if target is not None and not self.registry.knows_model(model):  # an alias: its target serves it
                req.body["model"] = model = target
                changed = True
            if (base := self.adapters.base_of(model)) is not None:  # a LoRA adapter: its base model's workers
                return base, changed
            mc = self.config.models.get(model)
            if not self.registry.knows_model(model) and (mc is None or not (mc.fallbacks or mc.context_window_fallbacks)):
                raise errors.model_not_found(model, self.registry.served_models())
            return model, changed   # a configured model without workers yet may still fall back
        served = self.registry.served_models()
        if len(served) == 1:
            req.body["model"] = served[0]
            return served[0], True
        if not served:
            raise errors.no_worker("any model", self.retry_after_s)
        raise errors.bad_request(
            f"`model` is required: this gateway serves several models ({', '.join(served)}).", "model")

    def _pd_fleet(self, model: str) -> bool:
        reg = self.registry
        return bool(reg.pool(model, ROLE_PREFILL) or reg.pool(model, ROLE_DECODE))

    def _features(self, req: ParsedRequest, route: Route, rt: ModelRuntime, rid: str,
                  hdrs: ClientHeaders) -> RequestFeatures:
        body = req.body
        hashes = rt.needs_prefix or self._pd_fleet(rt.model)  # P/D decides local prefills on cached prefixes
        if route is CHAT:
            messages = body["messages"]
            prompt_tokens = estimate_chat_tokens(messages)
            prefix = prompt_chunk_hashes(chat_text(messages)) if hashes else ()
        else:
            prompt = body["prompt"]
            prompt_tokens = estimate_prompt_tokens(prompt)
            prefix = prompt_chunk_hashes(prompt) if hashes and isinstance(prompt, str) else ()
        max_tokens = req.max_tokens if req.max_tokens is not None else route.default_max_tokens
        rclass = hdrs.request_class
        slo_ttft, slo_tpot = self.slo.targets(rt.model, rclass, hdrs.slo_ttft, hdrs.slo_tpot)
        return RequestFeatures(
            request_id=rid, model=rt.model, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
            predicted_output_tokens=self.learner.predict(rt.model, prompt_tokens, max_tokens),
            session_id=hdrs.session_id, prefix_hashes=prefix, slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot,
            priority=req.priority, request_class=rclass, arrival=time.time(),
            cached_prefix_tokens=cached_prefix_for(self.kv_events, rt.policy, body, route is CHAT),
            adapter=self.adapters.adapter_of(rt.model, body.get("model")),
        )

    # --- run ---------------------------------------------------------------------------------------------
    async def _run(self, ctx: RequestContext) -> RelayResult:
        """Run the request's plan, a leg after another, through the one leg runner (gateway/legs.py): one leg,
        or for a request the P/D profile placed a prefill leg then the decode leg (gateway/pd_legs.py). A leg
        that fails before the client saw a byte of the answer: the request is placed again (`place_again`);
        a stream that breaks after: continued on another worker (gateway/resume.py)."""
        try:
            await self._admit(ctx)
        except GatewayError as e:   # the model cannot take it: the next of its fallbacks may
            why = _admission_fallback_reason(e)
            if why is None or not await self.place_again(ctx, FALL_BACK, why):
                raise
        plan = self.pd.plan(ctx) if ctx.pd else None
        resume = self._resumable(ctx)
        failure: UpstreamFailure | None = None
        retries = 0
        out, met = 0, None
        try:
            while True:
                ws = ctx.worker
                kind, payload, remote_kv = PLAIN, ctx.payload, False
                if plan is not None:
                    kind = DECODE
                    payload, remote_kv = await self.pd.decode_leg(ctx, plan)
                broken, again = None, RETRY
                try:
                    t0 = time.perf_counter()
                    fallback = not ctx.state.started and bool(self._fallbacks(ctx, NO_WORKER)
                                                              or self._fallbacks(ctx, CONTEXT_WINDOW))
                    ctx.refusal_fails = fallback
                    leg = self.legs.run(ctx, ws, kind, payload, resume, retries + 1 < self.attempts or fallback,
                                        remote_kv)
                    result = await (leg if self.rebalancer is None else
                                    self.rebalancer.run_leg(ctx, ws, leg, plan is None and resume is not None))
                    if plan is not None:
                        self.pd.observe_decode(ctx.rt.model, remote_kv, t0, result)
                    if result.midstream_error is not None and resume is None:  # ended with an error event
                        self.metrics.count_stream_break(ctx.rt.model, "not_resumable")
                    if result.midstream_error is None or ctx.state.ended:
                        if resume is not None and resume.legs:
                            _join_legs(result, resume, ctx.state.tokens)
                        if result.status == 200 and result.midstream_error is None:
                            out = result.output_tokens
                        met = self.slo.judge(ctx.feats, ctx.stream, ctx.t0, result, time.perf_counter())
                        return result
                    broken = result.midstream_error  # the relay left the stream open: continue it elsewhere
                    if resume.first_token_at is None:
                        resume.first_token_at = result.first_token_at
                except Moved as m:   # no first token yet: placed again, or (response started) continued from nothing
                    ctx.moved_to = m.dst
                    ctx.tried.append(ws.id)
                    if ctx.state.started:
                        broken, again = MOVED, MOVE
                    elif await self.place_again(ctx, MOVE):
                        continue
                    else:
                        failure = UpstreamFailure("moved", f"{MOVED}; no worker took it")
                except UpstreamFailure as f:
                    failure = f
                    if ctx.state.started:  # a continuation leg failed before its first byte
                        broken = f.detail
                    else:
                        retries += 1
                    log.debug("request %s failed on %s (%s); %s", ctx.feats.request_id, ws.id, f.detail,
                              "retrying" if broken is not None or retries < self.attempts else "giving up")
                if broken is not None:
                    ended = await self._continue(ctx, resume, broken, again)
                    if ended is not None:
                        return ended
                    continue  # placed on another worker, ctx.payload is the continuation
                if (retries < self.attempts and failure.kind != WORKER_TOO_LONG
                        and await self.place_again(ctx, RETRY)):
                    self.metrics.count_retry(ctx.rt.model)
                    continue
                # out of retries, or nobody else to try: the last step, another model
                why = _failure_fallback_reason(failure)
                if why is None or ctx.state.started or not await self.place_again(ctx, FALL_BACK, why):
                    break
                retries = 0
                plan = self.pd.plan(ctx) if ctx.pd else None
        finally:
            if ctx.worker is not None:
                ws, ctx.worker = ctx.worker, None
                await self.release(ctx, ws, out, slo_met=met)
            if ctx.moved_to is not None and self.rebalancer is not None:
                self.rebalancer.finished(ctx.rt.model, met)
        if failure is None:
            raise errors.no_worker(ctx.rt.model, self.retry_after_s)
        return await self.answer_failure(ctx, failure)

    async def place_again(self, ctx: RequestContext, reason: str, why: str = "") -> bool:
        """Cancel the placement of a request that has not started on its worker (or of a broken stream, whose
        continuation goes next) and place it again, without the workers it already tried; False when no other
        worker takes it (the request keeps nothing then, or, a P/D request, its old decode reservation).

        The one step behind every rule that moves a request with no first token yet. `reason` is one of
        PLACE_AGAIN, in the order the rules act when several apply at once: RETRY (its leg failed or stalled;
        the first), then MOVE (rebalancing), then FALL_BACK (the next of the model's fallbacks, `why` says what
        failed: a reason of policies/fallbacks.py); each new rule adds its reason there and its case here, not a copy of
        this step."""
        if reason not in PLACE_AGAIN:
            raise ValueError(f"unknown reason to place a request again: {reason!r}")
        if reason == FALL_BACK:
            return await self._fall_back(ctx, why)
        if ctx.pd:  # another decode-capable worker, which prefills locally
            return await self.pd.another_decode(ctx)
        old, ctx.worker = ctx.worker, None
        if old is not None:
            await self.release(ctx, old)
        if self._all_tried(ctx):   # waiting would not help: the next step (a fallback model) may
            return False
        if reason == MOVE and ctx.moved_to is not None:   # the destination rebalancing proposed, if it still fits
            others = [ws.id for ws in self.registry.candidates(ctx.rt.model) if ws.id != ctx.moved_to]
            if await self._place(ctx, others):
                return True
        if await self._place(ctx, ctx.tried):
            return True
        # Nobody else can take it now (the others at their caps, or the policy would queue it): it waits in the
        # admission queue as a new request would, within its own queue budget, rather than failing.
        try:
            await self._wait_for_slot(ctx, ctx.decision.retry_at if ctx.decision is not None else None)
        except GatewayError:
            return False
        return ctx.worker is not None

    def _all_tried(self, ctx: RequestContext) -> bool:
        """Every worker that could answer the model has failed the request (a sleeping engine on a shared host
        may still wake: not all tried then)."""
        model = ctx.rt.model
        if self.pooling is not None and self.pooling.handles(model):
            return False
        return not self._elsewhere(ctx)

    def _elsewhere(self, ctx: RequestContext, resume: StreamResume | None = None) -> list[str]:
        """The workers the request (a broken stream's continuation, `resume`) could go to now."""
        if resume is not None and resume.legs >= self.max_resumes + (ctx.moved_to is not None):
            return []
        here = ctx.worker.id if resume is not None and ctx.worker is not None else None
        return [ws.id for ws in self.registry.candidates(ctx.rt.model)
                if ws.id not in ctx.tried and ws.id != here and ws.rec.role != ROLE_PREFILL]

    def _fallbacks(self, ctx: RequestContext, why: str) -> list[str]:
        """The models the request may still fall back to for `why`, in order (policies/fallbacks.py)."""
        mc = self.config.models.get(ctx.models[0]) if ctx.models else None
        if mc is None:
            return []
        return fallback_targets(mc.fallbacks, mc.context_window_fallbacks, why, self.config.aliases, ctx.models,
                                ctx.tenant.may_use if ctx.tenant is not None else None)

    async def _fall_back(self, ctx: RequestContext, why: str) -> bool:
        """FALL_BACK: the request, which has not started, leaves its model for the first of the remaining
        fallbacks that places it (admission queue included). False, the request as it was, when none does."""
        if ctx.state.started:
            return False
        targets = self._fallbacks(ctx, why)
        if not targets:
            return False
        for ws, feedback in ((ctx.worker, True), (ctx.prefill, False)):
            if ws is not None:
                await self.release(ctx, ws, feedback=feedback)
        ctx.worker = ctx.prefill = None
        before = (ctx.rt, ctx.feats, ctx.payload, ctx.strip_usage, ctx.decision, list(ctx.tried), len(ctx.models))
        source = ctx.rt.model
        for target in targets:
            self._switch_model(ctx, target)
            self.metrics.count_fallback(source, target, why)
            log.info("request %s: %s (%s); falling back to %s", ctx.feats.request_id, source, why, target)
            try:
                await self._admit(ctx)
                return True
            except GatewayError as e:
                log.info("request %s: fallback %s cannot take it either (%s)", ctx.feats.request_id, target,
                         e.message)
        ctx.rt, ctx.feats, ctx.payload, ctx.strip_usage, ctx.decision, ctx.tried, n = before
        del ctx.models[n:]
        self._served_header(ctx)
        return False

    def _switch_model(self, ctx: RequestContext, model: str) -> None:
        """Make `model` the request's model: its runtime, features and body (`model` rewritten) afresh."""
        rt = self.runtime(model)
        body = {**ctx.req.body, "model": model}
        shaped = self.adapter.shape_request(b"", body, ctx.req.stream, True)
        ctx.rt, ctx.payload, ctx.strip_usage = rt, shaped.body, shaped.strip_usage
        ctx.feats = self._features(ParsedRequest(body, model, ctx.req.stream, ctx.req.max_tokens, ctx.req.priority),
                                   ctx.route, rt, ctx.feats.request_id, ctx.hdrs)
        ctx.decision, ctx.tried = None, []
        ctx.models.append(model)
        self._served_header(ctx)

    @staticmethod
    def _served_header(ctx: RequestContext) -> None:
        ctx.client_headers[:] = [(k, v) for k, v in ctx.client_headers if k != SERVED_MODEL]
        ctx.client_headers.append((SERVED_MODEL, ctx.rt.model.encode()))

    def _resumable(self, ctx: RequestContext) -> StreamResume | None:
        """A stream that could be continued elsewhere should its worker fail mid-stream (gateway/resume.py)."""
        if not ctx.stream or self.max_resumes == 0 or not resumable(ctx.req.body, ctx.route is CHAT):
            return None
        opts = ctx.req.body.get("stream_options")
        continuous = isinstance(opts, dict) and opts.get("continuous_usage_stats") is True
        resume = StreamResume(ctx.route is CHAT, not ctx.strip_usage, continuous)
        resume.elsewhere = functools.partial(self._elsewhere, ctx)   # the relay's stall judge asks it
        return resume

    async def _continue(self, ctx: RequestContext, resume: StreamResume | None, why: str,
                        reason: str = RETRY) -> RelayResult | None:
        """The stream broke after the client got bytes: place its continuation on another worker (None), or end
        the stream (the result: the usage and [DONE] when nothing remained to generate, else an error event).
        `reason`: RETRY (its worker failed), or MOVE (rebalancing took it off before its first token; a move
        does not use up a resume attempt)."""
        model = ctx.rt.model
        delivered = resume.broke(ctx.state.tokens) if resume is not None else None
        if delivered is None or delivered.tool_calls:
            self.metrics.count_stream_break(model, "not_resumable")
            await self.relay.end_stream(ctx.send, ctx.state, error=why)
            return RelayResult(status=200, midstream_error=why)
        chat = ctx.route is CHAT
        if delivered.finish_reason is not None or continuation_body(ctx.req.body, chat, "", ctx.state.tokens) is None:
            return await self._close_locally(ctx, resume)
        attempts = self.max_resumes + (ctx.moved_to is not None)
        if resume.legs >= attempts or not await self.place_again(ctx, reason):
            self.metrics.count_stream_break(model, "ended")
            log.info("request %s: stream broke (%s); not resumed (%s)", ctx.feats.request_id, why,
                     "no other worker" if resume.legs < attempts else "out of resume attempts")
            await self.relay.end_stream(ctx.send, ctx.state, error=why)
            return RelayResult(status=200, midstream_error=why)
        # Exact counts from the new worker's tokenizer: an event may carry several tokens (vLLM merges the
        # outputs of a slow consumer), so the events relayed only bound the tokens sent from below.
        ws = ctx.worker
        want_prompt = resume.client_usage and resume.prompt_tokens is None
        sent, prompt = await asyncio.gather(
            self._count_tokens(ws, text_tokenize_body(delivered.text, ctx.req.body.get("model")))
            if delivered.text else _none(),
            self._count_tokens(ws, tokenize_body(ctx.req.body, chat)) if want_prompt else _none())
        if prompt is not None:
            resume.prompt_tokens = prompt
        if sent is not None and sent > ctx.state.tokens:
            resume.tokens_before = ctx.state.tokens = sent
        body = continuation_body(ctx.req.body, chat, delivered.text, resume.tokens_before)
        if body is None:  # the exact count says nothing remains
            ctx.worker = None
            await self.release(ctx, ws)
            return await self._close_locally(ctx, resume)
        if reason == RETRY:
            self.metrics.count_stream_break(model, "resumed")
        observe.note_resume(ctx.record)
        resume.legs += 1
        ctx.payload = orjson.dumps(body)
        log.info("request %s: stream broke after %d tokens (%s); resuming on %s", ctx.feats.request_id,
                 ctx.state.tokens, why, ws.id)
        return None

    async def _close_locally(self, ctx: RequestContext, resume: StreamResume) -> RelayResult:
        """Everything was delivered but the end: the usage (if asked) and [DONE] from here."""
        self.metrics.count_stream_break(ctx.rt.model, "completed")
        await self.relay.end_stream(ctx.send, ctx.state, resume.closing_events())
        return RelayResult(status=200, tokens=ctx.state.tokens, first_token_at=resume.first_token_at,
                           usage=Usage(resume.prompt_tokens or ctx.feats.prompt_tokens, ctx.state.tokens))

    async def _count_tokens(self, ws: WorkerState, body: bytes) -> int | None:
        """A token count from the worker's POST /tokenize (None if it cannot tell)."""
        try:
            r = await self.relay.upstream.fetch(ws.rec.url + "/tokenize", TOKENIZE_TIMEOUT_S, b"POST", body,
                                                b"Content-Type: application/json\r\nAccept: */*\r\n")
            count = orjson.loads(r.body).get("count") if r.status == 200 else None
        except (OSError, TimeoutError, orjson.JSONDecodeError, AttributeError):
            return None
        return count if isinstance(count, int) else None

    async def answer_failure(self, ctx: RequestContext, failure: UpstreamFailure) -> RelayResult:
        """Every worker tried failed before the client saw a byte: the last one's own error answer, unchanged,
        or a 502."""
        if failure.status is not None:
            ctx.state.started = ctx.state.ended = True
            await ctx.send({"type": "http.response.start", "status": failure.status,
                            "headers": [(b"content-type", failure.content_type), *ctx.client_headers]})
            await ctx.send({"type": "http.response.body", "more_body": False,
                            "body": self.adapter.openai_error(failure.status, failure.body)})
            return RelayResult(status=failure.status)
        raise errors.upstream_failed(failure.detail)

    # --- placement: the placement step plus reservations; the admission queue when nothing fits -----------
    async def _admit(self, ctx: RequestContext) -> None:
        rt = ctx.rt
        q = rt.queue
        retry_at = None
        if q.queue.admits_directly():
            placed, retry_at = await self._place_or_retry(ctx)
            if placed:
                return
        if self.no_room is not None:  # may evict batch work, or refuse a batch-runner request at once
            await self.no_room(rt, ctx.feats)
        await self._wait_for_slot(ctx, retry_at)

    async def _wait_for_slot(self, ctx: RequestContext, retry_at: float | None) -> None:
        """Queue the request until a drain places it (ctx.worker set) or refuses it (a 429 GatewayError); a
        GatewayError too when no worker serves its model or the queue is full."""
        rt = ctx.rt
        q = rt.queue
        self._check_serving(rt.model)
        if q.queue.full():
            raise errors.overloaded(rt.model, self.retry_after_s, "admission queue full")
        t = time.perf_counter()
        swap_s = self.pooling.wake_s(rt.model) if self.pooling is not None else 0.0   # its model asleep: a swap
        await q.wait(ctx, ctx.feats, retry_at, swap_s)
        self.metrics.observe_queue_wait(rt.model, time.perf_counter() - t)
        observe.note_queue(ctx.record, time.perf_counter() - t)

    async def _place_queued(self, ctx: RequestContext) -> tuple[bool, float | None]:
        """The admission queue's drain tries a waiting request (gateway/admission.py)."""
        self._check_serving(ctx.rt.model)
        return await self._place_or_retry(ctx)

    def _check_serving(self, model: str) -> None:
        """Waiting helps only while some healthy worker can answer the model (prefill workers alone cannot),
        or a sleeping engine of it on a shared host can be woken (gateway/pooling.py: asked to)."""
        if not any(ws.rec.role != ROLE_PREFILL for ws in self.registry.candidates(model)):
            pooling = self.pooling
            if pooling is not None and pooling.handles(model) and pooling.servable(model):
                pooling.demand(model)
                return
            raise errors.no_worker(model, self.retry_after_s)

    async def _place_or_retry(self, ctx: RequestContext) -> tuple[bool, float | None]:
        placed = await self._place(ctx, ctx.tried)   # a request waiting again after a failed leg: not there again
        return placed, (None if placed or ctx.decision is None else ctx.decision.retry_at)

    def views(self, model: str, exclude: Collection[str] = (),
              roles: Collection[str] | None = None) -> tuple[list[WorkerView], dict[str, WorkerState]]:
        """The candidates: healthy workers serving `model` (of `roles`, any by default) under their cap."""
        inflight = self.store.inflight()
        views: list[WorkerView] = []
        by_id: dict[str, WorkerState] = {}
        for ws in self.registry.candidates(model):
            wid = ws.rec.id
            if (exclude and wid in exclude) or (roles is not None and ws.rec.role not in roles):
                continue
            f = inflight.get(wid)
            if f is None:
                n = tokens_in = 0
            else:
                n, tokens_in = f.requests, f.tokens
            if not has_room(n, ws.rec.cap):
                continue
            views.append(ws.view(n, tokens_in))
            by_id[wid] = ws
        return views, by_id

    async def _place(self, ctx: RequestContext, exclude: Collection[str]) -> bool:
        """Ask the placement step and reserve what it chose (both workers for a P/D pair); a worker another
        replica filled meanwhile is dropped from the candidates and the step asked again. Sets ctx.decision
        (the last answer), and ctx.worker / ctx.prefill / ctx.pd when placed; the hooks hear it `placed`."""
        t = time.perf_counter()
        rt, feats = ctx.rt, ctx.feats
        views, by_id = self.views(rt.model, exclude)
        views = self.adapters.annotate(feats, views)
        store, rid = self.store, feats.request_id
        placed = False
        try:
            while True:
                d = rt.placement.place(feats, views, time.time())
                ctx.decision = d
                ws = by_id.get(d.worker_id) if d.worker_id is not None else None
                if ws is None:
                    if d.reason == TOO_LONG:
                        raise errors.context_too_long(too_long_message(feats, context_limit(views)))
                    return False
                if not await store.try_reserve(ws.id, rid, ws.rec.cap, reserved_tokens(feats)):
                    views = [v for v in views if v.id != ws.id]
                    continue
                pre = by_id.get(d.prefill_worker_id) if d.prefill_worker_id is not None else None
                if pre is not None and not await store.try_reserve(pre.id, rid, pre.rec.cap, feats.prompt_tokens):
                    await store.release(ws.id, rid)
                    views = [v for v in views if v.id != pre.id]
                    continue
                ctx.pd = rt.placement.dispatched(feats, d, time.time())
                ctx.worker, ctx.prefill = ws, pre
                ctx.routing_s = time.perf_counter() - t
                self.hooks.placed(ctx, ws)
                placed = True
                return True
        finally:
            if placed or ctx.decision is None or ctx.decision.reason != TOO_LONG:
                self.metrics.observe_routing(rt.model, time.perf_counter() - t)

    async def reserve(self, ctx: RequestContext, ws: WorkerState, tokens: int) -> bool:
        return await self.store.try_reserve(ws.id, ctx.feats.request_id, ws.rec.cap, tokens)

    async def release(self, ctx: RequestContext, ws: WorkerState, output_tokens: int = 0, feedback: bool = True,
                      slo_met: bool | None = None) -> None:
        """Give back the request's reservation on `ws`; with `feedback`, the hooks hear it `released` and the
        placement step that the request ended there (with `output_tokens` when it completed, and whether it met
        its SLO). Wakes the queues the worker serves."""
        rt, feats = ctx.rt, ctx.feats
        try:
            if not self.store.release_nowait(ws.id, feats.request_id):  # no I/O needed: a leased slot, memory
                release = self.store.release(ws.id, feats.request_id)
                # a networked store: a cancelled client must not leak the slot
                await (asyncio.shield(release) if self.shield_release else release)
        finally:
            if feedback:
                self.hooks.released(ctx, ws)
                rt.placement.finished(feats, ws.id, output_tokens, time.time(), slo_met)
                ctx.pd = False   # the placement step forgot it: placed again, it is decided afresh
            for m in ws.models:
                other = self.runtimes.get(m)
                if other is not None:
                    other.queue.kick()


def _admission_fallback_reason(e: GatewayError) -> str | None:
    """Why a request the model's placement refused may fall back to another model (None: it may not; the
    caller's own rate limit never moves it)."""
    if isinstance(e, RateLimited):
        return None
    return refusal_reason(e.status, isinstance(e, errors.ContextTooLong))


def _failure_fallback_reason(failure: UpstreamFailure | None) -> str | None:
    """Why a request whose workers all failed before its first byte may fall back (None: it may not)."""
    if failure is None:
        return NO_WORKER
    return failure_reason(failure.status, failure.kind == "timeout", failure.kind == WORKER_TOO_LONG)


async def _none() -> None:
    return None


def _join_legs(result: RelayResult, resume: StreamResume, tokens: int) -> None:
    """The last leg's result as the whole stream's: first token, all tokens delivered, the original usage."""
    result.first_token_at = resume.first_token_at or result.first_token_at
    result.tokens = tokens
    result.usage = resume.total_usage() or result.usage


async def _watch_disconnect(receive, task: asyncio.Task, state: ResponseState, gone: list[bool]) -> None:  # noqa: ANN001
    """Cancel the request's task when the client goes away (this closes the upstream response)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            if not state.ended:
                gone.append(True)
                task.cancel()
            return


async def _send_error(send, err: GatewayError, extra_headers: list[tuple[bytes, bytes]]) -> None:  # noqa: ANN001
    body = err.body()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [*err.headers(), (b"content-length", str(len(body)).encode()), *extra_headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
