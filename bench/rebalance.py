"""Rebalancing (Aladdin's Algorithm 2, appendix C) in virtual time: does it save workers, and why do oracle lengths
change nothing? Writes bench/results/rebalance.md (and .json).

    .venv/bin/python -m bench.rebalance             # ~30 minutes on 2 shared cores
    .venv/bin/python -m bench.rebalance --quick     # 60 simulated seconds per run, one seed

Protocol
1. Length-prediction error of every shipped trace (`length_errors`): the run's online predictor (warm-started
   from the trace's other rows, as `fleetgate simulate` does), each request predicted at arrival, the true length
   observed right after (an optimistic predictor: a run learns only at completions). The two traces with the
   largest relative error are the ones Algorithm 2 exists for.
2. On those traces, both loads of bench/placement.py, each seed: the smallest fleet with >= 99% attainment for
   aladdin with the parameters bench/placement.py chose for every trace (spread_lookahead), with predicted and
   with oracle lengths, each without and with rebalancing (`rebalance_s`, the simulator's `_rebalance`, which
   calls the same ModelPlacement.rebalance as the gateway). The best baseline of bench/results/placement.json is
   listed beside.
3. At the fleet size aladdin needs without rebalancing: one full run per variant, with what the policy did
   (decisions placed / late / best effort / queued, which constraints rejected workers) and the moves made.
   Moves per second and prefill tokens wasted: the simulator moves only requests that computed nothing
   (`engine.not_started`), so no prefill is wasted by construction; the live gateway moves only streams without a
   token among the worker's scraped `waiting`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.placement import CANDIDATES, TRACES, min_workers, point_spec, with_policy
from bench.report import git_commit
from policies.length_predictor import LengthPredictor
from simulator.profiles import load_profile
from simulator.simulate import SimSpec, build_sim, build_workload, history

ROOT = Path(__file__).parents[1]
OUT = ROOT / "bench" / "results" / "rebalance.md"
PARAMS = CANDIDATES["spread_lookahead"]
REBALANCE_S = 0.5
VARIANTS = {  # label -> (oracle lengths, rebalance_s)
    "predicted": (False, None),
    "predicted+rebalance": (False, REBALANCE_S),
    "oracle": (True, None),
    "oracle+rebalance": (True, REBALANCE_S),
}
TIGHT, TIGHT_TPOT_S = ("arxiv", 4.0), 0.025
LENGTH_TRACES = ("azure_conv", "sharegpt", "arxiv", "mooncake")   # the *_cv* variants share these lengths


def length_errors(duration: float) -> dict[str, dict[str, float]]:
    out = {}
    for trace in LENGTH_TRACES:
        level = TRACES[trace][1][1]
        spec = point_spec(trace, level, 0, duration)
        wl = build_workload(spec)
        model = load_profile(spec.profiles[0]).model
        pred = LengthPredictor()
        for p, o in history(spec, wl):
            pred.observe(model, p, o)
        errs, rel, true = [], [], []
        for r in wl:
            lp = pred.predict(model, r.prompt_tokens, r.max_tokens)
            errs.append(abs(lp - r.output_tokens))
            rel.append(abs(lp - r.output_tokens) / max(r.output_tokens, 1))
            true.append(r.output_tokens)
            pred.observe(model, r.prompt_tokens, r.output_tokens)
        out[trace] = {"requests": len(wl), "mean_output": statistics.fmean(true),
                      "mae_over_mean": statistics.fmean(errs) / statistics.fmean(true),
                      "median_rel_err": statistics.median(rel),
                      "share_off_by_half": sum(1 for x in rel if x > 0.5) / len(wl)}
    return out


def variant(spec: SimSpec, label: str, params: dict[str, Any] = PARAMS) -> SimSpec:
    oracle, reb = VARIANTS[label]
    return replace(with_policy(spec, "aladdin", params, oracle=oracle), rebalance_s=reb)


def detail(spec: SimSpec) -> dict[str, Any]:
    """One full run: attainment, moves, and what the policy decided and why."""
    wl = build_workload(spec)
    sim = build_sim(spec, wl)
    pol = sim.placement.policy
    rejections: Counter[str] = Counter()
    check = pol._check

    def counted(*a: Any, **kw: Any) -> Any:
        feas = check(*a, **kw)
        rejections.update(feas.rejections)
        return feas

    pol._check = counted
    t0 = time.perf_counter()
    res = sim.run(wl)
    d = res.to_dict()
    missed = [r for r in res.results if r.servable and not r.slo_met]
    ttft_miss = sum(1 for r in missed if r.ttft is None or r.ttft > r.slo_ttft_s)
    atgt_miss = sum(1 for r in missed if r.tpot is not None and r.tpot > r.slo_tpot_s)
    queued_miss = sum(1 for r in missed if r.queue_s is not None and r.slo_ttft_s is not None
                      and r.queue_s > 0.5 * r.slo_ttft_s)
    span = max(r.arrival for r in wl) - min(r.arrival for r in wl)
    placed = pol.decisions - pol.no_fits - pol.late - pol.best_efforts - pol.fallbacks
    return {"workers": spec.workers, "attainment": d["slo_attainment"], "moves": sim.moves,
            "ttft_miss": ttft_miss, "atgt_miss": atgt_miss, "miss_mostly_admission_wait": queued_miss,
            "moves_per_s": sim.moves / max(span, 1e-9), "moves_per_1000": 1000 * sim.moves / len(wl),
            "decisions": pol.decisions, "placed_fit": placed, "late": pol.late, "best_effort": pol.best_efforts,
            "fallback": pol.fallbacks, "queued_no_fit": pol.no_fits, "rejections": dict(rejections),
            "wall_s": time.perf_counter() - t0}


def tight(duration: float) -> list[dict[str, Any]]:
    """Is it the SLO regime? arxiv at its higher load with a decode-bound ATGT target: workers needed per variant."""
    rows = []
    spec = replace(point_spec(TIGHT[0], TIGHT[1], 0, duration), slo_tpot_s=TIGHT_TPOT_S)
    start = 10
    for label in VARIANTS:
        s = min_workers(variant(spec, label), label, TIGHT[0], TIGHT[1], 0.99, start, 64)
        start = s.needed or start
        at = {n: p.attainment for n, p in sorted(s.probes.items())}
        rows.append({"variant": label, "needed": s.needed, "probes": at})
        print(f"tight {label}: {s.needed} {at}", flush=True)
    return rows


def best_baseline(trace: str, level: float, seed: int) -> tuple[int | None, str]:
    path = ROOT / "bench" / "results" / "placement.json"
    if not path.is_file():
        return None, ""
    best: tuple[int, str] | None = None
    for s in json.loads(path.read_text())["searches"]:
        if (s["trace"], s["level"], s["seed"]) != (trace, level, seed) or s["label"].startswith(("cand:", "aladdin")):
            continue
        if s["needed"] is not None and (best is None or s["needed"] < best[0]):
            best = (s["needed"], s["label"])
    return best if best else (None, "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="60 simulated seconds per run, seed 0 only")
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--report", action="store_true", help="only rewrite the .md from the .json of a finished run")
    ap.add_argument("--tight", action="store_true",
                    help=f"add the decode-bound check (ATGT {TIGHT_TPOT_S * 1000:g} ms) to a finished run's .json")
    args = ap.parse_args()
    if args.report or args.tight:
        data = json.loads(args.out.with_suffix(".json").read_text())
        if args.tight:
            data["tight"] = tight(args.duration)
            data["tight_commit"] = git_commit()
            args.out.with_suffix(".json").write_text(json.dumps(data, indent=1))
        args.out.write_text(report(data) + _kept(args.out))
        return
    if args.quick:
        args.duration, args.seeds = 60.0, [0]
    t0 = time.perf_counter()
    errors = length_errors(args.duration)
    worst = sorted(errors, key=lambda t: -errors[t]["mae_over_mean"])[:2]
    rows, details = [], []
    for trace in worst:
        for level in TRACES[trace][1]:
            for seed in args.seeds:
                spec = point_spec(trace, level, seed, args.duration)
                needed: dict[str, int | None] = {}
                start = best_baseline(trace, level, seed)[0] or 8
                for label in VARIANTS:
                    s = min_workers(variant(spec, label), label, trace, level, 0.99, start, max(8 * start, 48))
                    needed[label] = s.needed
                    start = s.needed or start
                    print(f"[{time.perf_counter() - t0:5.0f} s] {trace} @ {level:g} seed {seed} {label}: {s.needed}",
                          flush=True)
                rows.append({"trace": trace, "level": level, "seed": seed, "needed": needed,
                             "best_baseline": best_baseline(trace, level, seed)})
                n = needed["predicted"]
                if n is not None and seed == args.seeds[0]:
                    for label in VARIANTS:
                        details.append({"trace": trace, "level": level, "seed": seed, "variant": label,
                                        **detail(replace(variant(spec, label), workers=n))})
                    for label in ("predicted", "oracle"):   # Algorithm 1 as printed: packing, no look-ahead
                        details.append({"trace": trace, "level": level, "seed": seed, "variant": f"{label}, paper",
                                        **detail(replace(variant(spec, label, CANDIDATES["paper"]), workers=n))})
    data = {"errors": errors, "worst": worst, "rows": rows, "details": details, "duration": args.duration,
            "seeds": args.seeds, "commit": git_commit(), "wall_s": time.perf_counter() - t0}
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    args.out.write_text(report(data) + _kept(args.out))
    print(f"wrote {args.out}")


def _kept(path: Path) -> str:
    """What a rewrite keeps of the file: the hand-written reading and the live point (bench/rebalance_live.py),
    which follow the generated tables."""
    old = path.read_text() if path.is_file() else ""
    starts = [i for i in (old.find("\n## Reading"), old.find("\n## One live point")) if i >= 0]
    return old[min(starts):] if starts else ""


def _machine() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Linux {platform.release()}, "
            f"Python {platform.python_version()}; load average at the end {load[0]:.1f} / {load[1]:.1f} / "
            f"{load[2]:.1f} (other engineers' jobs share the machine; virtual-time results do not depend on it)")


def report(data: dict[str, Any]) -> str:
    lines = ["# Rebalancing (Aladdin's Algorithm 2) in virtual time", "",
             f"- command: `python -m bench.rebalance{' --quick' if data['duration'] == 60.0 else ''}`",
             f"- commit: `{data['commit']}`", f"- machine: {_machine()}",
             f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; wall {data['wall_s']:.0f} s", "",
             "## Length-prediction error of the shipped traces", "",
             "| trace | requests | mean output | MAE / mean | median relative error | share off by > 50% |",
             "|---|---|---|---|---|---|"]
    for t, e in data["errors"].items():
        lines.append(f"| {t} | {e['requests']} | {e['mean_output']:.0f} | {e['mae_over_mean']:.2f} | "
                     f"{e['median_rel_err']:.2f} | {e['share_off_by_half']:.0%} |")
    lines += ["", f"Largest errors: {', '.join(data['worst'])} (chosen for the study below).", "",
              "## Workers needed for 99% SLO attainment", "",
              f"{data['duration']:.0f} simulated seconds per run; aladdin with `{json.dumps(PARAMS)}` "
              f"(bench/placement.py's choice); rebalancing every {REBALANCE_S} s.", "",
              "| trace | load | seed | best baseline | " + " | ".join(VARIANTS) + " |",
              "|---|---|---|---|" + "---|" * len(VARIANTS)]
    for r in data["rows"]:
        b, name = r["best_baseline"]
        cells = [str(r["needed"][v]) if r["needed"][v] is not None else "-" for v in VARIANTS]
        lines.append(f"| {r['trace']} | {r['level']:g} | {r['seed']} | {b if b else '-'} ({name}) | "
                     + " | ".join(cells) + " |")
    lines += ["", "## At the fleet aladdin needs without rebalancing: what the policy did", "",
              "Misses: TTFT / ATGT (a request may miss both) / of them waiting > half the TTFT target in the "
              f"admission queue. \"paper\": aladdin with `{json.dumps(CANDIDATES['paper'])}` (Algorithm 1 as "
              "printed: the fullest feasible worker, no look-ahead) at the same N.", "",
              "| trace | load | N | variant | attainment | misses | moves | moves/s | moves per 1000 req | "
              "placed (fit) | late | best effort | fallback | queued (no fit) | rejections by constraint |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in data["details"]:
        rej = ", ".join(f"{k} {v}" for k, v in sorted(d["rejections"].items()))
        lines.append(f"| {d['trace']} | {d['level']:g} | {d['workers']} | {d['variant']} | {d['attainment']:.4f} | "
                     f"{d['ttft_miss']} / {d['atgt_miss']} / {d['miss_mostly_admission_wait']} | "
                     f"{d['moves']} | {d['moves_per_s']:.3f} | {d['moves_per_1000']:.1f} | {d['placed_fit']} | "
                     f"{d['late']} | {d['best_effort']} | {d['fallback']} | {d['queued_no_fit']} | {rej} |")
    if data.get("tight"):
        lines += ["", f"## Decode-bound: {TIGHT[0]} @ {TIGHT[1]:g}, seed 0, ATGT target {TIGHT_TPOT_S * 1000:g} ms",
                  "", f"commit `{data.get('tight_commit', data['commit'])}`; otherwise as above. Attainment of "
                  "each fleet size probed (an upper bound where the run stopped once the target was lost).", "",
                  "| variant | workers needed | attainment by N |", "|---|---|---|"]
        for r in data["tight"]:
            probes = ", ".join(f"{n}: {a:.4f}" for n, a in r["probes"].items())
            lines.append(f"| {r['variant']} | {r['needed'] if r['needed'] is not None else '-'} | {probes} |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
