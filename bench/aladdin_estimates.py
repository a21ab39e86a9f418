"""aladdin's TTFT / TPOT estimate, term by term, next to what the simulated engine then did.

    python -m bench.aladdin_estimates [--out bench/results/aladdin_estimates.md]

For each window (bench/peers_sched.py's chat windows and Mooncake windows, ClusterSim built as its virtual-time
rows build it: llama3-8b-h100 workers, profile priors, bench/prefix.py's queue settings) aladdin runs once with
its default parameters; every decision that placed a request logs (c)'s terms on the chosen worker
(policies/aladdin/constraints.py `TtftTerms`) and the run's record of that request says what happened:

  predicted                       actual (simulator/cluster.py RequestResult)
  waited (in the admission queue)  dispatched - arrival
  queued prefill (c1 + k1·queued)  first_scheduled - dispatched (engine queue + API overhead)
  own prefill + chunk decodes      first_token - first_scheduled
  TTFT                             first_token - arrival
  decode step (eq. 3, now)         TPOT

A request aladdin refused (429) logs its last check: the least predicted TTFT over the workers, term by term,
next to the TTFT least_tokens served it with on the same fleet (same requests, same ids). Medians and p90s of the
ratio predicted / actual say which term is wrong and by how much.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.harness import REPO, log
from bench.peers_sched import PROFILE, chat_window, trace_window
from bench.prefix import QUEUE_LOOKAHEAD, QUEUE_POLL_S, SLO_TPOT_S
from bench.report import write_section
from simulator.workload import WorkloadRequest


@dataclass
class Logged:
    """(c)'s terms on one row at one decision, and the request's prompt and SLO."""

    reason: str
    waited: float
    queued_s: float
    own_s: float
    inter_s: float
    step_s: float
    n_dec: float
    ttft: float
    slo: float
    kv_ledger: float = 0.0     # the ledger's KV in use on the row now, / M
    kv_engine: float = 0.0     # the engine's reported KV usage (WorkerView.kv_usage)
    kv_used: float = 0.0       # what (e) counts now: the ledger's level with the engine's correction, if any


@dataclass
class Run:
    name: str
    placed: dict[str, Logged] = field(default_factory=dict)
    refused_last: dict[str, Logged] = field(default_factory=dict)
    rejections: dict[str, int] = field(default_factory=dict)
    first_no_fit: dict[str, int] = field(default_factory=dict)   # constraints that failed at a request's 1st check
    decisions: int = 0
    seen: set[str] = field(default_factory=set)
    wall_s: float = 0.0
    attainment: float = 0.0
    refused: int = 0


def _logged(feas, i: int, reason: str, slo: float) -> Logged:
    t = feas.terms
    return Logged(reason, t.waited, float(t.queued_s[i]), float(t.own_s[i]), float(t.interference_s[i]),
                  float(t.decode_step_s[i]), float(t.n_decoding[i]),
                  t.waited + float(t.queued_s[i] + t.own_s[i] + t.interference_s[i]), slo)


def instrumented_run(name: str, reqs: Sequence[WorkloadRequest], workers: int, policy: str = "aladdin",
                     params: dict | None = None) -> tuple[Run, dict]:
    """One ClusterSim run with aladdin's decisions logged (the policy object's `choose` wrapped)."""
    from simulator.cluster import ClusterSim

    # By name, as bench/peers_sched_virtual.py's probes build it (the run's length predictor shared).
    sim = ClusterSim(PROFILE, workers, policy, slo_tpot_s=SLO_TPOT_S, queue_poll_s=QUEUE_POLL_S,
                     queue_lookahead=QUEUE_LOOKAHEAD, policy_params=params)
    run = Run(name)
    if policy == "aladdin":
        _wrap(sim.policy, run)
    t0 = time.perf_counter()
    res = sim.run([_copy(r) for r in reqs])
    run.wall_s = time.perf_counter() - t0
    d = res.to_dict()
    run.attainment = d["slo_attainment"]
    run.refused = sum(1 for r in sim.results.values() if r.finish_reason == "refused")
    return run, sim.results


def _copy(r: WorkloadRequest) -> WorkloadRequest:
    import dataclasses

    return dataclasses.replace(r)


def _wrap(pol, run: Run) -> None:
    inner: Callable = pol.choose

    def choose(request, workers, now):
        d = inner(request, workers, now)
        run.decisions += 1
        feas = pol.last_feasibility
        for k, v in (pol.last_rejections or {}).items():
            run.rejections[k] = run.rejections.get(k, 0) + v
        if request.request_id not in run.seen:
            run.seen.add(request.request_id)
            if d.worker_id is None:
                key = " + ".join(sorted(k for k, v in (pol.last_rejections or {}).items() if v)) or "none"
                run.first_no_fit[key] = run.first_no_fit.get(key, 0) + 1
        if feas is None or feas.terms is None:
            return d
        slo = float(request.slo_ttft_s or 0.0)
        if d.worker_id is not None:
            ids = [w.id for w in workers]
            if d.worker_id in ids:
                i = ids.index(d.worker_id)
                lg = _logged(feas, i, d.reason, slo)
                r = pol.ledger.index[d.worker_id]
                lg.kv_ledger = pol.ledger.kv_now(r) / float(pol.ledger.kv_capacity[r])
                lg.kv_engine = float(workers[i].kv_usage)
                fix = getattr(pol.ledger, "kv_correction", None)
                corr = float(fix(np.array([r]))[0]) if fix is not None else 0.0
                lg.kv_used = lg.kv_ledger + corr / float(pol.ledger.kv_capacity[r])
                run.placed[request.request_id] = lg
        else:
            t = feas.terms
            est = t.queued_s + t.own_s + t.interference_s
            run.refused_last[request.request_id] = _logged(feas, int(np.argmin(est)), d.reason, slo)
        return d

    pol.choose = choose


def _q(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(int(q * len(s)), len(s) - 1)]


def _ratio_cell(pred: list[float], act: list[float]) -> str:
    """Median predicted, median actual, median and p90 of the per-request ratio (actual floored at 1 ms)."""
    ratios = [p / max(a, 1e-3) for p, a in zip(pred, act, strict=True)]
    return (f"{statistics.median(pred) * 1000:.0f} | {statistics.median(act) * 1000:.0f} | "
            f"{statistics.median(ratios):.2f} | {_q(ratios, 0.9):.2f}")


def term_rows(run: Run, results: dict) -> list[str]:
    """Per term: the prediction at the decision next to what happened, over the placed requests that completed."""
    pairs = [(lg, results[rid]) for rid, lg in run.placed.items()
             if results[rid].first_token is not None and results[rid].first_scheduled is not None]
    if not pairs:
        return ["(no placed request completed)"]
    rows = ["| term | predicted median ms | actual median ms | median predicted/actual | p90 predicted/actual |",
            "|---|---|---|---|---|"]
    spec = [
        ("wait in the admission queue (waited; dispatched - arrival)", lambda lg: lg.waited,
         lambda r: r.dispatched - r.arrival),
        ("queued prefill (c1 + k1·queued; first_scheduled - dispatched)", lambda lg: lg.queued_s,
         lambda r: r.first_scheduled - r.dispatched),
        ("own prefill + chunk decodes (first_token - first_scheduled)", lambda lg: lg.own_s + lg.inter_s,
         lambda r: r.first_token - r.first_scheduled),
        ("  of which the decodes batched with its chunks (and the step in flight)", lambda lg: lg.inter_s, None),
        ("TTFT (first_token - arrival)", lambda lg: lg.ttft, lambda r: r.first_token - r.arrival),
        ("decode step, eq. 3 at decision (TPOT)", lambda lg: lg.step_s,
         lambda r: r.tpot if r.tpot else 0.0),
    ]
    kv = [(lg.kv_ledger, lg.kv_engine, lg.kv_used) for lg, _ in pairs if lg.kv_engine > 0]
    for label, pf, af in spec:
        pred = [pf(lg) for lg, _ in pairs]
        if af is None:
            rows.append(f"| {label} | {statistics.median(pred) * 1000:.0f} | | | |")
            continue
        act = [af(r) for _, r in pairs]
        rows.append(f"| {label} | {_ratio_cell(pred, act)} |")
    if kv:
        rows.append(f"| KV in use at decision, fraction of M (ledger; engine-reported) | "
                    f"{statistics.median(k[0] for k in kv):.2f} | {statistics.median(k[1] for k in kv):.2f} | "
                    f"{statistics.median(k[0] / k[1] for k in kv):.2f} | {_q([k[0] / k[1] for k in kv], 0.9):.2f} |")
        rows.append(f"| KV (e) counts at decision, the ledger with the engine's correction; engine-reported | "
                    f"{statistics.median(k[2] for k in kv):.2f} | {statistics.median(k[1] for k in kv):.2f} | "
                    f"{statistics.median(k[2] / k[1] for k in kv):.2f} | {_q([k[2] / k[1] for k in kv], 0.9):.2f} |")
    over = sum(1 for lg, _ in pairs if lg.ttft > lg.slo)
    missed = sum(1 for _, r in pairs if r.ttft > r.slo_ttft_s)
    rows.append("")
    rows.append(f"{len(pairs)} placed requests completed; predicted TTFT over the target at placement: {over} "
                f"(placed late or at the risk deadline); actual TTFT over the target: {missed}. "
                f"Decode batch at placement: median {statistics.median(lg.n_dec for lg, _ in pairs):.0f} requests.")
    return rows


def refused_rows(run: Run, refused: dict, base: dict) -> list[str]:
    """The requests aladdin refused: its least predicted TTFT at the last check, next to least_tokens' actual."""
    ids = [rid for rid in run.refused_last if base.get(rid) is not None and base[rid].ttft is not None
           and refused.get(rid) is not None and refused[rid].finish_reason == "refused"]
    if not ids:
        return []
    lg = [run.refused_last[rid] for rid in ids]
    act = [base[rid].ttft for rid in ids]
    met = sum(1 for rid in ids if base[rid].slo_met)
    fresh = [x.queued_s + x.own_s + x.inter_s for x in lg]
    return [
        f"The {len(ids)} requests aladdin refused, at their last check (its least predicted TTFT over the workers):"
        f" least_tokens served {met} of them within their SLO on the same fleet.", "",
        "| | median ms | p90 ms |", "|---|---|---|",
        f"| aladdin: waited so far | {statistics.median(x.waited for x in lg) * 1000:.0f} "
        f"| {_q([x.waited for x in lg], 0.9) * 1000:.0f} |",
        f"| aladdin: queued prefill | {statistics.median(x.queued_s for x in lg) * 1000:.0f} "
        f"| {_q([x.queued_s for x in lg], 0.9) * 1000:.0f} |",
        f"| aladdin: own prefill | {statistics.median(x.own_s for x in lg) * 1000:.0f} "
        f"| {_q([x.own_s for x in lg], 0.9) * 1000:.0f} |",
        f"| aladdin: chunk decodes | {statistics.median(x.inter_s for x in lg) * 1000:.0f} "
        f"| {_q([x.inter_s for x in lg], 0.9) * 1000:.0f} |",
        f"| aladdin: estimate without the wait | {statistics.median(fresh) * 1000:.0f} | {_q(fresh, 0.9) * 1000:.0f} |",
        f"| TTFT target | {statistics.median(x.slo for x in lg) * 1000:.0f} | {_q([x.slo for x in lg], 0.9) * 1000:.0f} |",
        f"| least_tokens: actual TTFT | {statistics.median(act) * 1000:.0f} | {_q(act, 0.9) * 1000:.0f} |",
    ]


