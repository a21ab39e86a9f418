"""`fleetgate simulate` JSON is identical, field for field, to what the commit before the `policies/aladdin/`
package split printed for the same arguments (wall-clock time aside): the split moved code, not behaviour.

Each tests/data/simulate_golden/*.json holds the command-line arguments and the result the parent commit
(60c7d8a) printed for them: the aladdin policy on two shipped traces (sharegpt and azure_conv), in risk mode,
with Algorithm 2 rebalancing, tail mode and best fit, lifetime slack with cache pricing, and as the decode
policy of P/D serving. A deliberate behaviour change regenerates them (each file's `args` reproduce it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

GOLDEN = sorted((Path(__file__).parent / "data" / "simulate_golden").glob("*.json"))


def test_the_golden_runs_cover_two_traces() -> None:
    traces = {json.loads(f.read_text())["result"]["trace"] for f in GOLDEN}
    assert {"sharegpt", "azure_conv"} <= traces


@pytest.mark.parametrize("path", GOLDEN, ids=[f.stem for f in GOLDEN])
def test_simulate_json_matches_the_parent_commit(path: Path) -> None:
    golden = json.loads(path.read_text())
    res = subprocess.run([sys.executable, "-m", "gateway.cli", *golden["args"]], capture_output=True, text=True,
                         timeout=300, check=True)
    out = json.loads(res.stdout)
    out.pop("wall_s")
    assert out["requests"] > 0 and out["policy"] in ("aladdin", "pd/aladdin")
    assert out == golden["result"]
