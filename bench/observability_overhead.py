"""What the access log and tracing cost the gateway, and what they cost when off.

    python -m bench.observability_overhead [--rounds 3] [--full] [--base-tree DIR]

Two measurements, one run:

1. The hooks in the request path with both off (gateway/ops/observe.py: the request's record is None, one test),
   and one request's observer work with each on (access-log record + formatted logfmt line into a null stream;
   tracing: the request span, admission, placement and one upstream leg with its traceparent, no exporter), timed
   in this process with `timeit` (best of 5).
2. `python -m bench.overhead` (gateway CPU per request from /proc, the gateway pinned to its own core) for the
   gateway with both off, with the access log (logfmt, to a file), and with the access log plus tracing, in
   alternating rounds so the machine's load is shared evenly; with --base-tree, also the same benchmark in
   another checkout (the commit before these features) as the baseline. Medians and [min - max] over rounds.

Results: bench/results/observability_overhead.md (command, commit, machine).
"""

from __future__ import annotations

import argparse
import io
import logging
import re
import statistics
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

from bench.report import write_report
from simulator.progress import stderr_progress

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "off": "logging: {access_log: false}\n",
    "access log": "logging: {access_log: true, format: logfmt}\n",
    "access log + tracing": "logging: {access_log: true, format: logfmt}\ntracing: {enabled: true}\n",
}
METRICS = {  # bench.overhead summary row -> (column, unit)
    "gateway CPU per request (c=32, zero-latency backend)": ("CPU/request, null backend", "ms"),
    "gateway CPU per request through the simulated fleet (c=32)": ("CPU/request, simulated fleet", "ms"),
    "gateway CPU per relayed token": ("CPU/streamed token", "µs"),
    "added latency p50 (short non-streaming, c=1)": ("added latency p50", "ms"),
}


def hook_costs() -> list[tuple[str, float]]:
    """Seconds per call (best of 5) of the hot-path hooks and of one request's observer work."""
    from gateway.config import TracingConfig
    from gateway.ops import observe
    from gateway.ops.access_log import AccessLog
    from gateway.ops.logs import ACCESS_LOGGER, setup_logging
    from gateway.ops.tracing import Tracing
    from gateway.pipeline.observer import RequestObserver
    from gateway.request.context import Outcome, RequestContext
    from gateway.request.parse import CHAT
    from gateway.wire.results import RelayResult, ResponseState

    headers = b"Content-Type: application/json\r\nX-Request-Id: abc\r\nAccept: */*\r\n"

    def off() -> None:
        observe.note_placement(None, "w0", "least_requests", 1e-5)
        observe.leg(None, "upstream", "w0", headers)

    sink = io.StringIO()
    handler = setup_logging("info", "logfmt", stream=sink)  # as `fleetgate serve` sets it up, into memory
    logger = logging.getLogger(ACCESS_LOGGER)
    result = RelayResult(status=200, tokens=16, first_token_at=0.0, last_token_at=0.0)

    def one(observer: RequestObserver) -> None:
        rec = observer.begin("abc", "/v1/chat/completions", [])
        ctx = RequestContext(b"abc", CHAT, None, ResponseState(), 0.0, [], [], rec)
        observe.note_placement(rec, "w0", "least_requests", 1e-5)
        observe.leg(rec, "upstream", "w0", headers)
        observer.finished(ctx, Outcome(200, result, "m", "least_requests", None, 0.0))

    access = RequestObserver(AccessLog(logger), None)
    tracing = RequestObserver(AccessLog(logger), Tracing(TracingConfig(enabled=True)))
    out = []
    for name, fn, n in (("both off: the two hooks of a plain request", off, 200_000),
                        ("access log on: one request's record and line", lambda: one(access), 20_000),
                        ("access log + tracing: one request's spans and line", lambda: one(tracing), 5_000)):
        out.append((name, min(timeit.repeat(fn, number=n, repeat=5)) / n))
    logging.getLogger().removeHandler(handler)
    return out


def run_overhead(tree: Path, config: str | None, quick: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "o.md"
        cmd = [sys.executable, "-m", "bench.overhead", "--out", str(out)] + (["--quick"] if quick else [])
        if config is not None:
            cfg = Path(tmp) / "gw.yaml"
            cfg.write_text(config)
            cmd += ["--config", str(cfg)]
        for attempt in (1, 2):  # a loaded machine sometimes misses a start-up deadline: one more try
            r = subprocess.run(cmd, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               timeout=1800)
            if r.returncode == 0:
                break
            print(f"bench.overhead failed (try {attempt}): {r.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        else:
            raise RuntimeError(f"bench.overhead failed twice in {tree}: {r.stderr[-2000:]}")
        values = {}
        for line in out.read_text().splitlines():
            for key in METRICS:
                if line.startswith(f"| {key} |"):
                    values[key] = float(re.findall(r"[\d.]+", line.split("|")[2])[0])
        return values


def _cell(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3g} [{min(xs):.3g} - {max(xs):.3g}]" if xs else "-"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--full", action="store_true", help="bench.overhead's full runs (default: --quick runs)")
    ap.add_argument("--base-tree", type=Path, help="a checkout of the commit before, run as the baseline")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "observability_overhead.md")
    args = ap.parse_args(argv)
    hooks = hook_costs()
    variants: list[tuple[str, Path, str | None]] = []
    if args.base_tree:
        variants.append(("baseline (before)", args.base_tree, None))
    variants += [(name, ROOT, cfg) for name, cfg in VARIANTS.items()]
    results: dict[str, dict[str, list[float]]] = {v: {k: [] for k in METRICS} for v, _, _ in variants}
    runs = [(r, v) for r in range(args.rounds) for v in variants]
    with stderr_progress("bench.overhead runs") as progress:
        for i, (_, (name, tree, cfg)) in enumerate(runs):
            for k, v in run_overhead(tree, cfg, not args.full).items():
                results[name][k].append(v)
            progress(i + 1, len(runs))
    lines = ["## The hooks, timed in-process (best of 5)", "", "| what | per call |", "|---|---|"]
    lines += [f"| {name} | {s * 1e6:.3f} µs |" for name, s in hooks]
    lines += ["", f"## bench.overhead{'' if args.full else ' --quick'}, {args.rounds} alternating rounds "
              "(median [min - max])", "",
              "| gateway | " + " | ".join(f"{c} ({u})" for c, u in METRICS.values()) + " |",
              "|---" * (len(METRICS) + 1) + "|"]
    for name, _, _ in variants:
        lines.append(f"| {name} | " + " | ".join(_cell(results[name][k]) for k in METRICS) + " |")
    lines += ["", "Load on this shared 2-core machine moves the wall-clock numbers (latency) a lot between rounds; "
              "CPU per request is read from /proc for the gateway process alone and moves less."]
    cmd = "python -m bench.observability_overhead" + (f" --rounds {args.rounds}" if args.rounds != 3 else "") + \
        (" --full" if args.full else "") + (" --base-tree <checkout of the commit before>" if args.base_tree else "")
    write_report(args.out, "Access log and tracing overhead", cmd, "\n".join(lines))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
