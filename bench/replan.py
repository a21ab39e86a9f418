"""SeaLLM's diurnal setting (SeaLLM section 4.3): fixed placement vs fixed-interval re-placement vs
SeaLLM's adaptive interval, in the virtual-time simulator -> bench/results/replan.md + replan.png.

    nice -n 5 .venv/bin/python -m bench.replan            # full run, writes the results
    nice -n 5 .venv/bin/python -m bench.replan --quick    # a shorter day, fewer arms, no files

Setting (stated before any run, the same for every arm):
- 4 services, one model each, on A100s (stock 64): llama3-8b and llama2-13b with Azure conversation lengths
  (`azure_conv`), mistral-7b and qwen2.5-14b with ShareGPT lengths (`sharegpt`); lengths drawn from the shipped
  traces' rows, arrivals Poisson with a diurnal rate: rate_s(t) = base_s · (1 + A·sin(2π·t / DAY + φ_s)),
  A = 0.7, DAY = 3600 simulated seconds (a day compressed into an hour: the shipped traces span an hour or less),
  φ_s = 2π·s / 4 (the services peak at different times, so the best placement moves between them), base rates
  4, 2, 2, 1 req/s. SLO: TTFT 1 s, TPOT 50 ms; routing `least_requests` with the gateway's admission queue.
- Every arm starts from the same plan: the closed-form plan for the day's mean rates (policies/replan.py
  `replan` from an empty fleet). "fixed placement" keeps it all day (SeaLLM-A in SeaLLM section 6.3).
- Re-placement (the same policy functions as the gateway's leader, gateway/control/replanner.py): at the end of each
  interval, the demands of the interval just past (policies/replan.py `demands_between` on its arrivals and
  lengths) go to `replan` (closed forms over policies/planning.py, target 0.95, min saving 10 %); a changed plan
  starts its new instances, which take traffic after a 30 s cold start (Chiron section 6: 30-60 s), and drains the
  dropped ones once the new ones are up (make before break, as the sim actuator does), so a re-placement costs
  GPU time, not failed requests.
- Fixed intervals: 60, 120, 300, 600 s. Adaptive: SeaLLM eq. 8 (section 4.3, `next_interval`), β = 0.1,
  I_0 = 60 s and 300 s (both run: the paper leaves I_0 to the operator), bounds [60, 1200] s. The estimate M_est is what SeaLLM's simulator does before each interval: the
  new plan simulated on the last interval's arrivals; M_real is measured on the requests that finish in the
  interval. Two metrics are run as separate arms: SLO attainment, and mean normalized latency (e2e / output
  tokens, SeaLLM's eq. 1 per token).
- Reported per arm: mean normalized latency, SLO attainment, re-placements, GPU-hours.
Target: adaptive within 10 % of the best fixed interval's normalized latency, with fewer re-placements.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.report import git_commit, write_report
from policies.hardware import model_spec
from policies.length_predictor import LengthPredictor
from policies.planning import InstanceGroup, ServiceDemand, Slo, parse_stock
from policies.replan import ModelTotals, demands_between, group_key, next_interval, replan
from simulator.cluster import ClusterSim, RequestResult
from simulator.deployment import group_profile
from simulator.progress import stderr_progress
from simulator.workload import WorkloadRequest, trace_rows

RESULTS_MD = Path(__file__).resolve().parent / "results" / "replan.md"
SERVICES = (("llama3-8b", "azure_conv", 4.0), ("mistral-7b", "sharegpt", 2.0), ("llama2-13b", "azure_conv", 2.0),
            ("qwen2.5-14b", "sharegpt", 1.0))
AMPLITUDE, DAY = 0.7, 3600.0
STOCK = ["a100:64"]
SLO = Slo(1.0, 0.05)
TARGET = 0.95
COLD_START_S = 30.0
FIXED = (60.0, 120.0, 300.0, 600.0)
ADAPTIVE = dict(lo=60.0, hi=1200.0, beta=0.1)
ADAPTIVE_I0 = (60.0, 300.0)      # I_0 "selected by the cluster manager" (SeaLLM section 4.3): both are run
POLICY = "least_requests"
WITHIN = 0.10


def multiplier(t: float, s: int, n: int, amplitude: float = AMPLITUDE, day: float = DAY) -> float:
    """The stated diurnal rate multiplier of service `s` of `n` at time t."""
    return 1.0 + amplitude * math.sin(2 * math.pi * t / day + 2 * math.pi * s / n)


def diurnal_workload(day: float, seed: int) -> dict[str, list[WorkloadRequest]]:
    """Each service's requests over one day: Poisson arrivals thinned to the diurnal rate, lengths from its trace."""
    out: dict[str, list[WorkloadRequest]] = {}
    n = len(SERVICES)
    for s, (model, trace, base) in enumerate(SERVICES):
        rng = random.Random(seed * 1000 + s)
        rows = trace_rows(trace)
        peak = base * (1 + AMPLITUDE)
        t, reqs = 0.0, []
        while True:
            t += rng.expovariate(peak)
            if t >= day:
                break
            if rng.random() * peak <= base * multiplier(t, s, n, day=day):
                p, o = rows[rng.randrange(len(rows))]
                reqs.append(WorkloadRequest(f"{model}-{len(reqs)}", t, p, o))
        out[model] = reqs
    return out


