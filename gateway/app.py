"""The gateway's ASGI application.

A thin raw-ASGI front serves the two proxy routes (POST /v1/chat/completions, /v1/completions)
straight into the dispatcher, with no framework on the hot path, and POST /v1/responses through its front door
(gateway/api/responses.py), which runs it as a chat request. Everything else (/v1/models,
/health, /ready, /metrics, /admin/*) goes to a FastAPI app. There is no ASGI lifespan: the server
(gateway/server.py) starts the gateway (state store, upstream pool, control loops) before uvicorn serves and
stops it after, so start-up errors surface before the port opens. The `Gateway` (the process's parts) lives
in gateway/core.py, which imports none of the routers mounted here.
"""

from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.api.admin import admin_router
from gateway.api.batch import batch_router
from gateway.api.messages import PATHS as MESSAGES_PATHS
from gateway.api.messages import MessagesApi
from gateway.api.passthrough import passthrough_router
from gateway.api.responses import PATH as RESPONSES_PATH
from gateway.api.responses import ResponsesFrontDoor, responses_router
from gateway.api.status_page import status_router
from gateway.config import GatewayConfig
from gateway.core import Gateway
from gateway.pipeline.dispatch import ROUTES
from gateway.pipeline.drain import draining_error, refuse
from gateway.pipeline.request_metrics import count_error_response
from gateway.state.base import StateStore
from gateway.wire import errors
from gateway.wire.errors import GatewayError

log = logging.getLogger("fleetgate")

_METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class FleetgateApp:
    """The ASGI callable uvicorn runs."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.api = build_api(gateway)
        self.responses = ResponsesFrontDoor(gateway)   # POST /v1/responses (gateway/api/responses.py)
        self.messages = MessagesApi(gateway)   # Anthropic's Messages API over the chat pipeline

    async def __call__(self, scope: dict, receive, send) -> None:  # noqa: ANN001
        kind = scope["type"]
        if kind == "http":
            route = ROUTES.get(scope["path"])
            if route is not None and scope["method"] == "POST":
                drain = self.gateway.drain
                if drain.draining:   # SIGTERM: a clear 503 the client retries elsewhere (gateway/pipeline/drain.py)
                    await refuse(send)
                    return
                with drain.track():
                    await self.gateway.dispatcher.handle(scope, receive, send, route)
                return
            if scope["path"] == RESPONSES_PATH and scope["method"] == "POST":
                await self.responses(scope, receive, send)
                return
            if scope["path"] in MESSAGES_PATHS:
                await self.messages.handle(scope, receive, send)
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


def alias_cards(cards: list[dict], aliases: dict[str, str]) -> list[dict]:
    """`cards` plus a card per alias of a served model: its target's card under the alias's name, as vLLM lists
    each of a model's `--served-model-name`s (same `root`, `parent` null: a non-null parent marks a LoRA
    adapter)."""
    by_id = {c.get("id"): c for c in cards}
    extra = [{**by_id[target], "id": alias, "parent": None} for alias, target in sorted(aliases.items())
             if target in by_id and alias not in by_id]
    return [*cards, *extra]


def build_api(gw: Gateway) -> FastAPI:
    api = FastAPI(title="fleetgate", docs_url=None, redoc_url=None, openapi_url=None)
    api.state.gateway = gw

    def counted(err: GatewayError) -> Response:
        """An error answer of the APIs served here, counted in fleetgate_responses_total (no route included)."""
        count_error_response(gw.metrics, err)
        return _error_response(err)

    @api.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> Response:
        return counted(exc)

    @api.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        parts = []
        for e in exc.errors():
            loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            parts.append(f"{loc or 'body'}: {e.get('msg')}")
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return counted(errors.bad_request("Invalid request: " + "; ".join(parts), param))

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        code = None
        if exc.status_code == 404:
            message, code = f"No route {request.method} {request.url.path}.", "no_route"
        elif exc.status_code == 405:
            message, code = f"Method {request.method} is not allowed on {request.url.path}.", "method_not_allowed"
        return counted(GatewayError(exc.status_code, message, kind, None, code))

    @api.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        return counted(errors.internal_error())

    @api.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/ready")
    async def ready() -> Response:
        if gw.drain.draining:   # load balancers stop sending at once; /health stays 200 (gateway/pipeline/drain.py)
            return _error_response(draining_error())
        if gw.registry.any_healthy():
            return JSONResponse({"status": "ready"})
        return _error_response(GatewayError(503, "No healthy worker yet.", "service_unavailable_error",
                                            None, "not_ready", gw.config.health.interval_s))

    @api.get("/v1/models")
    async def models(request: Request) -> Response:
        tenant = gw.auth.authenticate(request.headers.get("authorization"))
        cards = gw.registry.model_cards()
        lora = gw.dispatcher.adapters if gw.dispatcher is not None else None
        if lora is not None:   # configured LoRA adapters, with their base model as `parent`; a key's base model
            cards = lora.cards(cards)   # covers its adapters, as for requests
        cards = alias_cards(cards, gw.config.aliases)
        cards = [c for c in cards if tenant.may_use(gw.config.aliases.get(c["id"])
                                                    or (lora.base_of(c["id"]) if lora else None) or c["id"])]
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
        return counted(GatewayError(405, f"Use POST for {request.url.path}.", "invalid_request_error", None,
                                    "method_not_allowed"))

    api.include_router(admin_router())
    api.include_router(batch_router())
    api.include_router(responses_router())
    api.include_router(status_router())
    api.include_router(passthrough_router())
    return api
