"""Decision speed of the placement policies: one `choose` at 100 workers with 200 in-flight requests each.

    .venv/bin/python -m bench.decision_speed [--workers 100] [--inflight 200] [--decisions 3000]

For each scenario the fleet is preloaded (requests dispatched over simulated time, so ledgers hold a mix of
queued prefills and decoding requests), then every iteration advances the clock, times one
`choose`, dispatches the request (to the chosen worker, or a random one on no_fit) and completes the
oldest request on that worker, keeping the in-flight count constant; the clock advances by the
mean lifetime / total in-flight per decision (Little's law). Only `choose` is in the latency
columns; dispatch + completion (the policy's bookkeeping) is reported separately. Target: p99 < 1 ms.
Writes bench/results/decision_speed.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time
from collections import deque
from pathlib import Path

import numpy as np

from bench.report import write_report
from policies.base import make_policy, policy_names
from policies.perf_model import PerfModel
from policies.types import RequestFeatures, WorkerView

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "bench" / "results" / "decision_speed.md"
TARGET_P99_US = 1000.0

# Aladdin coefficients derived (PerfModel.from_step_profile) from the simulator's profiles.
LLAMA3_8B_H100 = PerfModel(k1=2.9369856e-05, c1=0.022327, k2=4.347e-08, c2=1.87979e-05, c3=0.007327,
                           kv_capacity=27255, max_batch=1024)
LLAMA2_13B_A100 = PerfModel()

SCENARIOS = [
    # (label, policy, params, profile model)
    ("aladdin, llama3-8b-h100, slack=off (all candidates reach the KV check)", "aladdin", {"slack": "off"},
     LLAMA3_8B_H100),
    ("aladdin tail=cantelli, llama3-8b-h100, slack=off", "aladdin", {"slack": "off", "tail": "cantelli"},
     LLAMA3_8B_H100),
    ("aladdin (defaults), llama3-8b-h100", "aladdin", {}, LLAMA3_8B_H100),
    ("aladdin (defaults), llama2-13b-a100", "aladdin", {}, LLAMA2_13B_A100),
    ("hetero, llama3-8b-h100", "hetero", {}, LLAMA3_8B_H100),
    ("least_requests (for scale)", "least_requests", {}, LLAMA3_8B_H100),
]


def _request(rng: random.Random, i: int) -> RequestFeatures:
    prompt = min(max(int(rng.lognormvariate(5.5, 0.9)), 4), 3500)
    return RequestFeatures(request_id=f"q{i}", model="m", prompt_tokens=prompt,
                           predicted_output_tokens=float(min(max(rng.lognormvariate(5.0, 0.8), 1), 1500)))


def run(policy_name: str, params: dict, model: PerfModel, workers: int, inflight: int, decisions: int,
        lifetime: float, seed: int = 0) -> dict:
    rng = random.Random(seed)
    dt = lifetime / (workers * inflight)  # Little's law: in-flight = arrival rate x lifetime
    policy = make_policy(policy_name, perf_models={"prof": model}, **params) if policy_name != "least_requests" \
        else make_policy(policy_name)
    ids = [f"w{i}" for i in range(workers)]
    queues: dict[str, deque[RequestFeatures]] = {w: deque() for w in ids}
    now, n = 0.0, 0

    def views() -> list[WorkerView]:
        return [WorkerView(id=w, profile="prof", inflight=len(queues[w]), running=len(queues[w]),
                           kv_usage=0.3) for w in ids]

    policy.choose(_request(rng, -1), views(), now)  # the policy learns the workers' profiles
    # Preload: `inflight` requests per worker, dispatched over one request lifetime.
    for _ in range(inflight):
        for w in ids:
            r = _request(rng, n)
            n += 1
            policy.on_dispatch(r, w, now)
            queues[w].append(r)
        now += lifetime / inflight

    lat, cpu, book, no_fit = [], [], [], 0
    warmup = min(200, decisions // 5)
    gc.collect()
    for it in range(warmup + decisions):
        now += dt
        ws = views()
        r = _request(rng, n)
        n += 1
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        d = policy.choose(r, ws, now)
        t1 = time.perf_counter_ns()
        c1 = time.thread_time_ns()
        w = d.worker_id or ids[rng.randrange(workers)]
        old = queues[w].popleft()
        t2 = time.perf_counter_ns()
        policy.on_dispatch(r, w, now)
        policy.on_complete(old, w, now)
        t3 = time.perf_counter_ns()
        queues[w].append(r)
        if it >= warmup:
            lat.append((t1 - t0) / 1000)
            cpu.append((c1 - c0) / 1000)
            book.append((t3 - t2) / 1000)
            no_fit += d.worker_id is None
    a, c = np.array(lat), np.array(cpu)
    return {
        "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
        "max": float(a.max()), "cpu_p50": float(np.percentile(c, 50)), "cpu_p99": float(np.percentile(c, 99)),
        "no_fit": no_fit / decisions, "book": float(np.mean(book)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=100)
    ap.add_argument("--inflight", type=int, default=200)
    ap.add_argument("--decisions", type=int, default=3000)
    ap.add_argument("--lifetime", type=float, default=3.0, help="mean request lifetime, simulated seconds")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    pinned = False
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
            pinned = True
        except OSError:
            pass
    known = set(policy_names())
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows = []
    for label, name, params, model in SCENARIOS:
        if name not in known:
            rows.append(f"| {label} | not available | | | | | | | | |")
            continue
        res = run(name, params, model, args.workers, args.inflight, args.decisions, args.lifetime)
        ok = "yes" if res["cpu_p99"] < TARGET_P99_US else "**no**"
        rows.append(
            f"| {label} | {res['cpu_p50']:.0f} | {res['cpu_p99']:.0f} | {ok} | {res['p50']:.0f} | {res['p90']:.0f} | "
            f"{res['p99']:.0f} | {res['max']:.0f} | {res['no_fit']:.0%} | {res['book']:.0f} |"
        )
        print(rows[-1], flush=True)
    body = (
        f"{args.workers} workers x {args.inflight} in-flight requests each; {args.decisions} timed decisions per "
        f"scenario after a warm-up. The clock advances lifetime / in-flight = {args.lifetime:g} s / "
        f"{args.workers * args.inflight} per decision (Little's law), and each decision completes the oldest "
        f"request of the chosen worker, so the ledgers see a realistic rate of events (prefill completions, "
        f"re-predictions), which `choose` processes. Latencies in microseconds of one `choose` call (the "
        f"WorkerView list is built outside the timing): CPU time of the thread (what the code costs) and wall "
        f"time (includes preemption by other processes: the machine is shared; 1-minute load average at the "
        f"start: {load_before:.1f} on {os.cpu_count()} cores). The 1 ms target is checked on the CPU-time p99. "
        f"`bookkeeping` is the mean wall time of one `on_dispatch` + one `on_complete`. "
        f"Pinned to one core: {'yes' if pinned else 'no'}.\n\n"
        "| scenario | CPU p50 | CPU p99 | CPU p99 < 1 ms | wall p50 | wall p90 | wall p99 | wall max | no_fit "
        "| bookkeeping |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        "Scenarios: `llama3-8b-h100` has room for 200 requests per worker, so with `slack=off` every candidate "
        "passes (b)-(d) and reaches the KV check (the vector w over the request's lifetime: the most expensive "
        "path). With the default constraint (d) the preloaded workers have spent their decode slack on prefill "
        "(67 arrivals/s per worker), so every decision is no_fit after (b)-(d); on the smaller "
        "`llama2-13b-a100` (b), (c) and (d) all reject. Both no_fit paths evaluate every candidate.\n\n"
        "How a decision stays O(workers): every ledger quantity a constraint needs is a per-worker aggregate "
        "kept up to date by the events (sums of lengths, a decode-step clock, slack minima in heaps, the future "
        "KV demand as a ring of time buckets), and `choose` evaluates constraints (b)-(e) for all candidates "
        "with numpy array operations; Python loops run only over workers with a due event.\n"
    )
    cmd = f".venv/bin/python -m bench.decision_speed --workers {args.workers} --inflight {args.inflight} " \
          f"--decisions {args.decisions} --lifetime {args.lifetime:g}"
    write_report(args.out, "Decision speed: aladdin, hetero, least_requests", cmd, body)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
