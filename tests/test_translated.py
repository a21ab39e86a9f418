"""gateway/api/translated.py: the ASGI glue between a translating front door and the chat pipeline."""

from __future__ import annotations

import asyncio
import functools

import orjson
import pytest

from gateway.api.translated import (
    BodyTooLarge,
    SseSplitter,
    TranslatedSend,
    body_receive,
    chat_scope,
    dispatch_chat,
    read_body,
)
from gateway.request.parse import CHAT

CHUNKS = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b'data: {"error": {"message": "boom"}}\n\n',
          b"data: [DONE]\n\n"]


class Upper:
    """A translator that names what it saw, so the test can check the order and the cuts."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []

    def json_body(self, status: int, body: bytes) -> tuple[int, bytes]:
        return (299 if status == 200 else status), b"J" + body.upper()

    def stream_start(self) -> bytes:
        return b"event: start\n\n"

    def stream_data(self, data: bytes) -> bytes:
        self.seen.append(data)
        return b"event: d\ndata: " + data.upper() + b"\n\n"

    def stream_end(self) -> bytes:
        return b"event: end\n\n"


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


def test_splitter_gives_whole_events_from_any_cut():
    stream = b"".join(CHUNKS).replace(b"\n\n", b"\r\n\r\n", 1) + b": comment\n\nevent: x\ndata: a\ndata: b\n\n"
    want = [b'{"n": 1}', b'{"n": 2}', b'{"error": {"message": "boom"}}', b"[DONE]", b"a\nb"]
    for size in (1, 2, 3, 7, 64, len(stream)):
        sp = SseSplitter()
        got = []
        for i in range(0, len(stream), size):
            got += sp.feed(stream[i:i + size])
        got += sp.flush()
        assert [e.data for e in got] == want, size
        assert got[-1].event == "x"
    sp = SseSplitter()
    assert sp.feed(b"data: tail") == []
    assert [e.data for e in sp.flush()] == [b"tail"]


def test_chat_scope_rewrites_path_length_auth_and_session():
    scope = {"type": "http", "method": "POST", "path": "/v1/messages", "raw_path": b"/v1/messages",
             "headers": [(b"content-length", b"5"), (b"content-type", b"text/plain"), (b"x-api-key", b"k1"),
                         (b"x-request-id", b"r1")]}
    out = chat_scope(scope, 42, bearer=b"k1", session_id="resp_abc")
    assert out["path"] == "/v1/chat/completions" and out["raw_path"] == b"/v1/chat/completions"
    h = dict(out["headers"])
    assert h[b"content-length"] == b"42" and h[b"content-type"] == b"application/json"
    assert h[b"authorization"] == b"Bearer k1" and h[b"x-session-id"] == b"resp_abc" and h[b"x-request-id"] == b"r1"
    assert scope["path"] == "/v1/messages"   # the client's scope is left as it was
    # what the client sent wins
    mine = {**scope, "headers": [(b"authorization", b"Bearer mine"), (b"x-session-id", b"s9")]}
    h = dict(chat_scope(mine, 1, bearer=b"k1", session_id="resp_abc")["headers"])
    assert h[b"authorization"] == b"Bearer mine" and h[b"x-session-id"] == b"s9"


def test_body_receive_gives_the_body_then_the_real_messages():
    async def real() -> dict:
        return {"type": "http.disconnect"}

    async def go() -> list[dict]:
        rcv = body_receive(b"{}", real)
        return [await rcv(), await rcv()]

    first, second = run(go())
    assert first == {"type": "http.request", "body": b"{}", "more_body": False}
    assert second == {"type": "http.disconnect"}


def test_translated_send_json_answer_and_finish_before_it():
    sent: list[dict] = []
    order: list[str] = []

    async def send(msg: dict) -> None:
        order.append(msg["type"])
        sent.append(msg)

    async def finish() -> None:
        order.append("finish")

    async def go() -> None:
        ts = TranslatedSend(send, Upper(), finish)
        await ts({"type": "http.response.start", "status": 200,
                  "headers": [(b"content-type", b"application/json"), (b"content-length", b"7"),
                              (b"x-request-id", b"r1")]})
        await ts({"type": "http.response.body", "body": b'{"a":', "more_body": True})
        await ts({"type": "http.response.body", "body": b"1}", "more_body": False})

    run(go())
    assert order == ["finish", "http.response.start", "http.response.body"]
    assert sent[0]["status"] == 299
    h = dict(sent[0]["headers"])
    assert h[b"content-length"] == b"8" and h[b"x-request-id"] == b"r1" and h[b"content-type"] == b"application/json"
    assert sent[1] == {"type": "http.response.body", "body": b'J{"A":1}', "more_body": False}


def test_translated_send_stream_cut_anywhere_closes_at_done():
    stream = b"".join(CHUNKS)
    for size in (1, 5, len(stream)):
        sent: list[dict] = []
        tr = Upper()
        finished: list[int] = []

        async def send(msg: dict, sent=sent) -> None:
            sent.append(msg)

        async def finish(sent=sent, finished=finished) -> None:
            finished.append(len(sent))

        async def go(tr=tr, send=send, finish=finish, size=size) -> None:
            ts = TranslatedSend(send, tr, finish)
            await ts({"type": "http.response.start", "status": 200,
                      "headers": [(b"content-type", b"text/event-stream"), (b"x-served-model", b"m")]})
            for i in range(0, len(stream), size):
                await ts({"type": "http.response.body", "body": stream[i:i + size], "more_body": True})
            await ts({"type": "http.response.body", "body": b"", "more_body": False})   # dropped: ended at [DONE]

        run(go())
        assert tr.seen == [b'{"n": 1}', b'{"n": 2}', b'{"error": {"message": "boom"}}']
        assert sent[0]["type"] == "http.response.start" and dict(sent[0]["headers"])[b"x-served-model"] == b"m"
        body = b"".join(m.get("body", b"") for m in sent[1:])
        assert body.startswith(b"event: start\n\n") and body.endswith(b"event: end\n\n")
        assert body.count(b"event: d\n") == 3
        assert sent[-1]["more_body"] is False and sum(1 for m in sent if m.get("more_body") is False) == 1
        assert finished and finished[0] == len(sent) - 1   # stored before the closing events went out


def test_translated_send_stream_cut_without_done_still_closes():
    sent: list[dict] = []

    async def send(msg: dict) -> None:
        sent.append(msg)

    async def go() -> None:
        ts = TranslatedSend(send, Upper())
        await ts({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await ts({"type": "http.response.body", "body": b'data: {"n": 1}', "more_body": False})

    run(go())
    body = b"".join(m.get("body", b"") for m in sent[1:])
    assert body == b'event: start\n\nevent: d\ndata: {"N": 1}\n\nevent: end\n\n'


def test_dispatch_chat_hands_the_pipeline_a_chat_request():
    seen: dict = {}

    async def handle(scope, receive, send, route) -> None:  # noqa: ANN001 - the dispatcher's signature
        seen["path"], seen["route"] = scope["path"], route
        seen["body"] = (await receive())["body"]
        seen["headers"] = dict(scope["headers"])
        await send({"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    sent: list[dict] = []

    async def send(msg: dict) -> None:
        sent.append(msg)

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    scope = {"type": "http", "path": "/v1/responses", "headers": []}
    ts = run(dispatch_chat(functools.partial(handle, route=CHAT), scope, receive, send, {"messages": [{"role": "user", "content": "hi"}]}, Upper(),
                           session_id="resp_1"))
    assert seen["path"] == "/v1/chat/completions" and seen["route"] is CHAT
    assert orjson.loads(seen["body"])["messages"][0]["content"] == "hi"
    assert seen["headers"][b"x-session-id"] == b"resp_1"
    assert ts.status == 400 and not ts.streaming
    assert sent[0]["status"] == 400 and sent[1]["body"] == b"J{}"


def test_read_body_whole_bounded_or_none_when_the_client_left():
    def receiver(msgs: list[dict]):  # noqa: ANN202
        it = iter(msgs)

        async def receive() -> dict:
            return next(it)
        return receive

    parts = [{"type": "http.request", "body": b"ab", "more_body": True},
             {"type": "http.request", "body": b"cd", "more_body": False}]
    assert run(read_body(receiver(parts))) == b"abcd"
    assert run(read_body(receiver(parts), 4)) == b"abcd"
    with pytest.raises(BodyTooLarge):
        run(read_body(receiver(parts), 3))
    assert run(read_body(receiver([parts[0], {"type": "http.disconnect"}]))) is None
