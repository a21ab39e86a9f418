"""`POST /v1/messages` and `/v1/messages/count_tokens` of a simulated vLLM 0.32/0.33 (vllm-interface §1.1: 0.11 has
neither; the server registers them unless it imitates 0.11, as it does `/v1/responses`).

vLLM serves Anthropic's Messages API by translating it to its chat completions path; so does the simulated
server, with the translation the gateway's front door uses (engine_adapters/apis/messages.py) and the ASGI glue
of gateway/api/translated.py around the server's own chat route: one copy of each rule. Errors are Anthropic's shape
(a refusal of the chat route is translated by its status). `count_tokens` counts the rendered chat prompt with the
simulator's tokenizer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

import orjson

from engine_adapters.apis.messages import MessagesError, MessagesTranslator, to_chat
from engine_adapters.openai_errors import error_body
from gateway.api.translated import dispatch_chat, read_body
from policies.tokens import estimate_chat_tokens
from simulator import tokenizer

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGI = Callable[[dict, Receive, Send], Awaitable[None]]
_JSON = [(b"content-type", b"application/json")]


def messages_routes(chat: ASGI, api_error: type[Exception]) -> dict[str, dict[str, ASGI]]:
    """The two routes over the server's chat handler `chat`, whose refusals raise `api_error` (the server's
    ApiError: `status`, `message`, `err_type`)."""
    return {"/v1/messages": {"POST": partial(_serve, _answering(chat, api_error))},
            "/v1/messages/count_tokens": {"POST": _count_tokens}}


def _answering(chat: ASGI, api_error: type[Exception]) -> ASGI:
    """`chat` with its refusals answered (in the chat route's shape) to the send it was given: the translated
    send turns them into Anthropic's errors."""

    async def run(scope: dict, receive: Receive, send: Send) -> None:
        try:
            await chat(scope, receive, send)
        except api_error as exc:
            await _answer(send, exc.status, error_body(exc.message, exc.err_type, None, exc.status))

    return run


async def _answer(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _request(receive: Receive, send: Send, count_only: bool) -> dict | None:
    """The request as a chat body; None when the client left or the request was malformed (answered here)."""
    raw = await read_body(receive)
    if raw is None:
        return None
    try:
        try:
            req = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise MessagesError(f"The request body is not valid JSON: {e}.") from None
        if count_only and isinstance(req, dict) and req.get("max_tokens") is None:
            req = {**req, "max_tokens": 1}   # count_tokens takes no max_tokens; the translation needs one
        return to_chat(req).body
    except MessagesError as e:
        await _answer(send, e.status, e.body())
        return None


async def _serve(chat: ASGI, scope: dict, receive: Receive, send: Send) -> None:
    """POST /v1/messages through the server's chat route."""
    body = await _request(receive, send, False)
    if body is not None:
        translator = MessagesTranslator(body.get("model") or "", estimate_chat_tokens(body["messages"]),
                                        body.get("stop"))
        await dispatch_chat(chat, scope, receive, send, body, translator)


async def _count_tokens(scope: dict, receive: Receive, send: Send) -> None:
    """POST /v1/messages/count_tokens: {"input_tokens": N} of the prompt as the engine renders it."""
    body = await _request(receive, send, True)
    if body is not None:
        n = tokenizer.count_tokens(tokenizer.render_chat(body["messages"]))
        await _answer(send, 200, orjson.dumps({"input_tokens": n}))
