"""Time `fleetgate simulate` on the full Azure conversation hour (19,366 requests) on 16 workers.

    .venv/bin/python -m bench.sim_speed [--profile llama3-8b-h100] [--workers 16] [--policy least_requests]

Pinned to one core with `taskset -c 0` when available. Writes bench/results/sim_speed.md (command, commit,
machine, wall seconds, simulated requests per wall second). Target: < 60 s.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.report import git_commit, machine_info

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "bench" / "results" / "sim_speed.md"
TARGET_S = 60.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--policy", default="least_requests")
    ap.add_argument("--trace", default="azure_conv")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "gateway.cli", "simulate", "--trace", args.trace, "--workers", str(args.workers),
           "--profile", args.profile, "--policy", args.policy, "--json"]
    pinned = shutil.which("taskset") is not None
    if pinned:
        cmd = ["taskset", "-c", "0", *cmd]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stderr, file=sys.stderr)
        return proc.returncode
    out = json.loads(proc.stdout)
    shown = " ".join(c if c != sys.executable else "python" for c in cmd)
    lines = [
        "# fleetgate simulate: speed",
        "",
        f"- command: `{shown}` (run from the repo root; `python` = .venv/bin/python)",
        f"- commit: {git_commit()}",
        f"- machine: {machine_info()}; pinned to one core: {'yes (taskset -c 0)' if pinned else 'no (taskset missing)'}",
        f"- wall seconds (process, incl. start-up and trace loading): **{wall:.2f} s** (target < {TARGET_S:.0f} s)",
        f"- simulation loop only (wall_s in the result): {out['wall_s']:.2f} s",
        f"- simulated requests: {out['requests']} over {out['duration_s']:.0f} simulated s "
        f"= **{out['requests'] / wall:,.0f} requests per wall second**, "
        f"{out['duration_s'] / wall:,.0f}x real time",
        "",
        "Result summary:",
        "",
        "```json",
        json.dumps(out, indent=1),
        "```",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(f"wall {wall:.2f} s for {out['requests']} requests ({out['requests'] / wall:,.0f} req/s); wrote {args.out}")
    return 0 if wall < TARGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
