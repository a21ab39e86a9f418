"""Pooled serving: how many models one worker serves under each pooling mode (Aegaeon's setting).

    python -m bench.pooling --quick          # one profile, one rate, M = 8..32, 120 s runs (< 5 min)
    python -m bench.pooling                  # both profiles, M = 8..64, lambda = 0.1 and 0.5, 300 s runs

For each profile, per-model rate lambda and model count M (uniform popularity, as Aegaeon section 7.2), and
each pooling mode with the same swap cost (eq. 4 of appendix A.2, `reinit=optimized`): the fewest workers N
keeping 99% SLO attainment, found by bisection over N (attainment taken as non-decreasing in N), for the
per-request attainment of fleetgate (TTFT and mean TPOT both within target) and, beside it, Aegaeon's
per-token deadline attainment (section 2.1). Models per worker = M / N. The same workload (seed) for every
mode. Also Theorem 3.1: the measured mean active-model count against M (1 - e^{-lambda T}) for the measured
mean time in system T, from the runs at each mode's fewest workers.

Besides the four modes of the issue's contract, Aegaeon's turns on colocated hosts (`--pooling aegaeon
--prefill-fraction 0`, what the gateway's `scheduling: turns` runs, simulator/pooled.py):

- aegaeon-coloc      over stock vLLM: a sleeping engine's KV is dropped and recomputed, not counted in the quotas.
- aegaeon-coloc-rq   the same, with the recomputation counted as switching (`recompute_quota`): in eq. 3's c,
                     and the turn's quota starts after it (the gateway's default, `shared_hosts[].recompute_quota`).
- aegaeon-coloc-kv   KV kept in host memory and copied back before the turn (`kv_kept`, simulator only).

All of it is virtual-time simulation (simulator/pooled.py); the steps no stock vLLM can be driven to do
(Aegaeon keeping a preempted batch's KV in host memory across model switches) are simulator only.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from bench.harness import bisect_smallest
from bench.report import git_commit, write_report
from policies.pooling.baselines import resident_capacity
from simulator.pooled import POOLING_MODES, PooledResult, PooledSpec, simulate_pooled
from simulator.profiles import load_profile

TARGET = 0.99
COLOC = {"aegaeon-coloc": {}, "aegaeon-coloc-rq": {"recompute_quota": True}, "aegaeon-coloc-kv": {"kv_kept": True}}
BENCH_MODES = (*POOLING_MODES, *COLOC)
AEGAEON_MODES = ("aegaeon", *COLOC)       # compared with request-level swapping for the 2x target


def mode_spec(mode: str) -> dict:
    """PooledSpec fields of a bench mode (the colocated variants are aegaeon with no prefill partition)."""
    if mode in COLOC:
        return {"pooling": "aegaeon", "prefill_fraction": 0.0, **COLOC[mode]}
    if mode not in POOLING_MODES:
        raise ValueError(f"unknown mode {mode!r}: one of {', '.join(BENCH_MODES)}")
    return {"pooling": mode}
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Point:
    profile: str
    lam: float
    models: int
    mode: str
    n_request: int | None          # fewest workers at 99% per-request attainment (None: not within the cap)
    n_token: int | None            # ... at 99% per-token deadline attainment
    at_best: dict                  # the run at n_request (or at the cap)
    runs: int
    seed: int = 0


def _run(profile: str, lam: float, m: int, mode: str, n: int, duration: float, seed: int,
         **opts: bool) -> PooledResult:
    return simulate_pooled(PooledSpec(num_models=m, rate=m * lam, workers=n, profile=profile,
                                      duration=duration, seed=seed, **mode_spec(mode), **opts))


def fewest_workers(profile: str, lam: float, m: int, mode: str, duration: float, seed: int, cap: int,
                   **opts: bool) -> Point:
    """`opts`: PooledSpec's mechanism switches (prefetch, kv_overlap), the same for every mode of a run."""
    cache: dict[int, PooledResult] = {}

    def run(n: int) -> PooledResult:
        if n not in cache:
            cache[n] = _run(profile, lam, m, mode, n, duration, seed, **opts)
        return cache[n]

    lo = 2 if mode == "aegaeon" else 1     # the colocated variants run on one host
    if mode == "dedicated":
        lo = m
    elif mode == "multiplex":             # fewer workers than M / (models awake per worker) refuse models
        prof = load_profile(profile)
        memory = prof.weight_bytes + prof.kv_capacity_tokens * prof.kv_bytes_per_token
        per = max(1, resident_capacity(memory, prof.weight_bytes, prof.kv_bytes_per_token, prof.max_model_len))
        lo = max(1, math.ceil(m / per))

    def search(key: str) -> int | None:
        if run(cap).to_dict()[key] < TARGET:
            return None
        a, b = lo, cap                        # invariant: b passes
        if run(a).to_dict()[key] >= TARGET:
            return a
        return bisect_smallest(lambda n: run(n).to_dict()[key] >= TARGET, a, b)

    n_req = search("slo_attainment")
    n_tok = search("token_slo_attainment")
    res = run(n_req if n_req is not None else cap)
    best = res.to_dict() | quota_check(res)
    return Point(profile, lam, m, mode, n_req, n_tok, best, len(cache), seed)


