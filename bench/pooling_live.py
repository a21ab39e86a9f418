"""Live check of pooled serving: the gateway's request-level swapping (shared_hosts, gateway/control/pooling.py) and its
Aegaeon decode turns (`scheduling: turns`, gateway/control/turns.py) in front of pooled simulated engines, against the
virtual-time simulator's request mode and colocated turns (simulator/pooled.py) on the same workload, one point
of bench/pooling.py's table.

    .venv/bin/python -m bench.pooling_live                  # appends a "Live" section to bench/results/pooling.md
    .venv/bin/python -m bench.pooling_live --quick          # a shorter run, printed only

Both modes run in one invocation, one after the other (`--modes request,turns`), on the same machine state.

The point: `llama3-8b-h100`, M models of uniform popularity at lambda req/s each on N hosts, ShareGPT lengths,
Aegaeon's SLO (TTFT 10 s, mean TPOT 100 ms), seed 1 (bench/pooling.py's workload). Simulator side:
`simulate_pooled(PooledSpec(..., pooling="request"))`. Live side: one `fleetgate sim` process with one engine
per (model, host), each engine's wake-up set to the simulator's swap cost (eq. 4, `reinit=optimized`:
weights / host link x 0.625; its sleep is instant, as the simulator's offload is free), time scale K; the gateway
with one `shared_hosts` entry per host (max_awake 1) and no SLO of its own (so its admission queue refuses
nothing before the simulator's drain limit); an aiohttp client replays the workload at arrival / K with streamed
completions of the trace's exact lengths and judges each request's TTFT and mean TPOT in model seconds
(wall x K), as the simulator does.

Turns mode: simulator side `PooledSpec(pooling="aegaeon", prefill_fraction=0, turns_placement="all")` (every
model on every host, as the live shared_hosts declare them; eq. 2-3 quotas with tbt = the TPOT target; sleep
level 1 because eight models do not fit awake, so paused requests lose their KV and recompute). Live side: the
same engines, each host `scheduling: turns`, max_awake 1 (so level 1, the simulated engine drops the paused
requests' KV as vLLM does), tbt_ms = the TPOT target / K, q_max_s = Q_MAX / K, each engine's load_s /
offload_s = the simulator's swap cost / K (the gateway's clock is wall time).

What differs by construction (reported with the numbers): request mode: both plan swaps with the one planner
(`swapping.RequestLevelSwaps`: per-model FCFS demand, the model that started waiting first woken on a host with
room or an idle engine, else a busy one drained); the simulator drains at once (`drain_after_s` 0), the gateway
after its host's `drain_after_s`, and the gateway's placement policy spreads a model's requests over its awake
engines where the simulator sends each to the awake engine with the fewest in flight. Turns mode: without `--engine-profile` the gateway's engines have no
profile, so a batch's step time in eq. 2-3 is the TBT target itself (every quota is Q_MAX), where the simulator
uses the profile's decode step (with it, the learner's estimate from the same profile); the gateway's work list is the in-flight view (updated per request, not per step). The live engines also
pay the gateway's scrape and poll delays. Whether the live engines kept up with their model clock is checked
after each run (`/sim/state` lost_model_s, model time skipped because the host fell behind: 0 when they kept up).
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
    mode: str = "request"
    token_attainment: float = float("nan")
    ttft_p50_s: float = float("nan")
    tpot_p50_s: float = float("nan")
    tpot_p99_s: float = float("nan")
    turns: float = 0.0              # fleetgate_turns_total (turns mode)
    lost_model_s: float = 0.0       # model seconds the live engines skipped because the host fell behind
    quota_s: float = float("nan")   # turns: mean quota of the planned rounds sampled during the run, model s


async def replay(url: str, workload: list[ModelRequest], k: float, max_model_len: int, seed: int,
                 ttft_s: float, tpot_s: float) -> tuple[dict[str, int], list[float], list[int]]:
    """Send the workload at arrival / k; (counts met / completed / ttft_missed / tpot_missed / tokens_on_time,
    TTFTs then mean TPOTs in model seconds (a list of two lists), failure statuses). A token is on time when it
    arrives by arrival + TTFT target + i x TPOT target (Aegaeon's token measure, as the simulator's)."""
    failures: list[int] = []
    ttfts: list[float] = []
    tpots: list[float] = []
    n = {"met": 0, "completed": 0, "ttft_missed": 0, "tpot_missed": 0, "tokens_on_time": 0}
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
                                n["tokens_on_time"] += (now - sent) * k <= ttft_s + tokens * tpot_s
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
            tpots.append(tpot)
            n["ttft_missed"] += ttft > ttft_s
            n["tpot_missed"] += tpot > tpot_s
            n["met"] += ttft <= ttft_s and tpot <= tpot_s

        await asyncio.gather(*(one(i, r) for i, r in enumerate(workload)))
    return n, [ttfts, tpots], failures


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _sample_quotas(url: str, k: float, out: list[float]) -> None:
    """Turns mode: the quotas of each host's current round (/ui/status.json), in model seconds, every second."""
    async with aiohttp.ClientSession() as s:
        while True:
            await asyncio.sleep(1.0)
            with contextlib.suppress(aiohttp.ClientError, ValueError, KeyError):
                async with s.get(url + "/ui/status.json") as r:
                    for h in (await r.json())["shared_hosts"]:
                        if h.get("round"):
                            out.extend(q * k for q in h["round"]["quotas_s"])


