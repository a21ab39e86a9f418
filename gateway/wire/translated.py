"""ASGI glue for the front doors that speak another API (OpenAI's Responses, Anthropic's Messages) over the
chat-completions pipeline.

A front door checks and translates its request into a `/v1/chat/completions` body (the pure functions in
engine_adapters/apis/), then runs it through the dispatcher exactly as a chat request (`Dispatcher.handle`), so
admission, the queue, placement, SLO judging, resume after a worker dies mid-stream, fallbacks, tenant limits,
metrics, access logs and traces apply unchanged and every worker version can serve it. What this module gives:

    chat_scope        the client's scope rewritten for the chat route: path, content-length of the new body,
                      `Authorization: Bearer <key>` from another credential header, `x-session-id` from the
                      conversation id when the client sent none, and under `FRONT` the front door's `TranslatedSend`
                      (the dispatcher's access log, trace and metrics read the route the client called and the
                      status it received there: `front_of`)
    read_body         the client's request body, read whole (bounded) before it is translated
    body_receive      an ASGI `receive` that yields the translated body once, then forwards the real `receive`
                      (the dispatcher still sees the client disconnect)
    SseSplitter       an incremental splitter of server-sent events: bytes in any cut, whole events out
    TranslatedSend    an ASGI `send` that hands the pipeline's output to a `Translator`: a JSON answer (or error)
                      whole, a chat SSE stream event by event; it sends what the translator returns instead
    dispatch_chat     the above put together around one call of the chat route (`Dispatcher.handle` with CHAT)

Nothing here knows either target API (the translators in engine_adapters/apis/ do) or the gateway: the
simulated worker (simulator/) serves the same APIs over its own chat route with it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import orjson

CHAT_PATH = "/v1/chat/completions"
FRONT = "fleetgate.front"   # the scope key of the front door that rewrote a request for the chat route
SSE_TYPE = b"text/event-stream"
DONE = b"[DONE]"
JSON_TYPE = b"application/json"
# Response headers the translated answer does not keep from the pipeline's: it sets its own.
_REPLACED = frozenset({b"content-length", b"content-type"})

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


# --- the request side ---------------------------------------------------------------------------------

def chat_scope(scope: dict, body_len: int, *, bearer: bytes | None = None,
               session_id: str | None = None, front: TranslatedSend | None = None) -> dict:
    """`scope` for the chat route with a body of `body_len` bytes. `bearer`: a key to send as `Authorization:
    Bearer` when the client sent no Authorization header (Anthropic's `x-api-key`). `session_id`: becomes
    `x-session-id` when the client sent none (the conversation id placement keeps together). `front`: the
    front door's send wrapper, kept under `FRONT` (its `route` is the client's path)."""
    headers: list[tuple[bytes, bytes]] = []
    has_auth = has_session = False
    for k, v in scope.get("headers", ()):
        if k in (b"content-length", b"content-type", b"transfer-encoding"):
            continue
        has_auth = has_auth or k == b"authorization"
        has_session = has_session or (k == b"x-session-id" and bool(v))
        headers.append((k, v))
    headers += [(b"content-type", JSON_TYPE), (b"content-length", str(body_len).encode())]
    if bearer and not has_auth:
        headers.append((b"authorization", b"Bearer " + bearer))
    if session_id and not has_session:
        headers.append((b"x-session-id", session_id.encode("latin-1", "replace")))
    out = {**scope, "path": CHAT_PATH, "raw_path": CHAT_PATH.encode(), "headers": headers}
    if front is not None:
        out[FRONT] = front
    return out


def front_of(scope: dict) -> TranslatedSend | None:
    """The front door a chat-route scope came through (None: the client called the chat route itself)."""
    return scope.get(FRONT)


class BodyTooLarge(ValueError):
    """The request body passed the limit given to `read_body` (the front door answers 413)."""


async def read_body(receive: Receive, limit: int | None = None) -> bytes | None:
    """The client's whole request body (the chat pipeline reads it, a front door to translate it); None when the
    client disconnected first; `BodyTooLarge` past `limit` bytes. A body in one message is returned as it came."""
    parts: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        chunk = msg.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            raise BodyTooLarge(limit)
        if not msg.get("more_body"):
            return b"".join((*parts, chunk)) if parts else chunk
        parts.append(chunk)


def body_receive(body: bytes, receive: Receive) -> Receive:
    """An ASGI `receive` giving `body` as the whole request body, then the real `receive`'s messages (a client
    disconnect is an `http.disconnect` there)."""
    sent = False

    async def receive_translated() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_translated


# --- the response side --------------------------------------------------------------------------------

@dataclass(slots=True)
class SseEvent:
    """One server-sent event: its `event:` name (None when it has none) and its `data:` lines joined."""

    event: str | None
    data: bytes


class SseSplitter:
    """Whole server-sent events out of bytes cut anywhere (the relay forwards what the worker's socket gave).
    Events end with a blank line (LF or CRLF line ends); comment lines (`:`) and events without data are
    skipped."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[SseEvent]:
        buf = self._buf + chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        out: list[SseEvent] = []
        start = 0
        while (end := buf.find(b"\n\n", start)) != -1:
            ev = _parse_event(buf[start:end])
            if ev is not None:
                out.append(ev)
            start = end + 2
        self._buf = buf[start:]
        return out

    def flush(self) -> list[SseEvent]:
        """The last event when the stream ended without its blank line."""
        rest, self._buf = self._buf, b""
        ev = _parse_event(rest.strip(b"\n")) if rest.strip() else None
        return [ev] if ev is not None else []


def _parse_event(block: bytes) -> SseEvent | None:
    name: str | None = None
    data: list[bytes] = []
    for line in block.split(b"\n"):
        if not line or line.startswith(b":"):
            continue
        field, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            data.append(value)
        elif field == b"event":
            name = value.decode("utf-8", "replace")
    return SseEvent(name, b"\n".join(data)) if data else None


class Translator(Protocol):
    """What a target API turns the pipeline's chat answer into (engine_adapters/apis/)."""

    def json_body(self, status: int, body: bytes) -> tuple[int, bytes]:
        """A whole (non-streamed) answer or error: its status and body in the target API's shape."""
        ...

    def stream_start(self) -> bytes:
        """The target's opening events, sent right after the stream's response start."""
        ...

    def stream_data(self, data: bytes) -> bytes:
        """One chat SSE event's `data` (a chunk or an error object; never `[DONE]`): the target's events for it."""
        ...

    def stream_end(self) -> bytes:
        """The chat stream is over (`[DONE]`, or its end without it): the target's closing events."""
        ...


class TranslatedSend:
    """An ASGI `send` for the dispatcher that sends the translated answer to the client's `send`.

    `finish`, when given, is awaited once after the translator made the answer's last bytes (the JSON body, or a
    stream's closing events) and before they go out, so what it stores (a Responses conversation, read from the
    translator) is there when the client can ask again.

    `route` is the path the client called; `status` the pipeline's answer status, `sent_status` the one the
    client received (a Messages error's own status: 529 for the pipeline's 429 `overloaded` or 503, 500 for 502
    and 504), 0 until the answer starts."""

    def __init__(self, send: Send, translator: Translator,
                 finish: Callable[[], Awaitable[None]] | None = None, route: str = CHAT_PATH) -> None:
        self._send = send
        self.translator = translator
        self._finish = finish
        self.route = route
        self.status = 0
        self.sent_status = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self.streaming = False
        self._parts: list[bytes] = []
        self._splitter = SseSplitter()
        self.ended = False

    async def __call__(self, msg: dict) -> None:
        kind = msg["type"]
        if kind == "http.response.start":
            self.status = msg["status"]
            self._headers = [(k, v) for k, v in msg.get("headers", ()) if k.lower() not in _REPLACED]
            ctype = next((v for k, v in msg.get("headers", ()) if k.lower() == b"content-type"), b"")
            self.streaming = ctype.startswith(SSE_TYPE)
            if self.streaming:
                self.sent_status = self.status
                await self._send({"type": "http.response.start", "status": self.status,
                                  "headers": [(b"content-type", SSE_TYPE + b"; charset=utf-8"), *self._headers]})
                opening = self.translator.stream_start()
                if opening:
                    await self._send({"type": "http.response.body", "body": opening, "more_body": True})
            return
        if kind != "http.response.body":
            await self._send(msg)
            return
        if self.ended:   # the answer was closed at `[DONE]`: what follows (the pipeline's empty end) is dropped
            return
        body = msg.get("body", b"")
        more = msg.get("more_body", False)
        if not self.streaming:
            self._parts.append(body)
            if not more:
                await self._send_json(b"".join(self._parts))
            return
        events = self._splitter.feed(body)
        if not more:
            events += self._splitter.flush()
        out: list[bytes] = []
        for ev in events:
            if ev.data == DONE:
                break
            out.append(self.translator.stream_data(ev.data))
        else:
            if more:
                if out:
                    await self._send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                return
        # `[DONE]`, or the stream's end without it: the closing events, sent after `finish`
        out.append(self.translator.stream_end())
        if self._finish is not None:
            await self._finish()
        self.ended = True
        await self._send({"type": "http.response.body", "body": b"".join(out), "more_body": False})

    async def _send_json(self, body: bytes) -> None:
        status, out = self.translator.json_body(self.status, body)
        if self._finish is not None:
            await self._finish()
        self.ended = True
        self.sent_status = status
        headers = [(b"content-type", JSON_TYPE), (b"content-length", str(len(out)).encode()), *self._headers]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": out, "more_body": False})

    def client_status(self, status: int) -> int:
        """The status the client received for a request the pipeline counts as `status`: the translated one when
        `status` is what the pipeline answered, else `status` itself (499: the client left; 502: a stream that
        broke after its 200)."""
        return self.sent_status if self.sent_status and status == self.status else status


# An ASGI app serving the chat route: the gateway's `partial(dispatcher.handle, route=CHAT)`, or a simulated
# worker's own chat handler (it serves the other APIs through this module too).
ChatApp = Callable[[dict, Receive, Send], Awaitable[None]]


async def dispatch_chat(chat: ChatApp, scope: dict, receive: Receive, send: Send, chat_body: dict | bytes,
                        translator: Translator, *, bearer: bytes | None = None, session_id: str | None = None,
                        finish: Callable[[], Awaitable[None]] | None = None) -> TranslatedSend:
    """Run `chat_body` (a dict, or its JSON) through `chat` for the client of `scope`, the answer translated by
    `translator`. Returns the send wrapper (its `status`, whether it streamed)."""
    raw = chat_body if isinstance(chat_body, bytes) else orjson.dumps(chat_body)
    out = TranslatedSend(send, translator, finish, scope["path"])
    await chat(chat_scope(scope, len(raw), bearer=bearer, session_id=session_id, front=out),
               body_receive(raw, receive), out)
    return out
