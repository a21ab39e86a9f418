"""OpenAI's Responses API, stateful, served by the fleet through the chat-completions pipeline.

    POST   /v1/responses                      create (streamed or not)
    GET    /v1/responses/{id}                 a stored response
    DELETE /v1/responses/{id}
    GET    /v1/responses/{id}/input_items     its input items (after, limit 1-100, order asc|desc: OpenAI's list)

A create is checked and translated (engine_adapters/apis/responses.py) into a chat-completions request that runs
through the dispatcher as any chat request does (gateway/api/translated.py): admission and the queue, placement,
SLO judging, resume after a worker dies mid-stream, fallbacks, tenant limits, metrics, access log and traces.
Workers only ever see chat completions, so every vLLM version we support serves it and no worker holds state.

State: with `store: true` (the default) the finished response and the whole conversation it ends (the earlier
items, this turn's input, its output) are written to the gateway's state store (gateway/state/responses.py:
in memory, or Redis shared by the replicas) under the caller's tenant, before the client receives the answer's
last bytes; `previous_response_id` reads it back on any replica, so any worker can serve the next turn and a
worker's death loses nothing. Another key's response id is not found (404). `instructions` are not carried to
the next turn (as OpenAI documents). A response that failed is not stored.

Placement: the conversation id is the chain's first response id (or the request's `prompt_cache_key`); it
becomes `x-session-id` (RequestFeatures.session_id) unless the client sent one, so the turns of a conversation
are placed where its prefix is cached when that meets the SLO.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from engine_adapters.apis import responses as api
from gateway.api.translated import BodyTooLarge, dispatch_chat, read_body
from gateway.request.parse import CHAT, parse_json_object
from gateway.state.jobs import StoreUnavailableError
from gateway.wire import errors
from gateway.wire.errors import GatewayError

if TYPE_CHECKING:
    from gateway.core import Gateway

log = logging.getLogger("fleetgate.responses")

PATH = "/v1/responses"
MAX_LIST = 100
_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")   # what a stored id can be (the store key joins tenant and id)


class ResponsesFrontDoor:
    """POST /v1/responses for the raw-ASGI front (gateway/app.py)."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def __call__(self, scope: dict, receive, send) -> None:  # noqa: ANN001 - ASGI
        try:
            await self._create(scope, receive, send)
        except GatewayError as e:   # refused before the pipeline ran: nothing was sent yet
            await send_error(send, e)
        except Exception:   # a bug before the pipeline ran (the pipeline answers its own): a 500, never a hang
            log.exception("unexpected error on POST %s", PATH)
            await send_error(send, errors.internal_error())

    async def _create(self, scope: dict, receive, send) -> None:  # noqa: ANN001 - ASGI
        gw = self.gw
        headers = dict(scope.get("headers", ()))
        tenant = gw.auth.tenant_of_scope(scope, headers.get(b"authorization"))
        try:
            raw = await read_body(receive, gw.config.limits.max_body_bytes)
        except BodyTooLarge:
            raise errors.body_too_large(gw.config.limits.max_body_bytes) from None
        if raw is None:
            return   # the client left
        try:
            req = api.parse_request(parse_json_object(raw))
        except api.ResponsesRequestError as e:
            raise GatewayError(e.status, e.message, "invalid_request_error", e.param, e.code) from None
        history: list[dict[str, Any]] = []
        rid = api.new_id(api.RESPONSE_PREFIX)
        root = rid
        if req.previous_response_id is not None:
            prev = await _load(gw, tenant.id, req.previous_response_id, "previous_response_id")
            if prev.get("too_large"):
                raise errors.bad_request(
                    f"Response {req.previous_response_id!r} was answered but not stored: its conversation was "
                    f"larger than responses.max_bytes ({gw.config.responses.max_bytes} bytes). Send the history "
                    "as `input` with `store: false` instead.", "previous_response_id", "previous_response_too_large")
            history, root = prev["conversation"], prev.get("root") or req.previous_response_id
        model = req.model or _only_model(gw)
        translator = api.ResponsesTranslator(req, rid, model, time.time())

        async def finish() -> None:
            if req.store and translator.response is not None and translator.status != "failed":
                await self._keep(tenant.id, rid, root, req, history, translator)

        body = orjson.dumps(api.chat_body(req, history))
        if len(body) > gw.config.limits.max_body_bytes:
            if req.previous_response_id is None:
                raise errors.body_too_large(gw.config.limits.max_body_bytes)
            limit = gw.config.limits.max_body_bytes   # the conversation rebuilt from the store outgrew it
            raise GatewayError(413, f"The conversation continued from {req.previous_response_id!r} is larger than "
                                    f"the request limit of {limit} bytes (limits.max_body_bytes).",
                               "invalid_request_error", "previous_response_id", "request_too_large")
        chat = functools.partial(gw.dispatcher.handle, route=CHAT)
        await dispatch_chat(chat, scope, receive, send, body, translator, session_id=req.prompt_cache_key or root,
                            finish=finish)

    async def _keep(self, tenant: str, rid: str, root: str, req: api.ResponsesRequest,
                    history: list[dict[str, Any]], tr: api.ResponsesTranslator) -> None:
        cfg = self.gw.config.responses
        record = orjson.dumps({"response": tr.response, "input_items": req.input_items, "root": root,
                               "conversation": api.conversation_items(history, req, tr.output)})
        if len(record) > cfg.max_bytes:
            log.info("response %s not stored: %d bytes > responses.max_bytes", rid, len(record))
            record = orjson.dumps({"too_large": True, "root": root, "response": tr.response,
                                   "input_items": req.input_items})
        try:
            await self.gw.store.put_response(tenant, rid, record, cfg.ttl_s, cfg.max_total_bytes)
        except (StoreUnavailableError, OSError) as e:   # the answer still goes out; the next turn gets a 404
            log.warning("response %s not stored: the state store is unavailable (%s)", rid, e)


