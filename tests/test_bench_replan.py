"""Smoke versions of bench/replan.py (SeaLLM's diurnal setting), so it does not rot."""

from __future__ import annotations

from bench import replan as br
from policies.replan import group_key


def test_the_diurnal_workload_follows_the_stated_multiplier() -> None:
    work = br.diurnal_workload(1200.0, seed=3)
    assert set(work) == {m for m, _, _ in br.SERVICES}
    for s, (model, _, base) in enumerate(br.SERVICES):
        reqs = work[model]
        assert reqs == sorted(reqs, key=lambda r: r.arrival) and reqs[0].arrival >= 0 and reqs[-1].arrival < 1200
        expected = sum(base * br.multiplier(t + 0.5, s, len(br.SERVICES), day=1200.0) for t in range(1200))
        assert abs(len(reqs) - expected) < 5 * expected ** 0.5       # Poisson: within 5 standard deviations
        peak = max(range(12), key=lambda k: br.multiplier(100 * k + 50, s, len(br.SERVICES), day=1200.0))
        trough = min(range(12), key=lambda k: br.multiplier(100 * k + 50, s, len(br.SERVICES), day=1200.0))
        per_100s = [0] * 12
        for r in reqs:
            per_100s[int(r.arrival // 100)] += 1
        assert per_100s[peak] > 2 * per_100s[trough]


def test_re_placement_follows_the_traffic_and_adaptive_intervals_stay_in_bounds() -> None:
    day = 600.0
    work = br.diurnal_workload(day, seed=0)
    initial = br.initial_plan(work, day)
    assert {g.model for g in initial} == set(work)
    fixed = br.run_arm(br.Arm("fixed placement", "fixed-placement"), work, initial, day, 0)
    every = br.run_arm(br.Arm("every 60 s", "fixed", 60.0), work, initial, day, 0)
    adaptive = br.run_arm(br.Arm("adaptive", "adaptive", 60.0, metric="attainment"), work, initial, day, 0)
    assert fixed.replacements == 0 and fixed.rounds == 0
    assert every.rounds == 9 and every.replacements >= 1               # the plan moved with the rates
    assert every.normalized_latency < fixed.normalized_latency          # and that helped
    assert all(br.ADAPTIVE["lo"] <= i <= br.ADAPTIVE["hi"] for _, i in adaptive.intervals)
    for a in (fixed, every, adaptive):
        assert 0 < a.attainment <= 1 and a.gpu_hours > 0
    assert every.gpu_hours >= sum(g.gpus for g in initial) * day / 3600 * 0.5
    assert all("/a100/" in group_key(g) for g in initial)
