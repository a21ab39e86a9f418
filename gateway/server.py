"""Run the gateway: `fleetgate serve` (run_serve) and an in-process server for tests and the demo.

uvicorn with uvloop and httptools, access log off. The listening socket is bound here, so port 0
works: the actual address is printed as `fleetgate listening on http://HOST:PORT` once the gateway
is ready (scripts and tests read that line).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import logging
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import uvicorn

from gateway.app import FleetgateApp, create_app
from gateway.config import ConfigError, GatewayConfig, check_worker_url, load_config
from gateway.core import Gateway
from gateway.ops.fd_limit import check_fd_limit
from gateway.ops.logs import setup_logging_from
from gateway.state.base import StateStore
from gateway.wire.client_limits import ClientLimits, protocol_factory

log = logging.getLogger("fleetgate")


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio's selector loop sets TCP_NODELAY on accepted sockets only when
    # the listening socket says TCP explicitly; with proto 0 Nagle + delayed ACK add ~40 ms per response.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _uvicorn_config(app: FleetgateApp) -> uvicorn.Config:
    # lifespan off: the gateway is started before uvicorn and stopped after it, so start-up errors
    # (Redis unreachable...) come out as one clear message instead of uvicorn's traceback.
    # http: uvicorn's httptools protocol with bounds on header/body time, header size and connections.
    sc = app.gateway.config.server
    limits = ClientLimits(sc.header_timeout_s, sc.body_timeout_s, sc.keepalive_s, sc.max_header_bytes,
                          sc.max_headers, sc.max_connections)
    return uvicorn.Config(app, http=protocol_factory(limits), loop="none", lifespan="off", access_log=False,
                          log_level="warning", timeout_graceful_shutdown=AFTER_DRAIN_S, server_header=False,
                          date_header=False, timeout_keep_alive=sc.keepalive_s, limit_concurrency=sc.max_connections,
                          proxy_headers=False)  # X-Forwarded-For is gateway/wire/forwarding.py's (trusted_proxies)


AFTER_DRAIN_S = 5.0  # uvicorn's own shutdown, once the drain is over: only idle connections are left to close


class _DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM or SIGINT drains the gateway (gateway/pipeline/drain.py) before uvicorn's own shutdown:
    the listening socket stays open to answer 503 meanwhile. A second signal ends at once, as in uvicorn.
    The signal is not re-raised after the shutdown (uvicorn does so), so a drained gateway exits 0."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.loop = asyncio.get_running_loop()
        self._draining: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: object) -> None:
        if self._draining is not None or self.should_exit:
            self.should_exit = self.force_exit = True
            return
        self.loop.call_soon_threadsafe(self._begin_drain, sig)

    def _begin_drain(self, sig: int) -> None:
        if self._draining is None:
            self._draining = self.loop.create_task(self._drain(sig), name="fleetgate-drain")

    async def _drain(self, sig: int) -> None:
        drain = self.gateway.drain
        timeout = self.gateway.config.server.drain_timeout_s
        drain.begin()
        log.warning("%s: draining: %d request(s) in flight, up to %g s (server.drain_timeout_s)",
                    signal.Signals(sig).name, drain.inflight, timeout)
        try:
            left = await drain.wait(timeout)
            if left:
                log.warning("drain time up: ending %d request(s) still in flight", left)
                drain.cut()
                left = await drain.wait(AFTER_DRAIN_S)
            log.info("drained (%d request(s) left); shutting down", left)
        finally:
            self.should_exit = True


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside someone else's program: leaves signal handling to the host."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class GatewayServer:
    """`async with GatewayServer(config) as gw:` serves on `gw.url` inside the running event loop."""

    def __init__(self, config: GatewayConfig, store: StateStore | None = None) -> None:
        self.config = config
        self.app = create_app(config, store)
        self.gateway = self.app.gateway
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> GatewayServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        sock = bind_socket(self.config.listen.host, self.config.listen.port)
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        try:
            await start_gateway(self.gateway)
        except BaseException:
            sock.close()
            raise
        self._server = _EmbeddedServer(_uvicorn_config(self.app))
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="fleetgate-uvicorn")
        while not self._server.started:
            if self._task.done():
                sock.close()
                await self.gateway.stop()
                exc = self._task.exception()
                raise RuntimeError(f"gateway failed to start: {exc or 'see the log'}")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=10)
        except TimeoutError:
            self._server.force_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, timeout=5)
        finally:
            self._server = self._task = None
            await self.gateway.stop()


async def start_gateway(gateway: Gateway) -> None:
    """Start the gateway's store, session and control loops; on failure undo what started."""
    try:
        await gateway.start()
    except BaseException:
        with contextlib.suppress(Exception):
            await gateway.stop()
        raise


