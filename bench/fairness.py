"""Fair sharing between tenants (policies/service_priority.py `vtc`, Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024) against FCFS, over capacity.

    .venv/bin/python -m bench.fairness            # virtual time + one live point; writes bench/results/fairness.md
    .venv/bin/python -m bench.fairness --quick    # virtual time only, shorter runs, no files

Setting (chosen before any run, the same for every order):
- 2 workers `llama3-8b-h100`; each takes at most CAP requests (the gateway's worker `cap`, and vLLM's
  `--max-num-seqs` CAP), so the requests beyond that wait in the gateway's admission queue, which the order sorts;
  placement `least_requests`. Queue timeout 600 s (nobody is refused for waiting: the queueing delay shows).
- Tenants are services of the simulator's workload (simulator/services.py), each its own Poisson stream of
  ShareGPT lengths: `heavy` at 10x the rate of `light`, the total at LOAD x the fleet's capacity (capacity: the
  completed requests per second of a saturated run). A third table adds `gold`, at heavy's rate with weight 2.
- Requests have no TTFT target (the admission queue would refuse them at it) and no request is refused.
- Measured: TTFT p50 / p99 per tenant (completed requests); the light tenant alone (the same light requests,
  without the others') is the reference: target VTC's light p99 <= 1.5x alone. A bound row ("light first"): the
  same two-tenant runs with every light request ahead of every heavy one in the queue, the best any order that
  neither preempts nor leaves a slot idle can give the light tenant (a measuring stick, not a policy). Throughput: output tokens/s; per
  tenant, the service VTC counts (prompt x 1 + output x 2, over the tenant's weight) per second of the arrival
  window, of the requests finished inside it (the backlogged period: afterwards every queue drains whatever the
  order, so the whole run's totals would be the demand, the same under every order). Work conservation:
  the time some worker has a free slot (fewer than CAP requests) while a request waits in the queue, sampled every
  SAMPLE_S of virtual time.
- Live point: `fleetgate serve` with two API keys (tenants `heavy` and `light`) in front of one simulated worker
  (`fleetgate sim`, real time at LIVE_TIME_SCALE), worker cap LIVE_CAP; equal requests of LIVE_TOKENS streamed
  tokens; capacity from a closed loop, then light alone, FCFS and VTC at LOAD x capacity, TTFT seen by the client.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import yaml

from bench.harness import free_port, http_json, run_sim_server, running_process
from bench.report import git_commit, write_report
from policies.service_priority import ServiceScheduler, make_service_scheduler
from simulator.cluster import ClusterSim
from simulator.engine import EngineConfig
from simulator.services import ServiceSpec, service_workload
from simulator.workload import WorkloadRequest

ROOT = Path(__file__).parents[1]
RESULTS_MD = ROOT / "bench" / "results" / "fairness.md"
RESULTS_PNG = ROOT / "bench" / "results" / "fairness.png"
PROFILE = "llama3-8b-h100"
WORKERS = 2
CAP = 32
LOAD = 1.3                 # total arrival rate / capacity
HEAVY_X = 10.0             # heavy's rate / light's rate
QUEUE_TIMEOUT_S = 600.0
SAMPLE_S = 0.01
CAPACITY_PROBE_RATE = 40.0   # req/s offered to find the capacity
TARGET = 1.5               # light's TTFT p99 under VTC / alone
ORDERS = ("fcfs", "vtc")
TWO = [ServiceSpec("heavy", "sharegpt", HEAVY_X), ServiceSpec("light", "sharegpt", 1.0)]
THREE = [*TWO, ServiceSpec("gold", "sharegpt", HEAVY_X)]
WEIGHTS = {"gold": 2.0}


@dataclass
class Run:
    order: str
    tenants: dict[str, dict[str, float]]
    throughput: float           # output tokens / s
    idle_waiting_s: float       # worker-slot idle while the queue held a request (s, summed over samples)
    queued_s: float             # time the queue held a request
    duration: float


def workload(specs: list[ServiceSpec], rate: float, duration: float, seed: int) -> list[WorkloadRequest]:
    return service_workload(specs, rate=rate, duration=duration, seed=seed)


class LightFirst(ServiceScheduler):
    """The bound row's order: the light tenant's requests before any other's, each tenant in arrival order."""

    name = "light_first"

    def _key(self, t: Any, now: float) -> tuple[float, ...]:
        return (0.0 if t.service == "light" else 1.0, t.seq)