# ---- one model's fleet, re-placed over time ----------------------------------------------------------------
class Fleet:
    """A model's ClusterSim whose instances follow the plan (`apply` at a re-placement moment)."""

    def __init__(self, model: str, groups: Sequence[InstanceGroup], history: Sequence[WorkloadRequest],
                 seed: int) -> None:
        self.model = model
        predictor = LengthPredictor()
        for r in history:
            predictor.observe(model_spec(model).hf_id, r.prompt_tokens, r.output_tokens)
        profiles = [group_profile(g.model, g.gpu, g.tp) for g in groups] or [group_profile(model, "a100", 1)]
        self.sim = ClusterSim(profiles, 0, POLICY, slo_ttft_s=SLO.ttft_s, slo_tpot_s=SLO.tpot_s,
                              predicted_output_tokens=predictor, seed=seed)
        self.groups: dict[str, list[str]] = {}            # group key -> worker ids (not draining)
        self.added: dict[str, float] = {}                 # worker id -> when it was started (billed from then)
        for g in groups:
            for _ in range(g.count):
                self._add(g, 0.0)

    def _add(self, g: InstanceGroup, now: float, billed_from: float | None = None) -> None:
        wid = self.sim.add_worker(group_profile(g.model, g.gpu, g.tp), now=now)
        self.groups.setdefault(group_key(g), []).append(wid)
        self.added[wid] = now if billed_from is None else billed_from

    def gpu_seconds(self, end: float) -> float:
        """GPU time from each instance's start (its cold start included) to its retirement (or `end`); counted
        here because every incremental run() restarts ClusterSim's own clock for the fleet at its first arrival."""
        return sum(w.gpus * ((w.removed_at if w.removed_at is not None else end) - self.added[w.id])
                   for w in [*self.sim.workers.values(), *self.sim.retired])

    def apply(self, groups: Sequence[InstanceGroup], now: float, cold_s: float) -> None:
        """New instances take traffic at now + cold_s; the dropped ones drain from then on (make before break)."""
        want = {group_key(g): g for g in groups if g.model == self.model}
        drop: list[str] = []
        for key, wids in self.groups.items():
            extra = len(wids) - (want[key].count if key in want else 0)
            if extra > 0:
                busy = sorted(wids, key=lambda w: self.sim.workers[w].inflight if w in self.sim.workers else 0)
                drop += busy[:extra]
                self.groups[key] = [w for w in wids if w not in busy[:extra]]
        adds = [g for key, g in want.items() for _ in range(g.count - len(self.groups.get(key, ())))]

        def at_ready(sim: ClusterSim, t: float) -> None:
            for g in adds:
                self._add(g, t, billed_from=now)
            for wid in drop:
                if wid in sim.workers:
                    sim.remove_worker(wid, t)
        self.sim.schedule(now + (cold_s if adds else 0.0), at_ready)

    def run(self, arrivals: Sequence[WorkloadRequest], until: float | None) -> None:
        self.sim.run(arrivals, until=until)


