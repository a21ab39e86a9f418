"""Every policy by name on bench/peers_sched.py's chat windows and both Mooncake windows, in virtual time, with what
each run cost: workers for 99%, and at that size the refusals (429), the wall time of the run, the policy's
decisions (calls of `choose`, retries of waiting requests included) and microseconds per decision.

    python -m bench.peers_sched_cost [--workers-range 2 16] [--out bench/results/peers_sched.md]

Each probe is one ClusterSim run as bench/peers_sched_virtual.py's (the policy by name, its default parameters,
bench/prefix.py's queue settings, llama3-8b-h100 workers, the first seed). The windows: multi-turn chats at 12 new
conversations a second (requests 1920-2719, the live section's) and at 20 (3000-3799), Mooncake requests 0-399 (low
reuse) and 3000-3399 (high reuse). A second table puts aladdin next to least_tokens at every fleet size from
least_tokens' boundary up (attainment, refusals, wall time): the SLO-aware policy must refuse nothing there.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import REPO, log
from bench.peers_sched import PROFILE, chat_window, trace_window
from bench.peers_sched_virtual import Window, answer, user_policies
from bench.peers_sweep import TARGET, Probe, SweepResult, sweep_workers
from bench.prefix import QUEUE_LOOKAHEAD, QUEUE_POLL_S, SLO_TPOT_S
from bench.report import write_section
from simulator.workload import WorkloadRequest


@dataclass(frozen=True)
class Cost:
    attainment: float
    refused: int
    wall_s: float
    cpu_s: float        # the process's CPU time for the run: what a shared, loaded machine does not inflate
    decisions: int
    us_per_decision: float
    hit_rate: float = 0.0   # the engines' prefix-cache hit rate over prompt tokens


def cost_run(reqs: Sequence[WorkloadRequest], policy: str, workers: int, params: dict[str, Any] | None = None,
             kv_events: bool = True, on_sim: Callable[[Any], None] | None = None) -> Cost:
    """One virtual-time run of `policy` on `workers`, its decisions timed (the policy's `choose` wrapped).
    `params`: the policy's parameters (default: none); kv_events=False: engines that publish none;
    `on_sim(sim)`: called before the run (to observe it)."""
    from simulator.cluster import ClusterSim

    sim = ClusterSim(PROFILE, workers, policy, slo_tpot_s=SLO_TPOT_S, queue_poll_s=QUEUE_POLL_S,
                     queue_lookahead=QUEUE_LOOKAHEAD, seed=0, policy_params=params, kv_events=kv_events)
    if on_sim is not None:
        on_sim(sim)
    pol, inner, spent = sim.policy, sim.policy.choose, [0, 0.0]

    def timed(request, views, now):
        t0 = time.perf_counter()
        d = inner(request, views, now)
        spent[1] += time.perf_counter() - t0
        spent[0] += 1
        return d

    pol.choose = timed
    t0, c0 = time.perf_counter(), time.process_time()
    d = sim.run([dataclasses.replace(r) for r in reqs]).to_dict()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    refused = sum(1 for r in sim.results.values() if r.finish_reason == "refused")
    return Cost(d["slo_attainment"], refused, wall, cpu, spent[0], spent[1] / max(spent[0], 1) * 1e6,
                d["prefix_cache_hit_rate"])


class Runner:
    """Runs (window, policy, size) once and keeps the result (a sweep and the tables ask for the same points)."""

    def __init__(self) -> None:
        self.done: dict[tuple[str, str, int], Cost] = {}

    def __call__(self, w: Window, policy: str, n: int) -> Cost:
        key = (w.name, policy, n)
        if key not in self.done:
            self.done[key] = cost_run(w.reqs, policy, n)
        return self.done[key]

    def sweep(self, w: Window, policy: str, lo: int, hi: int) -> SweepResult:
        def probe(arm: str, n: int, _rate: float) -> Probe:
            c = self(w, arm, n)
            return Probe(arm, n, 1.0, c.attainment, 0.0, 0.0, "")

        res = sweep_workers(policy, probe, lo, hi)
        log(f"{w.name}: {policy}: {answer(res, lo, hi)}")
        return res


def cell(c: Cost | None) -> str:
    if c is None:
        return "- | - | - | - | -"
    return f"{c.refused} | {c.wall_s:.1f} | {c.cpu_s:.1f} | {c.decisions:,} | {c.us_per_decision:.0f}"


def windows(n_chat: int = 800, n_mooncake: int = 400) -> list[Window]:
    return [Window("chat 12/s, requests 1920-2719", 1920, chat_window(1920, n_chat, 12.0)),
            Window("chat 20/s, requests 3000-3799", 3000, chat_window(3000, n_chat, 20.0)),
            Window("Mooncake requests 0-399", 0, trace_window(0, n_mooncake)),
            Window("Mooncake requests 3000-3399", 3000, trace_window(3000, n_mooncake))]


def tables(ws: Sequence[Window], policies: Sequence[str], lo: int, hi: int) -> list[str]:
    run = Runner()
    out: list[str] = []
    for w in ws:
        out += [f"#### {w.name}", "",
                f"| policy | workers for {TARGET:.0%} | attainment there | refused (429) | wall s | CPU s | decisions "
                "| µs per decision |", "|---|---|---|---|---|---|---|---|"]
        answers: dict[str, SweepResult] = {}
        for p in policies:
            res = answers[p] = run.sweep(w, p, lo, hi)
            n = int(res.answer) if res.answer is not None else hi
            c = run(w, p, n)
            out.append(f"| {p} | {answer(res, lo, hi)} | {c.attainment:.1%} | {cell(c)} |")
        lt = answers.get("least_tokens")
        if lt is not None and "aladdin" in answers and lt.answer is not None and lt.bound != ">":
            base = int(lt.answer)
            out += ["", f"aladdin next to least_tokens from least_tokens' boundary ({base} workers) up:", "",
                    "| workers | least_tokens: attainment | refused | wall s | CPU s | aladdin: attainment | refused "
                    "| wall s | CPU s | ratio, wall; CPU |", "|---|---|---|---|---|---|---|---|---|---|"]
            for n in range(base, min(base + 3, hi) + 1):
                a, b = run(w, "least_tokens", n), run(w, "aladdin", n)
                out.append(f"| {n} | {a.attainment:.1%} | {a.refused} | {a.wall_s:.1f} | {a.cpu_s:.1f} "
                           f"| {b.attainment:.1%} | {b.refused} | {b.wall_s:.1f} | {b.cpu_s:.1f} "
                           f"| {b.wall_s / max(a.wall_s, 1e-9):.1f}x; {b.cpu_s / max(a.cpu_s, 1e-9):.1f}x |")
        out.append("")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers-range", type=int, nargs=2, default=(2, 16), metavar=("LO", "HI"))
    ap.add_argument("--policies", nargs="*", help="only these (default: every policy by name)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "peers_sched.md"))
    ap.add_argument("--title", default="Virtual time: every policy by name on chats and Mooncake, with decision cost")
    args = ap.parse_args()
    lo, hi = args.workers_range
    pols = args.policies or user_policies()
    body = tables(windows(), pols, lo, hi)
    cmd = (f"python -m bench.peers_sched_cost --workers-range {lo} {hi}"
           + (f" --policies {' '.join(args.policies)}" if args.policies else ""))
    intro = (f"Every policy by name in virtual time ({PROFILE} workers, default parameters, one seed; "
             "bench/peers_sched_cost.py). Workers for 99%: the fewest in "
             f"({lo}, {hi}] by bisection. Wall and CPU time: the whole ClusterSim run (the machine is shared and "
             "loaded, so wall time varies with the others' work; the process's CPU time much less); decisions: "
             "calls of the policy's choose, retries of waiting requests included; µs per decision: time inside "
             "choose.")
    write_section(Path(args.out), args.title, cmd, "\n".join([intro, "", *body]))
    print("\n".join(body))


if __name__ == "__main__":
    main()
