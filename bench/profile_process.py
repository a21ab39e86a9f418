"""Where the whole `fleetgate serve` process spends its CPU per request, under bench.peers' load, with py-spy.

    python -m bench.profile_process [--requests 6000] [--out bench/results/hotpath_profile.md]

bench/profile_hotpath.py profiles the gateway's own code in-process (cProfile); this counts all of the process:
`fleetgate serve` (least_requests, access log on, defaults) in front of two zero-latency backends
(bench/null_backend.py), loaded at concurrency 32 with 16 output tokens by bench/loadgen.py, four phases:
non-streaming and streaming, in-memory state and Redis (127.0.0.1:6379 db 13, a key prefix of this run's own).

Per phase: CPU per request of the gateway's process tree from /proc (bench.loadgen.process_tree_cpu_seconds), and
py-spy's samples of the same window (`py-spy record --format raw`, 250 Hz) grouped by the innermost frame that
belongs to a known part (redis-py, the state store, the access log, the upstream client, uvicorn, asyncio ...).
py-spy samples stacks at wall-clock intervals while the thread is not idle, so a sample is CPU time except when the
process is descheduled inside a call (it then counts for the calling line). The gateway is alone on core 1 and the
backends and client are on core 0, so a write to a backend does not hand the gateway's core to it; what other
processes on a shared machine take is spread over every line. us/request is a group's share of the samples times
the measured CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import bench.peers as peers
from bench.harness import delete_redis_keys, free_port, log, pinned, running_process
from bench.loadgen import chat_body, process_tree_cpu_seconds, run_closed_loop
from bench.report import write_report

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
GATEWAY_CORE, CLIENT_CORE = 1, 0
REDIS_URL = os.environ.get("FLEETGATE_PROFILE_REDIS_URL", "redis://127.0.0.1:6379/13")

# (group, pattern on a frame "function (file:line)"): a sample counts for the first group matched walking from
# its innermost frame outwards.
GROUPS: tuple[tuple[str, str], ...] = (
    ("Redis client (redis-py)", r"\(redis/"),
    ("state store (gateway/state/)", r"gateway/state/"),
    ("access log, observe (gateway/ops/: access_log, logs, observe, tracing)",
     r"gateway/ops/(access_log|logs|observe|tracing)\.py|logging/"),
    ("metrics (gateway/ops/metrics.py, prometheus-client)", r"prometheus_client|gateway/ops/metrics\.py"),
    ("SLO book, learner, services", r"gateway/(pipeline/slo|pipeline/learning|tenancy/services)\.py"),
    ("placement, policy, pace (policies/, gateway/request/admission.py)", r"policies/|gateway/request/admission\.py"),
    ("upstream client (gateway/wire/upstream.py)", r"gateway/wire/upstream\.py"),
    ("relay, SSE scan (gateway/pipeline/relay.py, engine_adapters/)", r"gateway/pipeline/relay\.py|engine_adapters/"),
    ("request read/parse/auth (gateway/request/parse, tenancy/auth, wire/ ...)",
     r"gateway/(request/parse|tenancy/auth|wire/(forwarding|validation|errors|client_limits))\.py"),
    ("dispatch pipeline (gateway/pipeline/: dispatch, attempts, legs; app.py, wire/resume.py)",
     r"gateway/(pipeline/(dispatch|attempts|legs|pd_legs)|app|wire/resume)\.py"),
    ("uvicorn HTTP server (httptools protocol)", r"uvicorn/"),
    ("Redis socket writes and reads (asyncio streams: only redis-py uses them here)", r"asyncio/streams\.py"),
    ("event loop, transports, tasks (asyncio, uvloop: C code shows as its caller)", r"asyncio/|selectors"),
)


@dataclass
class PhaseProfile:
    name: str
    ok: int
    rps: float
    cpu_ms: float                 # per request, whole process tree
    groups: dict[str, float]      # share of samples
    samples: int


def group_samples(raw: str) -> tuple[dict[str, float], int]:
    """Shares of py-spy raw (folded) stacks per group."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    compiled = [(name, re.compile(p)) for name, p in GROUPS]
    for line in raw.splitlines():
        if not line.strip():
            continue
        stack, n_text = line.rsplit(" ", 1)
        n = int(n_text)
        total += n
        group = "other"
        for frame in reversed(stack.split(";")):
            hit = next((name for name, pat in compiled if pat.search(frame)), None)
            if hit is not None:
                group = hit
                break
        counts[group] += n
    return {g: c / max(1, total) for g, c in counts.items()}, total


