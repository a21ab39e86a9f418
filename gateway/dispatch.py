"""The request pipeline for /v1/chat/completions and /v1/completions: where every request is placed.

    handle    read and check the request (gateway/request.py) into a RequestContext
    place     the model's placement step (policies/placement.py: pool filter, plain or P/D profile, policy)
              plus reservations in the state store; no room: the model's admission queue
              (gateway/admission.py over policies/admission.py), until placed or refused with 429
    run       one worker (gateway/relay.py), or a prefill leg then a decode leg (gateway/pd_legs.py); a failure
              before the client saw a byte places the request again, elsewhere
    finish    release the reservations, tell the placement step (feedback to the policy and the length
              predictor), account the SLO, count metrics

The virtual-time simulator (simulator/cluster.py) drives the same placement step and admission queue with
its own clock, so an experiment there runs this pipeline's decisions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import orjson

from engine_adapters.base import EngineAdapter, Usage
from gateway import errors, observe
from gateway.admission import ModelQueue
from gateway.auth import Authenticator
from gateway.config import GatewayConfig
from gateway.errors import GatewayError, sse_error_event
from gateway.forwarding import ForwardedFor
from gateway.kv_events import cached_prefix_for
from gateway.learning import Learner
from gateway.metrics import GatewayMetrics
from gateway.pd_legs import PdLegs, pd_policy_factory
from gateway.ratelimit import RateLimited, close_ticket, open_ticket
from gateway.registry import Registry, WorkerState
from gateway.relay import Relay, RelayResult, ResponseState, UpstreamFailure
from gateway.request import (
    CHAT,
    ROUTES,
    ClientHeaders,
    ParsedRequest,
    Route,
    chat_text,
    estimate_chat_tokens,
    estimate_prompt_tokens,
    parse_request,
    read_headers,
)
from gateway.resume import StreamResume, continuation_body, resumable, text_tokenize_body, tokenize_body
from gateway.services import ServiceOrder
from gateway.slo import SloBook
from gateway.state.base import StateStore
from policies.admission import AdmissionQueue
from policies.base import Policy, make_policy
from policies.placement import TOO_LONG, ModelPlacement, context_limit, too_long_message
from policies.prefix import prompt_chunk_hashes
from policies.types import ROLE_DECODE, ROLE_PREFILL, Decision, RequestFeatures, WorkerView

__all__ = ["ROUTES", "Dispatcher", "ModelRuntime", "RequestContext"]

log = logging.getLogger("fleetgate.dispatch")

UNKNOWN_MODEL_LABEL = "_unknown"  # metrics label for requests that never resolved to a served model
STATUS_CLIENT_GONE = 499  # nginx's convention for "client closed the request"
STATUS_BROKEN_STREAM = 502  # a stream that ended with an error event is counted as the bad gateway it was
TOKENIZE_TIMEOUT_S = 2.0


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


@dataclass(slots=True)
class ModelRuntime:
    """Per-model routing state, built once on the model's first request."""

    model: str
    policy: Policy
    policy_name: str
    needs_prefix: bool
    placement: ModelPlacement
    queue: ModelQueue


@dataclass(slots=True, eq=False)
class RequestContext:
    """One request on its way through the pipeline: what the client sent, what the gateway decided, and the
    reservations it holds."""

    rid: bytes
    route: Route
    req: ParsedRequest
    rt: ModelRuntime
    feats: RequestFeatures
    payload: bytes                      # the body for the worker, byte for byte unless shaping changed it
    strip_usage: bool
    upstream_headers: bytes             # worker-bound headers besides Host and Content-Length, encoded
    client_headers: list[tuple[bytes, bytes]]
    send: Any                           # ASGI send
    state: ResponseState
    t0: float                           # perf_counter() at arrival
    decision: Decision | None = None
    worker: WorkerState | None = None   # the (decode) worker holding a reservation for the request
    prefill: WorkerState | None = None  # P/D: the prefill worker holding a reservation for its prompt
    tried: list[str] = field(default_factory=list)

    @property
    def stream(self) -> bool:
        return self.req.stream


