"""Live check of pooled serving: the gateway's request-level swapping (shared_hosts, gateway/pooling.py) in front of
pooled simulated engines, against the virtual-time simulator's request mode (simulator/pooled.py) on the same
workload, one point of bench/pooling.py's table.

    .venv/bin/python -m bench.pooling_live                  # appends a "Live" section to bench/results/pooling.md
    .venv/bin/python -m bench.pooling_live --quick          # a shorter run, printed only

The point: `llama3-8b-h100`, M models of uniform popularity at lambda req/s each on N hosts, ShareGPT lengths,
Aegaeon's SLO (TTFT 10 s, mean TPOT 100 ms), seed 1 (bench/pooling.py's workload). Simulator side:
`simulate_pooled(PooledSpec(..., pooling="request"))`. Live side: one `fleetgate sim` process with one engine
per (model, host), each engine's wake-up set to the simulator's swap cost (eq. 4, `reinit=optimized`:
weights / host link x 0.625; its sleep is instant, as the simulator's offload is free), time scale K; the gateway
with one `shared_hosts` entry per host (max_awake 1) and no SLO of its own (so its admission queue refuses
nothing before the simulator's drain limit); an aiohttp client replays the workload at arrival / K with streamed
completions of the trace's exact lengths and judges each request's TTFT and mean TPOT in model seconds
(wall x K), as the simulator does.

What differs by construction (reported with the numbers): the simulator queues a request on a host at arrival
(`baselines.RequestSwapping.place`: the host with the shortest queue) and the host switches to the model of its
oldest queued request; the gateway keeps requests in per-model queues and wakes the model that started waiting
first on a host with an idle engine (`swapping.RequestLevelSwaps`), then its placement policy spreads the
model's requests over its awake engines. The live engines also pay the gateway's scrape and poll delays.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
import yaml

from bench.live_check import metric, unique_prompt
from bench.report import git_commit, machine_info
from gateway.config import load_config
from gateway.server import GatewayServer
from policies.pooling.costs import swap_cost
from simulator.fleet import FleetProcess
from simulator.pooled import PooledSpec, simulate_pooled
from simulator.pooled_workload import ModelRequest, multi_model_workload
from simulator.profiles import load_profile

ROOT = Path(__file__).resolve().parents[1]
RESULTS_MD = ROOT / "bench" / "results" / "pooling.md"
TOLERANCE_PP = 5.0


@dataclass
class LiveSide:
    attainment: float
    completed: int
    requests: int
    ttft_p99_s: float
    swaps_in: float
    failures: list[int]
    ttft_missed: int = 0
    tpot_missed: int = 0


async def replay(url: str, workload: list[ModelRequest], k: float, max_model_len: int, seed: int,
                 ttft_s: float, tpot_s: float) -> tuple[dict[str, int], list[float], list[int]]:
    """Send the workload at arrival / k; (counts met / completed / ttft_missed / tpot_missed, TTFTs in model
    seconds, failure statuses)."""
    failures: list[int] = []
    ttfts: list[float] = []
    n = {"met": 0, "completed": 0, "ttft_missed": 0, "tpot_missed": 0}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as s:
        t0 = time.perf_counter() + 0.5

        async def one(i: int, r: ModelRequest) -> None:
            body = orjson.dumps({"model": r.model, "prompt": unique_prompt(r.prompt_tokens, i, seed),
                                 "max_tokens": max(max_model_len - r.prompt_tokens, 1), "stream": True})
            sent = t0 + r.arrival / k
            delay = sent - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            headers = {"content-type": "application/json", "x-sim-output-tokens": str(r.output_tokens)}
            first = last = None
            tokens = 0
            try:
                async with s.post(url + "/v1/completions", data=body, headers=headers) as resp:
                    buf = b""
                    async for chunk in resp.content.iter_any():
                        now = time.perf_counter()
                        buf += chunk
                        while b"\n\n" in buf:
                            event, buf = buf.split(b"\n\n", 1)
                            if event.startswith(b"data: {") and b'"text"' in event:
                                tokens += 1
                                first = first if first is not None else now
                                last = now
                            elif event == b"data: [DONE]" and resp.status == 200:
                                n["completed"] += 1
                    if resp.status != 200:
                        failures.append(resp.status)
                        return
            except aiohttp.ClientError:
                failures.append(0)
                return
            if first is None:
                return
            ttft = (first - sent) * k
            ttfts.append(ttft)
            tpot = (last - first) * k / (tokens - 1) if tokens > 1 else 0.0
            n["ttft_missed"] += ttft > ttft_s
            n["tpot_missed"] += tpot > tpot_s
            n["met"] += ttft <= ttft_s and tpot <= tpot_s

        await asyncio.gather(*(one(i, r) for i, r in enumerate(workload)))
    return n, ttfts, failures


async def live_run(spec: PooledSpec, k: float, drain_after_s: float | None) -> LiveSide:
    prof = load_profile(spec.profile)
    wl = multi_model_workload(spec.mix, spec.duration, spec.seed)
    models = list(wl.rates)
    wake_s = swap_cost(prof.weight_bytes, prof.host_link_bytes_per_s, spec.reinit, prof.wake_up_s).load_s
    servers = [{"name": f"h{h}-{m}", "model": m, "profile": spec.profile,
                "profile_overrides": {"wake_up_s": wake_s}} for h in range(spec.workers) for m in models]
    fleet_file = Path(tempfile.mkstemp(suffix=".yaml")[1])
    fleet_file.write_text(yaml.safe_dump({"servers": servers}))
    wrapper = ["taskset", "-c", "1"] if shutil.which("taskset") and (os.cpu_count() or 1) > 1 else []
    try:
        with FleetProcess(fleet_file=fleet_file, time_scale=k, seed=spec.seed, wrapper=wrapper) as fleet:
            urls = iter(fleet.urls)
            drain = drain_after_s / k if drain_after_s is not None else None
            hosts = [{"id": f"h{h}", "max_awake": 1, "engines": {m: next(urls) for m in models},
                      "drain_after_s": drain} for h in range(spec.workers)]
            cfg = load_config(None, listen={"host": "127.0.0.1", "port": 0}, shared_hosts=hosts,
                              default_policy="least_requests", scrape_interval_s=0.5 / k,
                              limits={"queue_timeout_s": spec.drain_s / k, "queue_size": 100000},
                              health={"interval_s": 1.0})
            async with GatewayServer(cfg) as gw:
                n, ttfts, failures = await replay(gw.url, wl.requests, k, prof.max_model_len,
                                                               spec.seed, spec.slo_ttft_s, spec.slo_tpot_s)
                async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
                    text = await r.text()
    finally:
        fleet_file.unlink(missing_ok=True)
    swaps_in = sum(metric(text, "fleetgate_model_swaps_total", {"model": m, "direction": "in"}) or 0.0
                   for m in models)
    ttfts.sort()
    p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else float("nan")
    return LiveSide(n["met"] / len(wl.requests), n["completed"], len(wl.requests), p99, swaps_in, failures,
                    n["ttft_missed"], n["tpot_missed"])


def section(spec: PooledSpec, k: float, drain_after: float | None, sim: dict, live: LiveSide, cmd: str) -> str:
    diff = (live.attainment - sim["slo_attainment"]) * 100
    ok = abs(diff) <= TOLERANCE_PP
    fail = f"{len(live.failures)} failed ({sorted(set(live.failures))})" if live.failures else "none failed"
    return "\n".join([
        "## Live: the gateway's request-level swapping vs the simulator", "",
        f"- command: `{cmd}`", f"- commit: `{git_commit()}`", f"- machine: {machine_info()}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
        f"Point: `{spec.profile}`, M = {spec.num_models} models x lambda = {spec.rate / spec.num_models:g} req/s, "
        f"N = {spec.workers} hosts (max_awake 1), request-level swapping, {spec.duration:g} s of arrivals, seed "
        f"{spec.seed}, SLO TTFT {spec.slo_ttft_s:g} s / mean TPOT {spec.slo_tpot_s * 1000:g} ms. Live: time scale "
        f"K = {k:g}, one simulated engine per (model, host) whose wake-up is the simulator's swap cost, the gateway's "
        f"shared_hosts swap controller with drain_after_s = "
        f"{'none (idle engines only)' if drain_after is None else f'{drain_after:g} model s'}; attainment judged "
        "per request by the client in model seconds.", "",
        "| side | attainment (per request) | completed / requests | TTFT p99 s | swaps in |",
        "|---|---|---|---|---|",
        f"| simulator (request mode) | {sim['slo_attainment']:.3f} | {sim['completed']}/{sim['servable']} | "
        f"{sim['ttft_p99']:.3g} | {sim['swaps']} |",
        f"| live gateway | {live.attainment:.3f} | {live.completed}/{live.requests} | {live.ttft_p99_s:.3g} | "
        f"{live.swaps_in:g} |", "",
        f"Live misses: TTFT over target {live.ttft_missed}, mean TPOT over target {live.tpot_missed}.", "",
        f"Difference: {diff:+.1f} pp ({'within' if ok else 'outside'} the {TOLERANCE_PP:g} pp target); live: {fail}.",
        "What differed: the simulator queues each request on a host at arrival and a host switches to its oldest "
        "queued request's model; the gateway keeps per-model queues, wakes the model waiting longest on a host with "
        "an idle engine and spreads that model's requests over its awake engines; live engines also wait for the "
        "gateway's scrapes and polls (scaled by K) and share two cores with the gateway and the client.", ""])


async def main_async(args: argparse.Namespace) -> tuple[PooledSpec, dict, LiveSide]:
    spec = PooledSpec(num_models=args.models, rate=args.models * args.lam, workers=args.workers, pooling="request",
                      profile=args.profile, duration=args.duration, seed=args.seed)
    sim = simulate_pooled(spec).to_dict()
    print(f"simulator: attainment {sim['slo_attainment']:.3f}, swaps {sim['swaps']}", flush=True)
    live = await live_run(spec, args.time_scale, args.drain_after)
    print(f"live: attainment {live.attainment:.3f}, completed {live.completed}/{live.requests}, swaps in "
          f"{live.swaps_in:g}, TTFT missed {live.ttft_missed}, TPOT missed {live.tpot_missed}, TTFT p99 "
          f"{live.ttft_p99_s:.3g} s, failures {live.failures[:10]}", flush=True)
    return spec, sim, live


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--models", type=int, default=8)
    ap.add_argument("--lam", type=float, default=0.1, help="req/s per model")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--duration", type=float, default=300.0, help="model seconds of arrivals")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--time-scale", type=float, default=10.0)
    ap.add_argument("--drain-after", type=lambda v: None if v == "none" else float(v), default=None,
                    help="model seconds a model waits before a busy engine is drained for it (shared_hosts "
                    "drain_after_s x K); 'none': only idle engines are swapped out")
    ap.add_argument("--quick", action="store_true", help="60 model seconds, printed only")
    args = ap.parse_args(argv)
    if args.quick:
        args.duration = 60.0
    spec, sim, live = asyncio.run(main_async(args))
    cmd = ("python -m bench.pooling_live " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    text = section(spec, args.time_scale, args.drain_after, sim, live, cmd)
    print(text)
    if not args.quick:
        with RESULTS_MD.open("a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