async def live_run(spec: PooledSpec, k: float, drain_after_s: float | None, mode: str = "request",
                   engine_profile: bool = False) -> LiveSide:
    prof = load_profile(spec.profile)
    wl = multi_model_workload(spec.mix, spec.duration, spec.seed)
    models = list(wl.rates)
    cost = swap_cost(prof.weight_bytes, prof.host_link_bytes_per_s, spec.reinit, prof.wake_up_s)
    wake_s = cost.load_s
    servers = [{"name": f"h{h}-{m}", "model": m, "profile": spec.profile,
                "profile_overrides": {"wake_up_s": wake_s}} for h in range(spec.workers) for m in models]
    fleet_file = Path(tempfile.mkstemp(suffix=".yaml")[1])
    fleet_file.write_text(yaml.safe_dump({"servers": servers}))
    wrapper = ["taskset", "-c", "1"] if shutil.which("taskset") and (os.cpu_count() or 1) > 1 else []
    try:
        with FleetProcess(fleet_file=fleet_file, time_scale=k, seed=spec.seed, wrapper=wrapper) as fleet:
            urls = iter(fleet.urls)
            drain = drain_after_s / k if drain_after_s is not None else None
            if mode == "turns":    # the simulator's tbt, Q_MAX and swap costs, in wall seconds
                hosts = [{"id": f"h{h}", "max_awake": 1, "scheduling": "turns", "sleep_level": 1,
                          "tbt_ms": spec.slo_tpot_s * 1000 / k, "q_max_s": spec.q_max_s / k,
                          "engines": {m: {"url": next(urls), "load_s": cost.load_s / k,
                                          **({"profile": spec.profile} if engine_profile else {}),
                                          "offload_s": cost.offload_s / k} for m in models}}
                         for h in range(spec.workers)]
            else:
                hosts = [{"id": f"h{h}", "max_awake": 1, "engines": {m: next(urls) for m in models},
                          "drain_after_s": drain} for h in range(spec.workers)]
            cfg = load_config(None, listen={"host": "127.0.0.1", "port": 0}, shared_hosts=hosts,
                              default_policy="least_requests", scrape_interval_s=0.5 / k,
                              limits={"queue_timeout_s": spec.drain_s / k, "queue_size": 100000},
                              health={"interval_s": 1.0})
            async with GatewayServer(cfg) as gw:
                quotas: list[float] = []
                sampler = asyncio.create_task(_sample_quotas(gw.url, k, quotas)) if mode == "turns" else None
                n, ttfts, failures = await replay(gw.url, wl.requests, k, prof.max_model_len,
                                                               spec.seed, spec.slo_ttft_s, spec.slo_tpot_s)
                if sampler is not None:
                    sampler.cancel()
                async with aiohttp.ClientSession() as s:
                    async with s.get(gw.url + "/metrics") as r:
                        text = await r.text()
                    lost = 0.0
                    for u in fleet.urls:
                        async with s.get(u + "/sim/state") as r:
                            lost += (await r.json()).get("lost_model_s", 0.0)
    finally:
        fleet_file.unlink(missing_ok=True)
    swaps_in = sum(metric(text, "fleetgate_model_swaps_total", {"model": m, "direction": "in"}) or 0.0
                   for m in models)
    turns = sum(metric(text, "fleetgate_turns_total", {"host": f"h{h}", "model": m}) or 0.0
                for h in range(spec.workers) for m in models)
    ttfts, tpots = ttfts
    total_tokens = sum(r.output_tokens for r in wl.requests)
    return LiveSide(n["met"] / len(wl.requests), n["completed"], len(wl.requests), _pct(ttfts, 0.99), swaps_in,
                    failures, n["ttft_missed"], n["tpot_missed"], mode, n["tokens_on_time"] / total_tokens,
                    _pct(ttfts, 0.5), _pct(tpots, 0.5), _pct(tpots, 0.99), turns, lost,
                    sum(quotas) / len(quotas) if quotas else float("nan"))


