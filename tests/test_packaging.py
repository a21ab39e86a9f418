"""The installed product: a wheel carries the simulator's traces and profiles as package data, not `bench`, and
`fleetgate simulate --trace azure_conv` runs from that wheel outside the repository.

The wheel is built from a copy of the sources (the build writes `build/` and `*.egg-info` next to them) and
imported straight from the zip file, so every data file must be found through importlib.resources: a path
built from `__file__` does not exist inside a zip.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT

PACKAGES = ("gateway", "engine_adapters", "policies", "simulator")

RUN_FROM_WHEEL = """
import importlib.util, json, sys
wheel = sys.argv[1]
sys.path.insert(0, wheel)
import simulator, gateway.cli
assert simulator.__file__.startswith(wheel), simulator.__file__
assert importlib.util.find_spec("bench") is None, "bench is importable outside the repo"
from simulator.profiles import list_profiles, load_profile
assert "llama3-8b-h100" in list_profiles()
assert load_profile("llama2-13b-a100").max_num_seqs > 0
gateway.cli.app(["simulate", "--trace", "azure_conv", "--workers", "4", "--duration", "30",
                 "--profile", "llama2-13b-a100", "--json"], standalone_mode=False)
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           str(src), "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # No setuptools deprecation (a `project.license` table stops building in 2027): the SPDX string form.
    assert "deprecated" not in proc.stderr.lower(), proc.stderr[-3000:]
    (whl,) = out.glob("fleetgate-*.whl")
    return whl


@pytest.mark.slow
def test_wheel_carries_the_simulators_data_and_not_bench(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {p.relative_to(ROOT).as_posix() for sub in ("simulator/traces", "simulator/profiles")
               for p in (ROOT / sub).rglob("*") if p.is_file()}
    assert {"simulator/traces/azure2023_conv.csv", "simulator/traces/README.md",
            "simulator/profiles/llama3-8b-h100.yaml"} <= shipped
    assert shipped <= names, sorted(shipped - names)
    assert not [n for n in names if n.startswith("bench/")]


@pytest.mark.slow
def test_simulate_runs_from_the_wheel_outside_the_repo(wheel: Path, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", RUN_FROM_WHEEL, str(wheel)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["completed"] > 0, result
