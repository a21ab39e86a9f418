"""Hostile and careless clients, over raw sockets: headers dripped, a stalled body, idle connections, stray CRLFs,
an 8 MB header, 100,000 headers, too many connections -> closed or 4xx in bounded time, never forwarded.
And what the worker is told: no credentials, no hop-by-hop or Connection-named headers, X-Forwarded-For with
the client's address (an incoming one kept only from a trusted proxy)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest

from tests.helpers import MODEL, running_gateway

LIMITS = {"header_timeout_s": 1.0, "body_timeout_s": 1.0, "keepalive_s": 1.0, "max_header_bytes": 16384,
          "max_headers": 50}
CHAT = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


class RecordingWorker:
    """A minimal vLLM stand-in that records the headers of every completion request it gets."""

    def __init__(self) -> None:
        self.seen: list[dict[str, list[str]]] = []
        self.server: asyncio.base_events.Server | None = None
        self.url = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers: dict[str, list[str]] = {}
                for line in lines[1:]:
                    if line:
                        k, _, v = line.partition(":")
                        headers.setdefault(k.strip().lower(), []).append(v.strip())
                n = int(headers.get("content-length", ["0"])[0])
                if n:
                    await reader.readexactly(n)
                if lines[0].startswith("POST"):
                    self.seen.append(headers)
                    body = orjson.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": MODEL,
                                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                                      "finish_reason": "stop"}],
                                         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
                else:
                    body = b"" if "/metrics" in lines[0] else b"{}"
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(body), body))
                await writer.drain()
        writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@contextlib.asynccontextmanager
async def recording_worker() -> AsyncIterator[RecordingWorker]:
    w = RecordingWorker()
    await w.start()
    try:
        yield w
    finally:
        await w.stop()


class Raw:
    """A raw client connection on a non-blocking socket, read as the kernel delivers it: the gateway's answer is
    read even when a reset follows it (asyncio's StreamReader raises a reset that arrives before its reader has
    run, with the answer still in its buffer)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()

    async def send(self, data: bytes) -> None:
        """Send `data`; a connection the gateway closed meanwhile ends the sending, quietly."""
        with contextlib.suppress(ConnectionError):
            await self.loop.sock_sendall(self.sock, data)

    async def closed_within(self, seconds: float) -> tuple[bytes, float]:
        """Read until the gateway closes the connection; (what it sent, seconds it took). Fails past `seconds`."""
        t0 = time.monotonic()
        data = bytearray()

        async def read_all() -> None:
            while True:
                try:
                    chunk = await self.loop.sock_recv(self.sock, 65536)
                except ConnectionResetError:
                    return  # closed with a reset: what came before it is the answer
                if not chunk:
                    return
                data.extend(chunk)
        await asyncio.wait_for(read_all(), seconds)
        return bytes(data), time.monotonic() - t0

    def close(self) -> None:
        self.sock.close()


async def raw(url: str) -> Raw:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    except BaseException:
        sock.close()
        raise
    return Raw(sock)


# --- what the worker is told ---------------------------------------------------------------------------------------
async def test_credentials_hop_by_hop_and_connection_named_headers_are_not_forwarded() -> None:
    async with recording_worker() as w, running_gateway(workers=[{"id": "w", "url": w.url, "models": [MODEL]}],
                                                        api_keys=["sk-client-key-1"]) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
        r = await http.post("/v1/chat/completions", content=CHAT, headers={
            "content-type": "application/json", "authorization": "Bearer sk-client-key-1", "x-api-key": "secret-1",
            "cookie": "session=secret-2", "proxy-authorization": "Basic c2VjcmV0", "connection": "keep-alive, x-hop",
            "x-hop": "dropped", "te": "trailers", "x-forwarded-for": "6.6.6.6", "x-custom": "kept"})
        assert r.status_code == 200, r.text
        seen = w.seen[-1]
        for name in ("authorization", "x-api-key", "cookie", "proxy-authorization", "x-hop", "te", "connection"):
            assert name not in seen, (name, seen)
        assert seen["x-custom"] == ["kept"] and seen["x-forwarded-for"] == ["127.0.0.1"]  # the client's one: dropped