LAST_RUN = "## Live: the last recorded run, as bench.pooling_live wrote it"


def _ms(a: float, b: float) -> str:
    return f"{a * 1000:.0f} / {b * 1000:.0f}"


def _s(a: float, b: float) -> str:
    return f"{a:.2f} / {b:.2f}"


def section(runs: list[tuple[PooledSpec, dict, LiveSide]], k: float, drain_after: float | None, cmd: str,
            load: str) -> str:
    spec = runs[0][0]
    rows, notes = [], []
    for sp, sim, live in runs:
        diff = (live.attainment - sim["slo_attainment"]) * 100
        ok = abs(diff) <= TOLERANCE_PP
        fail = f"{len(live.failures)} failed ({sorted(set(live.failures))})" if live.failures else "0"
        switches = f"{sim['swaps']} / {live.swaps_in:g}" + (f" ({live.turns:g} turns)" if live.mode == "turns" else "")
        rows.append(f"| {live.mode} ({sp.label}) | {sim['slo_attainment']:.3f} | {live.attainment:.3f} | "
                    f"{diff:+.1f} ({'within' if ok else 'OUTSIDE'}) | {sim['token_slo_attainment']:.3f} / "
                    f"{live.token_attainment:.3f} | {switches} | {_s(sim['ttft_p50'], sim['ttft_p99'])} | "
                    f"{_s(live.ttft_p50_s, live.ttft_p99_s)} | {_ms(sim['tpot_p50'], sim['tpot_p99'])} | "
                    f"{_ms(live.tpot_p50_s, live.tpot_p99_s)} | {sim['completed']}/{sim['servable']} / "
                    f"{live.completed}/{live.requests} | {fail} | {live.lost_model_s:.2f} |")
        quota = (f"; turn quotas: simulator mean {sim['turn_quota_mean_s']:.2f} s, live mean {live.quota_s:.2f} "
                 "model s (sampled each second)" if live.mode == "turns" and "turn_quota_mean_s" in sim else "")
        notes.append(f"{live.mode}: live misses TTFT {live.ttft_missed}, mean TPOT {live.tpot_missed}{quota}.")
    return "\n".join([
        LAST_RUN, "",
        f"- command: `{cmd}`", f"- commit: `{git_commit()}`", f"- machine: {machine_info()}",
        f"- load average (1, 5, 15 min) before / after: {load}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
        f"Point: `{spec.profile}`, M = {spec.num_models} models x lambda = {spec.rate / spec.num_models:g} req/s, "
        f"N = {spec.workers} hosts (max_awake 1, every model on every host), {spec.duration:g} s of arrivals, seed "
        f"{spec.seed}, SLO TTFT {spec.slo_ttft_s:g} s / mean TPOT {spec.slo_tpot_s * 1000:g} ms. Live: time scale "
        f"K = {k:g}, one simulated engine per (model, host) whose wake-up is the simulator's swap cost; request "
        f"mode: the shared_hosts swap controller, drain_after_s = "
        f"{'none (idle engines only)' if drain_after is None else f'{drain_after:g} model s'}; turns mode: "
        "`scheduling: turns` (level 1, tbt = the TPOT target, Q_MAX and swap costs of the simulator, all / K). "
        "Attainment judged per request by the client in model seconds; token attainment: output tokens by "
        "arrival + TTFT target + i x TPOT target over all output tokens. Switches: the simulator's swaps / the "
        "gateway's wake-ups (fleetgate_model_swaps_total in). Lost model s: model time the live engines "
        "skipped because the machine fell behind (0: they kept up).", "",
        "| mode | sim attainment | live attainment | diff pp (5 pp target) | token attainment sim / live | "
        "switches sim / live | TTFT p50 / p99 s sim | TTFT p50 / p99 s live | TPOT p50 / p99 ms sim | "
        "TPOT p50 / p99 ms live | completed sim / live | "
        "live failed | lost model s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows, "", *notes, ""])


def write_results(text: str) -> None:
    """Replace the last-run section of bench/results/pooling.md (appended when there is none)."""
    md = RESULTS_MD.read_text()
    if LAST_RUN in md:
        head, rest = md.split(LAST_RUN, 1)
        tail = rest[rest.index("\n## "):] if "\n## " in rest else ""
        md = head + text + tail
    else:
        md += "\n" + text
    RESULTS_MD.write_text(md)


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


async def main_async(args: argparse.Namespace) -> list[tuple[PooledSpec, dict, LiveSide]]:
    base = {"num_models": args.models, "rate": args.models * args.lam, "workers": args.workers,
            "profile": args.profile, "duration": args.duration, "seed": args.seed}
    specs = {"request": PooledSpec(pooling="request", **base),
             # with engine profiles the gateway estimates each turn's recomputation (shared_hosts recompute_quota,
             # on by default; without a profile it estimates nothing): the simulator's recompute_quota matches it
             "turns": PooledSpec(pooling="aegaeon", prefill_fraction=0, turns_placement="all",
                                 recompute_quota=args.engine_profile, **base)}
    runs = []
    for mode in args.modes:
        spec = specs[mode]
        res = simulate_pooled(spec)
        sim = res.to_dict()
        quotas = [q for r in res.decode_rounds for q in r.quotas]
        if quotas:
            sim["turn_quota_mean_s"] = sum(quotas) / len(quotas)
        print(f"simulator {spec.label}: attainment {sim['slo_attainment']:.3f}, swaps {sim['swaps']}", flush=True)
        live = await live_run(spec, args.time_scale, args.drain_after, mode, args.engine_profile)
        print(f"live {mode}: attainment {live.attainment:.3f}, completed {live.completed}/{live.requests}, swaps "
              f"in {live.swaps_in:g}, turns {live.turns:g}, TTFT missed {live.ttft_missed}, TPOT missed "
              f"{live.tpot_missed}, TTFT p99 {live.ttft_p99_s:.3g} s, lost model s {live.lost_model_s:.2f}, "
              f"failures {live.failures[:10]}", flush=True)
        runs.append((spec, sim, live))
    return runs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--models", type=int, default=8)
    ap.add_argument("--lam", type=float, default=0.1, help="req/s per model")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--duration", type=float, default=300.0, help="model seconds of arrivals")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--time-scale", type=float, default=2.0)
    ap.add_argument("--modes", type=lambda v: v.split(","), default=["request", "turns"],
                    help="comma-separated: request (request-level swapping), turns (decode turns)")
    ap.add_argument("--drain-after", type=lambda v: None if v == "none" else float(v), default=None,
                    help="model seconds a model waits before a busy engine is drained for it (shared_hosts "
                    "drain_after_s x K); 'none': only idle engines are swapped out")
    ap.add_argument("--engine-profile", action="store_true",
                    help="turns: give the live engines the profile, so eq. 2-3 use the learner's decode step time "
                    "(wall seconds: meaningful at K = 1)")
    ap.add_argument("--quick", action="store_true", help="60 model seconds, printed only")
    ap.add_argument("--print-only", action="store_true", help="do not write bench/results/pooling.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.duration = 60.0
    before = _load()
    runs = asyncio.run(main_async(args))
    cmd = ("python -m bench.pooling_live " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    text = section(runs, args.time_scale, args.drain_after, cmd, f"{before} / {_load()}")
    print(text)
    if not (args.quick or args.print_only):
        write_results(text)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
