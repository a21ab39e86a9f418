"""bench/peers.py against a real peer: vllm-router (installed from PyPI into the cached peer venv on first use)
and fleetgate in front of two zero-latency backends, a few hundred requests each, the report written."""

from __future__ import annotations

import asyncio
import os

import pytest

from bench.peers import ARMS, BASELINE, OUTPUT_TOKENS, Sizes, round_order, run_all, write_results


def test_rounds_are_interleaved_a_b_b_a():
    assert round_order(3, 2) == [(1, 0), (1, 1), (1, 2), (2, 2), (2, 1), (2, 0)]
    assert round_order(2, 4) == [(1, 0), (1, 1), (2, 1), (2, 0), (3, 0), (3, 1), (4, 1), (4, 0)]


@pytest.mark.slow   # ~15 s with the peer venv cached; its first build adds ~40 s
def test_harness_measures_vllm_router_and_fleetgate(tmp_path):
    arms = [a for a in ARMS if a.name in ("direct (no router)", BASELINE, "fleetgate round_robin")]
    sizes = Sizes(latency_requests=50, load_requests=300, concurrencies=(32,))
    cores = os.sched_getaffinity(0)
    phases = asyncio.run(run_all(arms, sizes, rounds=2))
    assert os.sched_getaffinity(0) == cores   # the load generator's pinning does not outlive the run

    # every arm, round and phase measured; every request answered 200, every stream whole
    assert {(p.arm, p.round) for p in phases} == {(a.name, r) for a in arms for r in (1, 2)}
    for p in phases:
        assert p.failed == 0 and all(s.status == 200 for s in p.result.samples), (p.arm, p.phase)
        expected = sizes.latency_requests // 5 * 5 if p.phase == "c1" else sizes.load_requests
        assert len(p.result.samples) == expected, (p.arm, p.phase)
        if p.phase.endswith("stream"):
            assert all(s.chunks == OUTPUT_TOKENS for s in p.result.ok), p.arm
    for p in phases:
        if p.arm == "direct (no router)":
            assert p.cpu_s is None and p.phase != "c1"
        elif p.phase != "c1":   # a router that relayed 300 requests used some CPU, and not absurdly much
            assert 0 < p.cpu_ms_per_request < 50, (p.arm, p.phase, p.cpu_ms_per_request)
        else:
            assert p.direct is not None and len(p.direct.ok) == len(p.result.ok)

    out = tmp_path / "peers.md"
    write_results(phases, arms, sizes, 2, out, "pytest")
    text = out.read_text()
    assert "- commit: `" in text and "- machine: " in text
    row = next(line for line in text.splitlines() if line.startswith(f"| {BASELINE} |"))
    cpu_cell = row.split("|")[2].strip()
    assert float(cpu_cell.split("-")[0]) > 0
    assert next(line for line in text.splitlines() if line.startswith("| fleetgate round_robin | ") and "x |" in line)
    assert "Failed requests across all phases: 0." in text
    assert (tmp_path / "peers.png").stat().st_size > 1000
