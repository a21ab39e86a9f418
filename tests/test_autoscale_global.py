"""Chiron's global autoscaler and Aladdin's worker-count fit: every formula against a hand computation."""

from __future__ import annotations

import math
import random

import pytest

from policies.autoscale.global_ import (
    POOL_BATCH,
    POOL_INTERACTIVE,
    POOL_MIXED,
    FleetObservation,
    GlobalAutoscaler,
    GlobalConfig,
    PoolScaler,
    RateWorkerFit,
    arrival_spikes,
    batch_backpressure,
    batch_workers_needed,
    interactive_target,
    theta_from_spikes,
)
from policies.batch_queue import RequestGroup, estimate_wait, request_groups


# ---- waiting time and request groups --------------------------------------------------------------
def test_wait_estimate_matches_hand_computation():
    # q = 100 requests, mu = 200, sigma = 50, Theta = 1000 tok/s: (100*200 + 1.645*50*10) / 1000
    assert estimate_wait(100, 200.0, 50.0, 1000.0, z=1.645) == pytest.approx((20000 + 822.5) / 1000)
    assert estimate_wait(100, 200.0, 50.0, 1000.0, z=0.0) == pytest.approx(20.0)    # eq. 1 with the mean
    assert estimate_wait(0, 200.0, 50.0, 1000.0) == 0.0
    assert estimate_wait(5, 200.0, 50.0, 0.0) == math.inf


def test_request_groups_cluster_by_deadline():
    counts = [(100.0, 5), (110.0, 3), (130.0, 2), (3600.0, 10), (3650.0, 4), (9000.0, 1)]
    groups = request_groups(counts, span_s=300.0)
    assert [(g.deadline, g.latest, g.count, g.cumulative) for g in groups] == [
        (100.0, 130.0, 10, 10), (3600.0, 3650.0, 14, 24), (9000.0, 9000.0, 1, 25)]
    assert len(request_groups(counts, span_s=10_000.0)) == 1
    assert [g.count for g in request_groups(counts, span_s=0.0)] == [5, 3, 2, 10, 4, 1]
    assert request_groups([], 60.0) == []


def test_batch_backpressure_counts_late_groups():
    groups = [RequestGroup(100.0, 100.0, 10, 10), RequestGroup(1000.0, 1000.0, 10, 20)]
    # mean 100 tokens, no spread, 10 tok/s: group 1 needs 1000 tokens by t=100 (has 1000: on time),
    # group 2 needs 2000 by t=1000 (has 10000: on time); at 5 tok/s group 1 is late (500 < 1000).
    kw = {"inflight": 0, "mean_tokens": 100.0, "std_tokens": 0.0, "z": 0.0}
    assert batch_backpressure(groups, 0.0, fleet_tokens_per_s=10.0, **kw) == 0
    assert batch_backpressure(groups, 0.0, fleet_tokens_per_s=5.0, **kw) == 1
    assert batch_backpressure(groups, 0.0, fleet_tokens_per_s=1.0, **kw) == 2
    # running requests count as ahead of every group
    assert batch_backpressure(groups, 0.0, fleet_tokens_per_s=10.0, **{**kw, "inflight": 1}) == 1


def test_algorithm_2_adds_the_fewest_workers_counting_cold_start():
    groups = [RequestGroup(3600.0, 3600.0, 1000, 1000)]
    # need 1000 * 300 = 300k tokens in 3600 - 100 (margin) = 3500 s; the fleet makes 50 tok/s (175k);
    # each new worker adds 20 tok/s from 60 s on (20 * 3440 = 68.8k): 125k more needs 2 workers.
    n, bbp = batch_workers_needed(groups, 0.0, inflight=0, mean_tokens=300.0, std_tokens=0.0, fleet_tokens_per_s=50.0,
                                  worker_tokens_per_s=20.0, pending=0, cold_start_s=60.0, margin_s=100.0, max_new=10,
                                  z=0.0)
    assert (n, bbp) == (2, 1)
    n, _ = batch_workers_needed(groups, 0.0, inflight=0, mean_tokens=300.0, std_tokens=0.0, fleet_tokens_per_s=50.0,
                                worker_tokens_per_s=20.0, pending=1, cold_start_s=60.0, margin_s=100.0, max_new=10,
                                z=0.0)
    assert n == 1                                                   # one is already starting
    n, _ = batch_workers_needed(groups, 0.0, inflight=0, mean_tokens=300.0, std_tokens=0.0, fleet_tokens_per_s=50.0,
                                worker_tokens_per_s=20.0, pending=0, cold_start_s=60.0, margin_s=100.0, max_new=1,
                                z=0.0)
    assert n == 1                                                   # max bound


