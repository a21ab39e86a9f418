"""The gateway's ASGI application.

A thin raw-ASGI front serves the two proxy routes (POST /v1/chat/completions, /v1/completions)
straight into the dispatcher, with no framework on the hot path. Everything else (/v1/models,
/health, /ready, /metrics, /admin/*) goes to a FastAPI app. There is no ASGI lifespan: the server
(gateway/server.py) starts the gateway (state store, upstream pool, control loops) before uvicorn serves and
stops it after, so start-up errors surface before the port opens.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine_adapters.base import EngineAdapter
from engine_adapters.vllm import VllmAdapter
from gateway import errors
from gateway.access_log import AccessLog
from gateway.admin import admin_router
from gateway.auth import Authenticator
from gateway.autoscaler import Autoscaler
from gateway.batch_api import batch_router
from gateway.batch_runner import BatchRunner
from gateway.config import GatewayConfig
from gateway.dispatch import ROUTES, Dispatcher
from gateway.errors import GatewayError
from gateway.kv_events import KvEventsService
from gateway.learning import Learner
from gateway.metrics import GatewayMetrics
from gateway.observe import RequestObserver
from gateway.passthrough import passthrough_router
from gateway.pooling import SwapController
from gateway.registry import Registry
from gateway.relay import Relay, make_upstream_pool
from gateway.slo import SloBook
from gateway.state.base import StateStore
from gateway.state.factory import make_store
from gateway.status_page import status_router
from gateway.tracing import Tracing
from gateway.upstream import UpstreamPool
from policies.pace import FleetPace

log = logging.getLogger("fleetgate")

_METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Gateway:
    """All the parts of one gateway process, wired together; `start()` / `stop()` bracket its life."""

    def __init__(self, config: GatewayConfig, store: StateStore | None = None,
                 adapter: EngineAdapter | None = None) -> None:
        self.config = config
        if store is None:
            opts: dict[str, Any] = ({"key_prefix": config.redis_key_prefix, "lease_block": config.redis_lease_block}
                                    if config.redis_url else {})
            store = make_store(config.redis_url, config.replica_id, **opts)
        self.store = store
        self.shared_state = bool(config.redis_url)
        self.adapter = adapter or VllmAdapter()
        self.metrics = GatewayMetrics()
        self.auth = Authenticator(config, self.store)
        self.registry = Registry(config, self.store, self.adapter, self.metrics)
        self.slo = SloBook(config, self.metrics.registry)
        self.learner = Learner(config, self.store, self.registry, self.metrics.registry)
        self.batch = BatchRunner(config, self.store, self.registry, self.metrics)  # Batch API work
        self.autoscaler = Autoscaler(config, self.store, self.registry, self.metrics, self.batch)
        self.upstream: UpstreamPool | None = None  # the one client to workers (gateway/upstream.py)
        self.access_log = AccessLog() if config.logging.access_log else None
        self.tracing: Tracing | None = Tracing(config.tracing) if config.tracing.enabled else None
        self.kv_events = KvEventsService(config, self.registry, self.metrics.registry)  # exact prefix-cache view
        self.pooling = SwapController(config, self.registry, self.store, self.metrics)   # shared hosts
        self.pooling.learner = self.learner
        self.relay: Relay | None = None
        self.dispatcher: Dispatcher | None = None

    async def start(self) -> None:
        if self.dispatcher is not None:
            return  # already started (idempotent: lifespan and an embedding server may both call it)
        await self.store.start()
        self.store.on_restore(self.auth.republish)
        await self.auth.start()
        self.upstream = make_upstream_pool(self.config)
        pace = (FleetPace(self.config.resume.pace(), self.config.turns_workers())
                if self.config.resume.hung_detection else None)
        self.relay = Relay(self.adapter, self.config.timeouts, self.upstream, pace)
        self.registry.on_eject(self.relay.abort_worker)
        self.dispatcher = Dispatcher(self.config, self.store, self.registry, self.relay, self.adapter,
                                     self.metrics, shared_state=self.shared_state, slo=self.slo, learner=self.learner,
                                     auth=self.auth)
        self.dispatcher.observer = RequestObserver.make(self.access_log, self.tracing)
        self.dispatcher.kv_events = self.kv_events
        await self.registry.start(self.upstream)
        if self.pooling.enabled:
            self.dispatcher.pooling = self.pooling
            self.pooling.waiting = lambda d=self.dispatcher: {m for m, rt in d.runtimes.items() if len(rt.queue)}
            self.pooling.on_unservable = self.dispatcher.kick
            await self.pooling.start(self.upstream)
        await self.kv_events.start(self.upstream)
        await self.learner.start()
        await self.batch.start(self.dispatcher)
        await self.autoscaler.start(self.dispatcher)

    async def stop(self) -> None:
        """Stop loops, close the upstream pool and the store; safe on a partly started gateway."""
        await self.batch.stop()
        await self.autoscaler.stop()
        await self.kv_events.stop()
        await self.learner.stop()
        await self.pooling.stop()
        await self.registry.stop()
        await self.auth.stop()
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            await upstream.close()  # keep-alive connections to the workers
        self.dispatcher = None
        await self.store.close()
        if self.tracing is not None:
            self.tracing.shutdown()


class FleetgateApp:
    """The ASGI callable uvicorn runs."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.api = build_api(gateway)

    async def __call__(self, scope: dict, receive, send) -> None:  # noqa: ANN001
        kind = scope["type"]
        if kind == "http":
            route = ROUTES.get(scope["path"])
            if route is not None and scope["method"] == "POST":
                await self.gateway.dispatcher.handle(scope, receive, send, route)
                return
            await self._api(scope, receive, send)
        elif kind == "lifespan":
            return  # not supported (ASGI: returning ends it); gateway/server.py starts and stops the gateway
        else:
            await self._api(scope, receive, send)

    async def _api(self, scope: dict, receive, send) -> None:  # noqa: ANN001
        started = False

        async def tracking_send(msg: dict) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.api(scope, receive, tracking_send)
        except Exception:
            # FastAPI's handlers below already answered; this only catches what escaped them.
            if not started and scope["type"] == "http":
                log.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
                err = errors.internal_error()
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.start", "status": 500, "headers": err.headers()})
                    await send({"type": "http.response.body", "body": err.body()})


