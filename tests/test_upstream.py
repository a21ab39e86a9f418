"""The relay's upstream HTTP/1.1 client (gateway/wire/upstream.py) against scripted servers on real loopback sockets:
keep-alive reuse, chunked and EOF-delimited bodies, the failure kinds the relay maps, timeouts, flow control."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway.request.parse import new_request_id, read_headers
from gateway.wire.upstream import (
    KEEPALIVE_S,
    ClientConnectorError,
    ClientPayloadError,
    ServerDisconnectedError,
    ServerTimeoutError,
    UpstreamPool,
    encode_headers,
    header_pairs,
)
from tests.helpers import poll

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[None]]


class ScriptedServer:
    """Reads each request (head + Content-Length body) and lets `script` answer it; records what it saw."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[bytes] = []
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                await self.script(reader, writer, body)
                if writer.is_closing():
                    return
        finally:
            writer.close()

    async def __aenter__(self) -> ScriptedServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 1)


@contextlib.asynccontextmanager
async def pool(**kwargs: float) -> AsyncIterator[UpstreamPool]:
    p = UpstreamPool(connect_s=kwargs.pop("connect_s", 1.0), **kwargs)
    try:
        yield p
    finally:
        await p.close()


def answer(body: bytes, status: str = "200 OK", extra: bytes = b"") -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n".encode()
            + extra + b"\r\n" + body)


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
    writer.write(answer(b'{"echo":' + body + b"}"))
    await writer.drain()


async def test_request_bytes_and_keep_alive_reuse() -> None:
    async with ScriptedServer(echo) as srv, pool() as p:
        for i in range(3):
            conn = await p.request(srv.url, encode_headers([("X-Request-Id", f"r{i}")]), b"[%d]" % i, 5.0)
            assert conn.status == 200 and conn.content_type == b"application/json"
            assert await conn.read() == b'{"echo":[%d]}' % i
            conn.release()
        assert srv.connections == 1  # one keep-alive connection carried all three
        head, _, body = srv.requests[0].partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        assert lines[0] == b"POST /v1/chat/completions HTTP/1.1"
        assert set(lines[1:]) == {b"Host: " + srv.url.split("/")[2].encode(), b"Accept-Encoding: identity",
                                  b"X-Request-Id: r0", b"Accept: */*", b"Content-Length: 3"}
        assert body == b"[0]"


async def test_chunked_stream_arrives_piece_by_piece() -> None:
    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(3):
            data = b"data: %d\n\n" % i
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with ScriptedServer(stream) as srv, pool() as p:
        conn = await p.request(srv.url, b"", b"{}", 5.0, 5.0, stream=True)
        assert conn.content_type == b"text/event-stream"
        pieces = []
        while chunk := await conn.read_some():
            pieces.append(chunk)
        assert b"".join(pieces) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n" and len(pieces) >= 2
        conn.release()
        again = await p.request(srv.url, b"", b"{}", 5.0, 5.0, stream=True)
        while await again.read_some():
            pass
        again.release()
        assert srv.connections == 1


async def test_body_delimited_by_close_is_complete_and_not_reused() -> None:
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    async with ScriptedServer(until_close) as srv, pool() as p:
        for _ in range(2):
            conn = await p.request(srv.url, b"", b"{}", 5.0)
            assert conn.content_type == b"application/json"  # the default when the worker sends none
            assert await conn.read() == b"all of it"
            conn.release()
        assert srv.connections == 2


async def test_close_before_headers_is_a_disconnect() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
        writer.close()

    async with ScriptedServer(hang_up) as srv, pool() as p:
        with pytest.raises(ServerDisconnectedError) as e:
            await p.request(srv.url, b"", b"{}", 5.0)
        assert isinstance(e.value, OSError)


