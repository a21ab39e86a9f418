"""Sweeps over bench/peers_sched.py's arms: the fewest workers reaching 99% SLO attainment, and the largest
arrival-rate multiplier keeping 99% with its goodput. The targets: a fleetgate arm needs fewer workers for 99%
than every other arm, and fleetgate's best reaches >= 1.3x the best peer's goodput with equal workers.

    python -m bench.peers_sched --sweep-workers [--workers-range 4 12] ...
    python -m bench.peers_sched --sweep-rate [--workers 8] [--rates 0.4 0.5 ...] ...

Every probe is one live run of bench/peers_sched.py's run_arm: a fresh simulated fleet and router, the same
trace window and time scale for every arm. A rate multiplier m replays the window's arrivals at arrival / m
(m > 1 is more load); the SLOs stay per request (they depend on the prompt only). Workers: per arm the
smallest N in (lo, hi] with attainment >= 99% by bisection (bench/harness.py bisect_smallest, attainment
assumed monotone in N); ok(hi) is probed first (else "> hi"), and when the answer is lo + 1, lo itself is
probed too (else the answer would rest on an assumption). Rate: per arm the largest grid multiplier with
attainment >= 99% by bisection over the grid (attainment assumed to fall as the rate grows), its goodput
(requests that met their SLO per model second) the arm's "goodput at 99% SLO". This module holds the search
and the report; peers_sched.py the live runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import bisect_smallest, log
from simulator.workload import WorkloadRequest

TARGET = 0.99


@dataclass
class Probe:
    """One live run of one arm at one fleet size and rate multiplier."""

    arm: str
    workers: int
    rate: float
    attainment: float
    goodput: float        # met requests per model second
    hit_rate: float
    misses: str = ""      # which requests missed, by cause (see miss_causes)


@dataclass
class SweepResult:
    arm: str
    probes: list[Probe] = field(default_factory=list)
    answer: float | None = None   # smallest N / largest multiplier meeting TARGET; None: none in range
    bound: str = ""               # "" exact (within the grid); ">" / "<" / "<=" when it lies outside the range


RunPoint = Callable[[str, int, float], Probe]   # (arm, workers, rate multiplier) -> Probe


def scaled(reqs: Sequence[WorkloadRequest], rate: float) -> list[WorkloadRequest]:
    """The window with its arrivals at arrival / rate (rate 2: twice the requests per second)."""
    return [dataclasses.replace(r, arrival=r.arrival / rate) for r in reqs]


def sweep_workers(arm: str, run: RunPoint, lo: int, hi: int, rate: float = 1.0) -> SweepResult:
    """The smallest fleet in (lo, hi] whose attainment is >= TARGET (see the module doc)."""
    res = SweepResult(arm)
    seen: dict[int, Probe] = {}

    def ok(n: int) -> bool:
        if n not in seen:
            seen[n] = run(arm, n, rate)
            res.probes.append(seen[n])
        return seen[n].attainment >= TARGET

    if not ok(hi):
        res.answer, res.bound = float(hi), ">"
        return res
    n = bisect_smallest(ok, lo, hi)
    if n == lo + 1 and lo > 0 and ok(lo):
        res.answer, res.bound = float(lo), "<="
    else:
        res.answer = float(n)
    return res


def sweep_rate(arm: str, run: RunPoint, workers: int, grid: Sequence[float]) -> SweepResult:
    """The largest multiplier of `grid` (ascending) whose attainment is >= TARGET (see the module doc)."""
    res = SweepResult(arm)
    seen: dict[int, Probe] = {}

    def fails(i: int) -> bool:          # i in 1..len(grid): grid[i - 1]
        if i not in seen:
            seen[i] = run(arm, workers, grid[i - 1])
            res.probes.append(seen[i])
        return seen[i].attainment < TARGET

    if not fails(len(grid)):
        res.answer, res.bound = grid[-1], ">"
        return res
    first_fail = bisect_smallest(fails, 0, len(grid))
    if first_fail == 1:
        res.answer, res.bound = grid[0], "<"
    else:
        res.answer = grid[first_fail - 2]
    return res


def at_answer(res: SweepResult, key: str) -> Probe | None:
    """The probe at the sweep's answer (key: "workers" or "rate"), if it was run and met the target."""
    for p in res.probes:
        if res.answer is not None and getattr(p, key) == res.answer and p.attainment >= TARGET:
            return p
    return None


def is_ours(arm: str) -> bool:
    return arm.startswith("fleetgate")


def workers_table(results: Sequence[SweepResult], lo: int, hi: int) -> list[str]:
    rows = [f"| router, policy | workers for {TARGET:.0%} | probes (N: attainment, hit rate) |", "|---|---|---|"]
    for res in results:
        if res.bound == ">":
            ans = f"> {hi}"
        elif res.bound == "<=":
            ans = f"<= {lo}"
        else:
            ans = f"{res.answer:.0f}"
        probes = ", ".join(f"{p.workers}: {p.attainment:.1%}, {p.hit_rate:.0%}"
                           for p in sorted(res.probes, key=lambda p: p.workers))
        rows.append(f"| {res.arm} | {ans} | {probes} |")
    return rows


