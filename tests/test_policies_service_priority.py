"""Service-aware priority (policies/service_priority.py): SeaLLM's doubling budget (section 4.2, Algorithm 2 of
appendix A.2) and the FCFS / round-robin baselines. Expected values are worked out by hand from the paper's rules."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from policies.service_priority import (
    DoublingBudgetScheduler,
    RoundRobinScheduler,
    ServiceProfile,
    ServiceScheduler,
    execution_cost,
    make_service_scheduler,
)


def order(s: ServiceScheduler, ids: list[str], now: float) -> list[str]:
    return sorted(ids, key=lambda r: s.key(r, now))


def teach(s: ServiceScheduler, service: str, costs: list[int], now: float = 0.0) -> None:
    """Finish one request per cost (prompt of 0 tokens: the cost is the output length)."""
    for i, c in enumerate(costs):
        rid = f"hist-{service}-{i}-{c}"
        s.arrived(rid, service, now)
        s.finished(rid, 0, c, now)


def test_profile_is_welford_then_ewma():
    xs = [random.Random(3).uniform(0, 100) for _ in range(50)]
    p = ServiceProfile(max_samples=1000)
    for x in xs:
        p.observe(x)
    assert p.expected == pytest.approx(statistics.fmean(xs))
    assert p.spread == pytest.approx(statistics.pstdev(xs))
    # Past max_samples the weight stays 1/max_samples: a shift to a new level is followed.
    q = ServiceProfile(max_samples=10)
    for _ in range(10):
        q.observe(100.0)
    for _ in range(30):
        q.observe(200.0)
    assert q.expected == pytest.approx(200 - 100 * 0.9 ** 30)


def test_profile_prior_before_any_sample():
    p = ServiceProfile(prior=50.0)
    assert (p.expected, p.spread) == (50.0, 50.0)
    p.observe(10.0)
    assert (p.expected, p.spread) == (10.0, 0.0)


def test_execution_cost_counts_prefill_in_decode_iterations():
    assert execution_cost(512, 10, prompt_token_cost=1 / 256) == pytest.approx(12.0)
    assert execution_cost(512, 10, prompt_token_cost=0.0) == 10.0


def test_budget_is_mean_plus_spread_and_priority_budget_times_mean():
    s = DoublingBudgetScheduler(prompt_token_cost=0.0)
    teach(s, "chat", [10, 30])          # L̂ = 20, Var (std) = 10 -> Q = 30
    s.arrived("r", "chat", 1.0)
    assert s.budget("r") == (30.0, 30.0)
    assert s.order("r") == 30.0 * 20.0
    s.progressed("r", 0, 12, 1.5)       # 12 of the 30 used: Q_r = 18
    assert s.budget("r") == (30.0, 18.0)
    assert s.order("r") == 18.0 * 20.0
    assert s.engine_priority("r", 1.5) == 1 + 360


def test_budget_doubles_each_time_it_is_used_up():
    s = DoublingBudgetScheduler(prompt_token_cost=0.0)
    teach(s, "chat", [10, 30])          # Q = 30
    s.arrived("r", "chat", 0.0)
    s.progressed("r", 0, 30, 0.1)       # the first budget is used up: Q' = 2 x 30, all of it left
    assert s.budget("r") == (60.0, 60.0)
    assert s.order("r") == 60.0 * 20.0
    s.progressed("r", 0, 80, 0.2)       # 50 of 60 used
    assert s.budget("r") == (60.0, 10.0)
    s.progressed("r", 0, 200, 0.3)      # 30 + 60 + 120 = 210 > 200: third budget (120), 110 used of it
    assert s.budget("r") == (120.0, 10.0)
    assert s.order("r") == 10.0 * 20.0


def test_short_service_goes_first_and_a_nearly_done_long_request_overtakes():
    s = DoublingBudgetScheduler(prompt_token_cost=0.0)
    teach(s, "code", [10, 20, 30])       # L̂ = 20, std = 8.165: Q = 28.2, O = 563
    teach(s, "essay", [400, 600])        # L̂ = 500, std = 100: Q = 600, O = 300000
    s.arrived("e", "essay", 0.0)
    s.arrived("c", "code", 1.0)
    assert order(s, ["e", "c"], 1.0) == ["c", "e"]        # FCFS would run e first
    s.progressed("e", 0, 599, 1.0)       # e has 1 of its 600 left: O = 500 < 563
    assert s.order("e") == pytest.approx(500.0)
    assert order(s, ["e", "c"], 1.0) == ["e", "c"]


def test_starved_request_goes_first_per_service_threshold():
    s = DoublingBudgetScheduler(prompt_token_cost=0.0, starvation_s={"essay": 5.0}, default_starvation_s=60.0)
    teach(s, "code", [10, 30])
    teach(s, "essay", [400, 600])
    s.arrived("e", "essay", 0.0)
    s.arrived("c", "code", 3.0)
    assert order(s, ["e", "c"], 4.9) == ["c", "e"]
    assert not s.starved("e", 4.9) and s.starved("e", 5.0)
    assert order(s, ["e", "c"], 5.0) == ["e", "c"]
    assert s.engine_priority("e", 5.0) == 0
    s.progressed("e", 0, 1, 5.0)         # it ran, and keeps the lead until it finishes
    assert order(s, ["e", "c"], 6.0) == ["e", "c"]
    # code's threshold is the default (60 s): after 60 s without progress c is starved too, and the older goes first.
    assert not s.starved("c", 62.9)
    assert order(s, ["c", "e"], 63.0) == ["e", "c"] and s.starved("c", 63.0)
    s.arrived("c2", "code", 63.0)
    s.progressed("c2", 0, 1, 100.0)      # progress restarts the clock of a request not yet starved
    assert not s.starved("c2", 159.0) and s.starved("c2", 160.0)


def test_finished_requests_teach_the_profile_and_budgets_freeze_at_arrival():
    s = DoublingBudgetScheduler(prompt_token_cost=0.0, prior_cost=100.0)
    s.arrived("a", "chat", 0.0)
    assert s.budget("a") == (200.0, 200.0)   # prior: L̂ = 100, spread 100
    s.finished("a", 0, 40, 1.0)
    s.arrived("b", "chat", 1.0)
    assert s.budget("b") == (40.0, 40.0)     # one sample: L̂ = 40, std 0
    s.arrived("x", "chat", 1.0)
    s.finished("x", 0, 999, 2.0, completed=False)   # aborted: not learned
    assert s.profile("chat").n == 1
    assert s.budget("b") == (40.0, 40.0)


def test_fcfs_is_arrival_order_whatever_the_service():
    s = make_service_scheduler("fcfs")
    teach(s, "long", [1000])
    teach(s, "short", [1])
    s.arrived("l", "long", 0.0)
    s.arrived("s", "short", 0.5)
    assert order(s, ["s", "l"], 1.0) == ["l", "s"]
    assert s.engine_priority("s", 1.0) == s.engine_priority("l", 1.0) == 0


def test_round_robin_alternates_services_and_saves_no_turns():
    s = RoundRobinScheduler()
    for i in range(3):
        s.arrived(f"a{i}", "A", float(i))
    s.arrived("b0", "B", 3.0)
    s.arrived("b1", "B", 3.1)
    assert order(s, ["a0", "a1", "a2", "b0", "b1"], 4.0) == ["a0", "b0", "a1", "b1", "a2"]
    assert [s.engine_priority(r, 4.0) for r in ("a0", "b0", "a1", "b1", "a2")] == [1, 1, 2, 2, 3]
    # All were sent (the last at turn 3); a new service joins at the current turn, not at turn 1, and A, which
    # just had its turn, comes after it.
    for r in ("a0", "b0", "a1", "b1", "a2"):
        s.started(r, 5.0)
        s.finished(r, 0, 1, 5.0)
    s.arrived("c0", "C", 6.0)
    s.arrived("a3", "A", 6.0)
    assert s.engine_priority("c0", 6.0) == 3 and s.engine_priority("a3", 6.0) == 4
    assert order(s, ["a3", "c0"], 6.0) == ["c0", "a3"]


def test_unknown_names_and_bad_parameters():
    with pytest.raises(ValueError, match="unknown service priority"):
        make_service_scheduler("lottery")
    with pytest.raises(ValueError):
        make_service_scheduler("seallm", default_starvation_s=0.0)
    with pytest.raises(ValueError):
        make_service_scheduler("fcfs", prior_cost=0.0)
    s = make_service_scheduler("seallm")
    assert s.key("nobody", 0.0) == (math.inf, math.inf)
    s.progressed("nobody", 1, 1, 0.0)    # unknown ids are ignored
    s.finished("nobody", 1, 1, 0.0)
    assert len(s) == 0
