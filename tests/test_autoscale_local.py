"""Chiron's local autoscaler (Algorithm 1): formula, bounds, TBP rules, convergence."""

from __future__ import annotations

import math

import pytest

from policies.autoscale.local import LocalAutoscaler, LocalConfig, ewma_growth


def test_ewma_growth_is_algorithm_1_line_10():
    # alpha * (1/bp) * cap + (1 - alpha) * cap with alpha = 0.5, bp = 0.8, cap = 40: 25 + 20 = 45
    assert ewma_growth(40.0, 0.8) == pytest.approx(45.0)
    assert ewma_growth(40.0, 0.25, max_growth=2.0) == pytest.approx(80.0)     # 100 bounded to 2x
    assert ewma_growth(40.0, 0.0, max_growth=2.0) == pytest.approx(80.0)


def test_grows_below_one_and_halves_at_or_above_one():
    la = LocalAutoscaler(LocalConfig(itl_slo_s=0.2, initial_cap=20, max_cap=1000, settle_windows=0))
    la.observe(itl_s=0.1, tokens_per_s=100.0, saturated=True)       # LBP 0.5 -> 0.5*20/0.5 + 10 = 30
    assert la.update(0.0) == 30 and la.lbp == pytest.approx(0.5) and la.tbp is None
    la.observe(itl_s=0.2, tokens_per_s=150.0, saturated=True)       # LBP 1.0 -> halve
    assert la.update(1.0) == 15
    la.observe(itl_s=0.5, tokens_per_s=150.0, saturated=False)      # halves also when not binding
    assert la.update(2.0) == 7


def test_throughput_backpressure_only_after_an_increase_while_binding():
    la = LocalAutoscaler(LocalConfig(itl_slo_s=1.0, initial_cap=16, max_cap=1000, settle_windows=0))
    la.observe(itl_s=0.1, tokens_per_s=1000.0, saturated=True)
    assert la.update(0) == 32                                       # LBP 0.1 -> growth capped at 2x
    la.observe(itl_s=0.1, tokens_per_s=800.0, saturated=True)       # bigger cap, less throughput
    assert la.update(1) == 16 and la.tbp == pytest.approx(1.25)     # TBP 1000/800 > 1: halve
    la.observe(itl_s=0.1, tokens_per_s=500.0, saturated=True)       # after a decrease TBP is not formed
    assert la.update(2) == 32 and la.tbp is None


def test_holds_without_signal_or_when_not_binding_and_respects_bounds():
    la = LocalAutoscaler(LocalConfig(itl_slo_s=0.2, min_cap=4, max_cap=40, initial_cap=30, settle_windows=0))
    la.observe(itl_s=None, tokens_per_s=None)
    assert la.update(0) == 30                                       # no signal: hold
    la.observe(itl_s=0.02, tokens_per_s=10.0, saturated=False)
    assert la.update(1) == 30                                       # cap not binding: no growth
    la.observe(itl_s=0.02, tokens_per_s=10.0, saturated=True)
    assert la.update(2) == 40                                       # max_cap
    for t in range(10):
        la.observe(itl_s=1.0, saturated=True)
        la.update(3 + t)
    assert la.cap == 4                                              # min_cap


def test_converges_to_the_slo_cap_under_a_linear_itl_model():
    # ITL(c) = a + b*c; the cap where ITL == SLO is c* = (slo - a) / b = 60. From below the EWMA update
    # approaches c* monotonically (Algorithm 1's fixed point is bp == 1).
    a, b, slo = 0.02, 0.003, 0.2
    target = (slo - a) / b
    la = LocalAutoscaler(LocalConfig(itl_slo_s=slo, initial_cap=4, max_cap=4096, settle_windows=0))
    caps = []
    for t in range(60):
        la.observe(itl_s=a + b * la.cap, saturated=True)
        caps.append(la.update(float(t)))
    assert all(c <= target for c in caps)
    assert caps == sorted(caps)
    assert target - 1 <= caps[-1] <= target


def test_settle_window_skips_the_transient_after_a_change():
    la = LocalAutoscaler(LocalConfig(itl_slo_s=1.0, initial_cap=16, max_cap=1000, settle_windows=1))
    la.observe(itl_s=0.5, tokens_per_s=1000.0, saturated=True)
    assert la.update(0) == 24                                       # grew; the next window settles
    la.observe(itl_s=0.5, tokens_per_s=600.0, saturated=True)       # prefill dip right after the change
    assert la.update(1) == 24 and la.tbp is None
    la.observe(itl_s=0.5, tokens_per_s=1250.0, saturated=True)      # steady at the new cap: 1000/1250
    la.update(2)
    assert la.tbp == pytest.approx(0.8) and la.cap == 27            # bp 0.8: 0.5*24/0.8 + 0.5*24
    la.observe(itl_s=1.5, saturated=True)                           # settling, but the SLO is violated
    assert la.update(3) == 13                                       # 27 / 2


def test_itl_slo_override_and_bad_input():
    la = LocalAutoscaler(LocalConfig(itl_slo_s=2.0, initial_cap=10, settle_windows=0))
    la.observe(itl_s=0.3, saturated=True, itl_slo_s=0.2)           # an interactive request runs here
    assert la.update(0) == 5 and la.lbp == pytest.approx(1.5)
    with pytest.raises(ValueError):
        la.observe(itl_s=-1.0)
    with pytest.raises(ValueError):
        la.observe(tokens_per_s=math.nan)
    with pytest.raises(ValueError):
        LocalConfig(itl_slo_s=0)
    with pytest.raises(ValueError):
        LocalConfig(itl_slo_s=1, min_cap=10, max_cap=5)
    with pytest.raises(ValueError):
        LocalConfig(itl_slo_s=1, alpha=0)
