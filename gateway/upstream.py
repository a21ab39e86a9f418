"""The relay's upstream HTTP/1.1 client: pooled keep-alive connections, each request written in one piece,
responses parsed by httptools (llhttp, the parser uvicorn serves the gateway's own clients with).

Why not aiohttp on this path: a bare POST + read of a short answer against bench/null_backend.py at concurrency
32, on uvloop, cost ~72 us of CPU per request through an aiohttp session and ~12.5 us through this client (same
process, interleaved, medians of 5; aiohttp was about half of the gateway's whole per-request CPU,
bench/profile_hotpath.py). aiohttp stays the client for everything off the hot path (health checks, /metrics
scrapes, P/D prefill legs, webhooks).

Behaviour the relay relies on (the same as the aiohttp session it replaced there):
- opening a connection is bounded by `connect_s` (`ServerTimeoutError`, a TimeoutError); a connection that
  cannot be opened raises `ClientConnectorError` (a ConnectionError, so an OSError);
- `read_timeout_s` bounds every wait for more bytes of the response from the moment the request is written
  (aiohttp's sock_read), except while reading is paused because the consumer is behind; `headers_timeout_s`,
  when given, bounds the wait for the status line and headers as a whole;
- a connection closed by the worker before the response headers raises `ServerDisconnectedError`, one closed
  mid-body `ClientPayloadError`; bytes received before the break are still handed out first;
- a connection is reused only after a complete response that allows keep-alive, never after `keepalive_s`
  idle, and never once the worker closed it; a response given up before its end closes its connection, so
  the engine sees the disconnect and aborts the request;
- a reused connection can still be closed by the worker while the request is on its way (the worker's idle
  timer fired first, so it never read the request): when it ends before a single byte of response, the
  request is sent once more, on a new connection (as Go's net/http does for a server-closed idle connection).
  A fresh connection's failure, or one after any byte, is raised as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import ssl
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

import httptools

DEFAULT_CONTENT_TYPE = b"application/json"
# Idle pooled connections are dropped before the worker drops them: vLLM's API server runs uvicorn with a 5 s
# keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, vllm/envs.py), and a connection reused just as it expires
# is closed under the request.
KEEPALIVE_S = 4.0
_HIGH_WATER = 1 << 16  # buffered stream bytes at which reading pauses until the consumer catches up
_TARGET_SAFE = "/%:@!$&'()*+,;=-._~?"  # kept as is in a request target (RFC 3986 pchar, "/" and "?"; escapes kept)


class ClientConnectorError(ConnectionError):
    """No connection to the worker could be opened."""


class ServerDisconnectedError(ConnectionError):
    """The worker closed the connection before the response headers were complete."""


class ClientPayloadError(ConnectionError):
    """The response was cut short, or is not valid HTTP/1.1."""


class ServerTimeoutError(TimeoutError):
    """The worker did not accept the connection or send the response's next bytes in time."""


@dataclass(frozen=True, slots=True)
class _Target:
    key: tuple[str, str, int]  # (scheme, host, port): the pool a connection to this URL belongs to
    host: str
    port: int
    tls: bool
    head: bytes  # request line, Host and the headers every request carries


def encode_headers(headers: list[tuple[str, str]]) -> bytes:
    """`Name: value\\r\\n` lines of extra request headers, plus `Accept: */*` unless one is given (as aiohttp).
    Lines with CR or LF in them are dropped (they could smuggle a header)."""
    lines = []
    accept = False
    for k, v in headers:
        if "\r" in k or "\n" in k or "\r" in v or "\n" in v:
            continue
        accept = accept or k.lower() == "accept"
        lines.append(f"{k}: {v}\r\n")
    if not accept:
        lines.append("Accept: */*\r\n")
    return "".join(lines).encode("latin-1", "replace")