# ---- Aladdin E.2 ----------------------------------------------------------------------------------
def test_rate_fit_recovers_known_coefficients():
    fit = RateWorkerFit(forget=1.0, min_samples=3)
    for r in (1.0, 2.0, 4.0, 8.0):
        fit.observe(r, 0.75 * r + 1.5)
    k5, c5 = fit.coefficients
    assert k5 == pytest.approx(0.75) and c5 == pytest.approx(1.5)
    assert fit.workers(10.0) == math.ceil(0.75 * 10 + 1.5) == 9    # N = ceil(k5 * rate + c5)
    rng = random.Random(1)
    noisy = RateWorkerFit(forget=1.0)
    for _ in range(2000):
        r = rng.uniform(1, 20)
        noisy.observe(r, 0.4 * r + 2.0 + rng.gauss(0, 0.3))
    k5, c5 = noisy.coefficients
    assert k5 == pytest.approx(0.4, abs=0.01) and c5 == pytest.approx(2.0, abs=0.1)


def test_rate_fit_needs_spread_and_rates_above_r_and_forgets():
    fit = RateWorkerFit(min_rate=1.0, min_samples=2)
    fit.observe(0.5, 3.0)                       # below R: ignored
    fit.observe(2.0, 3.0)
    assert fit.coefficients is None             # one sample
    fit.observe(2.0, 3.0)
    assert fit.coefficients is None             # no spread in rate
    fit = RateWorkerFit(forget=0.5, min_samples=2)
    for r in (1.0, 2.0, 3.0):
        fit.observe(r, r)                       # old regime: k5 = 1
    for _ in range(40):
        for r in (1.0, 2.0, 3.0):
            fit.observe(r, 2 * r)               # new regime: k5 = 2
    assert fit.coefficients[0] == pytest.approx(2.0, abs=1e-6)
    with pytest.raises(ValueError):
        fit.observe(-1.0, 1.0)


# ---- the interactive band and theta ---------------------------------------------------------------
def test_band_decisions():
    assert interactive_target(3.0, 6, theta=0.5, delta=0.1) == (6, None)        # IBP 0.5: in band
    assert interactive_target(4.0, 6, theta=0.5, delta=0.1) == (8, "ibp_high")  # 0.67 > 0.6 -> ceil(4/0.5)
    assert interactive_target(3.4, 6, theta=0.5, delta=0.05) == (7, "ibp_high")  # at least +1
    assert interactive_target(1.0, 6, theta=0.5, delta=0.1) == (2, "ibp_low")
    assert interactive_target(2.8, 6, theta=0.5, delta=0.01) == (5, "ibp_low")   # at least -1
    assert interactive_target(0.5, 0, theta=0.5, delta=0.1) == (1, "ibp_high")
    assert interactive_target(0.0, 0, theta=0.5, delta=0.1) == (0, None)


def test_theta_from_arrival_spikes():
    # windows of 10 s with 10, 30, 10, 10, (last partial) arrivals: spikes 3.0, 1/3, 1.0
    arrivals = [i for i in range(10)] + [10 + i / 3 for i in range(30)] + [20 + i for i in range(10)] \
        + [30 + i for i in range(10)] + [40.5]
    spikes = arrival_spikes(arrivals, 10.0)
    assert spikes == pytest.approx([3.0, 1 / 3, 1.0])
    assert theta_from_spikes(spikes, 1.0) == pytest.approx(1 / 3)               # "3x spike -> theta 1/3"
    assert theta_from_spikes([1.0, 1.0], 0.99, hi=0.9) == 0.9
    assert theta_from_spikes([50.0], 0.99, lo=0.25) == 0.25


