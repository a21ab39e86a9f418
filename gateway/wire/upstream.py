"""The gateway's one HTTP/1.1 client to workers: pooled keep-alive connections, each request written in one
piece, responses parsed by httptools (llhttp, the parser uvicorn serves the gateway's own clients with).

It carries the relay's requests (the hot path) and everything else the gateway sends out: health checks,
/metrics scrapes, /v1/models discovery (gateway/fleet/registry.py) and the autoscaler's webhook (gateway/control/actuators.py),
so timeouts, TLS and header rules live here once. Why not aiohttp or httpx: a bare POST + read of a short
answer against bench/null_backend.py at concurrency 32, on uvloop, cost ~72 us of CPU per request through an
aiohttp session and ~12.5 us through this client (same process, interleaved, medians of 5; aiohttp was about
half of the gateway's whole per-request CPU, bench/profile_hotpath.py); httpx took 3.5-5 ms.

Settings (config `upstream:`, gateway/config/ UpstreamConfig; httpx's names where it has one):
- `max_connections` (all hosts) and `max_connections_per_host`: a request that finds neither an idle connection
  nor room for a new one waits, first come first served, at most `pool_timeout_s` (then `PoolTimeoutError`, a
  TimeoutError); idle connections to other hosts are closed to make room. None: no limit (the default);
- `keepalive_expiry_s`: an idle connection is not reused after this long;
- DNS: a host name is resolved (loop.getaddrinfo) once per `dns_cache_ttl_s` and its addresses tried in order;
  a failed connection drops the cached answer;
- TLS for `https://` workers (TlsSettings): `verify` (default on, system CAs), `ca_bundle` (a PEM file of CAs to
  trust instead), `client_cert` / `client_key` (certificate authentication to the worker).

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
import ipaddress
import logging
import math
import socket
import ssl
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

import httptools

log = logging.getLogger("fleetgate")

DEFAULT_CONTENT_TYPE = b"application/json"
# Idle pooled connections are dropped before the worker drops them: vLLM's API server runs uvicorn with a 5 s
# keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, vllm/envs.py), and a connection reused just as it expires
# is closed under the request.
KEEPALIVE_S = 4.0
DNS_TTL_S = 300.0
POOL_TIMEOUT_S = 10.0
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


class PoolTimeoutError(TimeoutError):
    """No connection to the worker became free within `pool_timeout_s` (the pool is at its limit)."""


# (host, port) -> [(address family, socket address)], as loop.getaddrinfo would give them
Resolver = Callable[[str, int], Awaitable[list[tuple[int, tuple]]]]


@dataclass(frozen=True, slots=True)
class TlsSettings:
    """How `https://` workers are checked and how the gateway proves itself to them."""

    verify: bool = True                 # check the worker's certificate and host name
    ca_bundle: str | None = None        # PEM file of CAs to trust (default: the system's)
    client_cert: str | None = None      # PEM certificate (chain) to present; may hold the key too
    client_key: str | None = None       # its private key when not in client_cert

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_bundle)
        if not self.verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.client_cert:
            ctx.load_cert_chain(self.client_cert, self.client_key)
        return ctx


@dataclass(slots=True)
class Response:
    """A whole response (UpstreamPool.fetch)."""

    status: int
    body: bytes
    content_type: bytes


@dataclass(frozen=True, slots=True)
class _Target:
    key: tuple[str, str, int]  # (scheme, host, port): the pool a connection to this URL belongs to
    host: str
    port: int
    tls: bool
    head: bytes  # POST request line, Host and the headers every request carries
    rest: bytes  # the same after the method: b" /path HTTP/1.1\r\nHost: ...", for other methods
    ip: bool     # host is an IP address literal (nothing to resolve)


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
                 "_last_io", "_got_bytes", "fresh", "on_silence")

    def __init__(self, pool: UpstreamPool, key: tuple[str, str, int], loop: asyncio.AbstractEventLoop) -> None:
        self._pool = pool
        self._key = key
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.busy = False
        self.idle_at = 0.0
        self.fresh = True  # not yet reused from the idle set
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
        # Asked when the read timeout passes: (seconds silent) -> more seconds to wait, or None to give up. The
        # relay's stall rule: a silence past the pace is not always a stall (policies/pace.py FleetPace.judge).
        self.on_silence: Callable[[float], float | None] | None = None

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
            more = self._more_time(now - self._last_io)
            if more is None:
                self._fail(ServerTimeoutError("Timeout on reading data from socket"))
            else:
                self._timer = self._loop.call_at(now + more, self._on_timer)
        else:
            at = self._last_io + self._read_timeout
            if not self._headers_done:
                at = min(at, self._headers_deadline)
            self._timer = self._loop.call_at(at, self._on_timer)

    def _more_time(self, silent_s: float) -> float | None:
        judge = self.on_silence
        if judge is None:
            return None
        try:
            more = judge(silent_s)
        except Exception:   # noqa: BLE001 - a timer callback must not raise; give the exchange up as before
            log.exception("stall judge failed")
            return None
        return None if more is None or not more > 0 else min(more, 3600.0)

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

    def set_read_timeout(self, seconds: float) -> None:
        """From now on, wait at most `seconds` for each next bytes of the response (a stream's pace changes after
        its first token); the timer is brought forward when the new limit ends earlier."""
        self._read_timeout = seconds
        if self._timer is not None and self._last_io + seconds < self._timer.when():
            self._timer.cancel()
            self._timer = self._loop.call_at(self._last_io + seconds, self._on_timer)

    def abort(self, reason: str) -> None:
        """Give up waiting on this worker (it is suspected hung): the reader gets a ServerTimeoutError."""
        if self.busy and not self._complete and self._error is None:
            self._fail(ServerTimeoutError(reason))

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
    """Keep-alive connections per (scheme, host, port), reused last-in first-out, within the limits set."""

    def __init__(self, connect_s: float, keepalive_s: float = KEEPALIVE_S, *, max_connections: int | None = None,
                 max_connections_per_host: int | None = None, pool_timeout_s: float = POOL_TIMEOUT_S,
                 dns_ttl_s: float = DNS_TTL_S, tls: TlsSettings | None = None, resolver: Resolver | None = None) -> None:
        self.connect_s = connect_s
        self.keepalive_s = keepalive_s
        self.max_connections = max_connections
        self.max_per_host = max_connections_per_host
        self.pool_timeout_s = pool_timeout_s
        self.dns_ttl_s = dns_ttl_s
        self.tls = tls or TlsSettings()
        self._resolve = resolver or _getaddrinfo
        self._limited = max_connections is not None or max_connections_per_host is not None
        self._idle: dict[tuple[str, str, int], list[UpstreamConnection]] = {}
        self._all: set[UpstreamConnection] = set()
        self._open: dict[tuple[str, str, int], int] = {}   # connections open or opening, per host
        self._open_total = 0
        self._waiters: dict[tuple[str, str, int], deque[asyncio.Future]] = {}
        self._dns: dict[tuple[str, int], tuple[float, list[tuple[int, tuple]]]] = {}
        self._targets: dict[str, _Target] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    async def request(self, url: str, headers: bytes, body: bytes, read_timeout: float,
                      headers_timeout: float | None = None, stream: bool = False,
                      method: bytes = b"POST", track: set[UpstreamConnection] | None = None) -> UpstreamConnection:
        """Send `body` to `url` with `headers` (encoded lines, see encode_headers) and wait for the response
        headers. The caller must end the exchange with `release()` (response read to its end) or `close()`.
        `track`: the connection carrying the exchange is added to it (so it can be aborted from outside)."""
        t = self._targets.get(url)
        if t is None:
            t = self._target(url)
        conn = self._take_idle(t.key)
        reused = conn is not None
        if conn is None:
            conn = await self._connect(t) if not self._limited else await self._checkout(t)
            reused = not conn.fresh
        if method == b"POST":
            message = b"".join((t.head, headers, b"Content-Length: %d\r\n\r\n" % len(body), body))
        elif body:
            message = b"".join((method, t.rest, headers, b"Content-Length: %d\r\n\r\n" % len(body), body))
        else:
            message = b"".join((method, t.rest, headers, b"\r\n"))
        while True:
            if track is not None:
                track.add(conn)
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
            conn = await self._connect(t) if not self._limited else await self._checkout(t)

    async def fetch(self, url: str, timeout_s: float, method: bytes = b"GET", body: bytes = b"",
                    headers: bytes = b"Accept: */*\r\n") -> Response:
        """One whole exchange within `timeout_s` (connecting included): for health checks, scrapes, discovery
        and webhooks. Raises TimeoutError or OSError (ConnectionError) as `request` does."""
        conn: UpstreamConnection | None = None
        try:
            async with asyncio.timeout(timeout_s):
                conn = await self.request(url, headers, body, timeout_s, method=method)
                data = await conn.read()
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        response = Response(conn.status, data, conn.content_type or DEFAULT_CONTENT_TYPE)
        conn.release()
        return response

    def idle_connections(self, url: str) -> int:
        """Idle connections to `url`'s host that a request could still reuse (open and not yet expired)."""
        now = asyncio.get_running_loop().time()
        return sum(1 for c in self._idle.get(self._target(url).key, ())
                   if not c.closed and not c.transport.is_closing() and now - c.idle_at <= self.keepalive_s)

    def open_connections(self, url: str | None = None) -> int:
        """Connections open or being opened, to `url`'s host or to all hosts."""
        return self._open_total if url is None else self._open.get(self._target(url).key, 0)

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._all):
            conn.close()
        self._all.clear()
        self._idle.clear()
        for waiters in self._waiters.values():
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

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
            conn.fresh = False
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
        if self._waiters:
            self._wake(conn._key)

    def _forget(self, conn: UpstreamConnection) -> None:
        if conn in self._all:
            self._all.discard(conn)
            self._free_slot(conn._key)
        idle = self._idle.get(conn._key)
        if idle and conn in idle:
            idle.remove(conn)

    # --- limits ------------------------------------------------------------------------------------------------
    def _room(self, key: tuple[str, str, int]) -> bool:
        """Whether a new connection to `key` may open now; closes an idle connection to another host when
        only the total limit is in the way."""
        if self.max_per_host is not None and self._open.get(key, 0) >= self.max_per_host:
            return False
        if self.max_connections is None or self._open_total < self.max_connections:
            return True
        for other, idle in self._idle.items():
            if other != key and idle:
                idle[0].close()  # the least recently used; frees its slot
                return self._open_total < self.max_connections
        return False

    async def _checkout(self, t: _Target) -> UpstreamConnection:
        """An idle connection or a new one, waiting (FIFO per host) while the limits allow neither."""
        if self._room(t.key):
            return await self._connect(t)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.pool_timeout_s
        waiters = self._waiters.setdefault(t.key, deque())
        first = True
        while True:
            fut = loop.create_future()
            (waiters.append if first else waiters.appendleft)(fut)  # woken and beaten to it: stays first in line
            first = False
            try:
                async with asyncio.timeout_at(deadline):
                    await fut
            except TimeoutError:
                raise PoolTimeoutError(f"no connection to {t.host}:{t.port} free within {self.pool_timeout_s:g} s "
                                       f"(max_connections {self.max_connections}, per host "
                                       f"{self.max_per_host})") from None
            except BaseException:
                if fut.done() and not fut.cancelled():
                    self._wake(t.key)  # pass the wake-up on: another waiter may use it
                raise
            finally:
                with contextlib.suppress(ValueError):
                    waiters.remove(fut)
            if self._closed:
                raise ClientConnectorError("the upstream pool is closed")
            conn = self._take_idle(t.key)
            if conn is not None:
                return conn
            if self._room(t.key):
                return await self._connect(t)

    def _wake(self, key: tuple[str, str, int]) -> None:
        """Wake the first waiter for `key`; if there is none and a slot of the total is free, one of another host."""
        waiters = self._waiters.get(key)
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        for waiters in self._waiters.values():
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_result(None)
                    return

    def _free_slot(self, key: tuple[str, str, int]) -> None:
        n = self._open.get(key, 0) - 1
        if n > 0:
            self._open[key] = n
        else:
            self._open.pop(key, None)
        self._open_total -= 1
        if self._waiters:
            self._wake(key)

    # --- opening a connection -------------------------------------------------------------------------------------
    async def _connect(self, t: _Target) -> UpstreamConnection:
        if self._closed:
            raise ClientConnectorError("the upstream pool is closed")
        self._open[t.key] = self._open.get(t.key, 0) + 1   # the slot is taken while connecting
        self._open_total += 1
        try:
            conn = await self._open_connection(t)
        except BaseException:
            self._free_slot(t.key)
            raise
        self._all.add(conn)
        return conn

    async def _open_connection(self, t: _Target) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        tls = None
        if t.tls:
            if self._ssl is None:
                self._ssl = self.tls.context()
            tls = self._ssl
        last: OSError | None = None
        try:
            async with asyncio.timeout(self.connect_s):
                addresses = [(0, (t.host, t.port))] if t.ip else await self._addresses(t.host, t.port)
                for family, sockaddr in addresses:
                    try:
                        _, conn = await loop.create_connection(
                            lambda: UpstreamConnection(self, t.key, loop), sockaddr[0], sockaddr[1], family=family,
                            ssl=tls, server_hostname=t.host if tls else None)
                        break
                    except ssl.SSLError:
                        raise
                    except OSError as e:
                        last = e
                else:
                    raise last or OSError(f"no address for {t.host}")
        except TimeoutError:
            self._dns.pop((t.host, t.port), None)
            raise ServerTimeoutError(f"Connection timeout to host {t.host}:{t.port}") from None
        except OSError as e:
            self._dns.pop((t.host, t.port), None)
            raise ClientConnectorError(f"Cannot connect to host {t.host}:{t.port} ssl:{'default' if tls else False} "
                                       f"[{getattr(e, 'strerror', None) or e}]") from None
        sock = conn.transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    async def _addresses(self, host: str, port: int) -> list[tuple[int, tuple]]:
        """The host's addresses, from the cache while its answer is younger than dns_ttl_s."""
        now = asyncio.get_running_loop().time()
        hit = self._dns.get((host, port))
        if hit is not None and hit[0] > now:
            return hit[1]
        addresses = await self._resolve(host, port)
        if not addresses:
            raise OSError(f"no address for {host}")
        if self.dns_ttl_s > 0:
            if len(self._dns) > 4096:
                self._dns.clear()
            self._dns[(host, port)] = (now + self.dns_ttl_s, addresses)
        return addresses

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
        rest = f" {target} HTTP/1.1\r\nHost: {netloc}\r\nAccept-Encoding: identity\r\n".encode("ascii")
        try:
            ipaddress.ip_address(host)
            ip = True
        except ValueError:
            ip = False
        t = _Target((parts.scheme, host, port or default), host, port or default, parts.scheme == "https",
                    b"POST" + rest, rest, ip)
        if len(self._targets) > 4096:  # worker URLs come and go through the admin API
            self._targets.clear()
        self._targets[url] = t
        return t


async def _getaddrinfo(host: str, port: int) -> list[tuple[int, tuple]]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out: list[tuple[int, tuple]] = []
    for family, _, _, _, sockaddr in infos:
        if (family, sockaddr) not in out:
            out.append((family, sockaddr))
    return out


__all__ = ["ClientConnectorError", "ClientPayloadError", "PoolTimeoutError", "Response", "ServerDisconnectedError",
           "ServerTimeoutError", "TlsSettings", "UpstreamConnection", "UpstreamPool", "encode_headers", "header_pairs"]
