"""Heterogeneous pair (heterogeneous-cluster paper, section 5.2 and figure 5): one strong and one weak worker.

    .venv/bin/python -m bench.hetero_pair            # writes bench/results/hetero_pair.md and hetero_pair.png
    .venv/bin/python -m bench.hetero_pair --quick    # a smoke run: 400 requests, no files

The pair: Llama-3.1-8B on one H100 (`llama3-8b-h100`, the strong worker) and on one A100
(`llama3-8b-a100`, the weak one): the same model on two GPU generations, the common heterogeneous fleet.
Both hold ~27k KV blocks; the H100 prefills ~2.9x and decodes ~1.6x faster per step and batches up to
1024 sequences (A100: 256), so on ShareGPT lengths it serves ~2.5x the requests per second (the paper's
pair, TP4 vs TP1 V100s, differs ~4x in compute and more in memory).

As in the paper: 4000 requests with lengths drawn from ShareGPT (i.i.d., seeded), sent at 8, 16 and 24
req/s (Poisson) and all at once; policies round robin (RR), weighted round robin 4:1 (WRR, the weight the
paper gives its 4-GPU instance), memory-only (`hetero` with memory_only=True, the paper's MB: T_r^s = 1)
and `hetero` (θ = 2, T_r^s from eq. 3-6 of each worker's PerfModel, derived from its profile), plus
`hetero_uncapped`: eq. 8 as printed, kv_usage not capped at 1 (see the notes in the report). Throughput =
completed requests / (last completion − first arrival); each worker's completion time is when its last
request finished. All policies get the same predicted output lengths (one online length predictor,
warm-started from the trace and fed every completion). Target of the issue: `hetero` >= 1.5x the
throughput of round robin at 24 req/s.
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.report import write_report
from policies.base import Policy, make_policy
from policies.length_predictor import LengthPredictor
from policies.perf_model import PerfModel
from simulator.cluster import ClusterSim
from simulator.profiles import load_profile
from simulator.progress import stderr_progress
from simulator.workload import WorkloadRequest, poisson_arrivals, read_lengths, resolve_trace

ROOT = Path(__file__).parents[1]
RESULTS_MD = ROOT / "bench" / "results" / "hetero_pair.md"
STRONG, WEAK = "llama3-8b-h100", "llama3-8b-a100"
STRONG_WEIGHT, WEAK_WEIGHT = 4.0, 1.0
UNCAPPED = "hetero_uncapped"
POLICIES = ("round_robin", "weighted_round_robin", "memory_only", "hetero", UNCAPPED)
RATES: tuple[float | None, ...] = (8.0, 16.0, 24.0, None)   # None: all requests at once
TARGET_RATIO = 1.5
WARM_SAMPLES = 2000


@functools.cache
def _sharegpt_rows() -> tuple[tuple[int, int], ...]:
    return tuple(read_lengths(resolve_trace("sharegpt")))


def workload(n: int, rate: float | None, seed: int) -> list[WorkloadRequest]:
    rows = _sharegpt_rows()
    rng = random.Random(seed)
    times = poisson_arrivals(rate, rng) if rate is not None else None
    out = []
    for i in range(n):
        p, o = rows[rng.randrange(len(rows))]
        out.append(WorkloadRequest(f"req-{i}", next(times) if times is not None else 0.0, p, o))
    return out


def make_pair_policy(name: str) -> Policy:
    if name in ("hetero", "memory_only", UNCAPPED):
        models = {p: PerfModel.from_step_profile(load_profile(p)) for p in (STRONG, WEAK)}
        return make_policy("hetero", perf_models=models, memory_only=name == "memory_only",
                           kv_cap=None if name == UNCAPPED else 1.0)
    return make_policy(name)


@dataclass
class PairResult:
    policy: str
    rate: float | None
    seed: int
    requests: int
    throughput_rps: float
    output_tokens_per_s: float
    strong_done_s: float
    weak_done_s: float
    strong_share: float          # fraction of requests sent to the strong worker
    ttft_p50: float | None
    wall_s: float


def run_pair(policy: str, rate: float | None, n: int, seed: int) -> PairResult:
    model = load_profile(STRONG).model
    predictor = LengthPredictor()
    rng = random.Random(10_000 + seed)
    rows = _sharegpt_rows()
    for _ in range(WARM_SAMPLES):
        p, o = rows[rng.randrange(len(rows))]
        predictor.observe(model, p, o)
    # every request placed (shed=False): the study measures where each policy sends the load, not admission
    sim = ClusterSim([STRONG, WEAK], 0, make_pair_policy(policy), predicted_output_tokens=predictor, shed=False)
    sim.add_worker(STRONG, "strong", weight=STRONG_WEIGHT)
    sim.add_worker(WEAK, "weak", weight=WEAK_WEIGHT)
    res = sim.run(workload(n, rate, seed))
    d = res.to_dict()
    done = {"strong": 0.0, "weak": 0.0}
    count = {"strong": 0, "weak": 0}
    for r in res.results:
        if r.worker_id in done and r.finished is not None:
            done[r.worker_id] = max(done[r.worker_id], r.finished - res.start)
            count[r.worker_id] += 1
    return PairResult(policy, rate, seed, d["requests"], d["throughput_rps"], d["output_tokens_per_s"], done["strong"],
                      done["weak"], count["strong"] / max(sum(count.values()), 1), d["ttft_p50"], res.wall_s)


def _rate(rate: float | None) -> str:
    return "all at once" if rate is None else f"{rate:g} req/s"


def report(results: list[PairResult], args: argparse.Namespace, png: Path | None) -> str:
    by = {(r.policy, r.rate, r.seed): r for r in results}
    lines = [
        f"{args.requests} ShareGPT requests per run (seeds {', '.join(map(str, args.seeds))}); strong worker `{STRONG}`, weak worker `{WEAK}`; "
        f"WRR weights {STRONG_WEIGHT:g}:{WEAK_WEIGHT:g}. Throughput in completed requests per second (output "
        "tokens per second in brackets); completion times in seconds from the first arrival.",
        "",
        "| rate | seed | policy | throughput | vs round_robin | strong done | weak done | to strong | TTFT p50 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rate in args.rates:
        for seed in args.seeds:
            base = by[("round_robin", rate, seed)].throughput_rps
            for p in args.policies:
                r = by[(p, rate, seed)]
                lines.append(
                    f"| {_rate(rate)} | {seed} | {p} | {r.throughput_rps:.2f} ({r.output_tokens_per_s:.0f}) | "
                    f"{r.throughput_rps / base:.2f}x | {r.strong_done_s:.0f} | {r.weak_done_s:.0f} | "
                    f"{r.strong_share:.0%} | {r.ttft_p50:.2f} |")
    lines.append("")
    for seed in args.seeds:
        if ("hetero", 24.0, seed) in by:
            ratio = by[("hetero", 24.0, seed)].throughput_rps / by[("round_robin", 24.0, seed)].throughput_rps
            verdict = "met" if ratio >= TARGET_RATIO else "missed"
            lines.append(f"Target: `hetero` >= {TARGET_RATIO}x the throughput of round robin at 24 req/s "
                         f"(seed {seed}): **{ratio:.2f}x, {verdict}**.")
    lines.append("")
    lines += [NOTES, ""]
    if png is not None:
        lines += [f"![throughput and completion times]({png.name})", ""]
    lines += [f"Wall time of the whole run: {args.wall_s:.0f} s (machine shared with other jobs).", ""]
    return "\n".join(lines)


NOTES = """Notes:

