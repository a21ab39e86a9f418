"""Processes for failure scenarios and the soak: a redis-server of one's own, client load that counts what
failed, a process's RSS and CPU, and the figures a scenario reports. Used by tests_chaos/ and bench/soak.py.

A scenario's figures go to the JSON-lines file named by FLEETGATE_CHAOS_RESULTS when it is set
(bench/chaos_state.py sets it and writes its section of bench/results/chaos.md from them).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.loadgen import process_cpu_seconds

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the simulator's default served model


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll_sync(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def record(scenario: str, **figures: Any) -> None:
    path = os.environ.get("FLEETGATE_CHAOS_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"scenario": scenario, **figures}) + "\n")


class RedisServer:
    """`redis-server --port P --save ''` owned by the test: killed, frozen and restarted empty on purpose."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no",
                                      "--dir", str(self.workdir)], stdout=subprocess.DEVNULL)
        poll_sync(self.pings, 10, "redis-server to answer")

    def pings(self) -> bool:
        try:
            return bool(redis.Redis.from_url(self.url, socket_connect_timeout=0.2, socket_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True, socket_timeout=5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def proc_stats(pid: int) -> tuple[float, float]:
    """(RSS in MiB, CPU seconds user + system) of a process."""
    rss = 0.0
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmRSS:"):
            rss = int(row.split()[1]) / 1024
    return rss, process_cpu_seconds(pid)


@dataclass
class Load:
    """Closed-loop streaming chat clients against gateway URLs (round robin), counting every failure: a status
    other than 200, a transport error, a stream without [DONE] or with an error event."""

    urls: list[str]
    clients: int = 8
    max_tokens: int = 40
    headers: dict[str, str] = field(default_factory=dict)
    ok: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def _one(self, http: httpx.AsyncClient, url: str) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "chaos"}], "max_tokens": self.max_tokens,
                "stream": True}
        t0 = time.monotonic()
        try:
            async with http.stream("POST", url + "/v1/chat/completions", json=body, headers=self.headers) as r:
                data = b"".join([c async for c in r.aiter_bytes()])
            if r.status_code != 200 or not data.endswith(b"data: [DONE]\n\n") or b'"error"' in data:
                self._fail(f"{r.status_code} {data[-200:]!r}")
            else:
                self.ok += 1
                self.latencies.append(time.monotonic() - t0)
        except httpx.HTTPError as e:
            self._fail(f"{type(e).__name__}: {e}")

    def _fail(self, what: str) -> None:
        self.failed += 1
        if len(self.failures) < 20:
            self.failures.append(what)

    async def _client(self, i: int) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0)) as http:
            n = i
            while not self._stop.is_set():
                await self._one(http, self.urls[n % len(self.urls)])
                n += 1

    async def run(self, seconds: float) -> None:
        tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]
        await asyncio.sleep(seconds)
        self._stop.set()
        await asyncio.gather(*tasks)

    def start(self) -> asyncio.Task:
        """Run until stop(); returns the task to await."""
        self._stop.clear()

        async def all_clients() -> None:
            await asyncio.gather(*(self._client(i) for i in range(self.clients)))
        return asyncio.create_task(all_clients())

    def stop(self) -> None:
        self._stop.set()


class ServeProcess:
    """`fleetgate serve --config CONFIG --port 0 [ARGS]` with its output kept (a thread reads it); `url` once
    it printed its listening line."""

    def __init__(self, config: Path, *args: str, env: dict[str, str] | None = None) -> None:
        import sys
        import threading

        root = Path(__file__).resolve().parent.parent
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port",
                                      "0", *args], cwd=root, text=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(root), **(env or {})})
        self.lines: list[str] = []
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        poll_sync(lambda: self.url or self.proc.poll() is not None, 120, "the gateway's listening line")
        if not self.url:
            raise RuntimeError("fleetgate serve exited: " + "\n".join(self.lines[-20:]))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("fleetgate listening on "):
                self.url = line.split()[-1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