async def test_reused_connection_closed_under_the_request_is_sent_once_more_on_a_new_one() -> None:
    """The worker's keep-alive timer fires as a pooled connection is reused: it closes without a byte of answer.
    The request goes once more on a new connection; a byte of answer, or a new connection, rules that out."""
    def second_request_on_a_connection(then: Callable[[asyncio.StreamWriter], Awaitable[None]]) -> Script:
        seen: list[int] = []

        async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
            seen.append(id(writer))
            if seen.count(id(writer)) == 2:
                await then(writer)
            else:
                await echo(reader, writer, body)
        return script

    async def idle_close(writer: asyncio.StreamWriter) -> None:  # the worker's idle close wins the race
        writer.close()

    async with ScriptedServer(second_request_on_a_connection(idle_close)) as srv, pool() as p:
        for i in range(2):
            conn = await p.request(srv.url, b"", b"%d" % i, 5.0)
            assert await conn.read() == b'{"echo":%d}' % i
            conn.release()
        assert srv.connections == 2 and [r[-1:] for r in srv.requests] == [b"0", b"1", b"1"]

    async def half_an_answer(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 O")  # the worker had begun to answer: it ran the request, no resend
        await writer.drain()
        writer.close()

    async with ScriptedServer(second_request_on_a_connection(half_an_answer)) as srv, pool() as p:
        conn = await p.request(srv.url, b"", b"0", 5.0)
        await conn.read()
        conn.release()
        with pytest.raises(ServerDisconnectedError):
            await p.request(srv.url, b"", b"1", 5.0)
        assert srv.connections == 1 and len(srv.requests) == 2

    async def always_hang_up_after_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                         body: bytes) -> None:
        if srv.requests[1:]:
            writer.close()
            return
        await echo(reader, writer, body)

    async with ScriptedServer(always_hang_up_after_first) as srv, pool() as p:
        conn = await p.request(srv.url, b"", b"0", 5.0)
        await conn.read()
        conn.release()
        with pytest.raises(ServerDisconnectedError):  # sent once more only: the new connection's failure stands
            await p.request(srv.url, b"", b"1", 5.0)
        assert srv.connections == 2 and len(srv.requests) == 3


def test_pooled_connections_expire_before_vllms_keep_alive() -> None:
    # vLLM's uvicorn closes idle connections after VLLM_HTTP_TIMEOUT_KEEP_ALIVE = 5 s
    assert KEEPALIVE_S < 5.0 and UpstreamPool(connect_s=1.0).keepalive_s == KEEPALIVE_S


async def test_body_cut_short_hands_out_what_arrived_then_fails() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()

    async with ScriptedServer(cut) as srv, pool() as p:
        conn = await p.request(srv.url, b"", b"{}", 5.0, stream=True)
        assert await conn.read_some() == b"partial"
        with pytest.raises(ClientPayloadError):
            await conn.read_some()
        conn.close()
        conn = await p.request(srv.url, b"", b"{}", 5.0)
        with pytest.raises(ClientPayloadError):
            await conn.read()
        conn.close()


async def test_read_timeout_between_bytes() -> None:
    hung_up = asyncio.Event()

    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await writer.drain()
        await reader.read()  # returns at the client's disconnect
        hung_up.set()

    async with ScriptedServer(stall) as srv, pool() as p:
        conn = await p.request(srv.url, b"", b"{}", 0.2)
        t = time.monotonic()
        with pytest.raises(ServerTimeoutError):
            await conn.read()
        assert 0.1 < time.monotonic() - t < 1.5
        conn.close()
        await asyncio.wait_for(hung_up.wait(), 2)  # the worker sees the disconnect


async def test_headers_timeout_bounds_the_wait_for_headers() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
        await asyncio.sleep(5)

    async with ScriptedServer(silent) as srv, pool() as p:
        t = time.monotonic()
        with pytest.raises(TimeoutError):
            await p.request(srv.url, b"", b"{}", 30.0, headers_timeout=0.2, stream=True)
        assert time.monotonic() - t < 1.5