async def _load(url: str, stream: bool, requests: int) -> tuple[int, float]:
    body = chat_body(MODEL, "Tell a story.", 16, stream=stream)
    r = await run_closed_loop(url + "/v1/chat/completions", lambda i: body, concurrency=32, requests=requests,
                              stream=stream)
    return len(r.ok), r.rps


def profile_phase(backends: list[str], redis: bool, stream: bool, requests: int, spy: str) -> PhaseProfile:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--policy", "least_requests", *[a for u in backends for a in ("-w", u)]]
    prefix = f"fgprof:{uuid.uuid4().hex[:12]}:"
    if redis:
        cmd += ["--redis-url", REDIS_URL]
    url = f"http://127.0.0.1:{port}"
    name = ("Redis, " if redis else "in-memory, ") + ("streaming" if stream else "non-streaming")
    with running_process(pinned(cmd, GATEWAY_CORE), "fleetgate", url + "/ready",
                         env={"FLEETGATE_REDIS_KEY_PREFIX": prefix}) as proc, \
            tempfile.TemporaryDirectory(prefix="fleetgate-pyspy-") as tmp:
        for warm_stream in (False, True):   # pools, lazy imports, the first model fit (bench/peers.py warms alike)
            asyncio.run(_load(url, warm_stream, 300))
        out = Path(tmp) / "stacks.txt"
        sp = subprocess.Popen([spy, "record", "-r", "250", "-f", "raw", "-o", str(out), "--pid", str(proc.pid),
                               "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            asyncio.run(asyncio.sleep(1.0))   # py-spy attached
            cpu0 = process_tree_cpu_seconds(proc.pid)
            ok, rps = asyncio.run(_load(url, stream, requests))
            cpu = process_tree_cpu_seconds(proc.pid) - cpu0
        finally:
            sp.send_signal(signal.SIGINT)
            sp.wait(60)
        groups, samples = group_samples(out.read_text() if out.exists() else "")
    if redis:
        delete_redis_keys(REDIS_URL, prefix)
    log(f"{name}: {ok} ok, {rps:,.0f} requests/s, {cpu / max(1, ok) * 1000:.3f} ms CPU/request, {samples} samples")
    return PhaseProfile(name, ok, rps, cpu / max(1, ok) * 1000, groups, samples)


def table(phases: list[PhaseProfile]) -> str:
    names = [g for g, _ in GROUPS] + ["other"]
    head = "| group | " + " | ".join(f"{p.name}: % / us per request" for p in phases) + " |\n"
    head += "|---|" + "---|" * len(phases) + "\n"
    rows = []
    for g in names:
        cells = [f"{p.groups.get(g, 0) * 100:.1f}% / {p.groups.get(g, 0) * p.cpu_ms * 1000:.0f}" for p in phases]
        rows.append(f"| {g} | " + " | ".join(cells) + " |")
    total = "| **CPU ms/request (process tree, /proc)** | " + " | ".join(f"**{p.cpu_ms:.3f}**" for p in phases) + " |"
    rps = "| requests/s | " + " | ".join(f"{p.rps:,.0f}" for p in phases) + " |"
    samples = "| py-spy samples | " + " | ".join(str(p.samples) for p in phases) + " |"
    return head + "\n".join([*rows, total, rps, samples]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument("--out", default=None, help="write the table there (a results file) as well as printing it")
    args = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        raise SystemExit("py-spy not found: pip install py-spy (in the dev extra)")
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {CLIENT_CORE})
    try:
        core, peers.ROUTER_CORE = peers.ROUTER_CORE, CLIENT_CORE   # backends beside the client, off the gateway's core
        try:
            with peers.null_backends() as backends:   # the same zero-latency backends as bench.peers
                phases = [profile_phase(backends, redis, stream, args.requests, spy)
                          for redis in (False, True) for stream in (False, True)]
        finally:
            peers.ROUTER_CORE = core
    finally:
        os.sched_setaffinity(0, affinity)
    body = table(phases)
    print(body)
    if args.out:
        load = os.getloadavg()
        write_report(Path(args.out), "Where fleetgate serve's CPU goes per request (whole process, py-spy)",
                     f"nice -n 5 python -m bench.profile_process --requests {args.requests}",
                     f"Load (1/5/15-minute averages) at the end: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} on "
                     f"{os.cpu_count()} cores.\n\n{body}")


if __name__ == "__main__":
    main()