def quota_check(res: PooledResult) -> dict:
    """Eq. 2-3's quotas against the per-request TPOT SLO, from an aegaeon run's decode rounds (empty for other
    modes). Over whole rounds a batch's mean time per token is alpha x TBT (policies/pooling/aegaeon.py,
    `decode_alpha`); a request that waits W for its batch's turn meets a mean-TPOT target d only with at least
    W / (d - t) output tokens. `short_tokens` is that L* for the mean wait (R - q_i) and step time t; the shares are
    of completed requests below it and of the missed requests below it; `ttft_misses` the misses late on TTFT."""
    rounds = [r for r in res.decode_rounds if len(r.quotas) > 1]
    if not rounds:
        return {}
    d = res.spec.slo_tpot_s
    waits = [r.round_s - q for r in rounds for q in r.quotas]
    steps = [t for r in rounds for t in r.step_times]
    wait, step = sum(waits) / len(waits), sum(steps) / len(steps)
    short = wait / (d - step) if d > step else math.inf
    done = [r for r in res.sim.results if r.completed]
    missed = [r for r in res.sim.results if not r.slo_met]
    return {"quota_alpha_max": max(r.alpha for r in rounds), "quota_wait_s": wait, "short_tokens": short,
            "short_share": sum(r.output_tokens < short for r in done) / max(1, len(done)),
            "misses": len(missed), "short_misses": sum(r.output_tokens < short for r in missed),
            "ttft_misses": sum(r.ttft is None or r.ttft > r.slo_ttft_s for r in missed)}