# ---- hysteresis, cooldown, bounds -----------------------------------------------------------------
def test_pool_scaler_cooldown_stabilization_and_bounds():
    ps = PoolScaler(min_workers=1, max_workers=10, cooldown_out_s=30, cooldown_in_s=60, stabilization_s=300,
                    max_step_in=1)
    assert ps.decide(4, 6, 0.0, "up", "down") == (6, "up")
    assert ps.decide(6, 8, 10.0, "up", "down") == (6, None)          # scale-out cooldown
    assert ps.decide(6, 8, 40.0, "up", "down") == (8, "up")
    assert ps.decide(8, 20, 100.0, "up", "down") == (10, "up")       # max bound
    for t in range(130, 401, 15):                                    # target 2 for a while
        got = ps.decide(10, 2, float(t), "up", "down")
        assert got == (10, None)                                     # the 20 (-> 10) at t=100 is remembered
    assert ps.decide(10, 2, 415.0, "up", "down") == (9, "down")      # one step once it left the window
    assert ps.decide(9, 2, 430.0, "up", "down") == (9, None)         # scale-in cooldown
    assert ps.decide(9, 2, 476.0, "up", "down") == (8, "down")
    assert ps.decide(0, 0, 500.0, "up", "down") == (1, "min")
    assert ps.decide(12, 12, 510.0, "up", "down") == (10, "max")
    assert ps.force_down(520.0, 0) == 1                              # never below min
    fresh = PoolScaler(stabilization_s=300, cooldown_in_s=0)
    assert fresh.decide(5, 1, 0.0, "up", "down") == (5, None)        # no history: the current size counts
    assert fresh.decide(5, 1, 301.0, "up", "down") == (4, "down")
    with pytest.raises(ValueError):
        PoolScaler(min_workers=5, max_workers=2)


# ---- the combiner -------------------------------------------------------------------------------
def _obs(**kw) -> FleetObservation:
    base = {"interactive_busy": 3.0, "workers": {POOL_INTERACTIVE: 3, POOL_MIXED: 3, POOL_BATCH: 0}}
    base.update(kw)
    return FleetObservation(**base)


def test_combiner_scales_the_interactive_pool_with_reasons():
    gs = GlobalAutoscaler(GlobalConfig(theta=0.5, delta=0.1, cooldown_out_s=0, use_rate_forecast=False))
    plan = gs.update(_obs(), 0.0)
    assert plan.desired == {POOL_INTERACTIVE: 3, POOL_MIXED: 3, POOL_BATCH: 0} and plan.actions == []
    assert plan.backpressure["ibp"] == pytest.approx(0.5)
    plan = gs.update(_obs(interactive_busy=5.0), 15.0)                  # IBP 0.83 -> ceil(5/0.5) = 10
    assert sum(plan.desired.values()) == 10 and plan.desired[POOL_INTERACTIVE] == 5
    assert {(a.pool, a.direction, a.reason) for a in plan.actions} == {
        (POOL_INTERACTIVE, "up", "ibp_high"), (POOL_MIXED, "up", "ibp_high")}
    assert sum(a.count for a in plan.actions) == 4
    # pending workers count: nothing more is added while they start
    plan = gs.update(_obs(interactive_busy=5.0, pending={POOL_MIXED: 4}), 30.0)
    assert plan.actions == []


def test_combiner_scale_in_waits_for_the_stabilization_window():
    gs = GlobalAutoscaler(GlobalConfig(theta=0.5, delta=0.1, stabilization_s=60, cooldown_in_s=0,
                                       use_rate_forecast=False))
    gs.update(_obs(), 0.0)
    assert gs.update(_obs(interactive_busy=1.0), 30.0).actions == []     # the target 6 seen at t=0 still wins
    plan = gs.update(_obs(interactive_busy=1.0), 90.0)
    assert sum(plan.desired.values()) == 5
    assert [(a.direction, a.reason) for a in plan.actions] == [("down", "ibp_low")]


