"""policies/pace.py: a worker's stall limits follow its own recent pace, bounded below, cold until it has one."""

from __future__ import annotations

import math

from policies.pace import (
    EjectionSettings,
    FleetPace,
    PaceSettings,
    WorkerPace,
    ejection_s,
    first_token_limit,
    may_eject,
    times_ejected,
)

S = PaceSettings(factor=4.0, gap_floor_s=2.0, first_floor_s=5.0, cold_gap_s=30.0, cold_first_s=60.0,
                 min_samples=8)


def test_cold_until_enough_samples() -> None:
    p = WorkerPace(S)
    for _ in range(7):
        p.observe(0.5, 0.1)
    assert p.limits() == (60.0, 30.0)
    p.observe(0.5, 0.1)
    assert p.limits() == (5.0, 2.0)  # 4 x 0.5 and 4 x 0.1 are under the floors


def test_limits_are_k_times_the_recent_p99() -> None:
    p = WorkerPace(S)
    for i in range(128):  # limits are recomputed every 16 requests
        p.observe(3.0, 3.0 if i in (50, 90) else 1.0)  # two slow gaps in 128
    first, gap = p.limits()
    assert first == 4 * 3.0
    assert 4 * 1.0 < gap < 4 * 3.0  # the p99 sits between the usual gap and the slow ones


def test_window_forgets_old_pace() -> None:
    p = WorkerPace(PaceSettings(window=32, min_samples=8))
    for _ in range(32):
        p.observe(10.0, 5.0)
    slow = p.limits()
    for _ in range(48):  # a window's worth, plus the up-to-16 requests a recomputation may lag
        p.observe(0.1, 0.01)
    assert p.limits() == (PaceSettings().first_floor_s, PaceSettings().gap_floor_s) and slow[1] == 20.0


def test_missing_measures_are_skipped_and_workers_are_separate() -> None:
    f = FleetPace(S)
    for _ in range(10):
        f.of("a").observe(1.0, None)  # one-token answers: no gap
    assert f.limits("a") == (5.0, 30.0)
    assert f.limits("b") == (60.0, 30.0)
    f.forget("a")
    assert f.limits("a") == (60.0, 30.0)


def test_the_quantile_is_numpys() -> None:
    """The p99 read from the top of the window equals numpy.quantile's default (linear) method."""
    import random
    from collections import deque

    import numpy as np

    from policies.pace import quantile

    rng = random.Random(7)
    for n in (1, 2, 8, 9, 100, 255, 256):
        d = deque(rng.random() * 10 for _ in range(n))
        for q in (0.0, 0.5, 0.9, 0.99, 1.0):
            assert abs(quantile(d, q) - float(np.quantile(list(d), q))) <= 1e-12 * 10, (n, q)


def test_unpaced_workers_have_no_pace_limit() -> None:
    fleet = FleetPace(PaceSettings(), unpaced=["turns-engine"])
    assert fleet.limits("turns-engine") == (math.inf, math.inf)
    assert fleet.limits("other") == (PaceSettings().cold_first_s, PaceSettings().cold_gap_s)


def test_a_not_started_leg_is_judged_by_its_predicted_first_token() -> None:
    s = PaceSettings(factor=4.0, first_floor_s=2.0, cold_first_s=60.0)
    assert first_token_limit(None, None, s) == 60.0  # nothing known: the cold limit
    assert first_token_limit(0.1, None, s) == 2.0  # 4 x 0.1 s is under the floor
    assert first_token_limit(1.5, None, s) == 6.0  # k x predicted
    assert first_token_limit(1.5, 9.0, s) == 9.0  # never before the worker's own pace allows
    assert first_token_limit(None, 9.0, s) == 9.0
    fleet = FleetPace(s, unpaced=["turns-engine"])
    assert fleet.first_limit("w0", 1.5) == 6.0 and fleet.first_limit("turns-engine", 1.5) == math.inf
    for _ in range(8):  # w0 gets a pace: 4 x 3 s
        fleet.of("w0").observe(3.0, 0.1)
    assert fleet.first_limit("w0", 0.1) == 12.0 and fleet.first_limit("w0", 5.0) == 20.0


def test_envoy_ejection_backoff_grows_caps_and_decays() -> None:
    s = EjectionSettings(base_s=10.0, max_s=35.0, max_fraction=0.5)
    assert [ejection_s(n, s) for n in (1, 2, 3, 4)] == [10.0, 20.0, 30.0, 35.0]
    assert times_ejected(0, math.inf, s) == 1  # the first ejection
    assert times_ejected(3, 5.0, s) == 4  # ejected again soon after it returned
    assert times_ejected(3, 25.0, s) == 2  # two base times healthy: the multiplier fell by two first
    assert times_ejected(3, 1000.0, s) == 1


def test_at_most_a_fraction_of_a_pool_is_ejected_but_always_one() -> None:
    s = EjectionSettings(max_fraction=0.5)
    assert may_eject(0, 1, s) and may_eject(0, 3, s)  # one always may
    assert not may_eject(1, 3, s)  # a second of three would be 67 %
    assert may_eject(1, 5, s) and not may_eject(2, 5, s)