def simulate(wl: list[WorkloadRequest], order: str, weights: dict[str, float] | None = None) -> Run:
    if order == LightFirst.name:
        sched: ServiceScheduler = LightFirst()
    else:
        sched = make_service_scheduler(order, **({"weights": weights} if order == "vtc" and weights else {}))
    sim = ClusterSim(PROFILE, WORKERS, "least_requests", cap=CAP, engine_config=EngineConfig(max_num_seqs=CAP),
                     service_priority=sched, queue_timeout_s=QUEUE_TIMEOUT_S, queue_size=1_000_000, seed=0,
                     slo_ttft_s=QUEUE_TIMEOUT_S)   # a TTFT target is also a queue deadline: none here
    last = max(r.arrival for r in wl)
    idle = [0.0, 0.0]

    def sample(s: ClusterSim, t: float) -> None:
        if s.queue:
            idle[1] += SAMPLE_S
            if any(w.inflight < CAP for w in s.workers.values()):
                idle[0] += SAMPLE_S
        if t < last or s.queue:
            s.schedule(t + SAMPLE_S, sample)

    sim.schedule(wl[0].arrival, sample)
    res = sim.run(wl)
    by_id = {r.request_id: r for r in wl}
    results = res.results
    span = max((r.finished for r in results if r.finished is not None), default=last) - wl[0].arrival
    tenants: dict[str, dict[str, float]] = {}
    for name in sorted({r.service for r in wl}):
        mine = [r for r in results if by_id[r.request_id].service == name]
        ttft = np.array([r.ttft for r in mine if r.completed and r.ttft is not None])
        w = (weights or {}).get(name, 1.0)
        served = sum(r.prompt_tokens * 1.0 + r.output_tokens * 2.0 for r in mine
                     if r.completed and r.finished is not None and r.finished <= last) / w
        tenants[name] = {
            "requests": len(mine), "completed": sum(1 for r in mine if r.completed),
            "ttft_p50": float(np.percentile(ttft, 50)) if ttft.size else float("nan"),
            "ttft_p99": float(np.percentile(ttft, 99)) if ttft.size else float("nan"),
            "service_per_s": served / (last - wl[0].arrival),
        }
    out_tokens = sum(r.output_tokens for r in results if r.completed)
    return Run(order, tenants, out_tokens / span, idle[0], idle[1], span)


def capacity(duration: float, seed: int) -> float:
    """Completed requests per second of the fleet kept saturated (ShareGPT lengths at CAPACITY_PROBE_RATE, about 4x
    what it completes: the queue never empties)."""
    wl = workload([ServiceSpec("all", "sharegpt")], CAPACITY_PROBE_RATE, duration, seed)
    run = simulate(wl, "fcfs")
    return run.tenants["all"]["completed"] / run.duration


def fmt(x: float, nd: int = 2) -> str:
    return "n/a" if x != x else f"{x:.{nd}f}"