def test_combiner_uses_the_rate_forecast():
    gs = GlobalAutoscaler(GlobalConfig(theta=0.5, delta=0.1, cooldown_out_s=0, rate_min_samples=4))
    for i, rate in enumerate((1.0, 2.0, 3.0, 4.0, 1.0, 2.0)):
        gs.update(_obs(interactive_busy=rate, interactive_rate=rate,
                       workers={POOL_INTERACTIVE: 4, POOL_MIXED: 4}), float(i))
    # the rate jumped to 6 req/s; the busy count has not caught up yet (3 busy): the fit says 6 workers
    plan = gs.update(_obs(interactive_busy=3.0, interactive_rate=6.0, workers={POOL_INTERACTIVE: 4, POOL_MIXED: 4}),
                     10.0)
    assert plan.backpressure["forecast_busy"] == pytest.approx(6.0)
    assert sum(plan.desired.values()) == 12
    assert {a.reason for a in plan.actions} == {"rate_forecast"}
    assert 0 < plan.backpressure["k5"] < 1.0        # the lagging pair (6 req/s, 3 busy) was learnt after the forecast


def test_combiner_batch_pool_adds_for_deadlines_then_scales_to_zero():
    cfg = GlobalConfig(theta=0.5, delta=0.1, batch_settle_s=30, batch_cooldown_s=0, cold_start_s=60,
                       deadline_margin_s=0, wait_z=0.0, use_rate_forecast=False)
    gs = GlobalAutoscaler(cfg)
    queue = [(3600.0, 2000)]                       # 2000 x 100 tokens = 200k by t=3600
    obs = {"queue": queue, "batch_tokens_per_s": 20.0, "worker_tokens_per_s": 30.0, "output_mean": 100.0}
    plan = gs.update(_obs(**obs), 0.0)
    assert plan.desired[POOL_BATCH] == 0 and plan.backpressure["bbp"] == 1.0    # still settling
    assert plan.backpressure["batch_wait_s"] == pytest.approx(2000 * 100 / 20.0)
    plan = gs.update(_obs(**obs), 30.0)
    # left 3570 s: fleet 20*3570 = 71.4k; each worker 30*(3570-60) = 105.3k -> 2 workers
    assert plan.desired[POOL_BATCH] == 2
    assert [(a.pool, a.direction, a.count, a.reason) for a in plan.actions] == [(POOL_BATCH, "up", 2, "deadline")]
    # while work remains the batch pool holds, even when it looks large enough
    workers = {POOL_INTERACTIVE: 3, POOL_MIXED: 3, POOL_BATCH: 2}
    plan = gs.update(_obs(**{**obs, "batch_tokens_per_s": 500.0}, workers=workers), 45.0)
    assert plan.desired[POOL_BATCH] == 2 and plan.actions == []
    # queue empty: scale to zero at once (Algorithm 2, lines 17-19)
    plan = gs.update(_obs(workers=workers), 60.0)
    assert plan.desired[POOL_BATCH] == 0
    assert [(a.pool, a.direction, a.count, a.reason) for a in plan.actions] == [(POOL_BATCH, "down", 2, "queue_empty")]


def test_combiner_respects_the_total_bound():
    gs = GlobalAutoscaler(GlobalConfig(theta=0.5, delta=0.1, max_total=8, cooldown_out_s=0, use_rate_forecast=False))
    plan = gs.update(_obs(interactive_busy=6.0, workers={POOL_INTERACTIVE: 3, POOL_MIXED: 3, POOL_BATCH: 2}), 0.0)
    assert plan.desired[POOL_INTERACTIVE] + plan.desired[POOL_MIXED] == 6     # 8 total, 2 are batch
    with pytest.raises(ValueError):
        GlobalConfig(theta=0.2, delta=0.3)


