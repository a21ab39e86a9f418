"""What the admission rule that sheds what will miss (policies/shedding.py) costs where the fleet can serve, in
virtual time: every policy by name on bench/peers_sched.py's two chat windows, at its own 99% boundary (the fewest
workers at which it attains 99% without the rule), run without and with the rule. The rule must not lower the
attainment there, and refuses (429) next to nothing. Also the per-request cost of the check on the hot path: the
time inside the rule (`Shedder.check` and its tracker's hooks) per request of the run with the rule.

    python -m bench.shed_cost [--workers-range 2 16] [--policies ...] [--out bench/results/shedding.md]

Each probe is one ClusterSim run as bench/peers_sched_cost.py's (llama3-8b-h100 workers, the policy's default
parameters, bench/prefix.py's queue settings, the first seed); `shed` is the only difference between the two runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench.harness import REPO, log
from bench.peers_sched import PROFILE
from bench.peers_sched_cost import windows
from bench.peers_sched_virtual import Window, answer, user_policies
from bench.peers_sweep import TARGET, Probe, sweep_workers
from bench.prefix import QUEUE_LOOKAHEAD, QUEUE_POLL_S, SLO_TPOT_S
from bench.report import write_section
from simulator.workload import WorkloadRequest

if TYPE_CHECKING:
    from simulator.cluster import ClusterSim


@dataclass(frozen=True)
class Run:
    attainment: float
    refused: int
    requests: int
    rule_us_per_request: float     # time inside the rule per request (0 without it)


def cluster(policy: str, workers: int, shed: bool) -> ClusterSim:
    """The fleet of every probe of this bench and bench/shed_window.py: `workers` x PROFILE, the policy's
    default parameters, bench/prefix.py's queue settings, the first seed; `shed`: the rule on or off."""
    from simulator.cluster import ClusterSim

    return ClusterSim(PROFILE, workers, policy, slo_tpot_s=SLO_TPOT_S, queue_poll_s=QUEUE_POLL_S,
                      queue_lookahead=QUEUE_LOOKAHEAD, seed=0, shed=shed)


def run(reqs: Sequence[WorkloadRequest], policy: str, workers: int, shed: bool) -> Run:
    """One virtual-time run; with the rule, its check and its tracker's hooks timed."""
    from simulator.cluster import REFUSED

    sim = cluster(policy, workers, shed)
    from policies.shedding import Shedder

    spent = [0.0]
    names = ("check", "dispatched", "moved", "progress", "finished")
    saved = {name: getattr(Shedder, name) for name in names}
    for name, inner in saved.items():     # Shedder has __slots__: its methods are timed on the class for the run

        def timed(*a, _inner=inner, **kw):
            t0 = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - t0

        setattr(Shedder, name, timed)
    try:
        res = sim.run([dataclasses.replace(r) for r in reqs])
    finally:
        for name, inner in saved.items():
            setattr(Shedder, name, inner)
    d = res.to_dict()
    n = len(res.results)
    refused = sum(1 for r in res.results if r.finish_reason == REFUSED)
    return Run(d["slo_attainment"], refused, n, spent[0] / max(n, 1) * 1e6)


def tables(ws: Sequence[Window], policies: Sequence[str], lo: int, hi: int) -> list[str]:
    done: dict[tuple[str, str, int, bool], Run] = {}

    def at(w: Window, p: str, n: int, shed: bool) -> Run:
        key = (w.name, p, n, shed)
        if key not in done:
            done[key] = run(w.reqs, p, n, shed)
        return done[key]

    out: list[str] = []
    for w in ws:
        out += [f"#### {w.name}", "",
                f"| policy | workers for {TARGET:.0%} without the rule | attainment without / with the rule | "
                "refused (429) without / with | attainment, one worker more: without / with | "
                "µs per request in the rule |", "|---|---|---|---|---|---|"]
        for p in policies:
            def probe(arm: str, n: int, _rate: float, _w: Window = w) -> Probe:
                return Probe(arm, n, 1.0, at(_w, arm, n, False).attainment, 0.0, 0.0, "")

            res = sweep_workers(p, probe, lo, hi)
            log(f"{w.name}: {p}: {answer(res, lo, hi)}")
            if res.answer is None or res.bound == ">":
                out.append(f"| {p} | {answer(res, lo, hi)} | - | - | - | - |")
                continue
            n = int(res.answer)
            a, b = at(w, p, n, False), at(w, p, n, True)
            a1, b1 = at(w, p, n + 1, False), at(w, p, n + 1, True)
            out.append(f"| {p} | {n} | {a.attainment:.1%} / {b.attainment:.1%} | {a.refused} / {b.refused} "
                       f"| {a1.attainment:.1%} / {b1.attainment:.1%} | {b.rule_us_per_request:.0f} |")
        out.append("")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers-range", type=int, nargs=2, default=(2, 16), metavar=("LO", "HI"))
    ap.add_argument("--policies", nargs="*", help="only these (default: every policy by name)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "shedding.md"))
    ap.add_argument("--title", default="Virtual time: the rule at each policy's 99% boundary on the chat windows")
    args = ap.parse_args()
    lo, hi = args.workers_range
    pols = args.policies or user_policies()
    body = tables(windows()[:2], pols, lo, hi)
    cmd = (f"python -m bench.shed_cost --workers-range {lo} {hi}"
           + (f" --policies {' '.join(args.policies)}" if args.policies else ""))
    intro = (f"Every policy by name in virtual time ({PROFILE} workers, default parameters, one seed; "
             "bench/shed_cost.py), at the fewest workers in "
             f"({lo}, {hi}] at which it attains 99% without the rule (bisection), then without and with it "
             "(`ClusterSim(shed=...)`, the gateway's `limits.shed_will_miss`). Refusals count as misses in the "
             "attainment. µs per request: time inside the rule (its check and its tracker's bookkeeping) over "
             "every request of the run with it, on this shared machine.")
    write_section(Path(args.out), args.title, cmd, "\n".join([intro, "", *body]))
    print("\n".join(body))


if __name__ == "__main__":
    main()