- Capacities on these lengths (from the runs above): the weak A100 completes ~2.8 req/s, the strong H100
  ~6.9 req/s, so the best split is ~70/30 and the pair tops out near 9.7 req/s. Round robin sends half to
  the A100, which finishes last (its completion time sets the makespan) whatever the arrival rate above ~6
  req/s. WRR 4:1 overshoots the other way (the A100 idles early) but is close, as in the paper, because 4:1
  happens to be near the true ratio; `hetero` gets the ratio from the profiles without being told.
- "to strong" counts requests; `hetero` sends fewer but longer requests to the H100 (T_r^s grows faster
  with length on the A100), so the completion times balance at ~57/43 requests.
- `hetero_uncapped` (eq. 8 as printed) lets kv_usage grow with the backlog: the unfinished requests'
  tokens over the cache size reach several times 1 under overload, and exp(θ · kv_usage) then dominates
  T_r^s. Both workers have ~27k KV blocks, so the split drifts back to ~50/50 and the gain over round robin
  shrinks as the load grows. `hetero` therefore caps kv_usage at 1 (`kv_cap`, default): requests beyond a
  full cache wait in the engine's queue, where they cost time (already in the load Σ w) but no memory. In
  the paper the weak instance also had ~10x less KV memory, so memory and speed pointed the same way there.
