"""Virtual-time autoscaling: the same scaling code on the cluster simulator, with cold start and drain."""

from __future__ import annotations

import statistics

import pytest

from policies.autoscale.global_ import POOL_BATCH, GlobalConfig
from simulator.autoscale_sim import (
    Arm,
    AutoscaleSim,
    BatchJob,
    Scenario,
    fit_to_context,
    run_arm,
    stepped_arrivals,
    tag_requests,
)
from simulator.profiles import load_profile
from simulator.workload import WorkloadRequest, load_workload

CTX = 4096      # llama2-70b-tp2-a100's max_model_len
FAST = {"stabilization_s": 60.0, "cooldown_in_s": 20.0, "cold_start_s": 20.0, "batch_settle_s": 60.0,
        "batch_cooldown_s": 60.0, "deadline_margin_s": 30.0, "max_interactive": 10, "max_batch": 10,
        "max_total": 10}


def _no_failures(sim: AutoscaleSim, arrived_before: float) -> int:
    """Every request that arrived in time finished normally, or was refused by the admission queue once its TTFT
    target had passed while it waited for a worker (the gateway's 429): nothing was lost to a scale-down.
    Returns how many were refused."""
    refused = 0
    for r in sim.results.values():
        if r.arrival < arrived_before:
            assert r.finish_reason in ("stop", "length", "refused"), (r.request_id, r.finish_reason, r.error)
            if r.finish_reason == "refused":
                assert r.status == 429
                refused += 1
    return refused


def test_desired_workers_rise_under_a_burst_and_fall_after_it_with_drain():
    inter = tag_requests(fit_to_context(stepped_arrivals("azure_conv", [(180, 0.5), (180, 3.0), (240, 0.3)],
                                                         seed=3), CTX), "i")
    sc = Scenario("burst", inter, horizon_s=900, cold_start_s=(10, 20), initial_workers=1, max_workers=10)
    sim = AutoscaleSim(sc, Arm("chiron", tick_s=10, global_config=GlobalConfig(theta=0.5, delta=0.1, **FAST)))
    res = sim.run_scenario()
    total = [(row["t"], sum(row["desired"].values())) for row in res.timeline if "desired" in row]
    before = max(n for t, n in total if t < 180)
    during = max(n for t, n in total if 180 <= t < 420)
    after = total[-1][1]
    assert during > before and after < during
    assert any(k.endswith("/up/ibp_high") or k.endswith("/up/rate_forecast") for k in res.scale_actions)
    assert any("/down/" in k for k in res.scale_actions)
    assert sim.retired and all(w.removed_at is not None and w.inflight == 0 for w in sim.retired)
    refused = _no_failures(sim, sc.horizon_s)
    assert res.interactive["completed"] == len(inter) - refused and refused < 0.1 * len(inter)
    # GPU time: the fleet was billed from each worker's provisioning (cold start included) to its release
    assert 0 < res.gpu_seconds < 10 * 2 * sc.horizon_s


def test_batch_queue_adds_batch_workers_for_the_deadline_evicts_and_scales_to_zero():
    inter = tag_requests(fit_to_context(stepped_arrivals("azure_conv", [(900, 1.0)], seed=4), CTX), "i")
    batch = tag_requests(fit_to_context(load_workload("sharegpt", rate=100, limit=600, seed=2), CTX)[:300], "b")
    sc = Scenario("batch", inter, [BatchJob(60.0, batch, 600.0)], horizon_s=1000, cold_start_s=(10, 20),
                  initial_workers=2, max_workers=10)
    sim = AutoscaleSim(sc, Arm("chiron", tick_s=10, global_config=GlobalConfig(theta=0.5, delta=0.1, **FAST)))
    res = sim.run_scenario()
    assert res.scale_actions.get("batch/up/deadline", 0) >= 1
    assert res.scale_actions.get("batch/down/queue_empty", 0) == res.scale_actions["batch/up/deadline"]
    assert res.timeline[-1]["active"][POOL_BATCH] == 0
    assert res.batch["on_time"] == 1.0 and res.batch["completed"] == len(batch)
    assert res.evictions > 0                   # interactive spikes took slots on mixed workers back
    _no_failures(sim, sc.horizon_s)