def table(runs: dict[str, list[Run]], alone: list[Run] | None, weights: dict[str, float],
          bound: list[Run] | None = None) -> str:
    names = list(runs[ORDERS[0]][0].tenants)
    head = ["order", "tenant", "weight", "requests", "TTFT p50 (s)", "TTFT p99 (s)", "service/s (VTC units)"]
    if alone is not None:
        head.append("p99 / light alone")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ref = statistics.fmean(r.tenants["light"]["ttft_p99"] for r in alone) if alone else None
    if alone is not None:
        a = alone
        lines.append(f"| light alone | light | 1 | {statistics.fmean(r.tenants['light']['requests'] for r in a):.0f} | "
                     f"{fmt(statistics.fmean(r.tenants['light']['ttft_p50'] for r in a))} | {fmt(ref)} | "
                     f"{statistics.fmean(r.tenants['light']['service_per_s'] for r in a):.0f} | 1.00 |")
    if bound is not None and ref is not None:
        b99 = statistics.fmean(r.tenants["light"]["ttft_p99"] for r in bound)
        lines.append(f"| light first (bound) | light | - | "
                     f"{statistics.fmean(r.tenants['light']['requests'] for r in bound):.0f} | "
                     f"{fmt(statistics.fmean(r.tenants['light']['ttft_p50'] for r in bound))} | {fmt(b99)} | "
                     f"{statistics.fmean(r.tenants['light']['service_per_s'] for r in bound):.0f} | "
                     f"{fmt(b99 / ref)} |")
    for order in ORDERS:
        rs = runs[order]
        for n in names:
            p50 = statistics.fmean(r.tenants[n]["ttft_p50"] for r in rs)
            p99 = statistics.fmean(r.tenants[n]["ttft_p99"] for r in rs)
            row = [order, n, f"{weights.get(n, 1.0):g}" if order == "vtc" else "-",
                   f"{statistics.fmean(r.tenants[n]['requests'] for r in rs):.0f}", fmt(p50), fmt(p99),
                   f"{statistics.fmean(r.tenants[n]['service_per_s'] for r in rs):.0f}"]
            if ref is not None:
                row.append(fmt(p99 / ref) if n == "light" else "")
            lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append("| order | output tokens/s | time queue non-empty (s) | worker slot idle while queue non-empty (s) |")
    lines.append("|---|---|---|---|")
    for order in ORDERS:
        rs = runs[order]
        lines.append(f"| {order} | {statistics.fmean(r.throughput for r in rs):.0f} | "
                     f"{statistics.fmean(r.queued_s for r in rs):.1f} | "
                     f"{statistics.fmean(r.idle_waiting_s for r in rs):.2f} |")
    return "\n".join(lines)