@dataclass
class Arm:
    label: str
    kind: str                    # fixed-placement | fixed | adaptive
    interval_s: float | None = None
    metric: str = "attainment"   # adaptive: what M_est / M_real compare
    replacements: int = 0
    rounds: int = 0
    intervals: list[tuple[float, float]] = field(default_factory=list)   # (time, interval) of each round
    normalized_latency: float = 0.0
    attainment: float = 0.0
    gpu_hours: float = 0.0
    wall_s: float = 0.0


def totals_of(reqs: Sequence[WorkloadRequest], model: str) -> ModelTotals:
    """What the gateway would count for these requests: every arrival; lengths of the servable ones."""
    ctx = model_spec(model).context
    ok = [r for r in reqs if r.prompt_tokens < ctx]
    return ModelTotals(len(reqs), len(ok), sum(r.prompt_tokens for r in ok),
                       sum(r.prompt_tokens ** 2 for r in ok), sum(r.output_tokens for r in ok))


def window(reqs: Sequence[WorkloadRequest], t0: float, t1: float) -> list[WorkloadRequest]:
    return [r for r in reqs if t0 <= r.arrival < t1]


def metrics_of(results: Sequence[RequestResult]) -> tuple[float, float]:
    """(mean normalized latency of the completed servable requests, SLO attainment of the servable ones)."""
    servable = [r for r in results if r.servable]
    norm = [r.normalized_latency for r in servable if r.completed and r.normalized_latency is not None]
    return (statistics.fmean(norm) if norm else math.nan,
            sum(r.slo_met for r in servable) / len(servable) if servable else math.nan)


def demands_of(work: dict[str, list[WorkloadRequest]], t0: float, t1: float) -> list[ServiceDemand]:
    before = {m: ModelTotals() for m in work}
    after = {m: totals_of(window(reqs, t0, t1), m) for m, reqs in work.items()}
    return demands_between(before, after, t1 - t0)


def estimate(groups: Sequence[InstanceGroup], work: dict[str, list[WorkloadRequest]], t0: float, t1: float,
             metric: str, seed: int) -> float:
    """SeaLLM's M_est: the plan simulated on the arrivals of [t0, t1) (section 4.3)."""
    results: list[RequestResult] = []
    for model, reqs in work.items():
        part = window(reqs, t0, t1)
        if not part:
            continue
        f = Fleet(model, [g for g in groups if g.model == model], reqs[:200], seed)
        f.run(part, None)
        results += f.sim.results.values()
    norm, att = metrics_of(results)
    return att if metric == "attainment" else norm


def run_arm(arm: Arm, work: dict[str, list[WorkloadRequest]], initial: Sequence[InstanceGroup], day: float,
            seed: int) -> Arm:
    t_wall = time.perf_counter()
    stocks = parse_stock(STOCK)
    fleets = {m: Fleet(m, [g for g in initial if g.model == m], reqs[:200], seed) for m, reqs in work.items()}
    current = tuple(initial)
    interval = arm.interval_s or 300.0         # adaptive arms: their I_0; fixed placement: just the run's chunks
    t, m_est = 0.0, None
    while t < day:
        t_next = min(t + interval, day)
        for m, f in fleets.items():
            f.run(window(work[m], t, t_next), t_next)
        if t_next >= day or arm.kind == "fixed-placement":
            t = t_next
            continue
        arm.rounds += 1
        if arm.kind == "adaptive":
            done = [r for f in fleets.values() for r in f.sim.results.values()
                    if r.finished is not None and t <= r.finished < t_next]
            norm, att = metrics_of(done)
            m_real = att if arm.metric == "attainment" else norm
            if m_est is not None:
                interval = next_interval(interval, m_est, m_real, ADAPTIVE["beta"], ADAPTIVE["lo"], ADAPTIVE["hi"])
        r = replan(demands_of(work, t, t_next), stocks, SLO, current, TARGET, mixed_only=True)
        if r.changed:
            arm.replacements += 1
            current = r.groups
            for f in fleets.values():
                f.apply(current, t_next, COLD_START_S)
        if arm.kind == "adaptive":
            m_est = estimate(current, work, t, t_next, arm.metric, seed)
        arm.intervals.append((t_next, interval))
        t = t_next
    results: list[RequestResult] = []
    gpu_s = 0.0
    for f in fleets.values():
        f.sim.run([], None)                # the requests still running finish
        results += f.sim.results.values()
        gpu_s += f.gpu_seconds(max(day, f.sim.now))
    arm.normalized_latency, arm.attainment = metrics_of(results)
    arm.gpu_hours = gpu_s / 3600
    arm.wall_s = time.perf_counter() - t_wall
    return arm


