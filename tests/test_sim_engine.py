"""EngineCore in virtual time: batching, KV cache, preemption, prefix caching, priority, P/D, macro steps."""

from __future__ import annotations

import copy
import random

import pytest

from simulator.engine import EngineConfig, EngineCore, RequestRecord, SimRequest
from simulator.profiles import load_profile
from simulator.tokenizer import block_hashes, encode, synthetic_text

PROFILE = "llama3-8b-h100"


def req(rid: str, prompt: int, out: int, arrival: float = 0.0, max_tokens: int = 4096, **kw) -> SimRequest:
    return SimRequest(rid, prompt, kw.pop("hashes", []), max_tokens, out, arrival=arrival, **kw)


def drive(core: EngineCore, requests: list[SimRequest], max_iterations: int = 1) -> dict[str, RequestRecord]:
    """A minimal virtual-time driver: add arrivals at iteration boundaries, step until idle."""
    arr = sorted(requests, key=lambda r: r.arrival)
    i, now, recs = 0, 0.0, {}
    while True:
        while i < len(arr) and arr[i].arrival <= now:
            core.add(arr[i], now)
            i += 1
        dur = core.plan_step(now, max_iterations)
        if dur is None:
            wake = [arr[i].arrival] if i < len(arr) else []
            t = core.next_event_time()
            if t is not None and t > now:
                wake.append(t)
            if not wake:
                return recs
            now = min(wake)
            continue
        start, end = now, now + dur
        if max_iterations > 1 and i < len(arr) and arr[i].arrival < end:
            end = start + core.truncate_step(arr[i].arrival)
        now = end
        for ev in core.finish_step(now):
            if ev.record is not None:
                recs[ev.request_id] = ev.record


def tpot(rec: RequestRecord) -> float:
    return (rec.finished - rec.first_token) / (rec.num_output - 1)


def ttft(rec: RequestRecord) -> float:
    return rec.first_token - rec.arrival


def test_tpot_grows_with_batch_size_and_context():
    def mean_tpot(batch: int, prompt: int) -> float:
        recs = drive(EngineCore(PROFILE), [req(f"r{i}", prompt, 64) for i in range(batch)])
        assert len(recs) == batch
        return sum(tpot(r) for r in recs.values()) / batch

    assert mean_tpot(1, 128) < mean_tpot(16, 128) < mean_tpot(128, 128)
    assert mean_tpot(16, 128) < mean_tpot(16, 2048) < mean_tpot(16, 8192)


def test_ttft_grows_with_prompt_length_and_queueing():
    lone = {n: ttft(drive(EngineCore(PROFILE), [req("a", n, 4)])["a"]) for n in (256, 2048, 16384)}
    assert lone[256] < lone[2048] < lone[16384]
    # 40 simultaneous 2048-token prompts: later ones queue behind earlier prefills.
    recs = drive(EngineCore(PROFILE), [req(f"r{i:02d}", 2048, 4) for i in range(40)])
    ttfts = [ttft(recs[f"r{i:02d}"]) for i in range(40)]
    assert ttfts[-1] > 5 * ttfts[0]
    assert ttfts == sorted(ttfts)


def test_kv_exhaustion_preempts_and_everything_finishes():
    core = EngineCore(PROFILE, EngineConfig(num_gpu_blocks=200))   # 3,200 tokens of KV
    reqs = [req(f"r{i}", 300, 400) for i in range(12)]             # 12 x 700 tokens at the end
    recs = drive(core, reqs)
    assert core.stats.preemptions > 0
    assert len(recs) == 12 and all(r.num_output == 400 for r in recs.values())
    assert sum(r.num_preemptions for r in recs.values()) == core.stats.preemptions
    assert core.stats.finished["stop"] == 12 and core.stats.generation_tokens == 12 * 400
    assert core.kv_usage == 0.0 and not core.has_work()
    # Recompute: preempted requests recomputed prompt + generated tokens, so more prompt work than 12 x 300.
    assert core.stats.prompt_tokens > 12 * 300