def quota_report(points: list[Point]) -> str:
    rows = [p for p in points if "short_tokens" in p.at_best]
    if not rows:
        return ""
    lines = ["## Eq. 2-3's quotas against the per-request TPOT SLO", "",
             "Over whole rounds every decode batch gets one token per alpha x TBT on average (eq. 2 with eq. 3's alpha;"
             " derivation in policies/pooling/aegaeon.py `decode_alpha`), so a long request's mean TPOT meets the"
             " 100 ms target whenever alpha <= 1. A request that waits W for its batch's turn needs at least"
             " L* = W / (TBT - t) output tokens to meet it. At aegaeon's fewest-workers run (per request) of each"
             " point, first seed; rounds of two or more batches:", "",
             "| profile | lambda | M | mode | N | max alpha | mean wait for the turn s | L* tokens | completed below L* |"
             " misses | misses below L* | misses late on TTFT |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in rows:
        d = p.at_best
        lines.append(f"| {p.profile} | {p.lam:g} | {p.models} | {p.mode} | {d['workers']} | {d['quota_alpha_max']:.2f} |"
                     f" {d['quota_wait_s']:.2f} | {d['short_tokens']:.1f} | {d['short_share']:.1%} | {d['misses']} |"
                     f" {d['short_misses']} | {d['ttft_misses']} |")
    return "\n".join(lines)


def _n(n: int | None, cap: int) -> str:
    return f"> {cap}" if n is None else str(n)


def _mpw(m: int, n: int | None) -> str:
    return "-" if n is None else f"{m / n:.2f}"


def report(points: list[Point], args: argparse.Namespace, cap_of: dict, png: str) -> str:
    lines = [
        "All numbers are virtual-time simulation (simulator/pooled.py, the policies of policies/pooling). Workload:",
        f"M models of uniform popularity, Poisson arrivals of lambda req/s each, ShareGPT lengths (Llama-2 tokenizer)"
        f" that fit the context, {args.duration:g} s of arrivals then drain, seed {args.seed}. SLO: TTFT 10 s and"
        " TBT (mean TPOT) 100 ms, Aegaeon section 7.1. Swap cost in every mode: eq. 4 (weights / 25 GB/s host link"
        " x 0.625). Aegaeon: 6/16 of the workers prefill (section 7.2), MAX_GPSIZE 8, Q_MAX 4 s."
        " aegaeon-coloc*: no partition, each host holds ceil(M / N) models' engines (`static_placement`), one"
        " running at a time in eq. 2-3 turns; sleep level 0 (free) when they fit awake, else weights swapped at the"
        " same cost and KV dropped (-coloc, -coloc-rq) or kept in host memory (-coloc-kv, simulator only); no"
        " weight prefetch."
        f" Weight prefetch (section 5.2, every swapping mode): {'off' if args.no_prefetch else 'on'};"
        f" Aegaeon's KV swap-in overlapped with the previous turn (section 5.3): {'off' if args.no_kv_overlap else 'on'}.",
        "",
        "Profiles: `llama2-13b-a100` (Llama-2-13B on A100-80GB, shipped) and `llama3-8b-h100` (Llama-3.1-8B on"
        " H100, shipped, standing in for the paper's 7-8B class on H800); no new profile was derived.",
        "",
        "`N@99% req` is the fewest workers with per-request attainment >= 99% (fleetgate's measure); `N@99% tok`"
        " with per-token deadline attainment >= 99% (Aegaeon's measure, section 2.1). `-`/`>`: not reached within"
        " the cap. dedicated and multiplex refuse models they have no room for, so they need N >= M and N >= M/2.",
        "",
        "| profile | lambda | M | mode | N@99% req | models/worker (req) | N@99% tok | models/worker (tok) |"
        " attainment req / tok at N | goodput rps | swaps | TTFT p99 s | TPOT p99 s | runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        d = p.at_best
        cap = cap_of[(p.profile, p.lam, p.models)]
        lines.append(
            f"| {p.profile} | {p.lam:g} | {p.models} | {p.mode} | {_n(p.n_request, cap)} | {_mpw(p.models, p.n_request)}"
            f" | {_n(p.n_token, cap)} | {_mpw(p.models, p.n_token)} | {d['slo_attainment']:.3f} /"
            f" {d['token_slo_attainment']:.3f} | {d['goodput_rps']:.2f} | {d['swaps']} | {_f(d['ttft_p99'])}"
            f" | {_f(d['tpot_p99'])} | {p.runs} |")
    lines += ["", "## Target: aegaeon >= 2x the models per worker of request-level swapping at equal attainment", "",
              "| profile | lambda | M | request N (req / tok) | aegaeon N (req / tok) | ratio req | ratio tok |",
              "|---|---|---|---|---|---|---|"]
    by = {(p.profile, p.lam, p.models, p.mode): p for p in points}
    for key in sorted({(p.profile, p.lam, p.models) for p in points}):
        r, a = by.get((*key, "request")), by.get((*key, "aegaeon"))
        if r is None or a is None:
            continue
        cap = cap_of[key]
        lines.append(f"| {key[0]} | {key[1]:g} | {key[2]} | {_n(r.n_request, cap)} / {_n(r.n_token, cap)} |"
                     f" {_n(a.n_request, cap)} / {_n(a.n_token, cap)} | {_ratio(r.n_request, a.n_request, cap)} |"
                     f" {_ratio(r.n_token, a.n_token, cap)} |")
    coloc = [m for m in COLOC if any(p.mode == m for p in points)]
    if coloc:
        lines += ["", "Colocated turns (what the gateway's `scheduling: turns` runs; `-kv` simulator only), against"
                  " request-level swapping, ratio req / tok:", "",
                  "| profile | lambda | M | request N (req / tok) | " + " | ".join(f"{m} N (req / tok) | ratio"
                                                                        for m in coloc) + " |",
                  "|---|---|---|---|" + "---|---|" * len(coloc)]
        for key in sorted({(p.profile, p.lam, p.models) for p in points}):
            r = by.get((*key, "request"))
            if r is None:
                continue
            cap = cap_of[key]
            cells = []
            for m in coloc:
                c = by.get((*key, m))
                cells.append("- | -" if c is None else
                             f"{_n(c.n_request, cap)} / {_n(c.n_token, cap)} | {_ratio(r.n_request, c.n_request, cap)}"
                             f" / {_ratio(r.n_token, c.n_token, cap)}")
            lines.append(f"| {key[0]} | {key[1]:g} | {key[2]} | {_n(r.n_request, cap)} / {_n(r.n_token, cap)} | "
                         + " | ".join(cells) + " |")
    lines += ["", "Ratio = request N / aegaeon N = aegaeon's models per worker over request-level's (`>`: request"
              " never reached 99% within the cap, so the ratio is at least that).", "",
              "## Theorem 3.1: active models", "",
              "At each mode's fewest-workers run: the measured time-average number of models with a request in the"
              " system against E[m] = sum over models of 1 - e^{-lambda T}, T the measured mean time in system.", "",
              "| profile | lambda | M | mode | measured m | E[m] |", "|---|---|---|---|---|---|"]
    for p in points:
        d = p.at_best
        lines.append(f"| {p.profile} | {p.lam:g} | {p.models} | {p.mode} | {d['active_models_mean']:.2f} |"
                     f" {d['expected_active_models']:.2f} |")
    lines += ["", f"![pooling]({png})"]
    return "\n".join(lines)


def seeds_report(points: list[Point], cap_of: dict, seeds: list[int]) -> str:
    """Per point, the fewest workers of every seed and aegaeon's ratio over request-level swapping per seed."""
    lines = ["## Seeds: spread of the fewest workers and of the target ratio", "",
             f"Seeds {', '.join(map(str, seeds))}; each cell lists the seeds in that order.", "",
             "| profile | lambda | M | mode | N@99% req | N@99% tok | hidden swaps / swaps | decode round s | alpha |",
             "|---|---|---|---|---|---|---|---|---|"]
    by: dict[tuple, dict[int, Point]] = {}
    for p in points:
        by.setdefault((p.profile, p.lam, p.models, p.mode), {})[p.seed] = p
    for key, per in by.items():
        cap = cap_of[key[:3]]
        ps = [per[s] for s in seeds if s in per]
        rounds = [p.at_best.get("decode_round_s_mean") for p in ps]
        alphas = [p.at_best.get("decode_alpha_mean") for p in ps]
        lines.append(f"| {key[0]} | {key[1]:g} | {key[2]} | {key[3]} | {' / '.join(_n(p.n_request, cap) for p in ps)}"
                     f" | {' / '.join(_n(p.n_token, cap) for p in ps)}"
                     f" | {' / '.join(_hidden(p) for p in ps)}"
                     f" | {' / '.join(_f(r) for r in rounds)} | {' / '.join(_f(a) for a in alphas)} |")
    lines += ["", "Ratio over request-level swapping (request N / the mode's N), per seed:", "",
              "| profile | lambda | M | mode | ratio req per seed | ratio tok per seed | req min-max | tok min-max |",
              "|---|---|---|---|---|---|---|---|"]
    for key in sorted({k[:3] for k in by}):
        for mode in AEGAEON_MODES:
            r, a = by.get((*key, "request"), {}), by.get((*key, mode), {})
            common = [s for s in seeds if s in r and s in a]
            if not common:
                continue
            cap = cap_of[key]
            cells = []
            for attr in ("n_request", "n_token"):
                vals = [(getattr(r[s], attr) or cap) / getattr(a[s], attr) for s in common if getattr(a[s], attr)]
                txt = " / ".join(_ratio(getattr(r[s], attr), getattr(a[s], attr), cap) for s in common)
                cells.append((txt, f"{min(vals):.2f}-{max(vals):.2f}x" if vals else "-"))
            lines.append(f"| {key[0]} | {key[1]:g} | {key[2]} | {mode} | {cells[0][0]} | {cells[1][0]} |"
                         f" {cells[0][1]} | {cells[1][1]} |")
    return "\n".join(lines)


def _hidden(p: Point) -> str:
    return f"{p.at_best['hidden_swaps']}/{p.at_best['swaps']}"


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def _ratio(n_req: int | None, n_aeg: int | None, cap: int) -> str:
    if n_aeg is None:
        return "-"
    if n_req is None:
        return f"> {cap / n_aeg:.2f}x"
    return f"{n_req / n_aeg:.2f}x"


def plot(points: list[Point], path: Path) -> None:
    """Rows 1-2: models per worker at 99% (per request, per token) against M; row 3: Theorem 3.1, the measured
    active-model count against E[m] at each mode's fewest-workers run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(p.profile, p.lam) for p in points})
    fig, axes = plt.subplots(3, len(groups), figsize=(5 * len(groups), 12), squeeze=False)
    for col, (prof, lam) in enumerate(groups):
        for row, (attr, label) in enumerate((("n_request", "per-request 99%"), ("n_token", "per-token 99%"))):
            ax = axes[row][col]
            for mode in BENCH_MODES:
                pts = sorted((p.models, p.models / getattr(p, attr)) for p in points
                             if (p.profile, p.lam, p.mode) == (prof, lam, mode) and getattr(p, attr))
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=mode)
            ax.set_title(f"{prof}, lambda={lam:g}: {label}", fontsize=9)
            ax.set_xlabel("models M")
            ax.set_ylabel("models per worker at 99%")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        ax = axes[2][col]
        top = 1.0
        for mode in BENCH_MODES:
            pts = [(p.at_best["expected_active_models"], p.at_best["active_models_mean"]) for p in points
                   if (p.profile, p.lam, p.mode) == (prof, lam, mode)]
            if pts:
                ax.scatter(*zip(*pts, strict=True), label=mode, s=18)
                top = max(top, *(max(x, y) for x, y in pts))
        ax.plot([0, top], [0, top], color="grey", lw=0.8, ls="--", label="measured = E[m]")
        ax.set_title(f"{prof}, lambda={lam:g}: Theorem 3.1", fontsize=9)
        ax.set_xlabel("E[m] = sum 1 - exp(-lambda T)")
        ax.set_ylabel("measured mean active models")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="One profile and rate, M = 8..32, 120 s runs.")
    ap.add_argument("--profiles", default="llama3-8b-h100,llama2-13b-a100")
    ap.add_argument("--lambdas", default="0.1,0.5", help="Per-model rates (req/s).")
    ap.add_argument("--models", default="8,16,32,64")
    ap.add_argument("--modes", default=",".join(BENCH_MODES), help=f"Any of {', '.join(BENCH_MODES)}.")
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seeds", default="", help="Comma-separated seeds (overrides --seed): adds a spread section; "
                    "the main tables show the first seed.")
    ap.add_argument("--no-prefetch", action="store_true", help="Aegaeon section 5.2's weight prefetch off (all modes).")
    ap.add_argument("--no-kv-overlap", action="store_true", help="Section 5.3's overlapped KV swap-in off.")
    ap.add_argument("--out", default="pooling")
    ap.add_argument("--jobs", type=int, default=1, help="Points computed in parallel processes (same results).")
    args = ap.parse_args(argv)
    if args.quick:
        args.profiles, args.lambdas, args.models, args.duration = "llama3-8b-h100", "0.5", "8,16,32", 120.0
    profiles = [p for p in args.profiles.split(",") if p]
    lambdas = [float(x) for x in args.lambdas.split(",")]
    models = [int(x) for x in args.models.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        mode_spec(m)
    seeds = [int(x) for x in args.seeds.split(",") if x] or [args.seed]
    args.seed = seeds[0]
    opts = {"prefetch": not args.no_prefetch, "kv_overlap": not args.no_kv_overlap}
    points: list[Point] = []
    cap_of: dict = {}
    t0 = time.time()
    commit = git_commit()          # the code the run started at (a long run may outlast a commit)
    tasks = []
    for prof in profiles:
        for lam in lambdas:
            for m in models:
                cap = 2 * m
                cap_of[(prof, lam, m)] = cap
                tasks += [(prof, lam, m, mode, args.duration, seed, cap) for mode in modes for seed in seeds]

    def done(p: Point) -> None:
        print(f"{p.profile} lambda={p.lam:g} M={p.models} {p.mode} seed={p.seed}: N@req={p.n_request} "
              f"N@tok={p.n_token} ({p.runs} runs, {time.time() - t0:.0f} s)", file=sys.stderr, flush=True)

    if args.jobs > 1:               # independent points in parallel processes; the table keeps the task order
        with ProcessPoolExecutor(args.jobs) as pool:
            # the largest M first, so the last process to finish is not left with a long point alone
            futures = {i: pool.submit(fewest_workers, *tasks[i], **opts)
                       for i in sorted(range(len(tasks)), key=lambda i: -tasks[i][2])}
            for f in as_completed(futures.values()):
                done(f.result())
            points = [futures[i].result() for i in range(len(tasks))]
    else:
        for t in tasks:
            points.append(fewest_workers(*t, **opts))
            done(points[-1])
    main_points = [p for p in points if p.seed == seeds[0]]
    png = RESULTS / f"{args.out}.png"
    plot(main_points, png)
    cmd = "python -m bench.pooling " + " ".join(argv if argv is not None else sys.argv[1:])
    write_report(RESULTS / f"{args.out}.md", "Pooled serving: models per worker by pooling mode", cmd.strip(),
                 report(main_points, args, cap_of, png.name)
                 + (f"\n\n{quota_report(main_points)}" if quota_report(main_points) else "")
                 + (f"\n\n{seeds_report(points, cap_of, seeds)}" if len(seeds) > 1 else "")
                 + f"\n\nWall time: {time.time() - t0:.0f} s.\n", commit=commit)
    print(f"wrote {RESULTS / (args.out + '.md')}")


if __name__ == "__main__":
    main()