# ---- joint placement and scaling (Aladdin section 4.2 + appendix E.2) ---------------------------------------
def test_placement_shortfall_raises_the_interactive_target_and_holds_scale_in() -> None:
    cfg = GlobalConfig(theta=0.5, delta=0.1, cooldown_out_s=0.0, cooldown_in_s=0.0, stabilization_s=0.0,
                       use_rate_forecast=False)
    workers = {POOL_INTERACTIVE: 2, POOL_MIXED: 2}
    # 2 of 4 workers busy: IBP 0.5 sits in the band, so Chiron alone would hold 4 ...
    calm = GlobalAutoscaler(cfg).update(FleetObservation(interactive_busy=2.0, workers=workers), 0.0)
    assert sum(calm.desired[p] for p in (POOL_INTERACTIVE, POOL_MIXED)) == 4 and not calm.actions
    # ... but 3 more workers' worth of requests fit nowhere within their SLO: 4 active + 3.
    plan = GlobalAutoscaler(cfg).update(FleetObservation(interactive_busy=2.0, workers=workers,
                                                         placement_shortfall=3.0), 0.0)
    assert sum(plan.desired[p] for p in (POOL_INTERACTIVE, POOL_MIXED)) == 7
    assert [(a.direction, a.reason) for a in plan.actions] and all(a.reason == "placement_shortfall"
                                                                   for a in plan.actions)
    assert plan.backpressure["placement_shortfall"] == 3.0
    # Idle by IBP (would scale in) yet 1 worker short: no scale-in below active + shortfall.
    idle = GlobalAutoscaler(cfg).update(FleetObservation(interactive_busy=0.2, workers=workers,
                                                         placement_shortfall=1.0), 0.0)
    assert sum(idle.desired[p] for p in (POOL_INTERACTIVE, POOL_MIXED)) == 5
    # Workers already starting cover the shortfall: nothing more is asked.
    covered = GlobalAutoscaler(cfg).update(FleetObservation(interactive_busy=2.0, workers=workers,
                                                            pending={POOL_MIXED: 3}, placement_shortfall=3.0), 0.0)
    assert sum(covered.desired[p] for p in (POOL_INTERACTIVE, POOL_MIXED)) == 7 and not covered.actions


def test_a_warm_minimum_is_kept_while_traffic_is_recent_then_the_pool_shrinks() -> None:
    """An idle fleet of 4 (the start counts as traffic) keeps 2 warm workers for warm_s after the last arrival,
    instead of shrinking to min_interactive at once; after warm_s of no arrivals it may; the warm minimum never
    scales out by itself."""
    cfg = dict(theta=0.5, delta=0.1, cooldown_in_s=0, stabilization_s=0, use_rate_forecast=False, max_step_in=4,
               min_interactive=1)
    idle = {"interactive_busy": 0.0, "workers": {POOL_INTERACTIVE: 2, POOL_MIXED: 2}}
    cold = GlobalAutoscaler(GlobalConfig(**cfg))
    cold.update(_obs(**idle), 0.0)
    assert sum(cold.update(_obs(**idle), 1.0).desired.values()) == 1        # without it: down to 1 at once
    gs = GlobalAutoscaler(GlobalConfig(**cfg, warm_min_interactive=2, warm_s=60.0))
    gs.update(_obs(**idle), 0.0)
    plan = gs.update(_obs(**idle), 1.0)
    assert sum(plan.desired.values()) == 2 and {a.reason for a in plan.actions} == {"ibp_low"}
    two = {"interactive_busy": 0.0, "workers": {POOL_INTERACTIVE: 1, POOL_MIXED: 1}}
    assert gs.update(_obs(**two), 50.0).actions == []                       # 50 s after the start: still warm
    assert gs.update(_obs(**two, interactive_rate=0.1), 70.0).actions == []  # traffic again: warm from 70 s
    assert gs.update(_obs(**two), 120.0).actions == []
    plan = gs.update(_obs(**two), 131.0)                                    # 61 s without arrivals
    assert sum(plan.desired.values()) == 1 and [a.direction for a in plan.actions] == ["down"]
    one = {"interactive_busy": 0.0, "workers": {POOL_INTERACTIVE: 1}}
    assert gs.update(_obs(**one, interactive_rate=0.1), 140.0).actions == []  # it never scales out by itself
    with pytest.raises(ValueError):
        GlobalConfig(warm_min_interactive=-1)
