"""A small closed-loop HTTP load generator for OpenAI-compatible endpoints (aiohttp; cheap per request).

Used by the benchmarks so that the client, not the thing measured, is never the bottleneck we report:
each run also records the load generator's own CPU time.
"""

from __future__ import annotations

import asyncio
import itertools
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson


@dataclass(slots=True)
class Sample:
    ok: bool
    status: int
    latency_s: float
    ttft_s: float | None = None
    chunks: int = 0


@dataclass(slots=True)
class RunResult:
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0
    client_cpu_s: float = 0.0

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.ok]

    @property
    def rps(self) -> float:
        return len(self.ok) / self.wall_s if self.wall_s else 0.0

    @property
    def chunks_per_s(self) -> float:
        return sum(s.chunks for s in self.ok) / self.wall_s if self.wall_s else 0.0

    def latency_quantile(self, q: float) -> float:
        return quantile([s.latency_s for s in self.ok], q)

    def ttft_quantile(self, q: float) -> float:
        return quantile([s.ttft_s for s in self.ok if s.ttft_s is not None], q)


def quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    xs = sorted(values)
    idx = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[idx]


def chat_body(model: str, prompt: str, max_tokens: int, stream: bool) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}
    return orjson.dumps(body)


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool) -> Sample:
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
            if not stream:
                await resp.read()
                return Sample(resp.status == 200, resp.status, time.perf_counter() - t0)
            ttft = None
            chunks = 0
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    chunks += 1
            return Sample(resp.status == 200, resp.status, time.perf_counter() - t0, ttft, chunks)
    except (TimeoutError, aiohttp.ClientError):
        return Sample(False, 0, time.perf_counter() - t0)


async def run_closed_loop(
    url: str,
    bodies: Callable[[int], bytes],
    *,
    concurrency: int,
    requests: int,
    stream: bool = False,
    timeout_s: float = 120.0,
) -> RunResult:
    """Send `requests` requests with `concurrency` in flight at all times; body i is `bodies(i)`."""
    counter = itertools.count()
    result = RunResult()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    cpu0 = _self_cpu()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            while (i := next(counter)) < requests:
                result.samples.append(await _one(session, url, bodies(i), stream))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.wall_s = time.perf_counter() - t0
    result.client_cpu_s = _self_cpu() - cpu0
    return result


def _self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (from /proc; Linux)."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def process_tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and every live descendant, plus what their reaped children used (Linux
    /proc: utime + stime + cutime + cstime of each), so a router's helper processes and threads all count."""
    import os

    ticks = os.sysconf("SC_CLK_TCK")
    parent_of: dict[int, int] = {}
    times: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:   # exited while we looked
            continue
        parent_of[int(entry)] = int(fields[1])
        times[int(entry)] = sum(int(x) for x in fields[11:15])
    tree, frontier = {pid}, [pid]
    children: dict[int, list[int]] = {}
    for child, parent in parent_of.items():
        children.setdefault(parent, []).append(child)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in tree:
                tree.add(child)
                frontier.append(child)
    if pid not in times:
        raise ProcessLookupError(pid)
    return sum(times.get(p, 0) for p in tree) / ticks
