"""`POST /v1/messages` and `/v1/messages/count_tokens` of a simulated vLLM 0.32/0.33 (vllm-interface §1.1: 0.11 has
neither; the server registers them when it imitates 0.33, `kv_events_format: "0.33"`).

vLLM serves Anthropic's Messages API by translating it to its chat completions path; so does the simulated
server, with the translation the gateway's front door uses (engine_adapters/apis/messages.py) and the ASGI glue
of gateway/translated.py around the server's own chat route: one copy of each rule. Errors are Anthropic's shape
(a chat route's vLLM-style error is translated by status). `count_tokens` counts the rendered chat prompt with the
simulator's tokenizer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson

from engine_adapters.apis.messages import MessagesError, MessagesTranslator, to_chat
from gateway.translated import dispatch_chat
from policies.tokens import estimate_chat_tokens
from simulator import tokenizer

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ChatHandler = Callable[[dict, Receive, Send], Awaitable[None]]
_JSON = [(b"content-type", b"application/json")]


async def _answer(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _request(receive: Receive, count_only: bool) -> dict:
    from simulator.vllm_api import _read_body  # the server imports this module

    raw = await _read_body(receive)
    try:
        req = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise MessagesError(f"The request body is not valid JSON: {e}.") from None
    if count_only and isinstance(req, dict) and req.get("max_tokens") is None:
        req = {**req, "max_tokens": 1}   # count_tokens takes no max_tokens; the translation needs one
    return to_chat(req).body


def answering_errors(chat: ChatHandler) -> ChatHandler:
    """The server's chat route with its refusals (ApiError) answered as its __call__ answers them, so the
    translated send turns them into Anthropic's errors."""
    from simulator.vllm_api import ApiError, error_body  # the server imports this module

    async def run(scope: dict, receive: Receive, send: Send) -> None:
        try:
            await chat(scope, receive, send)
        except ApiError as exc:
            await _answer(send, exc.status, error_body(exc.status, exc.message, exc.err_type, exc.param))

    return run


async def serve_messages(chat: ChatHandler, scope: dict, receive: Receive, send: Send) -> None:
    """POST /v1/messages through the server's chat route `chat`."""
    try:
        body = await _request(receive, False)
    except MessagesError as e:
        await _answer(send, e.status, e.body())
        return
    translator = MessagesTranslator(body.get("model") or "", estimate_chat_tokens(body["messages"]),
                                    body.get("stop"))
    await dispatch_chat(answering_errors(chat), scope, receive, send, body, translator)


async def count_tokens(scope: dict, receive: Receive, send: Send) -> None:
    """POST /v1/messages/count_tokens: {"input_tokens": N} of the prompt as the engine renders it."""
    try:
        body = await _request(receive, True)
    except MessagesError as e:
        await _answer(send, e.status, e.body())
        return
    n = tokenizer.count_tokens(tokenizer.render_chat(body["messages"]))
    await _answer(send, 200, orjson.dumps({"input_tokens": n}))