def create_app(config: GatewayConfig, store: StateStore | None = None) -> FleetgateApp:
    return FleetgateApp(Gateway(config, store))


def _error_response(err: GatewayError) -> Response:
    return Response(err.body(), status_code=err.status,
                    headers={k.decode(): v.decode() for k, v in err.headers()})


def build_api(gw: Gateway) -> FastAPI:
    api = FastAPI(title="fleetgate", docs_url=None, redoc_url=None, openapi_url=None)
    api.state.gateway = gw

    @api.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> Response:
        return _error_response(exc)

    @api.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        parts = []
        for e in exc.errors():
            loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            parts.append(f"{loc or 'body'}: {e.get('msg')}")
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return _error_response(errors.bad_request("Invalid request: " + "; ".join(parts), param))

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"No route {request.method} {request.url.path}."
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}."
        return _error_response(GatewayError(exc.status_code, message, kind))

    @api.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        return _error_response(errors.internal_error())

    @api.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/ready")
    async def ready() -> Response:
        if gw.registry.any_healthy():
            return JSONResponse({"status": "ready"})
        return _error_response(GatewayError(503, "No healthy worker yet.", "service_unavailable_error",
                                            None, "not_ready", gw.config.health.interval_s))

    @api.get("/v1/models")
    async def models(request: Request) -> Response:
        tenant = gw.auth.authenticate(request.headers.get("authorization"))
        cards = [c for c in gw.registry.model_cards() if tenant.may_use(c["id"])]
        return JSONResponse({"object": "list", "data": cards})

    @api.get("/metrics")
    async def metrics(request: Request) -> Response:
        gw.auth.check_metrics(request.headers.get("authorization"))
        gw.registry.refresh_gauges()
        gw.metrics.state_store_up.labels("redis" if gw.shared_state else "memory").set(int(gw.store.reachable()))
        return Response(gw.metrics.render(), media_type=_METRICS_CONTENT_TYPE)

    @api.api_route("/v1/chat/completions", methods=["GET", "PUT", "DELETE", "PATCH"], include_in_schema=False)
    @api.api_route("/v1/completions", methods=["GET", "PUT", "DELETE", "PATCH"], include_in_schema=False)
    async def wrong_method(request: Request) -> Response:
        return _error_response(GatewayError(405, f"Use POST for {request.url.path}.", "invalid_request_error"))

    api.include_router(admin_router())
    api.include_router(batch_router())
    api.include_router(status_router())
    api.include_router(passthrough_router())
    return api