class Dispatcher:
    def __init__(self, config: GatewayConfig, store: StateStore, registry: Registry, relay: Relay,
                 adapter: EngineAdapter, metrics: GatewayMetrics, shared_state: bool = False,
                 slo: SloBook | None = None, learner: Learner | None = None,
                 auth: Authenticator | None = None) -> None:
        self.config = config
        self.store = store
        self.registry = registry
        self.relay = relay
        self.adapter = adapter
        self.metrics = metrics
        self.max_body = config.limits.max_body_bytes
        self.attempts = config.limits.retries + 1
        self.max_resumes = config.resume.max_attempts
        self.auth = auth if auth is not None else Authenticator(config, store)
        self.forwarded_for = ForwardedFor(config.server.trusted_proxies)
        # The admission queue's safety-net poll: releases here and on other replicas (announced through the
        # shared store while requests wait) wake it anyway.
        self.poll_s = config.limits.queue_poll_s or 0.5
        self.shield_release = shared_state
        self.retry_after_s = max(1.0, config.health.interval_s)
        self.runtimes: dict[str, ModelRuntime] = {}
        self.slo = slo if slo is not None else SloBook(config, metrics.registry)
        self.learner = learner if learner is not None else Learner(config, store, registry, metrics.registry)
        self.pd = PdLegs(self)
        registry.on_change(self._wake_all)
        store.on_remote_release(self._wake_for)   # another replica freed a slot (a networked store tells)
        # Request classes and worker types (gateway/batch_runner.py ClassRouter): per-worker class counts and
        # eviction of batch work; the pool filter itself is part of the placement step.
        self.pools: Any = None
        self.observer: observe.RequestObserver | None = None  # access log / tracing (gateway/observe.py)
        self.kv_events: Any = None  # gateway/kv_events.py KvEventsService: the exact prefix-cache view
        self.services = ServiceOrder(config.service_priority)   # service-aware priority (gateway/services.py)
        self.pooling: Any = None    # gateway/pooling.py SwapController when shared hosts are configured

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
        client_headers = [(b"x-request-id", rid)]
        feats: RequestFeatures | None = None
        result: RelayResult | None = None
        ticket = None
        tracked = False     # the service order knows the request (it must hear its end)
        rec = self.observer.begin(rid.decode(), scope["path"], scope["headers"]) if self.observer else None
        try:
            try:
                if hdrs.content_length == -1:
                    raise errors.bad_request("Invalid Content-Length header.")
                tenant = self.auth.tenant_of_scope(scope, hdrs.auth)
                raw = await self._read_body(receive, hdrs.content_length)
                watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, task, state, gone))
                req = parse_request(raw, route)
                model, changed = self._resolve_model(req)
                rt = self.runtime(model)
                model_label, policy_label = model, rt.policy_name
                shaped = self.adapter.shape_request(raw, req.body, req.stream, changed)
                feats = self._features(req, route, rt, rid.decode(), hdrs)
                if self.services.enabled:
                    self.services.arrived(feats, self.services.service_of(scope["headers"], tenant, model))
                    tracked = True
                ticket = open_ticket(self.store, tenant, feats, client_headers)  # limited keys only
                ctx = RequestContext(
                    rid, route, req, rt, feats, shaped.body, shaped.strip_usage,
                    b"".join((b"Content-Type: application/json\r\nX-Request-Id: ", rid, b"\r\n", hdrs.forward,
                              self.forwarded_for.line(scope, hdrs.xff))),
                    client_headers, send, state, t0)
                result = await self._run(ctx)
                status = result.status if result.midstream_error is None else STATUS_BROKEN_STREAM
                self._observe(model, t0, result)
                self.slo.record(feats, req.stream, t0, result, time.perf_counter())
            except GatewayError as e:
                status = e.status
                if feats is not None and status in (429, 503) and not isinstance(e, RateLimited):
                    self.slo.record_refused(feats)
                if not state.started:
                    await _send_error(send, e, client_headers)
        except ClientGone:
            status = STATUS_CLIENT_GONE
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()  # the client left; nothing more to send
            status = STATUS_CLIENT_GONE
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
            if tracked:
                done = result is not None and status == 200 and result.midstream_error is None
                self.services.finished(feats, done, _output_tokens(result) if done else 0)
            if ticket is not None:
                close_ticket(self.store, ticket, result.usage if result is not None else None, feats.prompt_tokens,
                             state.tokens)
            self.metrics.count_request(model_label, policy_label, status)
            if model_label != UNKNOWN_MODEL_LABEL:
                self.metrics.observe_duration(model_label, time.perf_counter() - t0)
            if rec is not None:
                self.observer.end(rec, model_label, policy_label, status, feats, result)

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
            if not self.registry.knows_model(model):
                raise errors.model_not_found(model, self.registry.served_models())
            return model, False
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
        )

    # --- run ---------------------------------------------------------------------------------------------
    async def _run(self, ctx: RequestContext) -> RelayResult:
        await self._admit(ctx)
        if ctx.rt.placement.is_pd(ctx.feats.request_id):  # placed by the P/D profile: the two legs
            return await self.pd.run(ctx)
        resume = self._resumable(ctx)
        failure: UpstreamFailure | None = None
        retries = 0
        while True:
            ws = ctx.worker
            t_sent = self.learner.dispatched(ctx.rt.placement, ctx.feats, ws.id, ctx.state)
            out, met, broken = 0, None, None
            payload = self.services.dispatched(ctx.feats, ctx.payload) if self.services.enabled else ctx.payload
            try:
                result = await self.relay.forward(
                    ctx.send, getattr(ws, ctx.route.url_attr), payload,
                    observe.leg("upstream", ws.id, ctx.upstream_headers),
                    ctx.client_headers, ctx.stream, ctx.strip_usage, retries + 1 < self.attempts, ctx.state, resume,
                    ws.id)
                if result.stalled:
                    self.registry.suspect(ws.id, f"stalled mid-stream: {result.midstream_error}")
                self.registry.note_outcome(ws.id, result.midstream_error is None and result.status < 500)
                if result.midstream_error is not None:
                    self.metrics.upstream_error(ws.id, "midstream")
                    if resume is None:  # the relay ended the stream with an error event
                        self.metrics.count_stream_break(ctx.rt.model, "not_resumable")
                out = self.learner.finished(ctx.feats, ws.id, t_sent, result)
                if result.midstream_error is None or ctx.state.ended:
                    if resume is not None and resume.legs:
                        _join_legs(result, resume, ctx.state.tokens)
                    met = self.slo.judge(ctx.feats, ctx.stream, ctx.t0, result, time.perf_counter())
                    return result
                broken = result.midstream_error  # the relay left the stream open: continue it elsewhere
                if resume.first_token_at is None:
                    resume.first_token_at = result.first_token_at
                ctx.tried.append(ws.id)
            except UpstreamFailure as f:
                failure = f
                ctx.tried.append(ws.id)
                self.registry.note_outcome(ws.id, False)
                self.metrics.upstream_error(ws.id, f.kind)
                observe.leg_failed(f.kind, f.detail)
                if f.kind == "connect":
                    self.registry.report_failure(ws.id)
                elif f.kind == "timeout" and ctx.stream:  # no first token within the worker's pace
                    self.registry.suspect(ws.id, f"stalled before its first token: {f.detail}")
                if ctx.state.started:  # a continuation leg failed before its first byte
                    broken = f.detail
                else:
                    retries += 1
                log.debug("request %s failed on %s (%s); %s", ctx.feats.request_id, ws.id, f.detail,
                          "retrying" if broken is not None or retries < self.attempts else "giving up")
            finally:
                ctx.worker = None
                await self.release(ctx.rt, ctx.feats, ws, out, slo_met=met)
            if broken is not None:
                ended = await self._continue(ctx, resume, broken)
                if ended is not None:
                    return ended
                continue  # placed on another worker, ctx.payload is the continuation
            if retries >= self.attempts or not await self._place(ctx, ctx.tried):
                break  # out of retries, or nobody else to try
            self.metrics.count_retry(ctx.rt.model)
        if failure is None:
            raise errors.no_worker(ctx.rt.model, self.retry_after_s)
        return await self.answer_failure(ctx, failure)

    def _resumable(self, ctx: RequestContext) -> StreamResume | None:
        """A stream that could be continued elsewhere should its worker fail mid-stream (gateway/resume.py)."""
        if not ctx.stream or self.max_resumes == 0 or not resumable(ctx.req.body, ctx.route is CHAT):
            return None
        opts = ctx.req.body.get("stream_options")
        continuous = isinstance(opts, dict) and opts.get("continuous_usage_stats") is True
        return StreamResume(ctx.route is CHAT, not ctx.strip_usage, continuous)

    async def _continue(self, ctx: RequestContext, resume: StreamResume | None, why: str) -> RelayResult | None:
        """The stream broke after the client got bytes: place its continuation on another worker (None), or end
        the stream (the result: the usage and [DONE] when nothing remained to generate, else an error event)."""
        model = ctx.rt.model
        delivered = resume.broke(ctx.state.tokens) if resume is not None else None
        if delivered is None or delivered.tool_calls:
            self.metrics.count_stream_break(model, "not_resumable")
            await self.relay.end_stream(ctx.send, ctx.state, error=why)
            return RelayResult(status=200, midstream_error=why)
        chat = ctx.route is CHAT
        if delivered.finish_reason is not None or continuation_body(ctx.req.body, chat, "", ctx.state.tokens) is None:
            return await self._close_locally(ctx, resume)
        if resume.legs >= self.max_resumes or not await self._place(ctx, ctx.tried):
            self.metrics.count_stream_break(model, "ended")
            log.info("request %s: stream broke (%s); not resumed (%s)", ctx.feats.request_id, why,
                     "no other worker" if resume.legs < self.max_resumes else "out of resume attempts")
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
            await self.release(ctx.rt, ctx.feats, ws)
            return await self._close_locally(ctx, resume)
        self.metrics.count_stream_break(model, "resumed")
        observe.note_resume()
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
        if self.pools is not None:  # may evict batch work, or refuse a batch-runner request at once
            await self.pools.no_room(rt, ctx.feats)
        self._check_serving(rt.model)
        if q.queue.full():
            raise errors.overloaded(rt.model, self.retry_after_s, "admission queue full")
        t = time.perf_counter()
        await q.wait(ctx, ctx.feats, retry_at)
        self.metrics.observe_queue_wait(rt.model, time.perf_counter() - t)
        observe.note_queue(time.perf_counter() - t)

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
        placed = await self._place(ctx, ())
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
            cap = ws.rec.cap
            if cap is not None and n >= cap:
                continue
            views.append(ws.view(n, tokens_in))
            by_id[wid] = ws
        return views, by_id

    async def _place(self, ctx: RequestContext, exclude: Collection[str]) -> bool:
        """Ask the placement step and reserve what it chose (both workers for a P/D pair); a worker another
        replica filled meanwhile is dropped from the candidates and the step asked again. Sets ctx.decision
        (the last answer), and ctx.worker / ctx.prefill when placed."""
        t = time.perf_counter()
        rt, feats = ctx.rt, ctx.feats
        views, by_id = self.views(rt.model, exclude)
        store, rid = self.store, feats.request_id
        placed = False
        try:
            while True:
                d = rt.placement.place(feats, views, time.time())
                ctx.decision = d
                ws = by_id.get(d.worker_id) if d.worker_id is not None else None
                if ws is None:
                    if d.reason == TOO_LONG:
                        raise errors.bad_request(too_long_message(feats, context_limit(views)))
                    return False
                if not await store.try_reserve(ws.id, rid, ws.rec.cap, _tokens(feats)):
                    views = [v for v in views if v.id != ws.id]
                    continue
                pre = by_id.get(d.prefill_worker_id) if d.prefill_worker_id is not None else None
                if pre is not None and not await store.try_reserve(pre.id, rid, pre.rec.cap, feats.prompt_tokens):
                    await store.release(ws.id, rid)
                    views = [v for v in views if v.id != pre.id]
                    continue
                rt.placement.dispatched(feats, d, time.time())
                if self.pools is not None:
                    self.pools.placed(feats, ws.id)
                ctx.worker, ctx.prefill = ws, pre
                observe.note_placement(ws.id, d.reason, time.perf_counter() - t, pre and pre.id)
                placed = True
                return True
        finally:
            if placed or ctx.decision is None or ctx.decision.reason != TOO_LONG:
                self.metrics.observe_routing(rt.model, time.perf_counter() - t)

    async def reserve(self, ctx: RequestContext, ws: WorkerState, tokens: int) -> bool:
        return await self.store.try_reserve(ws.id, ctx.feats.request_id, ws.rec.cap, tokens)

    async def release(self, rt: ModelRuntime, feats: RequestFeatures, ws: WorkerState, output_tokens: int = 0,
                      feedback: bool = True, slo_met: bool | None = None) -> None:
        """Give back the request's reservation on `ws`; with `feedback`, the placement step hears that the
        request ended there (with `output_tokens` when it completed, and whether it met its SLO). Wakes the
        queues the worker serves."""
        try:
            if not self.store.release_nowait(ws.id, feats.request_id):  # no I/O needed: a leased slot, memory
                release = self.store.release(ws.id, feats.request_id)
                # a networked store: a cancelled client must not leak the slot
                await (asyncio.shield(release) if self.shield_release else release)
        finally:
            if feedback:
                self.learner.released(feats.request_id)
                if self.pools is not None:
                    self.pools.released(feats, ws.id)
                rt.placement.finished(feats, ws.id, output_tokens, time.time(), slo_met)
            for m in ws.models:
                other = self.runtimes.get(m)
                if other is not None:
                    other.queue.kick()

    def _observe(self, model: str, t0: float, result: RelayResult) -> None:
        if result.first_token_at is None:
            return
        self.metrics.observe_ttft(model, result.first_token_at - t0)
        n = _output_tokens(result)
        if n > 1 and result.last_token_at is not None:
            self.metrics.observe_tpot(model, (result.last_token_at - result.first_token_at) / (n - 1))


async def _none() -> None:
    return None


def _join_legs(result: RelayResult, resume: StreamResume, tokens: int) -> None:
    """The last leg's result as the whole stream's: first token, all tokens delivered, the original usage."""
    result.first_token_at = resume.first_token_at or result.first_token_at
    result.tokens = tokens
    result.usage = resume.total_usage() or result.usage


def _output_tokens(result: RelayResult) -> int:
    """Generated tokens of a finished request: the usage block's count, else the stream's token events."""
    return result.usage.completion_tokens if result.usage is not None else result.tokens


def _tokens(feats: RequestFeatures) -> int:
    """What a reservation holds: the prompt and the predicted output."""
    return feats.prompt_tokens + int(feats.predicted_output_tokens)


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
