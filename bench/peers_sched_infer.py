"""aladdin without KV events on bench/peers_sched.py's chat and Mooncake windows, in virtual time: its conversation
affinity from the request's conversation id, from its prefix (the ids removed, policies/aladdin/affinity.py), and
from neither, next to least_tokens and to aladdin with KV events.

    python -m bench.peers_sched_infer [--workers-range 2 16] [--out bench/results/peers_sched.md]

The arms (each probe one ClusterSim run as bench/peers_sched_cost.py's, llama3-8b-h100 workers, the first seed):
  least_tokens                  the default, for reference
  aladdin + KV events           the engines publish KV events: the exact cached prefix per worker
  aladdin, ids only             no KV events; each turn carries its conversation id (x-session-id); infer_prefix
                                false: the estimate is the id's last turn only (aladdin before the inference)
  aladdin, ids                  no KV events, ids; infer_prefix (the default): and what each worker was sent
  aladdin, ids removed          no KV events, no ids: the conversation inferred from the prefix chain, and what
                                each worker was sent
  aladdin, no ids, no inference no KV events, no ids, infer_prefix false: no cached-prefix estimate at all
The Mooncake trace carries no conversation ids, so there the arms with ids are the ones without and are not run.
Per window: workers for 99% (bisection in (lo, hi]), and at each size from one below the smallest boundary to two
above the largest: attainment, refusals, the engines' prefix-cache hit rate; at each arm's boundary the wall and CPU
time of the run and microseconds per decision. For the ids-removed arm: how each turn whose previous turn is in the
window too was matched (its own previous turn, another conversation's turn, none), and how many of the other
requests (first turns, turns whose previous one ran before the window) were matched to some turn anyway (a glue),
counted at each request's first placement.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import REPO, log
from bench.peers_sched import PROFILE
from bench.peers_sched_cost import Cost, cost_run, windows
from bench.peers_sched_virtual import Window, answer
from bench.peers_sweep import TARGET, Probe, SweepResult, sweep_workers
from bench.report import write_section
from simulator.workload import WorkloadRequest


@dataclass(frozen=True)
class Arm:
    label: str
    policy: str
    params: dict[str, Any] | None = None
    kv_events: bool = True
    strip_ids: bool = False


ARMS = (
    Arm("least_tokens", "least_tokens"),
    Arm("aladdin + KV events", "aladdin"),
    Arm("aladdin, ids only", "aladdin", {"infer_prefix": False}, kv_events=False),
    Arm("aladdin, ids", "aladdin", kv_events=False),
    Arm("aladdin, ids removed", "aladdin", kv_events=False, strip_ids=True),
    Arm("aladdin, no ids, no inference", "aladdin", {"infer_prefix": False}, kv_events=False, strip_ids=True),
)
WITH_IDS = ("aladdin, ids only", "aladdin, ids")   # the same as others where the trace carries no ids
INFER = "aladdin, ids removed"


@dataclass
class Matches:
    """How the turns after a conversation's first were matched at their first placement."""

    right: int = 0      # a turn whose previous turn ran in the window: matched to it
    wrong: int = 0      # ... to another conversation's turn
    none: int = 0       # ... to nothing
    glued: int = 0      # a turn with no previous turn in the window (or no known conversation) matched to one
    others: int = 0     # how many of those
    seen: set[str] = field(default_factory=set)

    def cell(self) -> str:
        n = self.right + self.wrong + self.none
        own = f"{self.right}/{n} right, {self.wrong} wrong, {self.none} none; " if n else ""
        return f"{own}{self.glued}/{self.others} of the others matched to a turn"


def watch(truth: dict[str, str], out: Matches):
    """on_sim hook: count, at each turn's first placement, which turn the cache inferred it continues. `truth`:
    request id -> its conversation's previous turn's id."""
    def hook(sim: Any) -> None:
        pol = sim.policy
        cache, inner = pol.constraints.sessions, pol.on_dispatch    # on_dispatch feeds the cache (placed)

        def on_dispatch(request, worker_id, now):
            rid = request.request_id
            if rid not in out.seen:
                out.seen.add(rid)
                got = cache.previous_turn(request)
                if rid not in truth:
                    out.others += 1
                    out.glued += got is not None
                elif got is None:
                    out.none += 1
                elif got == truth[rid]:
                    out.right += 1
                else:
                    out.wrong += 1
            inner(request, worker_id, now)

        pol.on_dispatch = on_dispatch
    return hook


