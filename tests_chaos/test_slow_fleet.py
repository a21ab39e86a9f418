"""A fleet that is slow but alive keeps its streams, with real processes: each worker a
`fleetgate sim --workers 1` process, the gateway `fleetgate serve`, the slowdown the simulator's fault
(`POST /sim/faults {"slowdown": k}`: every engine iteration k times longer, simulator/faults.py).

- every worker slowed 300x after a normal start, while streams run and new ones arrive (a gap between tokens of
  several seconds, past the 2 s floor of the stall rule): every stream completes, no error event;
- the issue's figures re-measured at a small size: every worker 100x slower, and a burst at 10x.

Before (an outside probe, on the stall rule of the worker's own pace): both workers 250x slower, 7 of 8 streams ended in errors; 3,000 streams at 100x, 3,000
errors; a burst of 3,000 streams at 10x, 2,998 "worker stalled mid-stream".
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from bench.chaos_procs import record
from simulator.tokenizer import synthetic_text
from tests.helpers import poll
from tests_chaos.test_workers import gateway_metric, stream_chat, write_config

pytestmark = pytest.mark.timeout(300)

LIMITS = httpx.Limits(max_connections=400, max_keepalive_connections=400)


async def set_faults(urls: list[str], faults: dict | None) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        for u in urls:
            r = await (http.post(u + "/sim/faults", json=faults) if faults else http.delete(u + "/sim/faults"))
            r.raise_for_status()


async def warm(http: httpx.AsyncClient, url: str, n: int = 32) -> None:
    """Every worker learns its normal pace from a few dozen short streams."""
    progress = [0] * n
    done = await asyncio.gather(*(stream_chat(http, url, 12, progress, i) for i in range(n)))
    assert [s.error for s in done if s.error] == []


async def test_a_fleet_slowed_300x_after_a_normal_start_keeps_its_streams(sim_fleet_process, gateway_process,
                                                                          tmp_path) -> None:
    # time_scale 0.5: 300x makes each engine iteration take seconds (~5 s), well past the 2 s floor
    fleet = [sim_fleet_process(1, time_scale=0.5, seed=i) for i in range(2)]
    urls = [f.urls[0] for f in fleet]
    gw = gateway_process(write_config(tmp_path, urls))
    url = gw.listening_url(timeout=120)
    async with httpx.AsyncClient(timeout=httpx.Timeout(240.0, connect=10.0), limits=LIMITS) as http:
        await warm(http, url)
        progress = [0] * 16
        tasks = [asyncio.create_task(stream_chat(http, url, 200, progress, i)) for i in range(12)]
        await poll(lambda: min(progress[:12]) >= 3 or any(t.done() for t in tasks), 60, "every stream under way")
        assert not any(t.done() for t in tasks), "streams ended before the slowdown: make them longer"
        await set_faults(urls, {"slowdown": 300})
        t_slow = time.monotonic()
        await asyncio.sleep(2.0)  # new streams arrive into the slowed fleet too
        tasks += [asyncio.create_task(stream_chat(http, url, 200, progress, i)) for i in range(12, 16)]
        await asyncio.sleep(18.0)  # ~20 s at 300x: gaps of seconds between tokens, every stream kept
        slow_tokens = list(progress)
        await set_faults(urls, None)
        streams = await asyncio.gather(*tasks)
    failed = [s.error for s in streams if s.error is not None]
    ended = await gateway_metric(url, "fleetgate_stream_breaks_total", outcome="ended")
    resumed = await gateway_metric(url, "fleetgate_stream_breaks_total", outcome="resumed")
    worst_gap = max(s.max_gap_s for s in streams)
    record("fleet_slowed_300x", workers=2, streams=16, failed=len(failed), ended_with_error=int(ended),
           resumed=int(resumed), worst_client_gap_s=round(worst_gap, 2), slowed_for_s=round(
               time.monotonic() - t_slow, 1), chunks_during_slowdown=sum(slow_tokens))
    assert failed == [], failed[:5]
    assert ended == 0
    assert worst_gap > 2.0, "the slowdown never made a gap past the stall rule's floor: nothing was tested"


async def burst(http: httpx.AsyncClient, url: str, n: int, max_tokens: int, prompt_tokens: int) -> list[str]:
    progress = [0] * n
    streams = await asyncio.gather(*(stream_chat(http, url, max_tokens, progress, i, synthetic_text(
        prompt_tokens, f"burst-{i}") if prompt_tokens else None) for i in range(n)))
    return [s.error for s in streams if s.error is not None]


# time_scale < 1 runs the engines slower still, and the burst's prompts are long (its prefills hold decoding
# back), so a small N meets the silences the 3,000 streams did
@pytest.mark.parametrize("slowdown, time_scale, n, max_tokens, prompt", [(100, 0.5, 24, 8, 0), (10, 1.0, 200, 16, 1000)],
                         ids=["100x", "burst-10x"])
async def test_a_slow_fleet_from_the_start(sim_fleet_process, gateway_process, tmp_path, slowdown: float,
                                           time_scale: float, n: int, max_tokens: int, prompt: int) -> None:
    fleet = [sim_fleet_process(1, time_scale=time_scale, seed=i) for i in range(2)]
    urls = [f.urls[0] for f in fleet]
    gw = gateway_process(write_config(tmp_path, urls))
    url = gw.listening_url(timeout=120)
    async with httpx.AsyncClient(timeout=httpx.Timeout(240.0, connect=10.0), limits=LIMITS) as http:
        await warm(http, url)
        await set_faults(urls, {"slowdown": slowdown})
        t0 = time.monotonic()
        failed = await burst(http, url, n, max_tokens, prompt)
        took = time.monotonic() - t0
    ended = await gateway_metric(url, "fleetgate_stream_breaks_total", outcome="ended")
    record(f"fleet_slowed_{slowdown}x", workers=2, time_scale=time_scale, streams=n, max_tokens=max_tokens,
           prompt_tokens=prompt, failed=len(failed), ended_with_error=int(ended), took_s=round(took, 1))
    assert failed == [], failed[:5]
    assert ended == 0