def header_pairs(block: bytes) -> list[tuple[str, str]]:
    """Encoded header lines back to (name, value) pairs (for an aiohttp call such as gateway/pd.py's prefill leg)."""
    out = []
    for line in block.decode("latin-1").split("\r\n"):
        if line:
            name, _, value = line.partition(": ")
            out.append((name, value))
    return out


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection carrying one exchange at a time; between `UpstreamPool.request` and
    `release()` / `close()` it is also the response: `status`, `content_type`, `read()`, `read_some()`."""

    __slots__ = ("_pool", "_key", "_loop", "transport", "_parser", "closed", "busy", "idle_at", "status",
                 "content_type", "_headers_done", "_complete", "_keep", "_until_eof", "_chunks", "_buffered",
                 "_error", "_waiter", "_wake_on_data", "_paused", "_timer", "_read_timeout", "_headers_deadline",
                 "_last_io", "_got_bytes")

    def __init__(self, pool: UpstreamPool, key: tuple[str, str, int], loop: asyncio.AbstractEventLoop) -> None:
        self._pool = pool
        self._key = key
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.busy = False
        self.idle_at = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.content_type: bytes | None = None  # the first Content-Type header (as aiohttp's headers.get)
        self._headers_done = self._complete = self._until_eof = self._paused = self._wake_on_data = False
        self._got_bytes = False  # any byte of this exchange's response arrived
        self._keep = True
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    # --- asyncio.Protocol -------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # nothing was asked: a confused or hostile peer
            self.transport.close()
            return
        self._last_io = self._loop.time()
        self._got_bytes = True
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            self._fail(ClientPayloadError(f"invalid HTTP response: {e}"))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool._forget(self)
        if not self.busy or self._complete or self._error is not None:
            return
        if self._headers_done and self._until_eof:  # a body delimited by the end of the connection
            self._complete = True
            self._keep = False
            self._cancel_timer()
            self._wake()
        elif self._headers_done:
            self._fail(ClientPayloadError("Response payload is not completed"))
        else:
            self._fail(ServerDisconnectedError("Server disconnected"))

    def pause_writing(self) -> None:  # a body larger than the socket buffer: the transport buffers it
        pass

    def resume_writing(self) -> None:
        pass

    # --- httptools callbacks ------------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        n = len(name)
        if n == 12 and self.content_type is None and name.lower() == b"content-type":
            self.content_type = value
        elif (n == 14 and name.lower() == b"content-length") or (n == 17 and name.lower() == b"transfer-encoding"):
            self._until_eof = False  # set back to True in on_headers_complete only when neither came

    def on_headers_complete(self) -> None:
        if self._complete:  # bytes after the end of our response: do not reuse this connection
            self._keep = False
            return
        self.status = self._parser.get_status_code()
        if self.content_type is None:
            self.content_type = DEFAULT_CONTENT_TYPE
        self._headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self._complete:
            self._keep = False
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if self._wake_on_data:
            if self._buffered > _HIGH_WATER and not self._paused:
                self._paused = True
                self.transport.pause_reading()
            self._wake()

    def on_message_complete(self) -> None:
        if self._complete:
            self._keep = False
            return
        if self.status < 200:  # an interim 1xx answer: the real one follows
            self._headers_done = False
            self._until_eof = True
            self.content_type = None
            return
        self._complete = True
        self._keep = self._keep and self._parser.should_keep_alive()
        self._cancel_timer()
        self._wake()

    # --- the exchange ----------------------------------------------------------------------------------------
    def _begin(self, read_timeout: float, headers_timeout: float | None, stream: bool) -> None:
        self.busy = True
        self._wake_on_data = stream
        self._until_eof = True  # until a Content-Length or Transfer-Encoding header says otherwise
        now = self._last_io = self._loop.time()
        self._read_timeout = read_timeout
        self._headers_deadline = now + headers_timeout if headers_timeout is not None else math.inf
        self._timer = self._loop.call_at(min(now + read_timeout, self._headers_deadline), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if not self.busy or self._complete or self._error is not None:
            return
        now = self._loop.time()
        if not self._headers_done and now >= self._headers_deadline:
            self._fail(ServerTimeoutError("no response headers in time"))
        elif self._paused:  # the consumer is behind, not the worker
            self._timer = self._loop.call_at(now + self._read_timeout, self._on_timer)
        elif now - self._last_io >= self._read_timeout:
            self._fail(ServerTimeoutError("Timeout on reading data from socket"))
        else:
            at = self._last_io + self._read_timeout
            if not self._headers_done:
                at = min(at, self._headers_deadline)
            self._timer = self._loop.call_at(at, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fail(self, err: BaseException) -> None:
        self._error = err
        self._keep = False
        self._cancel_timer()
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    async def _wait(self) -> None:
        w = self._waiter = self._loop.create_future()
        try:
            await w
        finally:
            self._waiter = None

    async def _wait_headers(self) -> None:
        while not self._headers_done and self._error is None:
            await self._wait()
        if self._error is not None:
            raise self._error

    async def read(self) -> bytes:
        """The whole response body."""
        while not self._complete:
            if self._error is not None:
                raise self._error
            await self._wait()
        chunks = self._chunks
        self._chunks = []
        self._buffered = 0
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def read_some(self) -> bytes:
        """Whatever body bytes arrived since the last call (waiting for some); b"" once the body is complete."""
        if not self._chunks:
            if self._complete:
                return b""
            if self._error is None:
                await self._wait()
            if not self._chunks:
                if self._error is not None:
                    raise self._error
                return b""
        chunks = self._chunks
        self._chunks = []
        self._buffered = 0
        if self._paused:
            self._paused = False
            self.transport.resume_reading()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def release(self) -> None:
        """The exchange is over: back to the pool when the response ended cleanly and allows reuse, else closed."""
        if not self.busy:
            return
        if self._complete and self._keep and not self.closed and not self._chunks:
            self.busy = False
            self._cancel_timer()
            self._reset()
            self._pool._put_idle(self)
        else:
            self.close()

    def close(self) -> None:
        """Give up the exchange and the connection (the worker sees a disconnect)."""
        self.busy = False
        self._cancel_timer()
        self._keep = False
        if self._paused:
            self._paused = False
            with contextlib.suppress(Exception):
                self.transport.resume_reading()
        if not self.closed:
            self.closed = True
            self.transport.close()
        self._pool._forget(self)


class UpstreamPool:
    """Keep-alive connections per (scheme, host, port), reused last-in first-out; no limit on their number."""

    def __init__(self, connect_s: float, keepalive_s: float = KEEPALIVE_S) -> None:
        self.connect_s = connect_s
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, str, int], list[UpstreamConnection]] = {}
        self._all: set[UpstreamConnection] = set()
        self._targets: dict[str, _Target] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    async def request(self, url: str, headers: bytes, body: bytes, read_timeout: float,
                      headers_timeout: float | None = None, stream: bool = False) -> UpstreamConnection:
        """POST `body` to `url` with `headers` (encoded lines, see encode_headers) and wait for the response
        headers. The caller must end the exchange with `release()` (response read to its end) or `close()`."""
        t = self._targets.get(url)
        if t is None:
            t = self._target(url)
        conn = self._take_idle(t.key)
        reused = conn is not None
        if conn is None:
            conn = await self._connect(t)
        message = b"".join((t.head, headers, b"Content-Length: %d\r\n\r\n" % len(body), body))
        while True:
            conn._begin(read_timeout, headers_timeout, stream)
            conn.transport.write(message)
            try:
                await conn._wait_headers()
                return conn
            except ServerDisconnectedError:
                conn.close()
                if not reused or conn._got_bytes:
                    raise
            except BaseException:
                conn.close()
                raise
            reused = False  # the worker closed an idle connection under the request: once more, on a new one
            conn = await self._connect(t)

    def idle_connections(self, url: str) -> int:
        """Idle connections to `url`'s host that a request could still reuse (open and not yet expired)."""
        now = asyncio.get_running_loop().time()
        return sum(1 for c in self._idle.get(self._target(url).key, ())
                   if not c.closed and not c.transport.is_closing() and now - c.idle_at <= self.keepalive_s)

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._all):
            conn.close()
        self._all.clear()
        self._idle.clear()

    # --- connections -----------------------------------------------------------------------------------------
    def _take_idle(self, key: tuple[str, str, int]) -> UpstreamConnection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport.is_closing():
                continue
            if conn._loop.time() - conn.idle_at > self.keepalive_s:
                conn.close()
                continue
            return conn
        return None

    def _put_idle(self, conn: UpstreamConnection) -> None:
        if self._closed:
            conn.close()
            return
        conn.idle_at = conn._loop.time()
        idle = self._idle.get(conn._key)
        if idle is None:
            idle = self._idle[conn._key] = []
        idle.append(conn)

    def _forget(self, conn: UpstreamConnection) -> None:
        self._all.discard(conn)
        idle = self._idle.get(conn._key)
        if idle and conn in idle:
            idle.remove(conn)

    async def _connect(self, t: _Target) -> UpstreamConnection:
        if self._closed:
            raise ClientConnectorError("the upstream pool is closed")
        loop = asyncio.get_running_loop()
        tls = None
        if t.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = self._ssl
        try:
            async with asyncio.timeout(self.connect_s):
                _, conn = await loop.create_connection(lambda: UpstreamConnection(self, t.key, loop), t.host, t.port,
                                                       ssl=tls, server_hostname=t.host if tls else None)
        except TimeoutError:
            raise ServerTimeoutError(f"Connection timeout to host {t.host}:{t.port}") from None
        except OSError as e:
            raise ClientConnectorError(f"Cannot connect to host {t.host}:{t.port} ssl:{'default' if tls else False} "
                                       f"[{e.strerror or e}]") from None
        sock = conn.transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._all.add(conn)
        return conn

    def _target(self, url: str) -> _Target:
        try:
            parts = urlsplit(url)
            host, port = parts.hostname, parts.port
            if parts.scheme not in ("http", "https") or not host:
                raise ValueError("expected http(s)://host[:port]/path")
            if not host.isascii():
                host = host.encode("idna").decode("ascii")
        except (ValueError, UnicodeError) as e:
            raise ClientConnectorError(f"invalid worker URL {url!r}: {e}") from None
        default = 443 if parts.scheme == "https" else 80
        netloc = f"[{host}]" if ":" in host else host
        if port is not None and port != default:
            netloc += f":{port}"
        target = quote(parts.path or "/", safe=_TARGET_SAFE) + (f"?{quote(parts.query, safe=_TARGET_SAFE)}"
                                                                 if parts.query else "")
        head = f"POST {target} HTTP/1.1\r\nHost: {netloc}\r\nAccept-Encoding: identity\r\n".encode("ascii")
        t = _Target((parts.scheme, host, port or default), host, port or default, parts.scheme == "https", head)
        if len(self._targets) > 4096:  # worker URLs come and go through the admin API
            self._targets.clear()
        self._targets[url] = t
        return t

__all__ = ["ClientConnectorError", "ClientPayloadError", "ServerDisconnectedError", "ServerTimeoutError",
           "UpstreamConnection", "UpstreamPool", "encode_headers", "header_pairs"]