def virtual(duration: float, seeds: list[int]) -> tuple[str, dict[str, Any]]:
    cap = statistics.fmean(capacity(min(duration, 60.0), s) for s in seeds)
    rate2 = LOAD * cap
    light_rate = rate2 / (HEAVY_X + 1.0)
    print(f"capacity {cap:.2f} req/s; two tenants at {rate2:.2f} req/s (light {light_rate:.2f})", file=sys.stderr)
    alone = [simulate([r for r in workload(TWO, rate2, duration, s) if r.service == "light"], "fcfs") for s in seeds]
    two = {o: [simulate(workload(TWO, rate2, duration, s), o) for s in seeds] for o in ORDERS}
    bound = [simulate(workload(TWO, rate2, duration, s), LightFirst.name) for s in seeds]
    rate3 = light_rate * (2 * HEAVY_X + 1.0)
    three = {o: [simulate(workload(THREE, rate3, duration, s), o, WEIGHTS) for s in seeds] for o in ORDERS}
    data = {"capacity": cap, "rate2": rate2, "rate3": rate3, "light_rate": light_rate, "alone": alone, "two": two,
            "three": three, "bound": bound}
    body = (f"Capacity (saturated run): {cap:.2f} requests/s. Seeds {seeds}, {duration:g} s of arrivals each; "
            f"every number is the mean over the seeds.\n\n"
            f"### Two tenants: heavy at {HEAVY_X:g}x light, total {rate2:.2f} req/s = {LOAD:g}x capacity\n\n"
            + table(two, alone, {}, bound) +
            f"\n\n### Three tenants: heavy, light, and gold at heavy's rate with weight 2; total {rate3:.2f} req/s "
            f"= {rate3 / cap:.2f}x capacity\n\n" + table(three, alone, WEIGHTS))
    return body, data


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in [(axes[0], "two", "two tenants"), (axes[1], "three", "three tenants (gold weight 2)")]:
        runs = data[key]
        names = list(runs[ORDERS[0]][0].tenants)
        x = np.arange(len(names))
        for i, order in enumerate(ORDERS):
            p99 = [statistics.fmean(r.tenants[n]["ttft_p99"] for r in runs[order]) for n in names]
            ax.bar(x + (i - 0.5) * 0.4, p99, 0.4, label=order)
        alone = statistics.fmean(r.tenants["light"]["ttft_p99"] for r in data["alone"])
        ax.axhline(alone * TARGET, color="k", ls="--", lw=1, label="1.5x light alone")
        ax.set_yscale("log")
        ax.set_xticks(x, names)
        ax.set_ylabel("TTFT p99 (s, log)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the live point: the gateway (real time, real HTTP) in front of one simulated vLLM worker -----------------------
LIVE_MODEL = "fairness-live"
LIVE_CAP = 8                 # the worker's cap in the gateway: beyond it requests queue in the gateway
LIVE_TIME_SCALE = 0.5        # the simulated engine runs 2x slower than an H100 (keeps the client's load small)
LIVE_TOKENS = 64             # every request: the same short prompt, 64 generated tokens (ignore_eos), streamed
LIVE_DURATION_S = 30.0
LIVE_KEYS = {"heavy": "sk-fairness-heavy-0001", "light": "sk-fairness-light-0001"}


@dataclass
class LiveSample:
    tenant: str
    sent: float
    ttft: float | None
    status: int


async def _send(session: aiohttp.ClientSession, url: str, tenant: str, t0: float, out: list[LiveSample]) -> None:
    body = orjson.dumps({"model": LIVE_MODEL, "messages": [{"role": "user", "content": "tell me a story"}],
                         "max_tokens": LIVE_TOKENS, "ignore_eos": True, "stream": True})
    sent = time.perf_counter()
    ttft, status = None, 0
    try:
        async with session.post(url + "/v1/chat/completions", data=body, headers={
                "content-type": "application/json", "authorization": f"Bearer {LIVE_KEYS[tenant]}"}) as resp:
            status = resp.status
            async for line in resp.content:
                if ttft is None and line.startswith(b"data: {"):
                    ttft = time.perf_counter() - sent
    except (TimeoutError, aiohttp.ClientError):
        pass
    out.append(LiveSample(tenant, sent - t0, ttft, status))


async def open_loop(url: str, rates: dict[str, float], duration: float, seed: int) -> tuple[list[LiveSample], float]:
    """Poisson arrivals per tenant for `duration` s, each tenant its own random stream (a tenant's arrivals are the
    same with or without the others); waits for every answer. Returns the samples and the wall time."""
    plan = []
    for tenant, rate in rates.items():
        rng = random.Random(seed * 1009 + list(LIVE_KEYS).index(tenant))
        t = rng.expovariate(rate)
        while t < duration:
            plan.append((t, tenant))
            t += rng.expovariate(rate)
    plan.sort()
    out: list[LiveSample] = []
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        t0 = time.perf_counter()
        tasks = []
        for at, tenant in plan:
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(_send(session, url, tenant, t0, out)))
        await asyncio.gather(*tasks)
        return out, time.perf_counter() - t0


async def closed_loop_rate(url: str, concurrency: int, duration: float) -> float:
    """Completed requests per second with `concurrency` requests always in flight (the fleet saturated)."""
    out: list[LiveSample] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()

        async def worker() -> None:
            while time.perf_counter() - t0 < duration:
                await _send(session, url, "heavy", t0, out)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return sum(1 for s in out if s.status == 200) / wall


def live_config(worker: str, order: str, path: Path) -> None:
    cfg = {"workers": [{"id": "w0", "url": worker, "cap": LIVE_CAP}],
           "auth": {"keys": [{"key": k, "name": n} for n, k in LIVE_KEYS.items()]},
           "service_priority": {"order": order, "service_from": ["tenant"]},
           "limits": {"queue_timeout_s": 600, "queue_size": 100_000}}
    path.write_text(yaml.safe_dump(cfg))


def keyed_gateway(config: Path) -> Any:
    """`fleetgate serve -c config` on a free port, ready once the model is listed to the heavy tenant's key (the
    harness's run_gateway checks readiness without a key, which a gateway with keys refuses)."""
    url = f"http://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1],
           "-c", str(config)]

    def ready() -> bool:
        try:
            models = http_json(url + "/v1/models", headers={"Authorization": f"Bearer {LIVE_KEYS['heavy']}"})
        except (OSError, ValueError):
            return False
        return any(m.get("id") == LIVE_MODEL for m in models.get("data", []))

    return running_process(cmd, "gateway", url + "/health", ready), url


