"""Workers needed for 99% SLO attainment on every shipped trace, per policy, with aladdin's parameters chosen by
leave-one-trace-out: the report on a trace never uses a parameter picked on it.

    .venv/bin/python -m bench.placement            # the full study (hours; partial results as it goes)
    .venv/bin/python -m bench.placement --quick    # the same protocol on short runs (< 15 minutes)

Every run is `simulator.simulate.simulate(SimSpec(...))`, what `fleetgate simulate` runs for the same flags
(tests/test_bench_placement.py checks they agree): the gateway's placement step and admission queue, the online
length predictor warm-started from the trace's other rows, attainment over servable requests.

Protocol
1. Traces (`TRACES`): azure_conv (its own arrivals, two rate scales), ShareGPT and arXiv lengths with Poisson and
   Gamma arrivals at CV 4 and 8 (two rates each) on Llama-2-13B/A100 with Aladdin's SLO (TTFT 600 ms, ATGT 30 ms),
   and mooncake (its own arrivals, long prompts with shared prefixes) on Llama-3-8B/H100 (128k context) whose TTFT
   target is at least `MOONCAKE_SLOWDOWN` times the prompt's prefill on an idle worker (ATGT 30 ms).
2. Baselines (`BASELINES`): for every trace, rate and seed, the smallest fleet with attainment >= target,
   found by a search over N (grow until it holds, then bisect; a run stops as soon as its misses exceed the
   budget). The best baseline of a point is the smallest N over all of them.
3. Candidates (`CANDIDATES`): aladdin's parameter sets (packing rule, margin, slack mode, queue look-ahead). Each
   is searched on every trace at its higher rate, first seed: that is the selection data.
4. Leave-one-trace-out: for trace t, the candidate with the smallest mean of N / N_best over the other traces
   (ties: the first listed). aladdin on t runs with that candidate at every rate and seed; so does the oracle row
   (the same parameters, told the true output lengths).
5. Targets: aladdin needs no more workers than the best baseline at every point, and at least 15% fewer at
   half of them or more. The report lists every miss with its numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.harness import bisect_smallest
from bench.report import git_commit, write_report
from simulator.cluster import ClusterSim, RequestResult
from simulator.profiles import load_profile
from simulator.simulate import SimSpec, build_sim, build_workload

ROOT = Path(__file__).parents[1]
RESULTS_MD = ROOT / "bench" / "results" / "placement.md"
TARGET = 0.99
P13, P8 = "llama2-13b-a100", "llama3-8b-h100"
MOONCAKE_SLOWDOWN = 3.0

# name -> (SimSpec fields, the two load levels: req/s for synthetic arrivals, else the rate scale)
TRACES: dict[str, tuple[dict[str, Any], tuple[float, float]]] = {
    "azure_conv": ({"trace": "azure_conv", "profile": P13}, (2.0, 4.0)),
    "sharegpt": ({"trace": "sharegpt", "profile": P13}, (4.0, 8.0)),
    "sharegpt_cv4": ({"trace": "sharegpt", "profile": P13, "arrival": "gamma", "cv": 4.0}, (4.0, 8.0)),
    "sharegpt_cv8": ({"trace": "sharegpt", "profile": P13, "arrival": "gamma", "cv": 8.0}, (4.0, 8.0)),
    "arxiv": ({"trace": "arxiv", "profile": P13}, (2.0, 4.0)),
    "arxiv_cv4": ({"trace": "arxiv", "profile": P13, "arrival": "gamma", "cv": 4.0}, (2.0, 4.0)),
    "arxiv_cv8": ({"trace": "arxiv", "profile": P13, "arrival": "gamma", "cv": 8.0}, (2.0, 4.0)),
    "mooncake": ({"trace": "mooncake", "profile": P8, "ttft_slowdown": MOONCAKE_SLOWDOWN}, (0.5, 1.0)),
}
BASELINES = ("round_robin", "least_requests", "power_of_two", "least_kv", "hetero")
# aladdin's candidate parameter sets: policy parameters, plus the admission queue's look-ahead.
CANDIDATES: dict[str, dict[str, Any]] = {
    "paper": {"fit": "best", "queue_lookahead": 1},     # Algorithm 1 as printed: fullest feasible bin
    "margin": {"fit": "best", "margin": 0.25, "queue_lookahead": 1},   # fullest bin keeping 25% headroom
    "spread": {"fit": "worst", "queue_lookahead": 1},   # most headroom: the constraints as admission control
    "spread_lookahead": {"fit": "worst", "queue_lookahead": 16},
}
ORACLE = "aladdin (oracle lengths)"


def point_spec(trace: str, level: float, seed: int, duration: float) -> SimSpec:
    fields, _ = TRACES[trace]
    timestamps = fields["trace"] in ("azure_conv", "mooncake")
    load = {"rate_scale": level} if timestamps else {"rate": level}
    return SimSpec(**fields, **load, seed=seed, duration=duration, slo_ttft_s=0.6, slo_tpot_s=0.03)


def with_policy(spec: SimSpec, policy: str, params: dict[str, Any] | None = None, workers: int | None = None,
                oracle: bool = False) -> SimSpec:
    params = dict(params or {})
    lookahead = params.pop("queue_lookahead", spec.queue_lookahead)
    return replace(spec, policy=policy, policy_params=params, queue_lookahead=lookahead,
                   workers=workers if workers is not None else spec.workers,
                   lengths="oracle" if oracle else "predicted")


# ---- one run, and the search over N ------------------------------------------------------------------------
@dataclass
class Probe:
    workers: int
    attainment: float            # an upper bound when stopped early
    ttft_miss: int
    atgt_miss: int
    servable: int
    wall_s: float
    cpu_s: float = 0.0           # this process's CPU time for the run (the machine may be shared)
    stopped_early: bool = False


class _Missed(Exception):
    """More servable requests missed than the target allows: the run cannot pass any more."""


def probe(spec: SimSpec, target: float = TARGET, stop_early: bool = True) -> Probe:
    """One fixed-fleet run; with `stop_early` it ends once more than (1 - target) of the servable requests missed."""
    wl = build_workload(spec)
    limit = load_profile(spec.profiles[0]).max_model_len
    servable = sum(1 for r in wl if r.prompt_tokens < limit)
    budget = int((1.0 - target) * servable) if stop_early else len(wl)
    miss = {"ttft": 0, "atgt": 0, "any": 0}

    def count(_sim: ClusterSim, r: RequestResult) -> None:
        if r.slo_met or not r.servable:
            return
        miss["any"] += 1
        miss["ttft"] += r.ttft is None or r.ttft > r.slo_ttft_s
        miss["atgt"] += r.tpot is not None and r.tpot > r.slo_tpot_s
        if miss["any"] > budget:
            raise _Missed

    sim = build_sim(spec, wl)
    sim.on_finish.append(count)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        d = sim.run(wl).to_dict()
    except _Missed:
        return Probe(spec.workers, 1.0 - miss["any"] / max(servable, 1), miss["ttft"], miss["atgt"], servable,
                     time.perf_counter() - t0, time.process_time() - c0, stopped_early=True)
    return Probe(spec.workers, d["slo_attainment"], miss["ttft"], miss["atgt"], d["servable"],
                 time.perf_counter() - t0, time.process_time() - c0)


@dataclass
class Search:
    label: str                   # policy or candidate label
    trace: str
    level: float
    seed: int
    needed: int | None           # None: not reached up to the cap
    probes: dict[int, Probe] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)


def min_workers(spec: SimSpec, label: str, trace: str, level: float, target: float, start: int,
                cap: int) -> Search:
    """Smallest N in [1, cap] with attainment >= target: from `start`, double up (or halve down) to bracket it,
    then bisect. Assumes attainment grows with N up to noise; every probe is kept."""
    s = Search(label, trace, level, spec.seed, None, params=dict(spec.policy_params))

    def ok(n: int) -> bool:
        if n not in s.probes:
            s.probes[n] = probe(replace(spec, workers=n), target)
        return s.probes[n].attainment >= target

    n = max(1, min(start, cap))
    if ok(n):
        hi, lo = n, 0
        while hi > 1:
            m = max(1, hi * 3 // 4 if hi > 4 else hi - 1)
            if not ok(m):
                lo = m
                break
            hi = m
    else:
        lo, hi = n, None
        while hi is None:
            if lo >= cap:
                return s
            m = min(cap, max(lo + 1, lo * 3 // 2))
            if ok(m):
                hi = m
            else:
                lo = m
    s.needed = bisect_smallest(ok, lo, hi)
    return s


# ---- the study ------------------------------------------------------------------------------------------
@dataclass
class Study:
    args: argparse.Namespace
    searches: list[Search] = field(default_factory=list)
    chosen: dict[str, str] = field(default_factory=dict)      # trace -> candidate chosen without it
    t0: float = field(default_factory=time.perf_counter)

    def find(self, label: str, trace: str, level: float, seed: int) -> Search | None:
        for s in self.searches:
            if (s.label, s.trace, s.level, s.seed) == (label, trace, level, seed):
                return s
        return None

    def best_baseline(self, trace: str, level: float, seed: int) -> tuple[int | None, str]:
        best: tuple[int, str] | None = None
        for b in BASELINES:
            s = self.find(b, trace, level, seed)
            if s is not None and s.needed is not None and (best is None or s.needed < best[0]):
                best = (s.needed, b)
        return (best[0], best[1]) if best else (None, "")

    def run(self, spec: SimSpec, label: str, trace: str, level: float, start: int) -> Search:
        done = self.find(label, trace, level, spec.seed)
        if done is not None and done.params == dict(spec.policy_params):   # --resume: kept from an earlier run
            return done
        cap = max(8 * start, 48)    # bursty arrivals (Gamma CV 8) need many times the mean load's fleet
        s = min_workers(spec, label, trace, level, self.args.target, start, cap)
        self.searches.append(s)
        cpu = sum(p.cpu_s for p in s.probes.values())
        print(f"[{time.perf_counter() - self.t0:6.0f} s] {trace} {level:g} seed {spec.seed} {label}: "
              f"{s.needed if s.needed else '>' + str(max(s.probes))} ({len(s.probes)} runs, {cpu:.0f} CPU s)",
              file=sys.stderr, flush=True)
        self.save()
        return s

    def save(self) -> None:
        if self.args.no_write:
            return
        data = {"chosen": self.chosen, "searches": [asdict(s) for s in self.searches]}
        self.args.out.with_suffix(".json").write_text(json.dumps(data, indent=1))


def estimate_start(spec: SimSpec) -> int:
    """A first guess of the fleet size from the offered load: prompt and output tokens per second over what one
    worker of the profile makes at a moderate batch (only where the search starts)."""
    wl = build_workload(spec)
    span = max(wl[-1].arrival - wl[0].arrival, 1.0)
    prof = load_profile(spec.profiles[0])
    tokens_out = sum(r.output_tokens for r in wl) / span
    step = prof.step_time(0, 32, 32 * 1500, 0.0)
    per_worker = 32 / step * 0.5
    return max(1, round(tokens_out / per_worker))


def run_study(args: argparse.Namespace) -> Study:
    st = Study(args)
    saved = args.out.with_suffix(".json")
    if args.resume and saved.is_file():
        for d in json.loads(saved.read_text())["searches"]:
            probes = {int(n): Probe(**p) for n, p in d.pop("probes").items()}
            st.searches.append(Search(**d, probes=probes))
        print(f"resuming with {len(st.searches)} searches from {saved.name}", file=sys.stderr)
    points = [(t, lv, sd) for t in args.traces for lv in TRACES[t][1] for sd in args.seeds]
    # 1. baselines at every point
    for trace, level, seed in points:
        spec = point_spec(trace, level, seed, args.duration)
        start = estimate_start(spec)
        for b in BASELINES:
            s = st.run(with_policy(spec, b), b, trace, level, start)
            start = s.needed or start
    # 2. selection data: every candidate on every trace at its higher load, first seed
    for trace in args.traces:
        level, seed = TRACES[trace][1][1], args.seeds[0]
        spec = point_spec(trace, level, seed, args.duration)
        best, _ = st.best_baseline(trace, level, seed)
        for name, params in CANDIDATES.items():
            st.run(with_policy(spec, "aladdin", params), f"cand:{name}", trace, level, best or estimate_start(spec))
    # 3. leave-one-trace-out choice, then aladdin and its oracle on every point of the left-out trace
    for trace in args.traces:
        st.chosen[trace] = choose(st, [t for t in args.traces if t != trace] or [trace])
    st.save()
    for trace, level, seed in points:
        spec = point_spec(trace, level, seed, args.duration)
        best, _ = st.best_baseline(trace, level, seed)
        params = CANDIDATES[st.chosen[trace]]
        a = st.run(with_policy(spec, "aladdin", params), "aladdin", trace, level, best or estimate_start(spec))
        if seed == args.seeds[0]:
            st.run(with_policy(spec, "aladdin", params, oracle=True), ORACLE, trace, level,
                   a.needed or best or estimate_start(spec))
    return st


def choose(st: Study, traces: list[str]) -> str:
    """The candidate with the smallest mean of N / N_best over `traces` (a miss counts as twice the best)."""
    scores: dict[str, float] = {}
    for name in CANDIDATES:
        ratios = []
        for trace in traces:
            level, seed = TRACES[trace][1][1], st.args.seeds[0]
            best, _ = st.best_baseline(trace, level, seed)
            s = st.find(f"cand:{name}", trace, level, seed)
            if best is None or s is None:
                continue
            ratios.append((s.needed / best) if s.needed is not None else 2.0)
        scores[name] = statistics.fmean(ratios) if ratios else float("inf")
    return min(CANDIDATES, key=lambda n: (scores[n], list(CANDIDATES).index(n)))


# ---- the report ---------------------------------------------------------------------------------------------
def _n(s: Search | None) -> str:
    if s is None:
        return "-"
    return str(s.needed) if s.needed is not None else f">{max(s.probes)}"


def report(st: Study, png: Path | None) -> str:
    args = st.args
    lines = [
        f"Target: the smallest fleet with SLO attainment >= {args.target:.0%} (over servable requests). "
        f"{args.duration:.0f} simulated seconds per run, seeds {', '.join(map(str, args.seeds))}; "
        f"Llama-2-13B/A100 (TTFT 600 ms, ATGT 30 ms) except mooncake on Llama-3-8B/H100 (TTFT >= "
        f"{MOONCAKE_SLOWDOWN:g}x the prompt's prefill alone, at least 600 ms; ATGT 30 ms).",
        "",
        "## Parameters chosen by leave-one-trace-out",
        "",
        "| left-out trace | candidate chosen on the other traces | aladdin parameters |",
        "|---|---|---|",
    ]
    for trace in args.traces:
        name = st.chosen.get(trace, "-")
        lines.append(f"| {trace} | {name} | `{json.dumps(CANDIDATES.get(name, {}))}` |")
    lines += ["", "Selection data (workers needed at the higher load, first seed; N / best baseline):", "",
              "| trace | best baseline | " + " | ".join(CANDIDATES) + " |", "|---|---|" + "---|" * len(CANDIDATES)]
    for trace in args.traces:
        level, seed = TRACES[trace][1][1], args.seeds[0]
        best, who = st.best_baseline(trace, level, seed)
        cells = []
        for name in CANDIDATES:
            s = st.find(f"cand:{name}", trace, level, seed)
            ratio = f" ({s.needed / best:.2f})" if s is not None and s.needed and best else ""
            cells.append(_n(s) + ratio)
        lines.append(f"| {trace} @ {level:g} | {best} ({who}) | " + " | ".join(cells) + " |")
    lines += ["", "## Workers needed", ""]
    head = "| trace | load | seed | " + " | ".join(BASELINES) + " | best baseline | aladdin | oracle | aladdin vs best |"
    lines += [head, "|" + "---|" * (len(BASELINES) + 7)]
    hits: list[tuple[str, float, int, int, int]] = []
    for trace in args.traces:
        for level in TRACES[trace][1]:
            for seed in args.seeds:
                best, _ = st.best_baseline(trace, level, seed)
                a = st.find("aladdin", trace, level, seed)
                o = st.find(ORACLE, trace, level, seed)
                cells = " | ".join(_n(st.find(b, trace, level, seed)) for b in BASELINES)
                vs = "-"
                if best and a is not None and a.needed is not None:
                    vs = f"{1 - a.needed / best:+.0%}"
                    hits.append((trace, level, seed, best, a.needed))
                elif best and a is not None:
                    hits.append((trace, level, seed, best, 10**6))
                lines.append(f"| {trace} | {level:g} | {seed} | {cells} | {best if best else '-'} | {_n(a)} | "
                             f"{_n(o)} | {vs} fewer |".replace("+-", "-").replace("-- fewer", "-"))
    lines += ["", "## Against the targets", ""]
    if hits:
        worse = [h for h in hits if h[4] > h[3]]
        saving = [h for h in hits if h[4] <= 0.85 * h[3]]
        lines += [f"- Points: {len(hits)}. aladdin needs more workers than the best baseline at {len(worse)} "
                  f"(target: 0); at least 15% fewer at {len(saving)} ({len(saving) / len(hits):.0%}; target: half or "
                  "more).", ""]
        for trace, level, seed, best, got in worse:
            shown = ">cap" if got >= 10**6 else str(got)
            lines.append(f"  - more than the best baseline: {trace} @ {level:g}, seed {seed}: {shown} vs {best}")
        lines.append("")
        per_trace: dict[str, list[float]] = {}
        for trace, _, _, best, got in hits:
            if got < 10**6:
                per_trace.setdefault(trace, []).append(1 - got / best)
        lines += ["Saving against the best baseline per trace (mean over loads and seeds, [min, max]):", ""]
        for trace, v in per_trace.items():
            lines.append(f"- {trace}: {statistics.fmean(v):+.0%} [{min(v):+.0%}, {max(v):+.0%}]")
        lines.append("")
    lines += ["## Every probe (attainment at N, TTFT misses / ATGT misses; `<` = stopped early)", ""]
    for s in st.searches:
        probes = ", ".join(f"N={n}: {'<' if p.stopped_early else ''}{p.attainment:.4f} ({p.ttft_miss}/{p.atgt_miss})"
                           for n, p in sorted(s.probes.items()))
        lines.append(f"- {s.trace} @ {s.level:g}, seed {s.seed}, {s.label}: {probes}")
    lines.append("")
    if png is not None:
        lines += [f"![workers needed]({png.name})", ""]
    cpu = sum(p.cpu_s for s in st.searches for p in s.probes.values())
    wall = time.perf_counter() - st.t0
    lines += [f"CPU time of the study's simulation runs: {cpu / 60:.0f} minutes; wall time {wall / 60:.0f} minutes "
              "(on a machine shared with other jobs).", ""]
    return "\n".join(lines)


def plot(st: Study, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = st.args.traces
    cols = min(4, len(traces))
    rows = -(-len(traces) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, trace in zip(axes.flat, traces, strict=False):
        levels = TRACES[trace][1]
        for label in (*BASELINES, "aladdin", ORACLE):
            xs, mean, lo, hi = [], [], [], []
            for level in levels:
                vals = [s.needed for sd in st.args.seeds if (s := st.find(label, trace, level, sd)) is not None
                        and s.needed is not None]
                if vals:
                    xs.append(level)
                    mean.append(statistics.fmean(vals))
                    lo.append(mean[-1] - min(vals))
                    hi.append(max(vals) - mean[-1])
            if xs:
                ax.errorbar(xs, mean, yerr=[lo, hi], marker="o", capsize=3, label=label,
                            lw=2.5 if label == "aladdin" else 1)
        ax.set_title(trace)
        ax.set_xlabel("load (req/s or rate scale)")
        ax.set_ylabel("workers for 99%")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(traces):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short runs, one seed, three traces (< 15 minutes)")
    ap.add_argument("--traces", default=",".join(TRACES))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--duration", type=float, default=300.0, help="simulated seconds per run")
    ap.add_argument("--target", type=float, default=TARGET)
    ap.add_argument("--out", type=Path, default=RESULTS_MD)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--resume", action="store_true", help="keep the searches the last run saved (its .json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.traces, args.seeds, args.duration = "sharegpt,arxiv_cv4,azure_conv", "0", 90.0
        args.no_write = args.no_write or args.out == RESULTS_MD
    args.traces = [t for t in args.traces.split(",") if t]
    args.seeds = [int(x) for x in args.seeds.split(",") if x]
    for t in args.traces:
        if t not in TRACES:
            ap.error(f"unknown trace {t!r}; use {', '.join(TRACES)}")
    commit = git_commit()
    st = run_study(args)
    print(f"total {time.perf_counter() - st.t0:.0f} s", file=sys.stderr)
    if args.no_write:
        print(report(st, None))
        return
    png = args.out.with_suffix(".png")
    plot(st, png)
    cmd = "python -m bench.placement " + " ".join(argv if argv is not None else sys.argv[1:])
    write_report(args.out, "Workers needed for 99% SLO attainment, every shipped trace (leave-one-trace-out)",
                 cmd.strip(), report(st, png), commit=commit)


if __name__ == "__main__":
    main()
