"""Every policy a user can pick by name on bench/peers_sched.py's trace windows, in virtual time: the fewest workers
reaching 99% SLO attainment per policy, on the low-reuse window (Mooncake requests 0-399, ~6% of prompt tokens
reusable) and the high-reuse one (3000-3399, ~41%).

    python -m bench.peers_sched --virtual-sweep [--workers-range 2 16] [--seeds 0 1 2]

Each probe is one ClusterSim run (simulator/cluster.py, the policy by name as `fleetgate simulate --policy` builds
it, its default parameters) of the window with bench/peers_sched.py's SLO rule and bench/prefix.py's queue settings,
N x llama3-8b-h100: deterministic for a seed, so the table separates the policies from the live runs' noise. The
seed reaches only the seeded policies (random, power_of_two); the others run with the first seed. The search is
bench/peers_sweep.py's sweep_workers (bisection, attainment assumed monotone in N).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from bench.harness import log
from bench.peers_sweep import TARGET, Probe, SweepResult, sweep_workers
from bench.prefix import QUEUE_LOOKAHEAD, QUEUE_POLL_S, SLO_TPOT_S
from simulator.workload import WorkloadRequest

SEEDED = ("random", "power_of_two")   # the policies whose choices depend on the seed


@dataclass(frozen=True)
class Window:
    name: str
    start: int
    reqs: list[WorkloadRequest]


def user_policies() -> list[str]:
    """Every policy a user can pick by name for a plain (not P/D) fleet."""
    from policies.base import policy_names

    return [p for p in policy_names() if not p.startswith("pd")]


def sim_probe(reqs: Sequence[WorkloadRequest], policy: str, workers: int, seed: int, profile: str) -> Probe:
    """One virtual-time run of `policy` on `workers` x `profile`."""
    from simulator.cluster import ClusterSim

    sim = ClusterSim(profile, workers, policy, slo_tpot_s=SLO_TPOT_S, queue_poll_s=QUEUE_POLL_S,
                     queue_lookahead=QUEUE_LOOKAHEAD, seed=seed)
    d = sim.run([dataclasses.replace(r) for r in reqs]).to_dict()
    return Probe(policy, workers, 1.0, d["slo_attainment"], 0.0, d["prefix_cache_hit_rate"],
                 f"TPOT p99 {d['tpot_p99'] * 1000:.0f} ms")


def policy_sweeps(window: Window, policies: Sequence[str], lo: int, hi: int, seeds: Sequence[int],
                  profile: str) -> list[tuple[int, SweepResult]]:
    """(seed, workers-for-99% search) per policy and seed (one seed for unseeded policies)."""
    out = []
    for policy in policies:
        for seed in (seeds if policy in SEEDED else seeds[:1]):
            res = sweep_workers(policy, lambda arm, n, _rate, s=seed: sim_probe(window.reqs, arm, n, s, profile),
                                lo, hi)
            log(f"{window.name}: {policy} seed {seed}: {answer(res, lo, hi)}")
            out.append((seed, res))
    return out


def answer(res: SweepResult, lo: int, hi: int) -> str:
    if res.bound == ">":
        return f"> {hi}"
    if res.bound == "<=":
        return f"<= {lo}"
    return f"{res.answer:.0f}"


def at_size(res: SweepResult, n: int) -> Probe | None:
    return next((p for p in res.probes if p.workers == n), None)


def virtual_table(windows: Sequence[Window], policies: Sequence[str], lo: int, hi: int, seeds: Sequence[int],
                  profile: str, at: int = 6) -> list[str]:
    """Per policy and seed: workers for 99% on each window, and attainment at `at` workers (probed if the search
    did not)."""
    heads = " | ".join(f"{w.name}: workers for {TARGET:.0%} | {w.name}: at {at} workers" for w in windows)
    rows = [f"| policy | seed | {heads} |", "|---|---|" + "---|---|" * len(windows)]
    sweeps = {w.name: policy_sweeps(w, policies, lo, hi, seeds, profile) for w in windows}
    for i, (seed, first) in enumerate(sweeps[windows[0].name]):
        cells = []
        for w in windows:
            res = sweeps[w.name][i][1]
            p = at_size(res, at) or sim_probe(w.reqs, first.arm, at, seed, profile)
            cells.append(f"{answer(res, lo, hi)} | {p.attainment:.1%} ({p.misses})")
        rows.append(f"| {first.arm} | {seed} | {' | '.join(cells)} |")
    return rows


def jittered(reqs: Sequence[WorkloadRequest], sigma_s: float, seed: int) -> list[WorkloadRequest]:
    """The window with every arrival moved by a Gaussian offset (sigma `sigma_s`, kept >= 0), in arrival order:
    the timing noise a live replay adds. Seed 0 leaves the trace as it is."""
    import random

    if seed == 0:
        return list(reqs)
    rng = random.Random(seed)
    moved = [dataclasses.replace(r, arrival=max(0.0, r.arrival + rng.gauss(0.0, sigma_s))) for r in reqs]
    return sorted(moved, key=lambda r: r.arrival)


def jitter_table(window: Window, policies: Sequence[str], workers: int, seeds: Sequence[int], sigma_s: float,
                 profile: str) -> list[str]:
    """Per policy: attainment (and TPOT p99) at `workers` over arrival jitters: is a policy's result stable
    against the timing noise of a live run?"""
    rows = [f"| policy | attainment per jitter seed ({', '.join(map(str, seeds))}) | range |", "|---|---|---|"]
    for policy in policies:
        probes = [sim_probe(jittered(window.reqs, sigma_s, s), policy, workers, 0, profile) for s in seeds]
        atts = [p.attainment for p in probes]
        rows.append(f"| {policy} | {', '.join(f'{p.attainment:.1%} ({p.misses})' for p in probes)} "
                    f"| {min(atts):.1%}-{max(atts):.1%} |")
        log(rows[-1])
    return rows
