"""policies/pace.py: a worker's stall limits follow its own recent pace, bounded below, cold until it has one."""

from __future__ import annotations

import math

from policies.pace import FleetPace, PaceSettings, WorkerPace

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