def test_local_caps_converge_under_a_fixed_load():
    # One worker, a queue that keeps it full, an ITL SLO the cap runs into: Algorithm 1 settles into
    # its sawtooth below the SLO cap (grow while bp < 1, halve at bp >= 1), never at its bounds.
    work = tag_requests(fit_to_context(load_workload("azure_conv", limit=800), CTX), "b")
    sc = Scenario("fixed", [], [BatchJob(0.0, work, 3600.0)], horizon_s=400, slo_tpot_s=0.08, initial_workers=1,
                  max_workers=1)
    sim = AutoscaleSim(sc, Arm("utilization_local"))
    sim.run_scenario()
    late = [(cap, itl) for t, _, cap, itl in sim.cap_log if t >= 100]
    caps = [c for c, _ in late]
    assert len(caps) >= 25
    cfg = sc.slo_tpot_s
    assert min(caps) >= 3 and max(caps) <= 40                    # far from min_cap 1 and max_cap 1024
    assert max(caps) <= 4 * min(caps)                             # bounded oscillation, no drift
    assert statistics.fmean(i for _, i in late if i is not None) <= cfg


def test_arms_share_the_workload_and_bad_arm_is_refused():
    inter = tag_requests(fit_to_context(stepped_arrivals("azure_conv", [(120, 1.0)], seed=5), CTX), "i")
    sc = Scenario("small", inter, horizon_s=200, initial_workers=2, max_workers=4)
    static = run_arm(sc, Arm("static", static_workers=3))
    util = run_arm(sc, Arm("utilization"))
    assert static.gpu_seconds == pytest.approx(3 * 2 * 200)     # 3 workers x TP2 x horizon
    assert static.interactive["requests"] == util.interactive["requests"] == len(inter)
    assert all(r.request_id.startswith("i") for r in inter)      # run_arm works on copies
    with pytest.raises(ValueError, match="unknown arm"):
        AutoscaleSim(sc, Arm("nope"))


def _evict_once_at(t_evict: float, mode: str) -> tuple[AutoscaleSim, str, float]:
    """Two warm workers (interactive + mixed), five long batch requests on the mixed one, no controller
    action before the horizon; at `t_evict` one batch request is evicted as an interactive request would."""
    reqs = [WorkloadRequest(f"b{i}", 0.0, 1000, 2000) for i in range(5)]
    sc = Scenario("evict", [], [BatchJob(0.0, reqs, 600.0)], horizon_s=300, initial_workers=2, max_workers=2,
                  theta=0.5)
    sim = AutoscaleSim(sc, Arm("chiron", evict_mode=mode, tick_s=1e6, local_tick_s=1e6))
    seen: dict[str, str] = {}

    def evict(s: AutoscaleSim, now: float) -> None:
        mixed = next(w for w in s.workers.values() if w.labels["pool"] == "mixed")
        victim = next(reversed(s.state[mixed.id].batch))
        assert s._evict_one(now)
        seen["victim"] = victim

    sim.schedule(t_evict, evict)
    sim.run_scenario()
    return sim, seen["victim"], t_evict


def _against_restart(mode: str) -> tuple[AutoscaleSim, AutoscaleSim, int]:
    """_evict_once_at in `mode` and in restart mode: the same victim, completed in full by both, and the
    tokens it had generated before the eviction (the same in both)."""
    sim, victim, t = _evict_once_at(20.0, mode)
    restart, victim_r, _ = _evict_once_at(20.0, "restart")
    assert victim == victim_r
    rs, rr = sim.results[victim], restart.results[victim]
    assert rs.completed and rr.completed and rs.output_tokens == rr.output_tokens == 2000
    assert rs.first_token < t                        # its first token came before the eviction and is kept
    assert rr.first_token > t                        # restarted: a new prefill, a new first token
    assert rs.finished < rr.finished                 # the kept work makes it finish sooner
    kept = sim.swap_stats["evicted_tokens"]
    assert kept > 0 and kept == restart.swap_stats["evicted_tokens"]
    return sim, restart, kept


def _engine_tokens(sim: AutoscaleSim) -> tuple[int, int]:
    """(prefill, decode) tokens of every engine of the run."""
    engines = [w.engine.stats for w in list(sim.workers.values()) + sim.retired]
    return sum(e.prompt_tokens for e in engines), sum(e.generation_tokens for e in engines)


