"""10x overload without caps, with real processes: admission sheds what will miss (policies/shedding.py).

Two `fleetgate sim --workers 1` processes on the tiny-cpu profile (vLLM on one CPU core, measured), run 10x slower
than that profile (`--time-scale 0.1`) so that a Python client on a loaded 2-core machine can offer ten times what
they serve; `fleetgate serve` in front with no `cap` on any worker, the default policy and an SLO of 2500 ms TTFT
and 200 ms per output token (the profile's 250 ms and 20 ms at the engines' time scale: the gateway's
`learning.time_scale` tells it, and it learns the rest online). Streamed chats of 128 tokens arrive as a Poisson
process at 10x the fleet's capacity (~5 req/s within the SLO: what the gateway admits and serves in time here,
and ~100 req/s of 32-token chats in virtual time with ClusterSim at the profile's own speed) for 12 s.

Asserted: at least 99% of the admitted requests meet their TTFT and TPOT targets as the gateway judges them (its
`fleetgate_slo_requests_total`, the product's attainment, where a 429 counts as missed: admitted misses = missed -
429s), every 429 carries an integer `Retry-After` >= 1, no 5xx, and the gateway's RSS grows by less than 100 MB.
The SLO is judged on the gateway's clock against the targets above; the engines' time scale makes each decode
step ~50 ms of wall time, so the jitter two CPU hogs add to the simulated workers' timing is small against it.

Before (an outside probe: 200 clients against 2 workers slowed 5x, no caps): 987 of 987 admitted, SLO
attainment 6% (aladdin 3.8%).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field

import httpx
import pytest

from bench.chaos_procs import proc_stats, record
from tests.helpers import MODEL
from tests_chaos.test_workers import gateway_metric

pytestmark = pytest.mark.timeout(300)

TIME_SCALE = 0.1
TTFT_MS, TPOT_MS = 2500, 200
MAX_TOKENS = 128
CAPACITY_RPS = 5.0          # what the two workers serve within the SLO (module docstring)
OFFERED_RPS = 10 * CAPACITY_RPS
DURATION_S = 12.0
# FLEETGATE_OVERLOAD_SHED=0 runs the scenario with `limits.shed_will_miss: false`, the admission before the rule
# (nothing queues without caps): it then fails, and its figures are the "before" of bench/results/chaos.md
SHED = os.environ.get("FLEETGATE_OVERLOAD_SHED", "1") != "0"


@dataclass
class Tally:
    statuses: dict[int, int] = field(default_factory=dict)
    retry_after: list[str | None] = field(default_factory=list)   # of every 429
    errors: list[str] = field(default_factory=list)
    completed: int = 0


async def one(http: httpx.AsyncClient, url: str, i: int, t: Tally) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"overload {i} " + "word " * (i % 20)}],
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            t.statuses[r.status_code] = t.statuses.get(r.status_code, 0) + 1
            if r.status_code == 429:
                t.retry_after.append(r.headers.get("retry-after"))
                err = json.loads(await r.aread())["error"]
                assert err["type"] == "rate_limit_error" and err["message"], err
                return
            data = b"".join([c async for c in r.aiter_raw()])
            if r.status_code == 200:
                if not data.rstrip().endswith(b"data: [DONE]") or b'"error"' in data:
                    t.errors.append(f"stream {i} did not end cleanly")
                else:
                    t.completed += 1
    except httpx.HTTPError as e:
        t.errors.append(f"{type(e).__name__}: {e}")


async def offer(url: str, rate: float, duration: float) -> Tally:
    """Poisson arrivals at `rate` for `duration` seconds, each a streamed chat; waits for all of them."""
    t = Tally()
    rng = random.Random(41)
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=0)  # no keep-alive race
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=20.0), limits=limits) as http:
        tasks: list[asyncio.Task] = []
        start = time.monotonic()
        at = 0.0
        i = 0
        while at < duration:
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(http, url, i, t)))
            i += 1
            at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return t


async def test_10x_overload_without_caps_admitted_requests_meet_their_slo(sim_fleet_process, gateway_process,
                                                                            tmp_path) -> None:
    fleet = [sim_fleet_process(1, profile="tiny-cpu", time_scale=TIME_SCALE, seed=i) for i in range(2)]
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(json.dumps({
        "workers": [{"id": f"w{i}", "url": f.urls[0], "profile": "tiny-cpu"} for i, f in enumerate(fleet)],
        "health": {"interval_s": 0.5, "timeout_s": 2.0},
        "learning": {"time_scale": TIME_SCALE},
        "models": {MODEL: {"slo": {"ttft_ms": TTFT_MS, "tpot_ms": TPOT_MS}}},
        "limits": {"shed_will_miss": SHED},
    }))
    gw = gateway_process(cfg)
    url = gw.listening_url(timeout=120)
    warm = await offer(url, 2.0, 3.0)              # a light load first: nothing is refused, the models settle
    assert warm.statuses.get(429, 0) == 0 and warm.errors == [], (warm.statuses, warm.errors[:3])
    met0 = await gateway_metric(url, "fleetgate_slo_requests_total", model=MODEL, result="met")
    missed0 = await gateway_metric(url, "fleetgate_slo_requests_total", model=MODEL, result="missed")
    rss0, _ = proc_stats(gw.proc.pid)
    t0 = time.monotonic()
    t = await offer(url, OFFERED_RPS, DURATION_S)
    took = time.monotonic() - t0
    rss1, _ = proc_stats(gw.proc.pid)
    met = await gateway_metric(url, "fleetgate_slo_requests_total", model=MODEL, result="met") - met0
    missed = await gateway_metric(url, "fleetgate_slo_requests_total", model=MODEL, result="missed") - missed0
    refused = t.statuses.get(429, 0)
    sent = sum(t.statuses.values())
    admitted = sent - refused
    admitted_missed = missed - refused
    record("overload_10x_no_caps" if SHED else "overload_10x_no_caps_no_rule", workers=2, offered_rps=OFFERED_RPS, duration_s=DURATION_S, sent=sent,
           admitted=admitted, refused_429=refused, completed=t.completed, slo_met_admitted=int(met),
           slo_missed_admitted=int(admitted_missed),
           attainment_admitted=round(met / max(met + admitted_missed, 1), 4),
           goodput_rps=round(met / DURATION_S, 2), rss_growth_mb=round(rss1 - rss0, 1), took_s=round(took, 1),
           errors=t.errors[:3], retry_after_values=sorted({ra for ra in t.retry_after if ra is not None}, key=lambda v: int(v))[:8])
    assert t.errors == [], t.errors[:5]
    assert not any(s >= 500 for s in t.statuses), t.statuses
    assert set(t.statuses) <= {200, 429}, t.statuses
    assert refused > 0.5 * sent, "a 10x overload was mostly admitted: nothing was shed"
    assert admitted >= 0.5 * CAPACITY_RPS * DURATION_S, f"only {admitted} admitted: the rule refuses what fits"
    assert all(ra is not None and ra.isdigit() and int(ra) >= 1 for ra in t.retry_after), set(t.retry_after)
    assert met + admitted_missed == admitted        # every admitted request was judged
    assert met >= 0.99 * admitted, f"{int(admitted_missed)} of {admitted} admitted requests missed their SLO"
    assert rss1 - rss0 < 100.0
