"""Calibration of the built-in profiles against the figures of docs/reference/vllm-interface.md §8 (virtual time).

Targets (simulator/CALIBRATION.md has the derivations):
- llama3-8b-h100: TTFT of a lone 2048-token prompt incl. API overhead ~70 ms (8.3: 15-30 ms + 2048 x
  ~0.025 ms); TPOT at batch 1 ~7.4 ms (8.4: 7.2-7.6 ms); TPOT at batch 64, context ~2048: ~12 ms (8.4:
  4.8 ms weights + 5.1 ms KV reads + 1-3 ms overhead). All within 25%.
- llama3-8b-a100: TPOT at batch 1 ~11.75 ms (8.4: 11.5-12 ms); prefill ~0.07 ms/token (8.3).
"""

from __future__ import annotations

import pytest

from simulator.engine import EngineCore, SimRequest
from simulator.profiles import list_profiles, load_profile, profile_from_dict


def lone_ttft(profile: str, prompt: int) -> float:
    """Arrival -> first token of one request on an idle engine, the API overhead included."""
    prof = load_profile(profile)
    core = EngineCore(prof)
    core.add(SimRequest("r", prompt, [], 16, 16, arrival=0.0), prof.ttft_overhead_s)
    now = prof.ttft_overhead_s
    while True:
        now += core.plan_step(now)
        if any(e.first_token for e in core.finish_step(now)):
            return now


def decode_tpot(profile: str, batch: int, context: int, tokens: int = 32) -> float:
    """Mean iteration time once `batch` requests with `context`-token prompts are all decoding."""
    core = EngineCore(profile)
    for i in range(batch):
        core.add(SimRequest(f"r{i}", context, [], 4096, 4096), 0.0)
    now, started = 0.0, set()
    while len(started) < batch:      # run the prefills
        now += core.plan_step(now)
        started |= {e.request_id for e in core.finish_step(now) if e.first_token}
    t0 = now
    for _ in range(tokens):
        now += core.plan_step(now)
        evs = core.finish_step(now)
        assert len(evs) == batch and all(e.new_tokens == 1 for e in evs)
    return (now - t0) / tokens


def test_h100_ttft_2048_tokens():
    assert lone_ttft("llama3-8b-h100", 2048) == pytest.approx(0.070, rel=0.25)


def test_h100_tpot_batch_1():
    assert decode_tpot("llama3-8b-h100", 1, 256) == pytest.approx(0.0074, rel=0.25)


def test_h100_tpot_batch_64_context_2048():
    assert decode_tpot("llama3-8b-h100", 64, 2048) == pytest.approx(0.012, rel=0.25)


def test_a100_tpot_batch_1_and_prefill_rate():
    assert decode_tpot("llama3-8b-a100", 1, 256) == pytest.approx(0.01175, rel=0.25)
    prof = load_profile("llama3-8b-a100")
    per_token = (lone_ttft("llama3-8b-a100", 4096) - lone_ttft("llama3-8b-a100", 2048)) / 2048
    assert per_token == pytest.approx(0.00007, rel=0.25)
    assert prof.max_num_batched_tokens == 2048 and prof.max_num_seqs == 256   # A100 defaults (8.2)


def test_h100_is_faster_than_a100_by_the_bandwidth_ratio_when_decoding():
    ratio = decode_tpot("llama3-8b-a100", 1, 256) / decode_tpot("llama3-8b-h100", 1, 256)
    assert ratio == pytest.approx(1.6, rel=0.15)     # 8.4: "the ratio (~1.6) matches the bandwidth ratio"


@pytest.mark.parametrize("name,kv_bytes,tokens_lo,tokens_hi", [
    ("llama3-8b-h100", 131072, 420_000, 450_000),          # 8.1-8.2: 128 KiB/token, ~420k-450k tokens
    ("llama3-8b-a100", 131072, 420_000, 450_000),
    ("llama2-13b-a100", 819200, 50_000, 70_000),           # 800 KiB/token, ~45 GiB left after 26 GB weights
    ("llama2-70b-tp2-a100", 327680, 20_000, 40_000),       # 320 KiB/token, ~5 GiB per GPU left
])
def test_kv_capacity(name, kv_bytes, tokens_lo, tokens_hi):
    prof = load_profile(name)
    assert prof.kv_bytes_per_token == kv_bytes
    assert tokens_lo <= prof.kv_capacity_tokens <= tokens_hi


def test_bigger_models_are_slower():
    b1 = {n: decode_tpot(n, 1, 256, tokens=4) for n in ("llama3-8b-a100", "llama2-13b-a100", "llama2-70b-tp2-a100")}
    assert b1["llama3-8b-a100"] < b1["llama2-13b-a100"] < b1["llama2-70b-tp2-a100"]
    assert load_profile("llama2-70b-tp2-a100").gpus_per_worker == 2


def test_builtins_listed_and_user_profiles_validated(tmp_path):
    assert {"llama3-8b-h100", "llama3-8b-a100", "llama2-13b-a100", "llama2-70b-tp2-a100"} <= set(list_profiles())
    base = load_profile("llama3-8b-h100")
    data = {f: getattr(base, f) for f in base.__slots__}
    path = tmp_path / "mine.yaml"
    path.write_text("\n".join(f"{k}: {v!r}" if isinstance(v, str) else f"{k}: {list(v)}" if isinstance(v, tuple)
                              else f"{k}: {v}" for k, v in {**data, "name": "mine", "c_step_s": 0.004}.items()))
    mine = load_profile(str(path))
    assert mine.name == "mine" and mine.c_step_s == 0.004
    with pytest.raises(ValueError, match="unknown profile key"):
        profile_from_dict({**data, "bogus": 1})
    with pytest.raises(ValueError, match="k_ctx_s must be a number"):
        profile_from_dict({**data, "k_ctx_s": "fast"})
    with pytest.raises(ValueError, match="exceeds KV capacity"):
        profile_from_dict({**data, "num_gpu_blocks": 10})
    with pytest.raises(ValueError, match="unknown profile"):
        load_profile("no-such-profile")