def test_swap_mode_eviction_keeps_generated_tokens_and_charges_the_swap_in():
    swap, restart, kept = _against_restart("swap")
    prof = load_profile(swap.scenario.profile)
    # placed again, it waits for its copy: the swap-in, (prompt + generated) x KV bytes / host link, plus
    # whatever remained of the swap-out when it was placed (here it had landed: placed after the next step)
    one_copy = prof.kv_swap_s(1000 + kept)
    assert swap.swap_stats["swap_ins"] == 1
    assert one_copy - 1e-9 <= swap.swap_stats["swap_in_s"] <= 2 * one_copy + 1e-9
    assert swap.swap_stats["peak_host_kv_bytes"] == (1000 + kept) * prof.kv_bytes_per_token
    assert swap.swap_stats["host_kv_bytes"] == 0     # freed once the copy landed
    # nothing recomputed in swap mode: each prompt was prefilled once; restart prefills the victim twice
    assert _engine_tokens(swap)[0] == 5 * 1000 and _engine_tokens(restart)[0] == 6 * 1000


def test_continue_mode_eviction_prefills_the_kept_text_and_decodes_only_the_rest():
    cont, restart, kept = _against_restart("continue")
    assert cont.swap_stats["continued"] == 1 and cont.swap_stats["swap_ins"] == 0
    assert cont.swap_stats["peak_host_kv_bytes"] == 0   # no KV kept, only the text
    # its next run prefills the prompt plus the kept text, then generates only what remained
    (pre_c, dec_c), (pre_r, dec_r) = _engine_tokens(cont), _engine_tokens(restart)
    assert pre_c == 6 * 1000 + kept and pre_r == 6 * 1000
    assert dec_r - dec_c == kept


def test_routing_fills_a_large_worker_faster_than_one_request_per_scrape():
    reqs = [WorkloadRequest(f"b{i}", 0.0, 200, 2000) for i in range(300)]
    sc = Scenario("fill", [], [BatchJob(0.0, reqs, 3600.0)], profile="llama3-8b-a100", horizon_s=20,
                  initial_workers=1, max_workers=1)
    sim = AutoscaleSim(sc, Arm("static", static_workers=1, static_cap=256))
    seen: list[int] = []
    sim.schedule(10.0, lambda s, now: seen.append(next(iter(s.workers.values())).engine.num_running))
    sim.run_scenario()
    assert seen == [256]                             # the static cap, reached within 10 s (one per scrape: ~20)


def test_arm_options_are_validated_and_reach_the_workers():
    sc = Scenario("small", [], horizon_s=10, initial_workers=2, max_workers=2)
    util = AutoscaleSim(sc, Arm("utilization", static_cap=32))
    assert {w.cap for w in util.workers.values()} == {32}
    chiron = AutoscaleSim(sc, Arm("chiron", batch_max_cap=2048))
    assert chiron._local_config(POOL_BATCH).max_cap == 2048
    assert chiron._local_config(POOL_BATCH).itl_slo_s == sc.batch_itl_slo_s
    assert chiron._local_config("mixed").itl_slo_s == sc.slo_tpot_s
    with pytest.raises(ValueError, match="evict_mode"):
        AutoscaleSim(sc, Arm("chiron", evict_mode="teleport"))
    with pytest.raises(ValueError, match="static_cap"):
        AutoscaleSim(sc, Arm("utilization", static_cap=0))


def test_host_link_is_an_optional_profile_field_with_a_pcie_default():
    from dataclasses import asdict

    from simulator.profiles import profile_from_dict

    data = asdict(load_profile("llama2-70b-tp2-a100"))
    assert data.pop("host_link_bytes_per_s") == 25e9
    prof = profile_from_dict(data)                                   # older profile files omit it
    assert prof.host_link_bytes_per_s == 25e9
    assert prof.kv_swap_s(1000) == pytest.approx(1000 * 327680 / 25e9)
    assert prof.kv_swap_s(1000, 12.5e9) == pytest.approx(2 * prof.kv_swap_s(1000))
    with pytest.raises(ValueError, match="host_link_bytes_per_s must be > 0"):
        profile_from_dict({**data, "host_link_bytes_per_s": 0})
