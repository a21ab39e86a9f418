"""The progress utility of long runs: a rich bar on a terminal, one line per step otherwise, never on stdout."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from simulator.progress import Progress, choose_mode
from tests.helpers import ROOT


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_when_not_a_terminal(monkeypatch) -> None:
    monkeypatch.delenv("FLEETGATE_PROGRESS", raising=False)
    out = io.StringIO()
    with Progress("sweep", total=3, stream=out) as bar:
        for i in range(3):
            bar.step(f"case {i}")
    lines = out.getvalue().splitlines()
    assert lines[0] == "sweep (3 steps)"
    assert [x.split("] ")[1] for x in lines[1:]] == ["case 0", "case 1", "case 2"]
    assert lines[-1].startswith("  [3/3 ")


def test_rich_bar_on_a_terminal(monkeypatch) -> None:
    monkeypatch.delenv("FLEETGATE_PROGRESS", raising=False)
    out = FakeTTY()
    assert choose_mode(out) == "bar"
    with Progress("sweep", total=2, stream=out) as bar:
        bar.step("first")
        bar.step("second")
    text = out.getvalue()
    assert "sweep" in text and "2/2" in text and "second" in text


def test_env_forces_a_mode_and_rejects_nonsense(monkeypatch) -> None:
    out = FakeTTY()
    monkeypatch.setenv("FLEETGATE_PROGRESS", "off")
    with Progress("quiet", total=1, stream=out) as bar:
        bar.step("x")
    assert out.getvalue() == ""
    monkeypatch.setenv("FLEETGATE_PROGRESS", "sideways")
    with pytest.raises(ValueError, match="sideways"):
        Progress("x", stream=out)


def test_a_bench_reports_progress_on_stderr_only() -> None:
    """bench.hetero_pair --quick: every run is a progress line on stderr; stdout is the report alone."""
    r = subprocess.run([sys.executable, "-m", "bench.hetero_pair", "--quick", "--policies", "round_robin"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    steps = [x for x in r.stderr.splitlines() if x.startswith("  [")]
    assert steps and steps[-1].startswith(f"  [{len(steps)}/{len(steps)} ")
    assert "[1/" not in r.stdout and "|" in r.stdout
