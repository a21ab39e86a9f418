"""How long a chat window must be before a fleet size can be judged on it, in virtual time: bench/peers_sched.py's
chat windows (800 requests, as its live and virtual tables replay) against the same windows three times as long,
with and without the admission rule that sheds what will miss (policies/shedding.py).

    python -m bench.shed_window [--policy least_tokens] [--workers 4 5 6 7] [--out bench/results/shedding.md]

An 800-request window is 25-40 s of arrivals from an empty fleet. Requests then decode for 10-20 s, so the
batches are still growing when the window ends, and the last requests finish on a fleet that no longer receives
any. A fleet size that serves the short window may fail the same traffic sustained. The long window shows which
refusals of the rule were foresight (the fleet could not have kept serving at that rate) and which were errors.
Each cell is one ClusterSim run built by bench/shed_cost.py's `cluster` (llama3-8b-h100 workers, the policy's default
parameters, bench/prefix.py's queue settings, the first seed); `shed` is the only difference between a pair of runs.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.harness import REPO, log
from bench.peers_sched import chat_window
from bench.report import write_section
from bench.shed_cost import cluster
from simulator.workload import WorkloadRequest

WINDOWS = ((12.0, 1920), (20.0, 3000))   # bench/peers_sched.py's two chat windows: (conversations/s, first request)
LENGTHS = (800, 2400)


@dataclass(frozen=True)
class Cell:
    attainment: float
    refused: int
    late_attainment: float     # over the last third of the window's arrivals
    admitted_met: float        # the share of the requests not refused that met their SLO


def run(reqs: Sequence[WorkloadRequest], policy: str, workers: int, shed: bool) -> Cell:
    from simulator.cluster import REFUSED

    res = cluster(policy, workers, shed).run([dataclasses.replace(r) for r in reqs]).results
    late = sorted(res, key=lambda r: r.arrival)[2 * len(res) // 3:]
    admitted = [r for r in res if r.finish_reason != REFUSED]
    return Cell(sum(r.slo_met for r in res) / len(res), len(res) - len(admitted),
                sum(r.slo_met for r in late) / len(late), sum(r.slo_met for r in admitted) / max(len(admitted), 1))


def table(policy: str, workers: Sequence[int]) -> list[str]:
    out = ["| window | requests | workers | attainment, rule off / on | refused (429), rule on "
           "| attainment over the last third, off / on | admitted that met their SLO, rule on |",
           "|---|---|---|---|---|---|---|"]
    for rate, start in WINDOWS:
        for n in LENGTHS:
            reqs = chat_window(start, n, rate)
            for w in workers:
                off, on = run(reqs, policy, w, False), run(reqs, policy, w, True)
                log(f"chat {rate:g}/s from {start}, {n} requests, {w} workers: {off} / {on}")
                out.append(f"| chat {rate:g}/s from {start} | {n} | {w} | {off.attainment:.1%} / {on.attainment:.1%} "
                           f"| {on.refused} | {off.late_attainment:.1%} / {on.late_attainment:.1%} "
                           f"| {on.admitted_met:.1%} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="least_tokens")
    ap.add_argument("--workers", type=int, nargs="+", default=[4, 5, 6, 7])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "shedding.md"))
    args = ap.parse_args()
    rows = table(args.policy, args.workers)
    command = "python -m bench.shed_window " + f"--policy {args.policy} --workers {' '.join(map(str, args.workers))}"
    write_section(Path(args.out), f"Virtual time: short chat windows against sustained ones ({args.policy})",
                  command, "\n".join(rows))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