async def serve(config: GatewayConfig) -> None:
    """Serve until SIGINT/SIGTERM; print the listening line once ready."""
    check_fd_limit(config.server.max_connections)
    sock = bind_socket(config.listen.host, config.listen.port)
    host, port = sock.getsockname()[:2]
    app = create_app(config)
    try:
        await start_gateway(app.gateway)
    except Exception as e:  # noqa: BLE001 - reported in one line, details at debug level
        sock.close()
        log.debug("start-up failure", exc_info=True)
        print(f"fleetgate: cannot start: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    server = _DrainingServer(_uvicorn_config(app), app.gateway)
    try:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            settle_gc()
            print(f"fleetgate listening on http://{host}:{port}", flush=True)
        await task
    finally:
        await app.gateway.stop()
    if not server.started:
        raise SystemExit(1)


GC_GEN0_THRESHOLD = 20_000


def settle_gc() -> None:
    """Once started: the start-up objects (modules, config, the app: ~100,000) live as long as the process, so
    they are frozen out of the cyclic collector (gc.freeze) and collections scan only what came after; and the
    youngest generation is collected every 20,000 net allocations instead of 700, since a request's objects die
    by reference count. Measured under bench.peers-like load: time in the collector 90 -> 35 ms per 6,000
    requests (~8 us per request)."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 128 * 1024


def fix_malloc_threshold() -> bool:
    """Keep glibc's mmap threshold at its 128 KiB default. glibc raises it to the size of each large block
    freed (up to 32 MiB), after which large request bodies come from the heap and their memory is not given
    back: 10,000 fuzzed requests with bodies up to 3 MB left RSS +48% (86 -> 128 MB); with the threshold
    fixed, +1% (tests_chaos/test_clients.py). Setting it explicitly turns the adjustment off (mallopt(3))."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): nothing to fix
        return False


def run(config: GatewayConfig) -> None:
    fix_malloc_threshold()
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(config))


def build_serve_config(config: Path | None = None, host: str | None = None, port: int | None = None,
                       workers: Sequence[str] = (), policy: str | None = None,
                       redis_url: str | None = None, log_format: str | None = None,
                       log_level: str | None = None) -> GatewayConfig:
    """The config file (and environment), with the command line's values on top. `--policy` applies before the
    file is checked, so a file whose policy parameters are for that policy is valid with it."""
    first = {"default_policy": policy} if policy is not None else {}
    base = load_config(config, **first)
    overrides: dict[str, Any] = dict(first)
    if log_format is not None or log_level is not None:
        overrides["logging"] = {**base.logging.model_dump(), **({"format": log_format} if log_format else {}),
                                **({"level": log_level} if log_level else {})}
    if workers:
        records = [w.model_dump() for w in base.workers]
        taken = {r["id"] for r in records}
        for url in workers:
            try:
                url = check_worker_url(url)
            except ValueError as e:
                raise ConfigError([f"--worker {url!r}: {e}"]) from None
            wid = _worker_id(url, taken)
            taken.add(wid)
            records.append({"id": wid, "url": url})
        overrides["workers"] = records
    if host is not None or port is not None:
        overrides["listen"] = {"host": host if host is not None else base.listen.host,
                               "port": port if port is not None else base.listen.port}
    if redis_url is not None:
        overrides["redis_url"] = redis_url
    return load_config(config, **overrides) if overrides.keys() - first.keys() else base


def _worker_id(url: str, taken: set[str]) -> str:
    base = urlsplit(url).netloc.replace("[", "").replace("]", "") or "worker"
    wid, n = base, 1
    while wid in taken:
        n += 1
        wid = f"{base}-{n}"
    return wid


def run_serve(config: Path | None = None, host: str | None = None, port: int | None = None,
              workers: Sequence[str] = (), policy: str | None = None, redis_url: str | None = None,
              log_format: str | None = None, log_level: str | None = None) -> None:
    """`fleetgate serve`."""
    try:
        cfg = build_serve_config(config, host, port, workers, policy, redis_url, log_format, log_level)
    except ConfigError as e:
        print("fleetgate: invalid configuration:", file=sys.stderr)
        for p in e.problems:
            print(f"  - {p}", file=sys.stderr)
        raise SystemExit(1) from None
    setup_logging_from(cfg)
    if not cfg.workers and not cfg.worker_discovery:
        log.warning("no workers configured; add some with POST /admin/workers")
    try:
        run(cfg)
    except OSError as e:
        print(f"fleetgate: cannot listen on {cfg.listen.host}:{cfg.listen.port}: {e.strerror or e}", file=sys.stderr)
        raise SystemExit(1) from None