def initial_plan(work: dict[str, list[WorkloadRequest]], day: float) -> tuple[InstanceGroup, ...]:
    """The closed-form plan for the day's mean rates (every arm's starting fleet)."""
    return replan(demands_of(work, 0.0, day), parse_stock(STOCK), SLO, [], TARGET, mixed_only=True).groups


# ---- the report ------------------------------------------------------------------------------------------------
def report(arms: list[Arm], initial: Sequence[InstanceGroup], args: argparse.Namespace, seed: int,
           requests: int) -> str:
    fixed = [a for a in arms if a.kind == "fixed"]
    best = min(fixed, key=lambda a: a.normalized_latency) if fixed else None
    lines = [f"{len(SERVICES)} services over a {args.day:g} s day (seed {seed}, {requests} requests): "
             + ", ".join(f"{m} ({tr}, base {b:g} req/s)" for m, tr, b in SERVICES)
             + f"; rate multiplier 1 + {AMPLITUDE:g}·sin(2π·t/{args.day:g} + 2π·s/{len(SERVICES)}). "
             f"Stock {', '.join(STOCK)}; SLO {SLO.ttft_s * 1000:g} ms TTFT / {SLO.tpot_s * 1000:g} ms TPOT; "
             f"cold start {COLD_START_S:g} s. Starting plan (day-mean rates): "
             + ", ".join(f"{g.count}x {group_key(g)}" for g in initial) + ".", "",
             "| arm | re-placements | rounds | mean normalized latency (s/token) | vs best fixed | SLO attainment | "
             "GPU-hours | wall s |", "|---|---|---|---|---|---|---|---|"]
    for a in arms:
        rel = f"{a.normalized_latency / best.normalized_latency - 1:+.1%}" if best else "-"
        lines.append(f"| {a.label} | {a.replacements} | {a.rounds} | {a.normalized_latency:.4f} | {rel} | "
                     f"{a.attainment:.3f} | {a.gpu_hours:.1f} | {a.wall_s:.0f} |")
    lines.append("")
    if best is not None:
        lines.append(f"Best fixed interval by normalized latency: **{best.label}** ({best.normalized_latency:.4f} s/token, "
                     f"{best.replacements} re-placements).")
        for a in (a for a in arms if a.kind == "adaptive"):
            rel = a.normalized_latency / best.normalized_latency - 1
            ok = rel <= WITHIN and a.replacements < best.replacements
            lines.append(f"- {a.label}: {rel:+.1%} normalized latency vs the best fixed interval, "
                         f"{a.replacements} vs {best.replacements} re-placements: **target "
                         f"{'met' if ok else 'missed'}** (within {WITHIN:.0%} and fewer re-placements); intervals "
                         f"chosen: {', '.join(f'{i:.0f}' for _, i in a.intervals)} s.")
    lines.append("")
    return "\n".join(lines)


def tail(args: argparse.Namespace, png: Path | None) -> str:
    lines = [f"![diurnal rates and the adaptive arms' intervals (seed {args.seeds[0]})]({png.name})", ""] if png else []
    lines += [NOTES, "", f"Wall time of the whole run: {args.wall_s:.0f} s (machine shared with other jobs).", ""]
    return "\n".join(lines)