def workers_verdict(results: Sequence[SweepResult], arm: str, hi: int) -> str:
    """The target: `arm` needs fewer workers for 99% than every other arm."""
    mine = next((r for r in results if r.arm == arm), None)
    if mine is None or not results:
        return ""
    others = [r for r in results if r.arm != arm]

    def need(r: SweepResult) -> float:   # for comparison: "> hi" counts as hi + 1, "<= lo" as lo
        return (hi + 1.0) if r.bound == ">" else float(r.answer or 0)

    fewer = [r.arm for r in others if need(mine) < need(r)]
    not_fewer = [r.arm for r in others if need(mine) >= need(r)]
    met = mine.bound != ">" and not not_fewer
    return (f"Target ({arm} needs fewer workers for {TARGET:.0%} than every other arm): "
            f"**{'met' if met else 'missed'}**"
            + (f"; not fewer than: {', '.join(not_fewer)}" if not_fewer else "")
            + (f"; fewer than: {', '.join(fewer)}" if fewer else "") + ".")


def rate_table(results: Sequence[SweepResult], grid: Sequence[float],
               base_rate: float) -> tuple[list[str], str]:
    """The per-arm table and the goodput verdict (fleetgate's best >= 1.3x the best peer's goodput).

    A peer arm that misses 99% even at the smallest multiplier is credited with an upper bound of its goodput at
    99%: the offered rate there (base_rate x grid[0], requests per model second), since it reaches 99% only
    below it; the ratios to it are then lower bounds ("x or more"). A fleetgate arm in that case counts 0."""
    rows = [f"| router, policy | largest rate multiplier at {TARGET:.0%} | goodput there (met req/s) "
            "| x best peer | probes (multiplier: attainment) |", "|---|---|---|---|---|"]
    good: dict[str, float] = {}
    bounded: set[str] = set()
    for r in results:
        p = at_answer(r, "rate")
        if p is not None:
            good[r.arm] = p.goodput
        elif r.bound == "<" and not is_ours(r.arm):
            good[r.arm] = base_rate * grid[0]
            bounded.add(r.arm)
        else:
            good[r.arm] = 0.0
    peers = {a: g for a, g in good.items() if not is_ours(a)}
    best_peer = max(peers, key=peers.__getitem__) if peers else None
    at_least = ">= " if best_peer in bounded else ""
    for res in results:
        if res.bound == ">":
            ans = f">= {grid[-1]:g}"
        elif res.bound == "<":
            ans = f"< {grid[0]:g}"
        else:
            ans = f"{res.answer:g}"
        unknown = res.bound == "<" and res.arm not in bounded   # a fleetgate arm below the grid: no goodput
        gp = "-" if unknown else f"< {good[res.arm]:.3f}" if res.arm in bounded else f"{good[res.arm]:.3f}"
        ratio = (f"{at_least}{good[res.arm] / peers[best_peer]:.2f}x"
                 if best_peer and peers[best_peer] > 0 and res.arm not in bounded and not unknown else "-")
        probes = ", ".join(f"{p.rate:g}: {p.attainment:.1%}" + (f" ({p.misses})" if p.misses else "")
                           for p in sorted(res.probes, key=lambda p: p.rate))
        rows.append(f"| {res.arm} | {ans} | {gp} | {ratio} | {probes} |")
    ours = {a: g for a, g in good.items() if is_ours(a)}
    if not ours or not best_peer:
        return rows, ""
    best = max(ours, key=ours.__getitem__)
    ratio = ours[best] / peers[best_peer] if peers[best_peer] > 0 else float("inf")
    rival = (f"{best_peer}, whose goodput at {TARGET:.0%} is below {peers[best_peer]:.3f} (it misses {TARGET:.0%} "
             f"even at x{grid[0]:g})" if best_peer in bounded else f"{best_peer} ({peers[best_peer]:.3f})")
    verdict = (f"Target (fleetgate's best >= 1.3x the best peer's goodput at {TARGET:.0%} SLO, "
               f"equal workers): **{'met' if ratio >= 1.3 else 'missed'}**: {best} {ours[best]:.3f} met req/s = "
               f"{at_least}{ratio:.2f}x {rival}.")
    return rows, verdict


def plot(results: Sequence[SweepResult], key: str, path: Path, title: str) -> None:
    """Attainment vs `key` ("workers" or "rate") per arm, every probe, with the 99% line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for res in results:
        pts = sorted((getattr(p, key), p.attainment) for p in res.probes)
        ax.plot([x for x, _ in pts], [y * 100 for _, y in pts], "-" if is_ours(res.arm) else "--",
                marker="o", label=res.arm)
    ax.axhline(TARGET * 100, color="grey", lw=0.8)
    ax.set_xlabel("workers" if key == "workers" else "arrival-rate multiplier")
    ax.set_ylabel("SLO attainment %")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"wrote {path}")
