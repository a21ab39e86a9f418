"""Long benchmarks report progress on stderr through the shared utility (simulator/progress.py): lines when
stderr is not a terminal, nothing with FLEETGATE_PROGRESS=0, and stdout stays the report alone."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import ROOT

CMD = [sys.executable, "-m", "bench.hetero_pair", "--quick", "--policies", "round_robin"]


def _run(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run(CMD, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_a_bench_reports_progress_on_stderr_only() -> None:
    r = _run()
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("hetero pair runs: ")]
    assert lines and lines[-1].startswith("hetero pair runs: 100% (4/4) after "), r.stderr
    assert "hetero pair runs" not in r.stdout and "| round_robin |" in r.stdout, r.stdout


def test_progress_can_be_switched_off() -> None:
    r = _run(FLEETGATE_PROGRESS="0")
    assert r.returncode == 0, r.stderr
    assert "hetero pair runs" not in r.stderr
