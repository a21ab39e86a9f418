"""The real-time HTTP server and the virtual-time engine tell the same story.

One seeded workload (40 requests, Poisson arrivals, fixed output lengths via `x-sim-output-tokens`) is
replayed over HTTP against one simulated server running 2x faster than real time (in a child process, so
the client's GIL does not delay the server's timers), and through EngineCore directly with the same
per-iteration loop in virtual time. Mean TTFT and mean TPOT (model seconds) agree within 10%, both as the
clients measured them and as the server's /metrics recorded them.

Client-side HTTP overhead is wall time, so it counts time_scale times over in model seconds: measured on
the 2-core dev box, client TTFT was +5..9% off at 5x on an idle core and +80..220% with the core shared by
two busy processes; at 2x it is +1..2% idle and +7..9% shared, and still fails on a scale error.
"""

from __future__ import annotations

import asyncio
import gc
import random
import statistics
import time

import aiohttp
import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator.engine import EngineCore, SimRequest
from simulator.fleet import FleetProcess
from simulator.profiles import load_profile
from simulator.tokenizer import block_hashes, count_tokens, encode, synthetic_text

PROFILE = "llama3-8b-h100"
TIME_SCALE = 2.0
N = 40
RATE = 40.0          # requests per model second: queueing, batching and chunked prefill overlap
MAX_TOKENS = 512


def workload(seed: int = 7) -> list[tuple[float, str, int]]:
    """(arrival in model seconds, prompt, output tokens) per request."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(N):
        t += rng.expovariate(RATE)
        out.append((t, synthetic_text(rng.randint(500, 4000), f"rt-{i}"), rng.randint(20, 120)))
    return out


def virtual_run(reqs: list[tuple[float, str, int]]) -> tuple[list[float], list[float]]:
    """EngineCore stepped in virtual time the way simulator/driver.py steps it in real time."""
    prof = load_profile(PROFILE)
    core = EngineCore(prof)
    pending = sorted(
        (a + prof.ttft_overhead_s, i, SimRequest(f"r{i}", count_tokens(p), block_hashes(encode(p)), MAX_TOKENS, o,
                                                 arrival=a))
        for i, (a, p, o) in enumerate(reqs))
    arrival = {f"r{i}": a for i, (a, _, _) in enumerate(reqs)}
    first: dict[str, float] = {}
    ttft, tpot = [], []
    now, k = 0.0, 0
    while k < len(pending) or core.has_work():
        while k < len(pending) and pending[k][0] <= now:
            core.add(pending[k][2], pending[k][0])
            k += 1
        dur = core.plan_step(now)
        if dur is None:
            now = pending[k][0] if k < len(pending) else core.next_event_time()
            continue
        now += dur
        for ev in core.finish_step(now):
            if ev.first_token:
                first[ev.request_id] = now
                ttft.append(now - arrival[ev.request_id])
            if ev.finished and ev.record.num_output > 1:
                tpot.append((now - first[ev.request_id]) / (ev.record.num_output - 1))
    return ttft, tpot


async def http_run(url: str, reqs: list[tuple[float, str, int]]) -> tuple[list[float], list[float]]:
    """Replay over HTTP (aiohttp: a light client, so its own overhead stays far below the 10% margin)."""
    ttft, tpot = [], []
    async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=0)) as session:
        # open the connections first, so connection setup is not part of any request's TTFT
        async def warm() -> None:
            async with session.get("/health") as r:
                await r.read()

        await asyncio.gather(*(warm() for _ in range(N)))
        t0 = time.perf_counter()

        async def one(arrival: float, prompt: str, out: int) -> None:
            await asyncio.sleep(max(0.0, t0 + arrival / TIME_SCALE - time.perf_counter()))
            start = time.perf_counter()
            stamps = []
            body = orjson.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True})
            async with session.post("/v1/completions", data=body, headers={
                    "x-sim-output-tokens": str(out), "content-type": "application/json"}) as r:
                async for line in r.content:
                    if line.startswith(b'data: {"id"') and b'"choices":[{' in line:
                        stamps.append(time.perf_counter())
            assert len(stamps) == out
            ttft.append((stamps[0] - start) * TIME_SCALE)
            tpot.append((stamps[-1] - stamps[0]) / (out - 1) * TIME_SCALE)

        await asyncio.gather(*(one(*r) for r in reqs))
    return ttft, tpot


def server_means(url: str) -> tuple[float, float]:
    """Mean TTFT and mean per-request TPOT the server recorded in /metrics (model seconds)."""
    values = {s.name: s.value for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text)
              for s in fam.samples}
    ttft = values["vllm:time_to_first_token_seconds_sum"] / values["vllm:time_to_first_token_seconds_count"]
    tpot = (values["vllm:request_time_per_output_token_seconds_sum"]
            / values["vllm:request_time_per_output_token_seconds_count"])
    return ttft, tpot


async def replay(reqs: list[tuple[float, str, int]]) -> dict[str, float]:
    with FleetProcess(1, profile=PROFILE, time_scale=TIME_SCALE) as fleet:
        gc.disable()  # a collection of pytest's heap mid-replay would stall the client's timestamps
        try:
            r_ttft, r_tpot = await http_run(fleet.urls[0], reqs)
        finally:
            gc.enable()
        st, sp = server_means(fleet.urls[0])
    return {"client_ttft": statistics.mean(r_ttft), "client_tpot": statistics.mean(r_tpot),
            "server_ttft": st, "server_tpot": sp}


@pytest.mark.timeout(60)
async def test_realtime_matches_virtual_time():
    reqs = workload()
    v_ttft, v_tpot = virtual_run(reqs)
    expected = {"client_ttft": statistics.mean(v_ttft), "client_tpot": statistics.mean(v_tpot),
                "server_ttft": statistics.mean(v_ttft), "server_tpot": statistics.mean(v_tpot)}
    attempts = []
    # A wall-clock test on a shared 2-core machine: one retry absorbs a burst of foreign load.
    for _ in range(2):
        got = await replay(reqs)
        attempts.append(got)
        # what clients measured over HTTP (wall x time_scale) and what the server's /metrics recorded
        # (model time) both match the virtual-time engine
        if all(got[k] == pytest.approx(expected[k], rel=0.10) for k in expected):
            return
    pytest.fail(f"real-time vs virtual (model seconds) differ by more than 10%: expected {expected}, "
                f"got {attempts}")
