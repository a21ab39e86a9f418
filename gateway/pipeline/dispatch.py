"""The request pipeline for /v1/chat/completions and /v1/completions: the entry that reads each request.

    handle    read and check the request (gateway/request/parse.py) into its RequestContext (gateway/request/context.py),
              which carries it to the end; the request hooks (gateway/request/hooks.py) hear it arrive
    run       the attempt loop (gateway/pipeline/attempts.py): admission (placement step, reservations, admission
              queue), then the plan's legs through the one leg runner (gateway/pipeline/legs.py), each leg's outcome a
              value the loop acts on (answer, resume, place again, fall back); it releases the reservations
              and gives the placement step its feedback
    finish    count metrics; the hooks hear it finish (the SLO book, the service order, the access log and
              tracing)

The virtual-time simulator (simulator/cluster.py) drives the same placement step and admission queue with
its own clock, so an experiment there runs this pipeline's decisions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from engine_adapters.base import EngineAdapter
from gateway.config import GatewayConfig
from gateway.fleet.adapters import AdapterRouter
from gateway.fleet.kv_events import KvEventsService, cached_prefix_for
from gateway.fleet.registry import Registry
from gateway.ops.metrics import STATUS_CLIENT_GONE, GatewayMetrics
from gateway.pipeline.attempts import SERVED_MODEL, Attempts
from gateway.pipeline.client import ClientGone, _send_error, _watch_disconnect
from gateway.pipeline.drain import Drain, end_request
from gateway.pipeline.learning import Learner
from gateway.pipeline.legs import LegRunner
from gateway.pipeline.observer import RequestObserver
from gateway.pipeline.pd_legs import PdLegs, pd_policy_factory
from gateway.pipeline.rebalancer import Rebalancer
from gateway.pipeline.relay import Relay
from gateway.pipeline.request_metrics import RequestMetrics
from gateway.pipeline.slo import SloBook
from gateway.request.admission import ModelQueue
from gateway.request.context import UNKNOWN_MODEL_LABEL, ModelRuntime, Outcome, RequestContext
from gateway.request.hooks import RequestHook, RequestHooks
from gateway.request.parse import (
    CHAT,
    ROUTES,
    ClientHeaders,
    ParsedRequest,
    Route,
    chat_text,
    parse_request,
    read_headers,
)
from gateway.state.base import StateStore
from gateway.tenancy.auth import Authenticator
from gateway.tenancy.services import ServiceOrder
from gateway.tenancy.tickets import Tickets
from gateway.wire import errors
from gateway.wire.errors import GatewayError, sse_error_event
from gateway.wire.forwarding import ForwardedFor
from gateway.wire.results import RelayResult, ResponseState
from gateway.wire.translated import BodyTooLarge, front_of, read_body
from policies.admission import AdmissionQueue
from policies.base import make_policy
from policies.placement import ModelPlacement
from policies.prefix import prompt_chain, prompt_chunk_hashes
from policies.tokens import estimate_chat_tokens, estimate_prompt_tokens
from policies.types import ROLE_DECODE, ROLE_PREFILL, RequestFeatures

if TYPE_CHECKING:
    from gateway.control.pooling import SwapController


__all__ = ["ROUTES", "Dispatcher", "NoRoom"]

log = logging.getLogger("fleetgate.dispatch")


STATUS_BROKEN_STREAM = 502  # a stream that ended with an error event is counted as the bad gateway it was


# Before a request waits in its model's admission queue (the Batch API's class router, gateway/batch/runner.py):
# may evict batch work for it, or refuse it (a GatewayError).
NoRoom = Callable[[ModelRuntime, RequestFeatures], Awaitable[None]]


class Dispatcher:
    """The request pipeline (module docstring). It is given every collaborator it uses; those that hear requests
    register as request hooks (gateway/request/hooks.py), in this order: the `hooks` given (the Batch API's class
    router), the service order (while on), the rate-limit tickets (gateway/tenancy/tickets.py), the learner, the SLO
    book, the request metrics (gateway/pipeline/request_metrics.py), the observer (access log and tracing)."""

    def __init__(self, config: GatewayConfig, store: StateStore, registry: Registry, relay: Relay,
                 adapter: EngineAdapter, metrics: GatewayMetrics, *, slo: SloBook, learner: Learner,
                 auth: Authenticator, shared_state: bool = False, observer: RequestObserver | None = None,
                 kv_events: KvEventsService | None = None, pooling: SwapController | None = None,
                 no_room: NoRoom | None = None, rebalancer: Rebalancer | None = None,
                 hooks: Sequence[RequestHook] = (), drain: Drain | None = None) -> None:
        self.config = config
        self.drain = drain or Drain()   # SIGTERM's drain (gateway/pipeline/drain.py): it may cut a request in flight
        self.store = store
        self.registry = registry
        self.relay = relay
        self.adapter = adapter
        self.metrics = metrics
        self.max_body = config.limits.max_body_bytes
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
        self.observer = observer      # access log / tracing (gateway/pipeline/observer.py), None when both are off
        self.kv_events = kv_events    # the exact prefix-cache view (gateway/fleet/kv_events.py)
        self.pooling = pooling        # shared hosts (gateway/control/pooling.py), None when none is configured
        self.services = ServiceOrder(config.service_priority)   # service-aware priority (gateway/tenancy/services.py)
        self.adapters = AdapterRouter(config, registry, relay.upstream.fetch, metrics.registry)  # LoRA adapters
        self.hooks = RequestHooks([*hooks, *([self.services] if self.services.enabled else []), Tickets(store),
                                   learner, slo, RequestMetrics(metrics), *([observer] if observer is not None else [])])
        # every leg of every request (gateway/pipeline/legs.py), and the P/D plan of a request placed as P/D
        self.legs = LegRunner(config, relay, registry, learner, metrics, self.services, self.adapters)
        self.pd = PdLegs(config, metrics.registry)
        self.rebalancer = rebalancer  # rebalancing (gateway/pipeline/rebalancer.py), None when no model has it on
        self.attempts = Attempts(self, self)   # the attempt loop: admission, placement, legs, what follows each

    # --- per-model state ------------------------------------------------------------------------
    def runtime(self, model: str) -> ModelRuntime:
        rt = self.runtimes.get(model)
        if rt is None:
            name, params, _ = self.config.model_settings(model)
            policy = make_policy(name, **params)
            self.learner.attach(model, policy)

            def pd_factory() -> Any:
                pd = pd_policy_factory(self.config, model)()
                self.learner.attach(model, pd)                 # its prefill time estimates
                self.learner.attach(model, pd.decode_policy)
                return pd

            lim = self.config.limits
            placement = ModelPlacement(policy, pd_factory, self.learner.observe_length, lim.shed_will_miss)
            if placement.shedder is not None and placement.shedder.own_tracker:
                self.learner.attach(model, placement.shedder.tracker)   # learned perf models, shared predictor
            queue = ModelQueue(model, AdmissionQueue(lim.queue_size, lim.queue_lookahead, lim.queue_timeout_s),
                               self.attempts.place_queued, self.poll_s, self.retry_after_s,
                               lambda n, m=model: self._queue_depth(m, n),
                               self.services.queue_order(model) if self.services.enabled else None,
                               lambda feats, now, p=placement: p.drain_s(feats, now, self.retry_after_s))
            rt = ModelRuntime(model, policy, name, policy.needs_prefix_hashes, placement, queue,
                              policy.needs_prefix_chain)
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
        front = front_of(scope)   # a front door (Responses, Messages) that runs the request as chat
        if self.observer is not None:
            ctx.record = self.observer.begin(rid.decode(), scope["path"] if front is None else front.route,
                                             scope["headers"])
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
                rt = self.runtime(model)
                model_label, policy_label = model, rt.policy_name
                shaped = self.adapter.shape_request(raw, req.body, req.stream, changed)
                feats = self.features(req, route, rt, rid.decode(), hdrs)
                ctx.req, ctx.rt, ctx.feats, ctx.payload, ctx.strip_usage = req, rt, feats, shaped.body, shaped.strip_usage
                ctx.upstream_headers = b"".join((b"Content-Type: application/json\r\nX-Request-Id: ", rid, b"\r\n",
                                                 hdrs.forward, self.forwarded_for.line(scope, hdrs.xff)))
                ctx.hdrs, ctx.tenant, ctx.models = hdrs, tenant, [model]
                self.hooks.arrived(ctx)   # the service order, the caller's rate-limit ticket: may refuse it
                client_headers.append((SERVED_MODEL, model.encode()))  # only once the key may use the model
                try:
                    result = await self.attempts.run(ctx)
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
            if front is not None:   # count what the client received (Messages: 529 for a 429 overloaded, ...)
                status = front.client_status(status)
            self.hooks.finished(ctx, Outcome(status, result, model_label, policy_label, feats,
                                             t_end if t_end is not None else time.perf_counter(), error))
            # The exception kept in a local ties this frame (and the body it read, up to server.max_body_bytes)
            # into a cycle through its traceback and chained exceptions: let go of it here, or refused
            # requests pile up until a full collection.
            error = None

    async def _read_body(self, receive, content_length: int | None) -> bytes:  # noqa: ANN001
        if content_length is not None and content_length > self.max_body:
            raise errors.body_too_large(self.max_body)
        try:
            body = await read_body(receive, self.max_body)
        except BodyTooLarge:
            raise errors.body_too_large(self.max_body) from None
        if body is None:
            raise ClientGone
        return body

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

    def features(self, req: ParsedRequest, route: Route, rt: ModelRuntime, rid: str,
                  hdrs: ClientHeaders) -> RequestFeatures:
        body = req.body
        hashes = rt.needs_prefix or self._pd_fleet(rt.model)  # P/D decides local prefills on cached prefixes
        chain = rt.needs_chain    # the policy estimates cached prefixes from it (aladdin without KV events)
        text: str | None = None
        if route is CHAT:
            messages = body["messages"]
            prompt_tokens = estimate_chat_tokens(messages)
            text = chat_text(messages) if hashes or chain else None
        else:
            prompt = body["prompt"]
            prompt_tokens = estimate_prompt_tokens(prompt)
            text = prompt if isinstance(prompt, str) else None
        prefix = prompt_chunk_hashes(text) if hashes and text is not None else ()
        full = prompt_chain(text) if chain and text is not None else ()
        max_tokens = req.max_tokens if req.max_tokens is not None else route.default_max_tokens
        rclass = hdrs.request_class
        slo_ttft, slo_tpot = self.slo.targets(rt.model, rclass, hdrs.slo_ttft, hdrs.slo_tpot)
        # the prefix-cache view (KV events, when configured) for the policy, or for the shedding rule's own ledger
        # (policies/shedding.py: its prefill estimates price cached prefixes whatever the policy)
        shedder = rt.placement.shedder
        reader = shedder.tracker if shedder is not None and shedder.own_tracker and slo_ttft is not None else rt.policy
        return RequestFeatures(
            request_id=rid, model=rt.model, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
            predicted_output_tokens=self.learner.predict(rt.model, prompt_tokens, max_tokens),
            session_id=hdrs.session_id, prefix_hashes=prefix, prefix_chain=full, slo_ttft_s=slo_ttft,
            slo_tpot_s=slo_tpot,
            priority=req.priority, request_class=rclass, arrival=time.time(),
            cached_prefix_tokens=cached_prefix_for(self.kv_events, reader, body, route is CHAT),
            adapter=self.adapters.adapter_of(rt.model, body.get("model")),
        )