def live_stats(samples: list[LiveSample], tenant: str) -> dict[str, float]:
    mine = [s for s in samples if s.tenant == tenant]
    ttft = np.array([s.ttft for s in mine if s.status == 200 and s.ttft is not None])
    return {"requests": len(mine), "ok": int(sum(1 for s in mine if s.status == 200)),
            "ttft_p50": float(np.percentile(ttft, 50)) if ttft.size else float("nan"),
            "ttft_p99": float(np.percentile(ttft, 99)) if ttft.size else float("nan")}


def live(duration: float = LIVE_DURATION_S) -> str:
    with run_sim_server(PROFILE, None, LIVE_MODEL, time_scale=LIVE_TIME_SCALE) as worker, \
            tempfile.TemporaryDirectory(prefix="fleetgate-fairness-") as tmp:
        results: dict[str, list[LiveSample]] = {}
        cap_rate = 0.0
        for order in ORDERS:
            cfg = Path(tmp) / f"{order}.yaml"
            live_config(worker, order, cfg)
            proc, url = keyed_gateway(cfg)
            with proc:
                if not cap_rate:
                    cap_rate = asyncio.run(closed_loop_rate(url, 3 * LIVE_CAP, 15.0))
                    total = LOAD * cap_rate
                    light_rate = total / (HEAVY_X + 1.0)
                    print(f"live capacity {cap_rate:.2f} req/s; light {light_rate:.2f}", file=sys.stderr)
                    results["alone"], _ = asyncio.run(open_loop(url, {"light": light_rate}, duration, 1))
                results[order], _ = asyncio.run(open_loop(url, {"heavy": light_rate * HEAVY_X,
                                                                "light": light_rate}, duration, 1))
    alone = live_stats(results["alone"], "light")
    lines = [f"One simulated `{PROFILE}` worker at time scale {LIVE_TIME_SCALE:g} behind `fleetgate serve` (worker cap "
             f"{LIVE_CAP}), requests of {LIVE_TOKENS} streamed tokens, {duration:g} s of Poisson arrivals per run; "
             f"capacity (closed loop, {3 * LIVE_CAP} in flight): {cap_rate:.2f} req/s; two tenants at "
             f"{LOAD:g}x that, heavy at {HEAVY_X:g}x light ({light_rate:.2f} req/s). TTFT measured by the client.",
             "", "| order | tenant | requests (200) | TTFT p50 (s) | TTFT p99 (s) | p99 / light alone |",
             "|---|---|---|---|---|---|",
             f"| light alone | light | {alone['ok']}/{alone['requests']} | {fmt(alone['ttft_p50'])} | "
             f"{fmt(alone['ttft_p99'])} | 1.00 |"]
    for order in ORDERS:
        for tenant in ("heavy", "light"):
            st = live_stats(results[order], tenant)
            ratio = fmt(st["ttft_p99"] / alone["ttft_p99"]) if tenant == "light" else ""
            lines.append(f"| {order} | {tenant} | {st['ok']}/{st['requests']} | {fmt(st['ttft_p50'])} | "
                         f"{fmt(st['ttft_p99'])} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="virtual time only, 60 s, one seed, no files")
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--no-live", action="store_true", help="skip the live point")
    args = ap.parse_args(argv)
    commit = git_commit()
    if args.quick:
        body, _ = virtual(60.0, [0])
        print(body)
        return 0
    body, data = virtual(args.duration, list(range(args.seeds)))
    print(body)
    RESULTS_MD.parent.mkdir(parents=True, exist_ok=True)
    plot(data, RESULTS_PNG)
    text = "## Virtual time (ClusterSim)\n\n" + body + f"\n\n![TTFT p99 per tenant]({RESULTS_PNG.name})\n"
    if not args.no_live:
        text += "\n## Live point (real time, real HTTP)\n\n" + live() + "\n"
    write_report(RESULTS_MD, "Fair sharing between tenants: VTC against FCFS", "python -m bench.fairness "
                 + " ".join(argv if argv is not None else sys.argv[1:]), text, commit=commit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