WINDOWS: tuple[tuple[str, str, int, float, int], ...] = (
    # (label, trace, start, chat rate, workers)
    ("chat 12/s, requests 1920-2719", "chat", 1920, 12.0, 4),
    ("chat 20/s, requests 3000-3799", "chat", 3000, 20.0, 6),
    ("Mooncake requests 3000-3399", "mooncake", 3000, 0.0, 6),
)


def window_reqs(trace: str, start: int, rate: float, n: int) -> list[WorkloadRequest]:
    return chat_window(start, n, rate) if trace == "chat" else trace_window(start, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "aladdin_estimates.md"))
    ap.add_argument("--title", default="aladdin's estimate, term by term, against the simulated engine")
    ap.add_argument("--only", type=int, nargs="*", help="indices of WINDOWS to run")
    args = ap.parse_args()
    body: list[str] = []
    for i, (label, trace, start, rate, workers) in enumerate(WINDOWS):
        if args.only and i not in args.only:
            continue
        n = 800 if trace == "chat" else 400
        reqs = window_reqs(trace, start, rate, n)
        base, base_res = instrumented_run(label, reqs, workers, "least_tokens")
        run, res = instrumented_run(label, reqs, workers)
        log(f"{label}: aladdin {run.attainment:.1%} ({run.refused} refused, {run.wall_s:.1f} s); least_tokens "
            f"{base.attainment:.1%} ({base.wall_s:.1f} s)")
        body += [f"### {label}, {workers} workers", "",
                 f"aladdin {run.attainment:.1%}, {run.refused} refused, {run.decisions} decisions, {run.wall_s:.1f} s "
                 f"wall; least_tokens {base.attainment:.1%}, {base.refused} refused, {base.wall_s:.1f} s. Worker "
                 "checks rejected, by constraint: "
                 + ", ".join(f"{k} {v:,}" for k, v in sorted(run.rejections.items())) + " (over every retry); at a "
                 "request's first check, the constraints that left it no worker: "
                 + (", ".join(f"{k} {v}" for k, v in sorted(run.first_no_fit.items(), key=lambda kv: -kv[1]))
                    or "none (every request fitted at once)") + ".", "",
                 *term_rows(run, res), "", *refused_rows(run, res, base_res), ""]
    cmd = "python -m bench.aladdin_estimates" + (f" --only {' '.join(map(str, args.only))}" if args.only else "")
    write_section(Path(args.out), args.title, cmd, "\n".join(body))
    print("\n".join(body))


if __name__ == "__main__":
    main()