- All at once, no request has finished when all are placed, so only the predicted loads decide; `hetero`
  still leaves the A100 finishing ~20% after the H100 (the eq. 3-6 static-batch model underrates the
  A100's continuous batching of short requests)."""


def plot(results: list[PairResult], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed = args.seeds[0]
    by = {(r.policy, r.rate): r for r in results if r.seed == seed}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(args.policies)
    xs = range(len(args.rates))
    for i, p in enumerate(args.policies):
        off = [x + (i - (len(args.policies) - 1) / 2) * width for x in xs]
        ax1.bar(off, [by[(p, r)].throughput_rps for r in args.rates], width, label=p)
        ax2.bar(off, [by[(p, r)].strong_done_s for r in args.rates], width * 0.45, color=f"C{i}", label=f"{p}: strong")
        ax2.bar([o + width * 0.45 for o in off], [by[(p, r)].weak_done_s for r in args.rates], width * 0.45,
                color=f"C{i}", alpha=0.45, hatch="//")
    for ax in (ax1, ax2):
        ax.set_xticks(list(xs), [_rate(r) for r in args.rates])
        ax.grid(axis="y", alpha=0.3)
    ax1.set_ylabel("throughput (req/s)")
    ax1.set_title(f"system throughput (seed {seed})")
    ax1.legend(fontsize=8)
    ax2.set_ylabel("completion time (s)")
    ax2.set_title("completion time: strong (solid) / weak (hatched)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 400 requests, no files")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--out", type=Path, default=RESULTS_MD)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.seeds, args.no_write = 400, "0", True
    args.seeds = [int(x) for x in args.seeds.split(",") if x]
    if args.requests < 1:
        ap.error("--requests must be >= 1")
    args.policies = [p for p in args.policies.split(",") if p]
    for p in args.policies:
        if p not in POLICIES:
            ap.error(f"unknown policy {p!r}; use {', '.join(POLICIES)}")
    if "round_robin" not in args.policies:
        args.policies.insert(0, "round_robin")
    args.rates = list(RATES)
    t0 = time.perf_counter()
    results = []
    runs = [(rate, seed, p) for rate in args.rates for seed in args.seeds for p in args.policies]
    with stderr_progress("hetero pair runs") as progress:
        for i, (rate, seed, p) in enumerate(runs):
            r = run_pair(p, rate, args.requests, seed)
            results.append(r)
            print(f"{_rate(rate)} seed {seed} {p}: {r.throughput_rps:.2f} req/s, strong {r.strong_done_s:.0f} s, "
                  f"weak {r.weak_done_s:.0f} s ({r.wall_s:.1f} s)", file=sys.stderr, flush=True)
            progress(i + 1, len(runs))
    args.wall_s = time.perf_counter() - t0
    print(f"total {args.wall_s:.0f} s", file=sys.stderr)
    if args.no_write:
        print(report(results, args, None))
        return
    png = args.out.with_suffix(".png")
    plot(results, args, png)
    cmd = "python -m bench.hetero_pair " + " ".join(argv if argv is not None else sys.argv[1:])
    write_report(args.out, "Heterogeneous pair: throughput and completion times", cmd.strip(),
                 report(results, args, png))


if __name__ == "__main__":
    main()
