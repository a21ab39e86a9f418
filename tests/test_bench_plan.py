"""Smoke versions of bench/plan.py's experiments, so they do not rot."""

from __future__ import annotations

from dataclasses import replace

from bench import plan as bp
from policies.planning import InstanceGroup
from simulator.deployment import DeploymentRun, ServiceShare, simulate_deployment


def test_tp_ranking_rows_are_measured_for_every_degree() -> None:
    rows = bp.tp_ranking(24, [1])
    assert [r.tp for r in rows] == [1, 2, 4, 8]
    assert all(r.sim_tokens_per_s[0] > 0 and r.alg1_tokens_per_s[0] > 0 and r.closed_form_rps > 0 for r in rows)


def test_rate_at_slo_finds_a_rate_that_meets_the_target_and_a_higher_one_that_does_not() -> None:
    groups = [InstanceGroup("llama3-8b", "h100", 1, 1)]
    services = [ServiceShare("llama3-8b", 1.0)]
    run = DeploymentRun(trace="sharegpt", duration=20.0, slo_ttft_s=1.0, slo_tpot_s=0.05)
    rate, att = bp.rate_at_slo(groups, services, run, 2.0, steps=3)
    assert rate > 0 and att >= bp.TARGET
    over = simulate_deployment(groups, services, replace(run, rate=rate * 3)).summary()
    assert over["slo_attainment"] < bp.TARGET


def test_exhaustive_search_returns_the_fewest_gpus_that_meet_the_target() -> None:
    services = [ServiceShare("llama3-8b", 1.0)]
    run = DeploymentRun(trace="sharegpt", rate=3.0, duration=20.0, slo_ttft_s=1.0, slo_tpot_s=0.05)
    gpus, shape = bp.exhaustive("llama3-8b", services, run, 8)
    assert gpus is not None and 1 <= gpus <= 8 and "TP" in shape
