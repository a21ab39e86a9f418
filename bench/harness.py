"""What the benchmarks share to run the product: gateway and simulator processes, free ports, process groups.

Every process runs from the repository root in its own process group (so stopping it stops its children), with
its output in a temp log that a start-up failure shows. `python -m bench.<name>` runs from a checkout; `bench` is
not installed with the product.

    with run_sim_server("llama3-8b-h100", cpus="1", model=MODEL) as sim, run_gateway(sim, model=MODEL) as gw:
        ...
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from scripts.vllm_servers import free_port, stop_group

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 60.0


def bisect_smallest(ok: Any, lo: int, hi: int) -> int:
    """The smallest n in (lo, hi] with ok(n), for a monotone ok with ok(hi) true and ok(lo) false (or lo = 0):
    the bisection step of the benches' "fewest workers that meet the target" searches."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def delete_redis_keys(url: str, prefix: str) -> None:
    """Delete a run's own keys (those starting with `prefix`) from the Redis at `url`."""
    import redis

    r = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
    keys = list(r.scan_iter(match=prefix + "*", count=1000))
    if keys:
        r.delete(*keys)
    r.close()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- plain HTTP (stdlib, for polling from synchronous code) ---------------------------------------------------
def http_ok(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def http_json(url: str, timeout: float = 10.0, headers: dict[str, str] | None = None) -> Any:
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as resp:
        return json.loads(resp.read())


def http_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


async def wait_ready(url: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Poll `url` until it answers 200."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s}s")


# --- processes -------------------------------------------------------------------------------------------------
def pinned(cmd: list[str], cpus: int | str | None) -> list[str]:
    """`cmd` run on the cores `cpus` (a taskset list such as "1" or "0,1"); unchanged without taskset or cpus."""
    if cpus is None or not shutil.which("taskset"):
        return cmd
    return ["taskset", "-c", str(cpus), *cmd]


def start_process(cmd: list[str], cpus: int | str | None = None, stderr: Any = subprocess.DEVNULL,
                  **kwargs: Any) -> subprocess.Popen:
    """`cmd` in its own process group from the repository root, on `cpus`; stop it with stop_processes."""
    return subprocess.Popen(pinned(cmd, cpus), cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=stderr, start_new_session=True, **kwargs)


def stop_processes(procs: Iterable[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM each process group, SIGKILL whatever is left after `grace_s`."""
    for proc in procs:
        stop_group(proc, grace_s)


@contextlib.contextmanager
def running_process(cmd: list[str], name: str, ready_url: str, ready: Any = None,
                    env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Run `cmd` in its own process group with its log in a temp file; yield once `ready_url` answers 200 (and
    `ready()`, if given, is true). A process that exits or is not ready in time raises with its log's tail."""
    with tempfile.TemporaryDirectory(prefix=f"fleetgate-{name}-") as tmp:
        log_path = Path(tmp) / f"{name}.log"
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log_file,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, **env} if env else None)
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not (http_ok(ready_url) and (ready is None or ready())):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{name} not ready (exit code {proc.poll()}); log:\n{tail}")
                time.sleep(0.1)
            yield proc
        finally:
            stop_group(proc)


@contextlib.contextmanager
def run_gateway(worker_urls: str | Sequence[str], model: str | None = None, cpus: int | str | None = None,
                args: Sequence[str] = ()) -> Iterator[str]:
    """`fleetgate serve` in front of the workers (extra CLI `args`); yields its URL once every worker is healthy
    in it (and, with `model`, serves that model)."""
    urls = [worker_urls] if isinstance(worker_urls, str) else list(worker_urls)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args,
           *(a for u in urls for a in ("-w", u))]

    admin_key = "fg-bench-" + secrets.token_urlsafe(12)   # the admin API (worker health) needs one

    def healthy() -> bool:
        try:
            workers = http_json(url + "/admin/workers", headers={"Authorization": f"Bearer {admin_key}"})["data"]
            models = http_json(url + "/v1/models")["data"]
        except (OSError, KeyError, ValueError):
            return False
        return (bool(workers) and all(w.get("healthy") for w in workers)
                and (model is None or any(m.get("id") == model for m in models)))

    with running_process(pinned(cmd, cpus), "gateway", url + "/v1/models", healthy,
                         env={"FLEETGATE_ADMIN_KEY": admin_key}):
        yield url


@contextlib.contextmanager
def run_sim_server(profile: str | Path, cpus: int | str | None, model: str, time_scale: float = 1.0,
                   seed: int = 0) -> Iterator[str]:
    """`fleetgate sim` with one worker of `profile` (a built-in name or a YAML file) serving `model`, the whole
    process on `cpus`; yields its URL once it is healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "sim", "--workers", "1", "--base-port", str(port), "--host",
           "127.0.0.1", "--profile", str(profile), "--model", model, "--time-scale", f"{time_scale:g}",
           "--seed", str(seed)]
    url = f"http://127.0.0.1:{port}"
    with running_process(pinned(cmd, cpus), "sim", url + "/health"):
        yield url


__all__ = ["REPO", "free_port", "http_json", "http_ok", "http_text", "log", "pinned", "run_gateway",
           "run_sim_server", "running_process", "start_process", "stop_processes", "wait_ready"]
