"""policies/pace.py: a worker's stall limits follow its own recent pace, bounded below, cold until it has one."""

from __future__ import annotations

import math

import pytest

from policies.pace import (
    EjectionSettings,
    FleetPace,
    PaceSettings,
    WorkerPace,
    ejection_s,
    first_token_limit,
    may_eject,
    stall_verdict,
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


# --- the stall judge: relative to the fleet, and only with somewhere better to go ---------------------------

def paced_fleet(workers: list[str], gap: float = 0.1, now: float = 100.0) -> FleetPace:
    f = FleetPace(S)
    for w in workers:
        for _ in range(8):
            f.of(w).observe(0.5, gap)
        f.of(w).last_token_at = now
    return f


def test_a_zombie_among_progressing_peers_is_cut_at_the_same_limit() -> None:
    f = paced_fleet(["a", "b", "c"])
    f.of("a").last_token_at = 98.0       # a: silent since 98; b and c just produced tokens
    assert f.judge("a", True, 1.9, None, 99.9, [("b", True), ("c", True)]) == pytest.approx(0.1)  # the 2 s floor
    assert f.judge("a", True, 2.0, None, 100.0, [("b", True), ("c", True)]) is None   # a stall: give it up


def test_a_stream_with_nowhere_better_to_go_is_kept() -> None:
    f = paced_fleet(["a", "b"])
    for w in ("a", "b"):
        f.of(w).last_token_at = 95.0     # the whole fleet went quiet at once (slowed down, or a long prefill)
    assert f.judge("a", True, 5.0, None, 100.0, [("b", True)]) == S.recheck_s   # judged again later, not cut
    assert f.judge("a", True, 5.0, None, 100.0, []) == S.recheck_s   # no other worker at all


def test_an_idle_peer_is_somewhere_better() -> None:
    f = paced_fleet(["a", "b"])
    f.of("a").last_token_at = 95.0
    f.of("b").last_token_at = 50.0       # long quiet, but nothing in flight there
    assert f.judge("a", True, 5.0, None, 100.0, [("b", False)]) is None


def test_a_slowed_fleet_raises_every_limit_from_streams_in_flight() -> None:
    f = paced_fleet(["a", "b", "c"])
    f.of("a").last_token_at = 90.0
    f.of("b").note_late(6.0, False, 99.0)   # b's next token came after 6 s
    assert f.fleet_limits(100.0)[1] == 4 * 6.0
    # a's own pace says 2 s, but the fleet's silences are 6 s long: a 10 s silence on a is not a stall yet
    assert f.judge("a", True, 10.0, None, 100.0, [("b", True), ("c", True)]) == 24.0 - 10.0
    # the evidence is forgotten after live_window_s
    assert f.fleet_limits(99.0 + S.live_window_s + 1)[1] == S.gap_floor_s


def test_a_worker_still_feeding_its_other_streams_is_working_through_its_queue() -> None:
    f = paced_fleet(["a", "b"])
    f.of("a").last_token_at = 99.5       # a's other streams progress; this one has been silent 3 s
    assert f.judge("a", True, 3.0, None, 100.0, [("b", False)]) == pytest.approx(1.5)   # judged by a's silence
    assert f.judge("a", False, 30.0, 2.5, 100.0, [("b", False)]) == pytest.approx(4.5)   # a first token too


def test_first_token_waits_are_judged_the_same_way() -> None:
    f = paced_fleet(["a", "b"])
    f.of("a").last_token_at = None
    assert f.judge("a", False, 4.0, 2.5, 100.0, [("b", True)]) == 1.0   # the fleet's paced limit: 5 s
    assert f.judge("a", False, 5.0, 2.5, 100.0, [("b", True)]) is None
    f.of("b").note_late(5.0, True, 100.0)  # b's first tokens come after 5 s: the fleet's first limit is 20 s
    assert f.judge("a", False, 5.0, 2.5, 100.5, [("b", True)]) == 15.0   # (fleet limits: 0.25 s cache)


def test_a_first_token_is_never_judged_stricter_than_the_fleets_slowed_gaps() -> None:
    f = paced_fleet(["a", "b"])
    f.of("a").last_token_at = None
    f.of("b").note_late(4.0, False, 100.0)   # b's gaps are 4 s now: an engine iteration takes that long
    assert f.judge("a", False, 6.0, 2.5, 100.0, [("b", True)]) == 16.0 - 6.0
    cold = FleetPace(S)   # a worker without a pace: its cold gap limit does not hold its first token back
    assert cold.judge("z", False, 3.0, 2.5, 0.0, [("y", False)]) is None


def test_unpaced_workers_are_never_judged() -> None:
    f = FleetPace(S, unpaced=["t"])
    assert f.judge("t", True, 1e6, None, 0.0, [("x", False)]) == math.inf


def test_stall_verdict() -> None:
    assert stall_verdict(1.0, None, 2.0, True, 1.0) == 1.0
    assert stall_verdict(2.0, None, 2.0, False, 1.0) == 1.0
    assert stall_verdict(2.0, None, 2.0, True, 1.0) is None
    assert stall_verdict(2.0, 0.5, 2.0, True, 1.0) == 1.5   # the worker fed another stream 0.5 s ago


def test_peers_that_went_quiet_at_the_same_moment_are_no_better() -> None:
    f = paced_fleet(["a", "b"])
    f.of("a").last_token_at = 98.0
    f.of("b").last_token_at = 98.001     # the whole fleet slowed down at once: b is quiet as long as a
    assert f.judge("a", True, 2.0, None, 100.0, [("b", True)]) == S.recheck_s