async def test_x_forwarded_for_is_kept_only_from_trusted_proxies() -> None:
    async with recording_worker() as w, running_gateway(workers=[{"id": "w", "url": w.url, "models": [MODEL]}],
                                                        server={"trusted_proxies": ["127.0.0.0/8"]}) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
        r = await http.post("/v1/chat/completions", content=CHAT,
                            headers={"content-type": "application/json", "x-forwarded-for": "203.0.113.7"})
        assert r.status_code == 200
        assert w.seen[-1]["x-forwarded-for"] == ["203.0.113.7, 127.0.0.1"]


# --- hostile connections ----------------------------------------------------------------------------------------
async def test_dripped_headers_stalled_bodies_and_idle_connections_are_closed_in_time() -> None:
    async with recording_worker() as w, running_gateway(workers=[{"id": "w", "url": w.url, "models": [MODEL]}],
                                                        server=LIMITS) as gw:
        async def drip() -> tuple[bytes, float]:
            conn = await raw(gw.url)
            await conn.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")

            async def more() -> None:
                for i in range(100):
                    await asyncio.sleep(0.2)
                    await conn.send(b"X-Drip-%d: 1\r\n" % i)
            t = asyncio.create_task(more())
            try:
                return await conn.closed_within(3.0)
            finally:
                t.cancel()
                await asyncio.gather(t, return_exceptions=True)
                conn.close()

        async def stall() -> tuple[bytes, float]:
            conn = await raw(gw.url)
            await conn.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 1000\r\n\r\n{\"model\":")
            try:
                return await conn.closed_within(3.0)
            finally:
                conn.close()

        async def idle(data: bytes = b"") -> tuple[bytes, float]:
            conn = await raw(gw.url)
            await conn.send(data)
            try:
                return await conn.closed_within(3.0)
            finally:
                conn.close()

        results = await asyncio.gather(*(drip() for _ in range(5)), *(stall() for _ in range(5)),
                                       *(idle() for _ in range(3)), idle(b"\r\n\r\n\r\n"))
        for answer, took in results[:5]:
            assert answer.startswith(b"HTTP/1.1 408") and took < 2.0
        for answer, took in results[5:10]:
            assert answer.startswith(b"HTTP/1.1 408") or answer == b"", answer[:80]
            assert took < 2.0
        for answer, took in results[10:]:
            assert took < 2.0 and (answer == b"" or answer.startswith(b"HTTP/1.1 4"))
        assert w.seen == []  # nothing reached the worker
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:  # and the gateway still serves
            assert (await http.post("/v1/chat/completions", content=CHAT,
                                    headers={"content-type": "application/json"})).status_code == 200


@pytest.mark.parametrize("case", ["8 MB header", "100,000 headers", "a long request line"])
async def test_oversized_headers_get_431_and_are_never_forwarded(case: str) -> None:
    async with recording_worker() as w, running_gateway(workers=[{"id": "w", "url": w.url, "models": [MODEL]}],
                                                        server={**LIMITS, "header_timeout_s": 10.0}) as gw:
        conn = await raw(gw.url)
        if case == "8 MB header":
            head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (8 << 20) + b"\r\n"
        elif case == "100,000 headers":
            head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + b"".join(
                b"X-H%d: v\r\n" % i for i in range(100_000))
        else:
            head = b"POST /v1/chat/completions?" + b"q" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n"
        request = head + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(CHAT) + CHAT

        sender = asyncio.create_task(conn.send(request))
        try:
            answer, took = await conn.closed_within(10.0)
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            conn.close()
        assert answer.startswith(b"HTTP/1.1 431"), answer[:100]
        assert took < 5.0
        assert w.seen == []


async def test_connections_beyond_the_limit_are_closed_at_once() -> None:
    async with recording_worker() as w, running_gateway(workers=[{"id": "w", "url": w.url, "models": [MODEL]}],
                                                        server={**LIMITS, "max_connections": 4,
                                                                "keepalive_s": 30.0}) as gw:
        held = [await raw(gw.url) for _ in range(4)]
        conn = await raw(gw.url)
        answer, took = await conn.closed_within(2.0)
        assert answer == b"" and took < 1.0
        conn.close()
        for c in held:
            c.close()

        async def serves() -> bool:
            async with httpx.AsyncClient(base_url=gw.url, timeout=5) as http:
                with contextlib.suppress(httpx.HTTPError):
                    r = await http.post("/v1/chat/completions", content=CHAT,
                                        headers={"content-type": "application/json"})
                    return r.status_code == 200
            return False
        from tests.helpers import poll
        await poll(serves, 5, "the gateway to take connections again")
