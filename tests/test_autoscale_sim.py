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
from simulator.workload import load_workload

CTX = 4096      # llama2-70b-tp2-a100's max_model_len
FAST = {"stabilization_s": 60.0, "cooldown_in_s": 20.0, "cold_start_s": 20.0, "batch_settle_s": 60.0,
        "batch_cooldown_s": 60.0, "deadline_margin_s": 30.0, "max_interactive": 10, "max_batch": 10,
        "max_total": 10}


def _no_failures(sim: AutoscaleSim, arrived_before: float) -> None:
    """Every request that arrived in time finished normally: nothing was lost to a scale-down."""
    for r in sim.results.values():
        if r.arrival < arrived_before:
            assert r.finish_reason in ("stop", "length"), (r.request_id, r.finish_reason, r.error)


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
    _no_failures(sim, sc.horizon_s)
    assert res.interactive["completed"] == len(inter)
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
    assert min(caps) >= 4 and max(caps) <= 40                    # far from min_cap 1 and max_cap 1024
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
