"""The upstream client's settings (config `upstream:`): connection limits with a queue of waiters and a pool
timeout, keep-alive expiry, the DNS cache, whole exchanges for the control loops (`fetch`), and that the
gateway builds its one client from the config. Real sockets on 127.0.0.1; TLS is in test_upstream_tls.py."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from gateway.config import load_config
from gateway.pipeline.relay import make_upstream_pool
from gateway.wire.upstream import ClientConnectorError, PoolTimeoutError, encode_headers
from tests.helpers import free_port, poll
from tests.test_upstream import ScriptedServer, answer, echo, pool


class Gate:
    """A worker whose answers wait until the test lets them go, one `release()` per answer."""

    def __init__(self) -> None:
        self.waiting = 0
        self._go: asyncio.Queue[None] = asyncio.Queue()

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self._go.put_nowait(None)

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
        self.waiting += 1
        await self._go.get()
        self.waiting -= 1
        writer.write(answer(b"{}"))
        await writer.drain()


async def exchange(p, url: str, body: bytes = b"{}") -> bytes:  # noqa: ANN001
    conn = await p.request(url, b"", body, 10.0)
    data = await conn.read()
    conn.release()
    return data


# --- connection limits ------------------------------------------------------------------------------------
async def test_per_host_limit_queues_requests_on_the_connections_it_has() -> None:
    gate = Gate()
    async with ScriptedServer(gate) as srv, pool(max_connections_per_host=2) as p:
        tasks = [asyncio.create_task(exchange(p, srv.url)) for _ in range(5)]
        await poll(lambda: gate.waiting == 2, what="two requests at the worker")
        assert p.open_connections(srv.url) == 2 and not any(t.done() for t in tasks)
        gate.release(5)
        assert await asyncio.gather(*tasks) == [b"{}"] * 5
        assert srv.connections == 2 and len(srv.requests) == 5  # the three waiters reused the two connections


async def test_total_limit_spans_hosts_and_idle_connections_make_room() -> None:
    gate = Gate()
    async with ScriptedServer(gate) as a, ScriptedServer(echo) as b, pool(max_connections=2) as p:
        held = [asyncio.create_task(exchange(p, a.url)) for _ in range(2)]
        await poll(lambda: gate.waiting == 2, what="host A holding both connections")
        to_b = asyncio.create_task(exchange(p, b.url))
        await poll(lambda: p.open_connections() == 2 and not to_b.done(), what="B waiting at the total limit")
        gate.release(2)
        await asyncio.gather(*held)
        assert await to_b == b'{"echo":{}}'
        # A's idle connection is closed to make room when B needs a second connection and the total is reached
        assert p.open_connections() == 2 and p.idle_connections(a.url) == 1
        b2 = [asyncio.create_task(exchange(p, b.url)) for _ in range(2)]
        assert await asyncio.gather(*b2) == [b'{"echo":{}}'] * 2
        assert p.idle_connections(a.url) == 0 and p.open_connections() <= 2


async def test_a_request_waits_at_most_pool_timeout() -> None:
    gate = Gate()
    async with ScriptedServer(gate) as srv, pool(max_connections=1, pool_timeout_s=0.2) as p:
        held = asyncio.create_task(exchange(p, srv.url))
        await poll(lambda: gate.waiting == 1, what="the one connection busy")
        t0 = time.monotonic()
        with pytest.raises(PoolTimeoutError) as e:
            await exchange(p, srv.url)
        assert isinstance(e.value, TimeoutError) and time.monotonic() - t0 >= 0.2
        assert "max_connections 1" in str(e.value)
        gate.release(2)
        assert await held == b"{}"
        assert await exchange(p, srv.url) == b"{}"  # nothing leaked: the slot is usable again


async def test_a_cancelled_waiter_does_not_swallow_the_wake_up() -> None:
    gate = Gate()
    async with ScriptedServer(gate) as srv, pool(max_connections_per_host=1) as p:
        held = asyncio.create_task(exchange(p, srv.url))
        await poll(lambda: gate.waiting == 1, what="the one connection busy")
        first = asyncio.create_task(exchange(p, srv.url))
        second = asyncio.create_task(exchange(p, srv.url))
        await poll(lambda: len(p._waiters.get(p._target(srv.url).key, ())) == 2, what="two waiters")
        first.cancel()
        gate.release(2)
        assert await held == b"{}" and await second == b"{}"
        assert first.cancelled()


# --- keep-alive expiry -------------------------------------------------------------------------------------
async def test_keepalive_expiry_from_the_config() -> None:
    cfg = load_config(None, upstream={"keepalive_expiry_s": 0.1, "max_connections": 3,
                                      "max_connections_per_host": 2, "pool_timeout_s": 1.5, "dns_cache_ttl_s": 7})
    p = make_upstream_pool(cfg)
    try:
        assert (p.keepalive_s, p.max_connections, p.max_per_host, p.pool_timeout_s, p.dns_ttl_s) == (
            0.1, 3, 2, 1.5, 7)
        async with ScriptedServer(echo) as srv:
            await exchange(p, srv.url)
            assert p.idle_connections(srv.url) == 1
            await poll(lambda: p.idle_connections(srv.url) == 0, what="the idle connection to expire")
            await exchange(p, srv.url)
            assert srv.connections == 2
    finally:
        await p.close()


# --- DNS cache ---------------------------------------------------------------------------------------------
class CountingResolver:
    """Resolves every name to the given addresses and counts the lookups."""

    def __init__(self, *ports: int) -> None:
        self.ports = ports
        self.calls: list[str] = []

    async def __call__(self, host: str, port: int) -> list[tuple[int, tuple]]:
        self.calls.append(host)
        return [(socket.AF_INET, ("127.0.0.1", p)) for p in (self.ports or (port,))]


async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
    writer.write(answer(b"{}", extra=b"connection: close\r\n"))
    await writer.drain()
    writer.close()


async def test_a_name_is_resolved_once_per_ttl_and_sent_as_host() -> None:
    resolver = CountingResolver()
    async with ScriptedServer(closing) as srv, pool(dns_ttl_s=0.3, resolver=resolver) as p:
        port = srv.url.split(":")[2].split("/")[0]
        url = f"http://worker.test:{port}/v1/chat/completions"
        for _ in range(3):
            assert await exchange(p, url) == b"{}"
        assert srv.connections == 3 and resolver.calls == ["worker.test"]
        assert b"Host: worker.test:" + port.encode() in srv.requests[0]
        t0 = time.monotonic()
        await poll(lambda: time.monotonic() - t0 > 0.3, what="the cached answer to age past its TTL")
        await exchange(p, url)
        assert resolver.calls == ["worker.test", "worker.test"]


async def test_addresses_are_tried_in_order_and_a_failure_drops_the_cached_answer() -> None:
    dead = free_port()
    async with ScriptedServer(echo) as srv:
        live = int(srv.url.split(":")[2].split("/")[0])
        resolver = CountingResolver(dead, live)
        async with pool(resolver=resolver) as p:
            assert await exchange(p, f"http://worker.test:{live}/x") == b'{"echo":{}}'  # the dead one first
        only_dead = CountingResolver(dead)
        async with pool(resolver=only_dead) as p:
            for _ in range(2):
                with pytest.raises(ClientConnectorError):
                    await exchange(p, f"http://worker.test:{live}/x")
            assert only_dead.calls == ["worker.test", "worker.test"]  # not cached after the failure


async def test_the_system_resolver_is_the_default() -> None:
    async with ScriptedServer(echo) as srv, pool() as p:
        port = srv.url.split(":")[2].split("/")[0]
        try:
            socket.getaddrinfo("localhost", int(port), type=socket.SOCK_STREAM)
        except OSError:
            pytest.skip("no resolver for localhost on this machine")
        assert await exchange(p, f"http://localhost:{port}/x") == b'{"echo":{}}'


# --- fetch: the control loops' whole exchanges ----------------------------------------------------------------
async def test_fetch_sends_a_plain_get_and_bounds_the_whole_exchange() -> None:
    async with ScriptedServer(echo) as srv, pool() as p:
        r = await p.fetch(srv.url.replace("/v1/chat/completions", "/metrics"), 2.0)
        assert (r.status, r.body, r.content_type) == (200, b'{"echo":}', b"application/json")
        head = srv.requests[0].split(b"\r\n")
        assert head[0] == b"GET /metrics HTTP/1.1" and not any(h.lower().startswith(b"content-length")
                                                               for h in head)
        r = await p.fetch(srv.url, 2.0, b"POST", b"[1]", encode_headers([("Content-Type", "application/json")]))
        assert r.body == b'{"echo":[1]}' and b"Content-Length: 3" in srv.requests[1]
    gate = Gate()
    async with ScriptedServer(gate) as srv, pool() as p:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await p.fetch(srv.url, 0.2)
        assert 0.2 <= time.monotonic() - t0 < 2.0 and p.open_connections() == 0  # given up and closed
        gate.release()