def test_repeated_prompt_hits_prefix_cache_and_ttft_drops():
    hashes = block_hashes(encode(synthetic_text(4000, "doc")))
    core = EngineCore(PROFILE)
    first = drive(core, [req("a", 4000, 8, hashes=hashes)])["a"]
    assert core.stats.prefix_cache_hits == 0 and core.stats.prefix_cache_queries == 4000
    second = drive(core, [req("b", 4000, 8, arrival=10.0, hashes=hashes)])["b"]
    # Whole blocks only, and the last prompt token is always recomputed: 3999 // 16 blocks.
    assert second.num_cached_tokens == (3999 // 16) * 16
    assert core.stats.prefix_cache_hits == second.num_cached_tokens
    assert core.stats.prefix_cache_queries == 8000
    assert core.stats.prompt_tokens == 4000 + (4000 - second.num_cached_tokens)
    assert ttft(second) < 0.5 * ttft(first)
    # A different prompt does not hit.
    other = block_hashes(encode(synthetic_text(4000, "other")))
    third = drive(core, [req("c", 4000, 8, arrival=20.0, hashes=other)])["c"]
    assert third.num_cached_tokens == 0


def test_cached_blocks_are_evicted_lru_only_when_needed():
    core = EngineCore(PROFILE, EngineConfig(num_gpu_blocks=300))
    h1 = block_hashes(encode(synthetic_text(3200, "one")))
    drive(core, [req("a", 3200, 2, hashes=h1)])
    assert core.kv_usage == 0.0          # cached but free
    h2 = block_hashes(encode(synthetic_text(3200, "two")))
    drive(core, [req("b", 3200, 2, arrival=1.0, hashes=h2)])   # needs ~100 of a's 200 cached blocks
    rec = drive(core, [req("c", 3200, 2, arrival=2.0, hashes=h1)])["c"]
    assert 0 < rec.num_cached_tokens < 3200 - 16   # part of a's prefix survived, its tail was evicted


def test_priority_policy_lets_urgent_requests_overtake():
    def run(policy: str) -> dict[str, RequestRecord]:
        core = EngineCore(PROFILE, EngineConfig(scheduling_policy=policy, max_num_seqs=2))
        reqs = [req(f"low{i}", 500, 50, arrival=0.0, priority=10) for i in range(6)]
        reqs.append(req("urgent", 500, 50, arrival=0.001, priority=0))
        return drive(core, reqs)

    prio, fcfs = run("priority"), run("fcfs")
    # Two slots: the urgent request takes the first free one, ahead of the four queued low ones.
    assert prio["urgent"].first_scheduled <= min(prio[f"low{i}"].first_scheduled for i in range(2, 6))
    assert fcfs["urgent"].first_scheduled >= max(fcfs[f"low{i}"].first_scheduled for i in range(6))
    assert prio["urgent"].finished < 0.6 * fcfs["urgent"].finished


def test_priority_preemption_evicts_lowest_priority():
    core = EngineCore(PROFILE, EngineConfig(scheduling_policy="priority", num_gpu_blocks=60))
    reqs = [req("hi", 400, 300, priority=0), req("lo", 400, 300, priority=5, arrival=0.0)]
    recs = drive(core, reqs)
    assert core.stats.preemptions > 0
    assert recs["hi"].num_preemptions == 0 and recs["lo"].num_preemptions > 0


def test_chunked_prefill_respects_token_budget():
    budget = 512
    core = EngineCore(PROFILE, EngineConfig(max_num_batched_tokens=budget))
    core.add(req("long", 2000, 4), 0.0)
    core.add(req("short", 100, 100), 0.0)
    now, steps_to_first = 0.0, 0
    while True:
        before = core.stats.prompt_tokens
        now += core.plan_step(now)
        evs = core.finish_step(now)
        steps_to_first += 1
        assert 0 < core.stats.prompt_tokens - before <= budget
        if any(e.first_token and e.request_id == "long" for e in evs):
            break
    # The partial prefill continues first each step; "short" only gets the leftover of the last chunk.
    assert steps_to_first == -(-2000 // budget)
    recs = drive(core, [])
    assert recs["short"].first_scheduled == pytest.approx(now - core.profile.step_time(
        2000 - 3 * budget + 48, 0, 0, (2000 - 3 * budget) * (3 * budget + (2000 - 3 * budget) / 2) + 48 * 24),
        abs=1e-3)


def test_abort_frees_blocks_and_counts():
    core = EngineCore(PROFILE)
    core.add(req("a", 3000, 500), 0.0)
    core.add(req("b", 3000, 500), 0.0)
    now = 0.0
    for _ in range(3):
        now += core.plan_step(now)
        core.finish_step(now)
    assert core.kv_usage > 0
    ev = core.abort("a", now)
    assert ev.finished and ev.finish_reason == "abort" and ev.record.finished == now
    assert core.abort("a", now) is None
    assert core.num_running == 1
    core.abort("b", now)
    assert core.kv_usage == 0.0 and not core.has_work()
    assert core.stats.finished["abort"] == 2
    # abort of a waiting request
    core.add(req("c", 100, 5), now)
    assert core.abort("c", now).finish_reason == "abort" and core.num_waiting == 0


def test_abort_during_step_in_flight_drops_its_events():
    core = EngineCore(PROFILE)
    core.add(req("a", 100, 50), 0.0)
    dur = core.plan_step(0.0)
    core.abort("a", dur / 2)
    assert core.finish_step(dur) == [] and core.kv_usage == 0.0


def test_pd_producer_pins_blocks_until_release_or_expiry():
    core = EngineCore(PROFILE, EngineConfig(kv_hold_s=5.0))
    recs = drive(core, [req("p1", 1600, 100, remote_decode=True), req("p2", 1600, 100, remote_decode=True)])
    assert recs["p1"].finish_reason == "length" and recs["p1"].num_output == 1
    assert core.num_held == 2 and core.num_running == 0 and not core.has_work()
    pinned = core.kv_usage
    assert pinned == pytest.approx(2 * (1600 // 16) / core.num_gpu_blocks)
    assert core.release_remote("p1", 1.0)
    assert core.kv_usage == pytest.approx(pinned / 2)
    core.expire_remote(2.0)
    assert core.num_held == 1            # not expired yet
    core.expire_remote(recs["p2"].finished + 5.0)
    assert core.num_held == 0 and core.kv_usage == 0.0


def test_pd_consumer_waits_for_kv_and_does_not_compute_prompt():
    core = EngineCore(PROFILE)
    recs = drive(core, [req("d", 4000, 20, remote_prefill=True, kv_ready_at=0.5)])
    rec = recs["d"]
    assert rec.first_scheduled >= 0.5
    assert core.stats.prompt_tokens == 0 and core.stats.generation_tokens == 20
    # Its first token costs about one decode step, not a 4000-token prefill.
    prefill = EngineCore(PROFILE)
    normal = drive(prefill, [req("n", 4000, 20)])["n"]
    assert rec.first_token - rec.first_scheduled < 0.3 * (normal.first_token - normal.first_scheduled)


def _mixed_workload(seed: int) -> list[SimRequest]:
    rng = random.Random(seed)
    docs = [block_hashes(encode(synthetic_text(2048, f"doc{d}"))) for d in range(4)]
    out, t = [], 0.0
    for j in range(600):
        t += rng.expovariate(15.0)
        prompt = rng.randint(20, 3000)
        hashes = []
        if rng.random() < 0.3:
            prompt = 2048 + rng.randint(0, 500)
            hashes = docs[rng.randrange(4)]
        out.append(req(f"r{j}", prompt, rng.randint(1, 500), arrival=t, max_tokens=400,
                       hashes=hashes, priority=rng.randint(0, 3)))
    return out


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_macro_steps_match_per_iteration(policy):
    reqs = _mixed_workload(7)
    cfg = EngineConfig(num_gpu_blocks=2500, scheduling_policy=policy)   # tight: preemptions happen
    one = EngineCore(PROFILE, cfg)
    a = drive(one, copy.deepcopy(reqs), 1)
    many = EngineCore(PROFILE, cfg)
    b = drive(many, copy.deepcopy(reqs), 10**9)
    assert one.stats.preemptions > 0 and one.stats.prefix_cache_hits > 0
    assert one.stats == many.stats
    assert a.keys() == b.keys() and len(a) == len(reqs)
    for rid, ra in a.items():
        rb = b[rid]
        assert (ra.num_output, ra.finish_reason, ra.num_preemptions) == (rb.num_output, rb.finish_reason,
                                                                         rb.num_preemptions)
        for f in ("first_scheduled", "first_token", "finished"):
            assert getattr(ra, f) == pytest.approx(getattr(rb, f), abs=1e-7), (rid, f)


def test_output_limits_and_finish_reasons():
    recs = drive(EngineCore(PROFILE), [req("s", 10, 5, max_tokens=10), req("l", 10, 50, max_tokens=10)])
    assert (recs["s"].finish_reason, recs["s"].num_output) == ("stop", 5)
    assert (recs["l"].finish_reason, recs["l"].num_output) == ("length", 10)


def test_bad_requests_are_refused():
    core = EngineCore(PROFILE, EngineConfig(num_gpu_blocks=100, max_model_len=1600))
    with pytest.raises(ValueError, match="max_model_len"):
        core.add(req("big", 5000, 1), 0.0)
    with pytest.raises(ValueError, match="at least one token"):
        core.add(req("empty", 0, 1), 0.0)
    core.add(req("ok", 10, 1), 0.0)
    with pytest.raises(ValueError, match="duplicate"):
        core.add(req("ok", 10, 1), 0.0)
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineCore(PROFILE, EngineConfig(scheduling_policy="lifo"))


def test_output_length_sampler_is_seeded_and_clipped():
    prof = load_profile(PROFILE)
    a = [prof.sample_output_tokens(random.Random(3), 1000) for _ in range(5)]
    b = [prof.sample_output_tokens(random.Random(3), 1000) for _ in range(5)]
    assert a == b
    rng = random.Random(0)
    draws = [prof.sample_output_tokens(rng, 300) for _ in range(4000)]
    assert max(draws) == 300 and min(draws) >= 1
    rng = random.Random(0)
    free = [prof.sample_output_tokens(rng) for _ in range(20000)]
    assert sum(free) / len(free) == pytest.approx(prof.output_mean_tokens, rel=0.05)