def previous_turns(reqs: Sequence[WorkloadRequest]) -> dict[str, str]:
    """Request id -> the id of its conversation's previous turn (chat ids are c<conv>-t<k>), for the turns whose
    previous turn is in the window too (the others' ran before it: nothing to find, with an id or without)."""
    ids = {r.request_id for r in reqs}
    out = {}
    for r in reqs:
        conv, _, k = r.request_id.rpartition("-t")
        if r.session_id and conv and k.isdigit() and int(k) > 0 and f"{conv}-t{int(k) - 1}" in ids:
            out[r.request_id] = f"{conv}-t{int(k) - 1}"
    return out


class Runner:
    def __init__(self) -> None:
        self.done: dict[tuple[str, str, int], Cost] = {}
        self.matches: dict[tuple[str, int], Matches] = {}

    def __call__(self, w: Window, arm: Arm, n: int) -> Cost:
        key = (w.name, arm.label, n)
        if key not in self.done:
            reqs = [dataclasses.replace(r, session_id=None) for r in w.reqs] if arm.strip_ids else w.reqs
            hook = None
            if arm.label == INFER:
                m = self.matches[(w.name, n)] = Matches()
                hook = watch(previous_turns(w.reqs), m)
            self.done[key] = cost_run(reqs, arm.policy, n, arm.params, arm.kv_events, hook)
            c = self.done[key]
            log(f"{w.name}: {arm.label} at {n}: {c.attainment:.1%}, {c.refused} refused, {c.wall_s:.1f} s")
        return self.done[key]

    def sweep(self, w: Window, arm: Arm, lo: int, hi: int) -> SweepResult:
        def probe(_arm: str, n: int, _rate: float) -> Probe:
            return Probe(arm.label, n, 1.0, self(w, arm, n).attainment, 0.0, 0.0, "")

        res = sweep_workers(arm.label, probe, lo, hi)
        log(f"{w.name}: {arm.label}: {answer(res, lo, hi)}")
        return res


def tables(ws: Sequence[Window], lo: int, hi: int) -> list[str]:
    run = Runner()
    out: list[str] = []
    for w in ws:
        arms = [a for a in ARMS if not (a.label in WITH_IDS and not any(r.session_id for r in w.reqs))]
        out += [f"#### {w.name}", "",
                f"| arm | workers for {TARGET:.0%} | attainment there | refused (429) | hit rate | wall s | CPU s "
                "| decisions | µs per decision |", "|---|---|---|---|---|---|---|---|---|"]
        ns: list[int] = []
        for a in arms:
            res = run.sweep(w, a, lo, hi)
            n = int(res.answer) if res.answer is not None else hi
            ns.append(n)
            c = run(w, a, n)
            out.append(f"| {a.label} | {answer(res, lo, hi)} | {c.attainment:.1%} | {c.refused} | {c.hit_rate:.1%} "
                       f"| {c.wall_s:.1f} | {c.cpu_s:.1f} | {c.decisions:,} | {c.us_per_decision:.0f} |")
        sizes = range(max(min(ns) - 1, lo + 1), min(max(ns) + 2, hi) + 1)
        out += ["", "Attainment, refused and hit rate per fleet size:", "",
                "| workers | " + " | ".join(a.label for a in arms) + " |", "|---" * (len(arms) + 1) + "|"]
        for n in sizes:
            cells = []
            for a in arms:
                c = run(w, a, n)
                cells.append(f"{c.attainment:.1%}, {c.refused}, {c.hit_rate:.0%}")
            out.append(f"| {n} | " + " | ".join(cells) + " |")
        out += ["", "What the ids-removed arm inferred at each request's first placement (turns whose previous turn "
                "ran in the window: matched to it, to another conversation's turn, to none; the others: matched to "
                "any turn, which can only be another conversation's on chats; on Mooncake, which carries no ids, "
                "every request is an 'other' and a match is a request whose whole prompt continues an earlier one): "
                + "; ".join(f"{n} workers: {run.matches[(w.name, n)].cell()}" for n in sizes
                            if (w.name, n) in run.matches)]
        out.append("")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers-range", type=int, nargs=2, default=(2, 16), metavar=("LO", "HI"))
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "peers_sched.md"))
    ap.add_argument("--title", default="Virtual time: aladdin without KV events, conversation ids removed "
                    "(inferred from the prefix) against ids, no inference and least_tokens")
    ap.add_argument("--commit", help="the commit to record (when run from an export without .git)")
    args = ap.parse_args()
    lo, hi = args.workers_range
    body = tables(windows(), lo, hi)
    intro = (f"Virtual time ({PROFILE} workers, default parameters, one seed; bench/peers_sched_infer.py, whose "
             "docstring defines the arms). Cells of the per-size table: attainment, refused (429), the engines' "
             "prefix-cache hit rate.")
    write_section(Path(args.out), args.title, f"python -m bench.peers_sched_infer --workers-range {lo} {hi}",
                  "\n".join([intro, "", *body]), commit=args.commit)
    print("\n".join(body))


if __name__ == "__main__":
    main()
