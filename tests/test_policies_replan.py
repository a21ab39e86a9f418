"""policies/replan.py: SeaLLM's adaptive re-placement interval (eq. 8), demands from traffic totals, and when a
re-plan moves the fleet (pure functions, no I/O)."""

from __future__ import annotations

import math

import pytest

from policies.planning import InstanceGroup, ServiceDemand, Slo, parse_stock
from policies.replan import (
    ModelTotals,
    closed_form_attainment,
    coverage,
    demands_between,
    group_key,
    next_interval,
    plan_capacity,
    plan_changes,
    replan,
)

SLO = Slo(1.0, 0.05)
A100 = parse_stock(["a100:16"])


def test_interval_grows_while_estimate_and_achievement_agree_and_shrinks_when_they_part() -> None:
    assert next_interval(10.0, 0.95, 0.93) == pytest.approx(11.0)      # gap 2 % < β = 10 %: (1 + β) I
    assert next_interval(10.0, 0.95, 0.60) == pytest.approx(9.0)       # gap 37 % > β: (1 - β) I
    assert next_interval(10.0, 0.95, 0.95, beta=0.2) == pytest.approx(12.0)
    assert next_interval(10.0, 0.5, 0.75, beta=0.5) == 10.0            # gap exactly β: unchanged
    assert next_interval(10.0, 0.95, 0.95, lo_s=1, hi_s=10.5) == 10.5  # clamped to the bounds
    assert next_interval(2.0, 0.95, 0.1, lo_s=1.9) == 1.9
    assert next_interval(10.0, 0.0, 0.5) == 10.0 and next_interval(10.0, math.nan, 0.5) == 10.0
    with pytest.raises(ValueError):
        next_interval(10.0, 0.9, 0.9, beta=1.5)


def test_demands_are_rates_and_mean_lengths_over_the_window() -> None:
    before = {"llama3-8b": ModelTotals(10, 8, 8000, 8_000_000, 800)}
    after = {"llama3-8b": ModelTotals(70, 58, 58000, 58_000_000, 5800), "llama2-7b": ModelTotals(5, 2, 200, 2e4, 20)}
    got = {d.model: d for d in demands_between(before, after, 20.0, min_finished=5)}
    a = got["llama3-8b"]
    assert (a.rate, a.mean_input, a.mean_output, a.input_sq) == (3.0, 1000.0, 100.0, 1e6)
    assert "llama2-7b" not in got           # 2 finished < 5, and no earlier lengths to fall back on
    fallback = {"llama2-7b": ServiceDemand("llama2-7b", 1.0, 300.0, 50.0)}
    b = {d.model: d for d in demands_between(before, after, 20.0, 5, fallback)}["llama2-7b"]
    assert (b.rate, b.mean_input, b.mean_output) == (0.25, 300.0, 50.0)


def test_a_rate_step_grows_the_model_and_a_fall_shrinks_it_back_and_noise_changes_nothing() -> None:
    base = [ServiceDemand("llama3-8b", 4.0, 1000, 100), ServiceDemand("llama2-7b", 2.0, 1000, 100)]
    first = replan(base, A100, SLO, [])
    assert first.changed and {g.model for g in first.groups} == {"llama3-8b", "llama2-7b"}
    assert coverage(plan_capacity(first.groups, base, SLO), base) >= 1.0
    assert first.estimated_attainment == 0.95
    same = replan([ServiceDemand("llama3-8b", 4.4, 1000, 100), base[1]], A100, SLO, first.groups)
    assert not same.changed and same.groups == first.groups              # +10 % is covered: no flapping
    step = [ServiceDemand("llama3-8b", 12.0, 1000, 100), base[1]]
    grown = replan(step, A100, SLO, first.groups)
    gpus = lambda r, m: sum(g.gpus for g in r.groups if g.model == m)  # noqa: E731
    assert grown.changed and gpus(grown, "llama3-8b") > gpus(first, "llama3-8b")
    assert gpus(grown, "llama2-7b") == gpus(first, "llama2-7b")
    assert "covers" in grown.reason and coverage(plan_capacity(grown.groups, step, SLO), step) >= 1.0
    idle = replan([ServiceDemand("llama3-8b", 12.0, 1000, 100), ServiceDemand("llama2-7b", 0.0, 1000, 100)],
                  A100, SLO, first.groups)                     # a model without traffic keeps its instances
    assert idle.changed and gpus(idle, "llama2-7b") == gpus(first, "llama2-7b")
    assert gpus(idle, "llama3-8b") > gpus(first, "llama3-8b")
    back = replan(base, A100, SLO, grown.groups)
    assert back.changed and "cheaper" in back.reason and back.cost_per_hour < grown.cost_per_hour


def test_changes_capacity_and_estimates() -> None:
    g1 = InstanceGroup("llama3-8b", "a100", 1, 2, price_per_gpu_hour=1.8)
    g2 = InstanceGroup("llama3-8b", "a100", 2, 1, price_per_gpu_hour=1.8)
    assert group_key(g1) == "llama3-8b/a100/tp1/mixed"
    assert plan_changes([g1], [g2]) == {"llama3-8b/a100/tp1/mixed": -2, "llama3-8b/a100/tp2/mixed": 1}
    d = [ServiceDemand("llama3-8b", 1.0, 1000, 100)]
    assert plan_capacity([g1], d, SLO)["llama3-8b"] == pytest.approx(2 * plan_capacity([g1.__class__(
        "llama3-8b", "a100", 1, 1)], d, SLO)["llama3-8b"])
    assert closed_form_attainment(1.2, 0.95) == 0.95 and closed_form_attainment(0.5, 0.9) == pytest.approx(0.45)
    # Too little stock for any plan: the current one stays.
    tiny = replan([ServiceDemand("llama2-70b", 5.0, 1000, 100)], parse_stock(["l4:1"]), SLO, [g1])
    assert not tiny.changed and tiny.groups == (g1,)
