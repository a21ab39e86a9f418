"""Anthropic's Messages API at the gateway's front door: `POST /v1/messages` and `/v1/messages/count_tokens`.

A Messages request is checked and translated into a chat completions request (engine_adapters/apis/messages.py)
and run through the chat pipeline (gateway/api/translated.py `dispatch_chat` around `Dispatcher.handle`), its answer
translated back: admission, the queue, placement, SLO judging, resume after a worker's death, fallbacks, tenant
limits, metrics, access logs and traces are the chat route's, and every worker version serves it (vLLM 0.11
has no `/v1/messages`). The key comes as `x-api-key` (Anthropic's SDKs) or `Authorization: Bearer`; the
`anthropic-version` header is accepted and not needed. `metadata.user_id` names the conversation: it becomes
`x-session-id` (the session placement keeps together) when the client sent none.

Errors are Anthropic's shape and statuses (engine_adapters/apis/messages.py `error_from_openai`): what the
pipeline refuses is translated from its OpenAI-shaped answer; what this module refuses itself (a body over
`limits.max_body_bytes`, malformed JSON or blocks) is answered here.

`count_tokens` answers `{"input_tokens": N}`: the prompt the worker would see, counted by the model's tokenizer
when the KV-events view has one (gateway/wire/prompt_tokens.py), else by the estimate placement uses
(policies/tokens.py `estimate_chat_tokens`).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import orjson

from engine_adapters.apis.messages import MessagesError, MessagesTranslator, error_from_openai, to_chat
from gateway.api.translated import BodyTooLarge, Receive, Send, dispatch_chat, read_body
from gateway.request.parse import CHAT
from gateway.tenancy.auth import bearer
from gateway.wire import errors
from gateway.wire.errors import GatewayError
from policies.tokens import estimate_chat_tokens

if TYPE_CHECKING:
    from gateway.core import Gateway

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
PATHS = (MESSAGES_PATH, COUNT_TOKENS_PATH)
_JSON = [(b"content-type", b"application/json")]


def _header(scope: dict, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v
    return None


def api_key(scope: dict) -> bytes | None:
    """The client's key: `x-api-key` (Anthropic's header) unless `Authorization: Bearer` names one."""
    return bearer(_header(scope, b"authorization")) or (_header(scope, b"x-api-key") or b"").strip() or None


async def _answer(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON, (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _gateway_error(send: Send, e: GatewayError) -> None:
    status, body = error_from_openai(e.status, e.body())
    await _answer(send, status, body, [h for h in e.headers() if h[0] != b"content-type"])


class MessagesApi:
    """The two routes; `handle` is their ASGI entry (gateway/app.py sends them here)."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def handle(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            await _answer(send, 405, MessagesError(f"Use POST for {scope['path']}.", 405,
                                                   "invalid_request_error").body())
            return
        dispatcher = self.gw.dispatcher
        if dispatcher is None:   # not started: nothing serves yet
            await _gateway_error(send, errors.no_worker("any model", self.gw.config.health.interval_s))
            return
        limit = self.gw.config.limits.max_body_bytes
        try:
            declared = _header(scope, b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise errors.body_too_large(limit)
            raw = await read_body(receive, limit)
            if raw is None:   # the client left
                return
            try:
                req = orjson.loads(raw)
            except orjson.JSONDecodeError as e:
                raise MessagesError(f"The request body is not valid JSON: {e}.") from None
            if scope["path"] == COUNT_TOKENS_PATH:
                await self._count_tokens(scope, send, req)
            else:
                await self._create(scope, receive, send, req)
        except BodyTooLarge:
            await _gateway_error(send, errors.body_too_large(limit))
        except MessagesError as e:
            await _answer(send, e.status, e.body())
        except GatewayError as e:
            await _gateway_error(send, e)

    async def _create(self, scope: dict, receive: Receive, send: Send, req: object) -> None:
        chat = to_chat(req)
        body = chat.body
        translator = MessagesTranslator(body.get("model") or "", estimate_chat_tokens(body["messages"]),
                                        body.get("stop"))
        dispatcher = self.gw.dispatcher
        await dispatch_chat(partial(dispatcher.handle, route=CHAT), scope, receive, send, body, translator,
                            bearer=api_key(scope), session_id=chat.conversation)

    async def _count_tokens(self, scope: dict, send: Send, req: object) -> None:
        tenant = self.gw.auth.authenticate(b"Bearer " + (api_key(scope) or b""))
        if isinstance(req, dict) and req.get("max_tokens") is None:
            req = {**req, "max_tokens": 1}   # count_tokens takes no max_tokens; the translation needs one
        body = to_chat(req).body
        model = body.get("model")
        if model and not (self._known(model) and tenant.may_use(self.gw.config.aliases.get(model, model))):
            raise errors.model_not_found(model, self.gw.registry.served_models())
        await _answer(send, 200, orjson.dumps({"input_tokens": self._prompt_tokens(body["messages"])}))

    def _known(self, model: str) -> bool:
        gw = self.gw
        return (gw.registry.knows_model(model) or model in gw.config.aliases or model in gw.config.models
                or (gw.dispatcher is not None and gw.dispatcher.adapters.base_of(model) is not None))

    def _prompt_tokens(self, messages: list[dict]) -> int:
        tok = self.gw.kv_events.tokenizer
        if tok is not None:
            try:
                ids = tok.chat(messages)
            except (TypeError, AttributeError, ValueError):
                ids = None
            if ids is not None:
                return len(ids)
        return estimate_chat_tokens(messages)