async def test_connection_refused_and_invalid_http() -> None:
    async with ScriptedServer(echo) as srv:
        url = srv.url
    async with pool() as p:
        with pytest.raises(ClientConnectorError) as e:
            await p.request(url, b"", b"{}", 1.0)
        assert isinstance(e.value, OSError) and "Cannot connect to host" in str(e.value)

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
        writer.write(b"this is not HTTP\r\n\r\n")
        await writer.drain()

    async with ScriptedServer(garbage) as srv, pool() as p:
        with pytest.raises(ClientPayloadError):
            await p.request(srv.url, b"", b"{}", 1.0)


async def test_idle_connections_expire_and_dead_ones_are_not_reused() -> None:
    async with ScriptedServer(echo) as srv, pool(keepalive_s=0.05) as p:
        conn = await p.request(srv.url, b"", b"1", 5.0)
        await conn.read()
        conn.release()
        assert p.idle_connections(srv.url) == 1
        await poll(lambda: p.idle_connections(srv.url) == 0, what="the idle connection to expire")
        conn = await p.request(srv.url, b"", b"2", 5.0)  # the idle one expired: a new connection
        await conn.read()
        conn.release()
        assert srv.connections == 2

    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
        writer.write(answer(b"{}"))
        await writer.drain()
        writer.close()  # keep-alive announced, but the worker closes right after

    async with ScriptedServer(once) as srv, pool() as p:
        for _ in range(2):
            conn = await p.request(srv.url, b"", b"{}", 5.0)
            assert await conn.read() == b"{}"
            conn.release()
            await poll(lambda: p.idle_connections(srv.url) == 0, what="the worker's close to reach the pool")
        assert srv.connections == 2


async def test_slow_consumer_pauses_reading_and_loses_nothing() -> None:
    piece = b"x" * 8192

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(64):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with ScriptedServer(big) as srv, pool() as p:
        conn = await p.request(srv.url, b"", b"{}", 0.3, 5.0, stream=True)
        total = 0
        await asyncio.sleep(0.5)  # longer than the read timeout: paused reading is not a worker stall
        while chunk := await conn.read_some():
            total += len(chunk)
            await asyncio.sleep(0.001)
        assert total == 64 * len(piece)
        conn.release()


def test_encode_headers_drops_line_breaks_and_keeps_a_given_accept() -> None:
    assert encode_headers([("accept", "text/event-stream"), ("x-a", "1\r\nx-evil: 1"), ("x-b", "2")]) == \
        b"accept: text/event-stream\r\nx-b: 2\r\n"
    assert encode_headers([]) == b"Accept: */*\r\n"


def test_client_headers_become_one_encoded_block() -> None:
    hdrs = read_headers([(b"host", b"gw"), (b"content-length", b"2"), (b"authorization", b"Bearer k"),
                          (b"x-session-id", b"s1"), (b"x-a", b"1\r\nx-evil: 1"), (b"accept", b"text/event-stream")])
    assert hdrs.forward == b"x-session-id: s1\r\naccept: text/event-stream\r\n"  # no hop-by-hop, credentials, CR/LF
    assert header_pairs(hdrs.forward) == [("x-session-id", "s1"), ("accept", "text/event-stream")]
    assert read_headers([(b"x-b", b"2")]).forward == b"x-b: 2\r\nAccept: */*\r\n"
    rid = read_headers([(b"x-request-id", b"bad id!")]).request_id  # invalid: a uuid4 hex replaces it
    assert uuid.UUID(rid.decode()).version == 4 and len(rid) == 32
    assert new_request_id() != new_request_id()


async def test_interim_answer_is_skipped_and_the_first_content_type_wins() -> None:
    async def with_continue(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-type: text/plain\r\n"
                     b"content-type: text/html\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    async with ScriptedServer(with_continue) as srv, pool() as p:
        conn = await p.request(srv.url, b"", b"{}", 5.0)
        assert (conn.status, conn.content_type, await conn.read()) == (201, b"text/plain", b"ok")
        conn.release()
