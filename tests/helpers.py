"""Helpers shared by the test modules: constants, waits with a deadline, free ports, in-process gateways,
metrics lookups and `fleetgate ...` child processes whose output is read by a thread (so a full pipe never
blocks them and no wait can hang: a child that does not answer in time is a failure that shows its output).

    async with running_gateway(fleet.urls, default_policy="round_robin") as gw: ...  # in this process
    url = gateway_process(cfg_path).listening_url()   # conftest fixture: a `fleetgate serve` child
    await poll(lambda: worker.rec.cap is not None, what="the first cap")
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.config import load_config
from gateway.server import GatewayServer

ROOT = Path(__file__).resolve().parent.parent
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
REDIS_URL = os.environ.get("FLEETGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
LISTENING = "fleetgate listening on "
# The admin key of the tests' gateways (running_gateway, GatewayProcess); ADMIN is the header that carries it.
ADMIN_KEY = "fg-test-admin-key-0123456789"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


# --- waiting on a condition ------------------------------------------------------------------------------
async def poll(cond: Callable[[], Any], timeout: float = 10.0, what: str = "condition", every: float = 0.02) -> Any:
    """Wait until cond() (a value, or an awaitable of one) is truthy and return it; AssertionError naming
    `what` once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        result = cond()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last value: {result!r})")
        await asyncio.sleep(every)


def poll_sync(cond: Callable[[], Any], timeout: float = 5.0, what: str = "condition", every: float = 0.01) -> Any:
    """poll() for synchronous tests."""
    deadline = time.monotonic() + timeout
    while True:
        result = cond()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last value: {result!r})")
        time.sleep(every)


# --- ports -------------------------------------------------------------------------------------------------
def free_port() -> int:
    """A loopback TCP port that nothing listens on right now, drawn below the kernel's ephemeral range (so that no
    outgoing connection can take it before the test binds it, as one could take a port the kernel just handed
    out for bind(("127.0.0.1", 0)))."""
    return free_ports(1)[0]


def _below_ephemeral(n: int) -> tuple[int, int]:
    """The range [low, high) to draw ports (or a first port of `n` consecutive ones) from: below the kernel's
    ephemeral range, where only an explicit bind takes a port."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    return (10000, ephemeral_low - n) if ephemeral_low - n > 12000 else (20000, 60000)


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback TCP ports that are all free right now (each probed while the others are held, so two
    calls' worth of ports never coincide), drawn like free_port's."""
    low, high = _below_ephemeral(1)
    rng = random.Random()
    ports: list[int] = []
    with contextlib.ExitStack() as stack:
        for _ in range(200 + 20 * n):
            port = rng.randrange(low, high)
            if port in ports:
                continue
            try:
                stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == n:
                return ports
    raise RuntimeError(f"no {n} free ports")


def free_port_range(n: int) -> int:
    """A base port P such that P..P+n-1 are all free right now (for CLIs that take a --base-port), drawn like
    free_port's."""
    low, high = _below_ephemeral(n)
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(low, high)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + n):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports")


def refused(port: int) -> bool:
    """Nothing accepts connections on 127.0.0.1:port."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


# --- a gateway in this process ------------------------------------------------------------------------------
def worker_entries(urls: Sequence[str], **fields: Any) -> list[dict[str, Any]]:
    """Config `workers` entries w0, w1, ... for `urls`, each with `fields`."""
    return [{"id": f"w{i}", "url": u, **fields} for i, u in enumerate(urls)]


@contextlib.asynccontextmanager
async def running_gateway(urls: Sequence[str] = (), **settings: Any) -> AsyncIterator[GatewayServer]:
    """A GatewayServer on an ephemeral loopback port over `urls` (workers w0, w1, ...) or `workers=[...]`;
    `settings` are config keys, as in the YAML file. Its admin key is ADMIN_KEY unless `auth` says otherwise."""
    settings.setdefault("workers", worker_entries(urls))
    settings.setdefault("auth", {"admin_key": ADMIN_KEY})
    config = load_config(None, listen={"host": "127.0.0.1", "port": 0}, **settings)
    async with GatewayServer(config) as gw:
        yield gw


@contextlib.asynccontextmanager
async def loopback_app(app: Any) -> AsyncIterator[str]:
    """An aiohttp `web.Application` served on an ephemeral loopback port; yields its base URL."""
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


# --- Prometheus text ------------------------------------------------------------------------------------------
def metric(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of the first sample `name` whose labels include `labels`, or None."""
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                return s.value
    return None


# --- `fleetgate ...` child processes ----------------------------------------------------------------------------
def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """`fleetgate ARGS` to completion (captured text output)."""
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def require_redis(url: str) -> str:
    """`url` if that Redis answers; else the test fails, saying what to start."""
    import pytest
    import redis

    try:
        redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1).ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis is not reachable at {url} ({exc}). Start it with `redis-server --daemonize yes "
                    "--port 6379` or `docker run -p 6379:6379 redis:7`, or point FLEETGATE_TEST_REDIS_URL at one.")
    return url


