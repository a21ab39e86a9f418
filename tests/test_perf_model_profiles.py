"""Every built-in profile's performance model predicts a lone prompt's TTFT in the simulator within 10%,
from 128 tokens up to the profile's max_model_len (Aladdin eq. 2 with the attention term, perf_model.py)."""

from __future__ import annotations

import pytest

from policies.perf_model import PerfModel
from simulator.cluster import ClusterSim
from simulator.profiles import list_profiles, load_profile
from simulator.workload import WorkloadRequest

GPU_PROFILES = [p for p in list_profiles() if p != "tiny-cpu"]


def lengths(max_model_len: int, chunk: int) -> list[int]:
    """Powers of two from 128, the points a third above them, and one token past a prefill chunk."""
    out, n = [], 128
    while n + 2 <= max_model_len:
        out += [n, min(n + n // 3, max_model_len - 2)]
        n *= 2
    return sorted({*out, chunk + 1, max_model_len - 2})


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_lone_prompt_ttft_within_10_percent(name: str) -> None:
    prof = load_profile(name)
    model = PerfModel.from_step_profile(prof)
    worst = (0.0, 0)
    for n in lengths(prof.max_model_len, prof.max_num_batched_tokens):
        res = ClusterSim(prof, 1, "round_robin").run([WorkloadRequest("r", 0.0, n, 2)]).results[0]
        err = model.prefill_time(n) / res.ttft - 1.0
        if abs(err) > abs(worst[0]):
            worst = (err, n)
    assert abs(worst[0]) <= 0.10, f"{name}: {worst[0]:+.1%} at {worst[1]} prompt tokens"


def test_the_long_context_profiles_reach_128k() -> None:
    assert max(load_profile(p).max_model_len for p in GPU_PROFILES if "llama3-8b" in p) >= 128 * 1024