NOTES = """Notes:

- The re-planner is the closed-form one the gateway's leader runs (policies/replan.py); only the adaptive arms
  simulate, to estimate M_est as SeaLLM's simulator does. The gateway's live loop has no simulator in it and uses
  the closed-form estimate (gateway/control/replanner.py).
- Lengths for the demands are taken from the requests that arrived in the interval (the gateway learns them from
  the requests that finished; with lengths drawn from a fixed distribution the two agree).
- Requests whose prompt exceeds the model's context (ShareGPT on the 4096-token llama2-13b) are refused by every
  arm alike and left out of the attainment and latency."""


def plot(arms: list[Arm], day: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    ts = [day * k / 200 for k in range(201)]
    for s, (model, _, base) in enumerate(SERVICES):
        ax1.plot(ts, [base * multiplier(t, s, len(SERVICES), day=day) for t in ts], label=model)
    ax1.set_xlabel("simulated s")
    ax1.set_ylabel("req/s")
    ax1.set_title("diurnal rates")
    ax1.legend(fontsize=8)
    for a in arms:
        if a.kind == "adaptive" and a.intervals:
            ax2.step([t for t, _ in a.intervals], [i for _, i in a.intervals], where="post", label=a.label)
    for a in arms:
        if a.kind == "fixed":
            ax2.axhline(a.interval_s or 0, color="grey", lw=0.6, ls="--")
    ax2.set_xlabel("simulated s")
    ax2.set_ylabel("re-placement interval (s)")
    ax2.set_title("adaptive interval (SeaLLM eq. 8); dashed: fixed arms")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 1200 s day, two fixed arms, no files")
    ap.add_argument("--day", type=float, default=DAY)
    ap.add_argument("--seeds", default="0,1", help="comma-separated; each seed draws its own arrivals and lengths")
    ap.add_argument("--out", type=Path, default=RESULTS_MD)
    args = ap.parse_args(argv)
    fixed = FIXED
    args.seeds = [int(x) for x in args.seeds.split(",") if x]
    if args.quick:
        args.day, fixed, args.seeds = 1200.0, (60.0, 300.0), args.seeds[:1]
    t0 = time.perf_counter()
    commit = git_commit()
    sections, first = [], None
    with stderr_progress("bench.replan") as progress:
        for k, seed in enumerate(args.seeds):
            work = diurnal_workload(args.day, seed)
            initial = initial_plan(work, args.day)
            arms = [Arm("fixed placement", "fixed-placement")]
            arms += [Arm(f"every {i:g} s", "fixed", i) for i in fixed]
            arms += [Arm(f"adaptive, {metric}, I_0 = {i0:g} s", "adaptive", i0, metric=metric)
                     for metric in ("attainment", "normalized latency") for i0 in ADAPTIVE_I0]
            for a in arms:
                run_arm(a, work, initial, args.day, seed)
                print(f"seed {seed}, {a.label}: norm latency {a.normalized_latency:.4f}, attainment "
                      f"{a.attainment:.3f}, {a.replacements} re-placements, {a.gpu_hours:.1f} GPU-h, {a.wall_s:.0f} s",
                      file=sys.stderr, flush=True)
            first = first or arms
            sections.append((seed, arms, initial, sum(len(v) for v in work.values())))
            progress(k + 1, len(args.seeds))
    args.wall_s = time.perf_counter() - t0
    png = None if args.quick else args.out.with_suffix(".png")
    body = "\n".join(f"## Seed {seed}\n\n" + report(arms, initial, args, seed, n) for seed, arms, initial, n in sections)
    body += "\n" + tail(args, png)
    if args.quick:
        print(body)
        return
    plot(first, args.day, png)
    cmd = "python -m bench.replan" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    write_report(args.out, "Re-planning as traffic moves (SeaLLM's diurnal setting)", cmd, body, commit=commit)
    print(f"wrote {args.out} and {png}", file=sys.stderr)


if __name__ == "__main__":
    main()