@contextlib.contextmanager
def redis_prefix(url: str, name: str) -> Iterator[str]:
    """A fresh key prefix `fgtest:<name>:<random>:` on the Redis at `url` (which must answer: `require_redis`);
    every key under it is deleted afterwards."""
    import uuid

    import redis

    r = redis.Redis.from_url(require_redis(url), socket_connect_timeout=1, socket_timeout=5)
    prefix = f"fgtest:{name}:{uuid.uuid4().hex[:8]}:"
    try:
        yield prefix
    finally:
        keys = list(r.scan_iter(match=prefix + "*", count=1000))
        if keys:
            r.delete(*keys)
        r.close()


def require_command(name: str, package: str | None = None) -> str:
    """The path of a command a test drives for real; the test fails (never skips) without it, saying what to
    install (.ci/run and the machine provide these)."""
    path = shutil.which(name)
    if path is None:
        import pytest

        pytest.fail(f"{name} is needed for this test: apt-get install {package or name}")
    return path


class CliProcess:
    """`fleetgate ARGS` running as a child process. Threads read its stdout and stderr (merged into stdout with
    merge_stderr=True) as they come, so a chatty child never blocks on a full pipe; every wait has a deadline
    and fails with the child's output. Use as a context manager or call stop()."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, merge_stderr: bool = False,
                 preexec_fn: Callable[[], None] | None = None) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", *args], cwd=ROOT, preexec_fn=preexec_fn,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.stdout: list[str] = []   # the lines read so far, in order
        self.stderr: list[str] = []
        self._readers = [threading.Thread(target=self._read_stdout, daemon=True)]
        if not merge_stderr:
            self._readers.append(threading.Thread(target=self._read_stderr, daemon=True))
        for t in self._readers:
            t.start()

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)  # end of output

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line.rstrip("\n"))

    def describe(self) -> str:
        out = "\n".join(self.stdout[-40:])
        err = "\n".join(self.stderr[-40:])
        return (f"`fleetgate {' '.join(self.args)}` (exit code {self.proc.poll()})\n--- stdout:\n{out}"
                + (f"\n--- stderr:\n{err}" if err else ""))

    def _next(self, timeout: float) -> str | None:
        """The next stdout line, or None at the end of the output; queue.Empty after `timeout` s."""
        line = self._lines.get(timeout=max(0.0, timeout))
        if line is None:
            self._lines.put(None)  # stay at the end for later calls
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(1.0)          # its exit code and
            self._readers[-1].join(1.0)      # all of its stderr, for messages
            return None
        self.stdout.append(line)
        return line

    def wait_for(self, prefix: str, timeout: float = 30.0, *, anywhere: bool = False) -> str:
        """The first stdout line from here on that starts with `prefix` (contains it, with anywhere=True);
        AssertionError (with the output) if none comes within `timeout` s or the child closes its output first."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._next(deadline - time.monotonic())
            except queue.Empty:
                raise AssertionError(f"no line with {prefix!r} within {timeout:g} s: {self.describe()}") from None
            if line is None:
                raise AssertionError(f"output ended before a line with {prefix!r}: {self.describe()}")
            if (prefix in line) if anywhere else line.startswith(prefix):
                return line

    def next_line(self, timeout: float = 15.0) -> str:
        """The next stdout line (as wait_for)."""
        return self.wait_for("", timeout)

    def read_to_end(self, timeout: float = 20.0) -> str:
        """All stdout (what was read before too) once the child has closed it, within `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self._next(deadline - time.monotonic()) is None:
                    return "\n".join(self.stdout)
            except queue.Empty:
                raise AssertionError(f"output still open after {timeout:g} s: {self.describe()}") from None

    def send_signal(self, sig: int, timeout: float = 20.0) -> int:
        """Send `sig` and wait for the exit; the exit code (AssertionError if it does not exit in time)."""
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {timeout:g} s after signal {sig}: {self.describe()}") from None

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout` s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self.kill()

    def __enter__(self) -> CliProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class GatewayProcess(CliProcess):
    """`fleetgate serve --config CONFIG --port 0 [ARGS]`; listening_url() waits (bounded) for its listening line."""

    def __init__(self, config: Path, *args: str, env: dict[str, str] | None = None) -> None:
        super().__init__("serve", "--config", str(config), "--port", "0", *args,
                         env={"FLEETGATE_ADMIN_KEY": ADMIN_KEY, **(env or {})})
        self._url: str | None = None

    def listening_url(self, timeout: float = 60.0) -> str:   # a bound on a hang: a loaded machine took > 30 s
        if self._url is None:
            self._url = self.wait_for(LISTENING, timeout).split()[-1]
        return self._url