def _only_model(gw: Gateway) -> str:
    served = gw.registry.served_models()
    return served[0] if len(served) == 1 else ""


async def _load(gw: Gateway, tenant: str, rid: str, param: str) -> dict[str, Any]:
    try:
        raw = await gw.store.get_response(tenant, rid) if _ID_RE.match(rid) else None
    except (StoreUnavailableError, OSError) as e:
        raise GatewayError(503, f"The response store is unavailable ({type(e).__name__}); retry shortly.",
                           "service_unavailable_error", None, "store_unavailable", 5.0) from None
    if raw is None:
        code = "previous_response_not_found" if param == "previous_response_id" else "not_found"
        raise GatewayError(404, f"Response with id {rid[:128]!r} not found (never stored for this key, expired "
                                "after responses.ttl_s, or deleted).", "invalid_request_error", param, code)
    return orjson.loads(raw)


async def send_error(send, err: GatewayError) -> None:  # noqa: ANN001 - ASGI
    await send({"type": "http.response.start", "status": err.status, "headers": err.headers()})
    await send({"type": "http.response.body", "body": err.body(), "more_body": False})


# --- the stored responses: GET, DELETE, input_items (plain routes) ---------------------------------------

def responses_router() -> APIRouter:
    r = APIRouter(prefix="/v1/responses")

    async def own(request: Request, rid: str) -> tuple[Gateway, str, dict[str, Any]]:
        gw: Gateway = request.app.state.gateway
        tenant = gw.auth.authenticate(request.headers.get("authorization"))
        return gw, tenant.id, await _load(gw, tenant.id, rid, "response_id")

    @r.get("/{rid}")
    async def get_response(request: Request, rid: str) -> Response:
        _, _, rec = await own(request, rid)
        return JSONResponse(rec["response"])

    @r.delete("/{rid}")
    async def delete_response(request: Request, rid: str) -> Response:
        gw, tenant, _ = await own(request, rid)
        try:
            await gw.store.delete_response(tenant, rid)
        except (StoreUnavailableError, OSError) as e:
            raise GatewayError(503, f"The response store is unavailable ({type(e).__name__}); retry shortly.",
                               "service_unavailable_error", None, "store_unavailable", 5.0) from None
        return JSONResponse({"id": rid, "object": api.DELETED_OBJECT, "deleted": True})

    @r.get("/{rid}/input_items")
    async def input_items(request: Request, rid: str, after: str | None = None, limit: int = 20,
                          order: str = "desc") -> Response:
        if not 1 <= limit <= MAX_LIST:
            raise errors.bad_request(f"`limit` must be between 1 and {MAX_LIST}.", "limit")
        if order not in ("asc", "desc"):
            raise errors.bad_request("`order` must be asc or desc.", "order")
        _, _, rec = await own(request, rid)
        return JSONResponse(item_page(rec["input_items"], after, limit, order))

    return r


def item_page(items: list[dict[str, Any]], after: str | None, limit: int, order: str) -> dict[str, Any]:
    """OpenAI's list shape over `items`: `data` in `order`, starting after the item `after`."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [it.get("id") for it in ordered]
        if after not in ids:
            raise errors.bad_request(f"No input item {after[:80]!r} in this response.", "after")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}
