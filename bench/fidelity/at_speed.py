"""Replay a finished fidelity run's levels on the simulator at the real engine's speed in each level's minutes.

    .venv/bin/python -m bench.fidelity.at_speed RUN_DIR [--cpus 1]

RUN_DIR holds what `bench.fidelity --profile RUN_DIR/profile.yaml --raw RUN_DIR/raw.json --step-trace
RUN_DIR/trace` wrote. Each level's requests and arrivals are rebuilt exactly as the run made them (same seed, rate
from the real burst), its engine speed is the step trace's measured / modelled over the level's first real run
(bench.fidelity.step_trace, both kinds of step), and the level runs on `fleetgate sim` with the profile's step times
scaled by it. The same diagnostic bench.fidelity now runs itself with --step-trace; this applies it to runs made
before, or again to see the simulator's own spread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.fidelity.harness import (
    MODEL,
    StreamResult,
    keep_off_core,
)
from bench.fidelity.legs import (
    LEVELS,
    LegResult,
    WorkItem,
    compare,
    leg_stats,
    level_plan,
    pool,
    run_leg,
    scaled_profile,
)
from bench.fidelity.run import (
    LevelResult,
    matched_table,
)
from bench.harness import (
    run_gateway,
    run_sim_server,
)


@dataclass(slots=True)
class LevelPlan:
    name: str
    rate: float
    items: list[WorkItem]
    a_arrivals: list[float]   # first half: items[:len(a_arrivals)]
    b_arrivals: list[float]


def results(records: Sequence[dict[str, Any]]) -> list[StreamResult]:
    """A leg's requests from raw.json (bench.fidelity.run.dump_raw), times relative to the leg's start."""
    return [StreamResult(r["prompt"], r["max_tokens"], sent=r["sent"], status=r["status"], error=r["error"] or "",
                         chunks=[(t, n) for t, n in r["chunks"]]) for r in records]


def plans_from_raw(raw: dict[str, Any], seed: int = 1, n: int = 400) -> list[LevelPlan]:
    """Every level's requests and arrivals as bench.fidelity.run made them (level_plan), at rates from the real
    burst's throughput."""
    saturation = leg_stats(results(raw["real"]["burst"]), 0.0).requests_per_s
    plans = []
    for k, (name, frac) in enumerate(LEVELS):
        rate = frac * saturation
        a_items, a_arr, b_items, b_arr = level_plan(k, rate, seed, n)
        if len(a_items) + len(b_items) != len(raw["real"][name]):
            raise ValueError(f"{name}: the run sent {len(raw['real'][name])} requests, rebuilt "
                             f"{len(a_items) + len(b_items)}: another seed or --quick?")
        plans.append(LevelPlan(name, rate, a_items + b_items, a_arr, b_arr))
    return plans


async def run_halves(gateway: str, engine: str, plan: LevelPlan, what: str) -> LegResult:
    """A level's two halves, one after the other, pooled as bench.fidelity pools them."""
    half = len(plan.a_arrivals)
    a = await run_leg(gateway, engine, plan.items[:half], plan.a_arrivals, f"A {what}")
    b = await run_leg(gateway, engine, plan.items[half:], plan.b_arrivals, f"B {what}")
    return pool(a, b)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--cpus", default="1", help="cores for the simulator (the fidelity run's host cores)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    from bench.fidelity.step_trace import load_steps, step_ratios
    from simulator.profiles import load_profile

    keep_off_core(0)
    raw = json.loads((args.run_dir / "raw.json").read_text())
    profile = args.run_dir / "profile.yaml"
    steps, prof = load_steps(args.run_dir / "trace"), load_profile(str(profile))
    levels = []
    for (name, frac), plan in zip(LEVELS, plans_from_raw(raw, args.seed), strict=True):
        speed = step_ratios(steps, prof, raw["windows"]["real"][name]).all_ratio
        with tempfile.TemporaryDirectory(prefix="fleetgate-at-speed-") as tmp, \
                run_sim_server(scaled_profile(profile, speed, Path(tmp) / "p.yaml"), args.cpus, MODEL) as url, \
                run_gateway(url, MODEL) as gw:
            leg = asyncio.run(run_halves(gw, url, plan, f"sim x{speed:.2f}"))
        real = leg_stats(results(raw["real"][name]), 0.0)
        fitted = leg_stats(results(raw["sim"][name]), 0.0)
        at_speed = leg_stats(leg.results, leg.start)
        levels.append(LevelResult(name, frac, plan.rate, len(plan.items), real, fitted, 0.0, 0.0,
                                  cells=compare(real, fitted), speed=speed, matched=at_speed,
                                  matched_cells=compare(real, at_speed)))
    cells = [c for lv in levels for c in lv.matched_cells]
    print(matched_table(levels))
    print(f"\n{sum(c.passed for c in cells)} of {len(cells)} cells within target at each level's engine speed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
