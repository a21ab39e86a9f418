"""bench/autoscale.py: how the band's settings are chosen and how Chiron is compared with them."""

from __future__ import annotations

import pytest

from bench.autoscale import (
    band_arm,
    choose_static_cap,
    headline,
    iso_slo_comparator,
    meets,
    pareto_front,
    saving,
)
from simulator.autoscale_sim import ArmResult


def _r(arm: str, gpu: float, slo: float, on_time: float | None = 1.0) -> ArmResult:
    return ArmResult("W_B-x", arm, gpu, {"slo_attainment": slo}, {"on_time": on_time}, 0, {}, [], 0.0)


def test_the_comparator_is_the_cheapest_setting_at_equal_or_better_slo():
    chiron = _r("chiron", 60_000, 0.990, 1.0)
    band = [_r("cheap but worse SLO", 40_000, 0.950), _r("equal SLO", 80_000, 0.990),
            _r("better SLO, cheaper", 70_000, 0.995), _r("better SLO, late batch", 50_000, 0.999, 0.98),
            _r("best, dearest", 95_000, 1.0)]
    comp, ok = iso_slo_comparator(chiron, band)
    assert ok and comp.arm == "better SLO, cheaper"       # not the cheapest overall, not one with late batch work
    assert saving(chiron, comp) == pytest.approx(1 - 60 / 70)
    assert meets(band[1], chiron) and not meets(band[0], chiron) and not meets(band[3], chiron)


def test_without_a_setting_at_chirons_slo_the_best_slo_one_is_named_and_flagged():
    chiron = _r("chiron", 60_000, 0.995)
    band = [_r("a", 50_000, 0.93), _r("b", 90_000, 0.96), _r("c", 70_000, 0.96), _r("d", 40_000, 0.99, 0.9)]
    comp, ok = iso_slo_comparator(chiron, band)
    assert not ok and comp.arm == "c"          # best SLO among those with all batch work on time, the cheaper of two
    with pytest.raises(ValueError):
        iso_slo_comparator(chiron, [])


def test_interactive_only_workloads_compare_on_interactive_slo_alone():
    assert meets(_r("band", 1, 0.99, None), _r("chiron", 1, 0.98, None))


def test_static_cap_maximises_mean_slo_and_ties_go_to_the_larger_cap():
    assert choose_static_cap({64: [0.90, 0.80], 128: [0.95, 0.90], 256: [0.93, 0.80]}) == 128
    assert choose_static_cap({64: [0.99, 0.99], 256: [0.99, 0.988], 1024: [0.985, 0.99]}) == 1024
    assert choose_static_cap({64: [0.99], 1024: [0.97]}) == 64
    with pytest.raises(ValueError):
        choose_static_cap({})


def test_pareto_front_drops_dominated_settings():
    a, b, c, d = _r("a", 10, 0.90), _r("b", 20, 0.95), _r("c", 25, 0.94), _r("d", 30, 0.99, 0.5)
    assert [r.arm for r in pareto_front([d, c, b, a])] == ["a", "b", "d"]


def test_band_labels_name_a_cap_only_when_it_is_not_vllms_default():
    assert band_arm(0.3, 0.7, 256, 256).name == "utilization 0.3-0.7"
    arm = band_arm(0.05, 0.5, 1024, 256)
    assert arm.name == "utilization 0.05-0.5 cap 1024" and arm.static_cap == 1024 and arm.util_low == 0.05


def test_headline_states_whether_the_target_is_met():
    from bench.autoscale import MODELS, ModelResults, WorkloadResults
    from simulator.autoscale_sim import Scenario

    chiron, swap = _r("chiron", 60_000, 0.99), _r("chiron swap", 59_000, 0.99)
    default, ok = _r("utilization 0.3-0.7", 70_000, 0.95), _r("utilization 0.05-0.3", 100_000, 0.995)
    w = WorkloadResults(Scenario("W_B-x", []), [chiron, swap, default, ok], [default, ok])
    lines = headline([ModelResults(MODELS[0], 256, 256, {}, {}, [], [w])])
    assert "chiron: met on 1 of 1 W_B workloads** (W_B-x)" in lines[0]      # 40% below 100k at better SLO
    assert "+40.0%" in "\n".join(lines)
    w.band = [default]
    lines = headline([ModelResults(MODELS[0], 256, 256, {}, {}, [], [w])])
    assert "met on 0 of 1" in lines[0] and "None of the 1 band settings reaches its SLOs" in "\n".join(lines)


def test_gpu_seconds_after_integrates_the_timeline_from_a_time_on():
    from bench.autoscale import gpu_seconds_after

    r = _r("x", 0, 1.0)
    r.timeline = [{"t": 0.0, "workers": 4}, {"t": 100.0, "workers": 2}, {"t": 200.0, "workers": 1}]
    assert gpu_seconds_after(r, 150.0, 300.0, 2) == pytest.approx(2 * (2 * 50 + 1 * 100))
    assert gpu_seconds_after(r, 0.0, 300.0, 1) == pytest.approx(400 + 200 + 100)


def test_near_comparator_allows_a_small_slo_shortfall_but_no_late_batch_work():
    from bench.autoscale import near_comparator

    chiron = _r("chiron", 12_000, 1.000)
    band = [_r("strict", 18_000, 1.000), _r("a few short", 13_500, 0.9996), _r("late", 11_000, 1.0, 0.99),
            _r("far", 9_000, 0.98)]
    assert near_comparator(chiron, band).arm == "a few short"
    assert near_comparator(chiron, band[2:]) is None
