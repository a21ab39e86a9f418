"""The Virtual Token Counter (policies/service_priority.py, Sheng et al., OSDI 2024, Algorithm 2): counters, the lift
of a tenant returning from idle, weights and the queue order. Expected values are worked out by hand from the rules:
a counter grows by (prompt x w_in + output x w_out) / weight, w_in = 1 and w_out = 2 by default."""

from __future__ import annotations

import pytest

from policies.service_priority import VirtualTokenCounterScheduler, make_service_scheduler


def order(s: VirtualTokenCounterScheduler, ids: list[str], now: float = 0.0) -> list[str]:
    return sorted(ids, key=lambda r: s.key(r, now))


def serve(s: VirtualTokenCounterScheduler, rid: str, tenant: str, prompt: int, output: int) -> None:
    """One request arrives, starts and finishes."""
    s.arrived(rid, tenant, 0.0, prompt_tokens=prompt)
    s.started(rid, 0.0)
    s.finished(rid, prompt, output, 0.0)


def test_counter_charges_input_at_start_and_output_as_reported():
    s = make_service_scheduler("vtc")
    assert isinstance(s, VirtualTokenCounterScheduler)
    s.arrived("a", "alice", 0.0, prompt_tokens=100)
    assert s.counter("alice") == 0.0 and s.backlogged("alice")
    s.started("a", 0.1)
    assert s.counter("alice") == 100.0 and not s.backlogged("alice")
    s.progressed("a", 100, 10, 0.2)
    assert s.counter("alice") == 100.0 + 2 * 10
    s.progressed("a", 100, 10, 0.3)          # no new token: no charge
    assert s.counter("alice") == 120.0
    s.finished("a", 100, 25, 0.4)            # the 15 tokens not yet reported
    assert s.counter("alice") == 100.0 + 2 * 25
    assert len(s) == 0


def test_finish_without_start_charges_everything_once():
    s = make_service_scheduler("vtc", input_weight=0.5, output_weight=3.0)
    s.arrived("a", "alice", 0.0, prompt_tokens=40)
    s.finished("a", 40, 7, 1.0)
    assert s.counter("alice") == 40 * 0.5 + 7 * 3.0
    s.finished("a", 40, 7, 1.0)              # unknown now: nothing more
    assert s.counter("alice") == 41.0


def together(s: VirtualTokenCounterScheduler, reqs: list[tuple[str, str, int, int]]) -> None:
    """Requests (id, tenant, prompt, output) that all arrive before any starts, then run to their finish."""
    for rid, tenant, prompt, _ in reqs:
        s.arrived(rid, tenant, 0.0, prompt_tokens=prompt)
    for rid, _, prompt, output in reqs:
        s.started(rid, 0.0)
        s.finished(rid, prompt, output, 0.0)


def test_weights_divide_the_charge():
    s = make_service_scheduler("vtc", weights={"gold": 2.0})
    together(s, [("g", "gold", 100, 50), ("b", "bronze", 100, 50)])
    assert s.counter("gold") == (100 + 2 * 50) / 2
    assert s.counter("bronze") == 100 + 2 * 50


def test_backlogged_tenants_are_served_by_smallest_counter():
    s = make_service_scheduler("vtc")
    together(s, [("h0", "heavy", 500, 100), ("l0", "light", 100, 50)])   # heavy: 700, light: 200
    for i in range(3):
        s.arrived(f"h{i + 1}", "heavy", 1.0, prompt_tokens=10)
    s.arrived("l1", "light", 1.1, prompt_tokens=10)
    # light went idle with the smaller counter, returns while heavy is backlogged: lifted to max(200, 700) = 700.
    assert s.counter("light") == 700.0
    # Keys: heavy's queued requests 700, 710, 720 (the input of those ahead); light's 700 and later than h1.
    assert order(s, ["h1", "h2", "h3", "l1"]) == ["h1", "l1", "h2", "h3"]


def test_light_tenant_overtakes_a_backlog_fcfs_does_not():
    for name, expected in [("vtc", ["h1", "l1", "h2", "h3", "h4"]), ("fcfs", ["h1", "h2", "h3", "h4", "l1"])]:
        s = make_service_scheduler(name)
        for i in range(4):
            s.arrived(f"h{i + 1}", "heavy", float(i), prompt_tokens=100)
        s.arrived("l1", "light", 10.0, prompt_tokens=100)
        assert order(s, ["h1", "h2", "h3", "h4", "l1"]) == expected, name


def test_lift_is_only_upwards_and_only_from_idle():
    s = make_service_scheduler("vtc")
    serve(s, "a0", "a", 1000, 0)             # a: 1000
    s.arrived("b1", "b", 0.0, prompt_tokens=10)   # b idle, a not backlogged, a left the queue last: lifted to 1000
    assert s.counter("b") == 1000.0
    s.arrived("c1", "c", 0.0, prompt_tokens=10)   # c returns while b is backlogged at 1000
    assert s.counter("c") == 1000.0
    s.started("b1", 0.0)                     # b: 1010
    s.arrived("b2", "b", 0.0, prompt_tokens=10)   # backlogged c at 1000 < 1010: no lift downwards
    assert s.counter("b") == 1010.0
    s.arrived("c2", "c", 0.0, prompt_tokens=10)   # c already backlogged: no lift
    assert s.counter("c") == 1000.0


def test_a_returning_tenant_cannot_bank_credit():
    """Idle for a long time, a tenant returns with no more than the backlogged tenants' service to catch up: its
    requests alternate with the busy tenant's instead of all going first."""
    s = make_service_scheduler("vtc")
    together(s, [("q0", "quiet", 10, 0), ("b0", "busy", 100, 0)])   # quiet: 10, busy: 100
    for i in range(1, 50):
        serve(s, f"b{i}", "busy", 100, 0)    # busy: 5000, quiet idle all along
    for i in range(4):
        s.arrived(f"bq{i}", "busy", 1.0, prompt_tokens=100)
    for i in range(4):
        s.arrived(f"qq{i}", "quiet", 2.0, prompt_tokens=100)
    assert s.counter("quiet") == s.counter("busy") == 5000.0
    got = order(s, [f"bq{i}" for i in range(4)] + [f"qq{i}" for i in range(4)])
    assert got == ["bq0", "qq0", "bq1", "qq1", "bq2", "qq2", "bq3", "qq3"]


def test_forget_releases_the_queue_without_charge():
    s = make_service_scheduler("vtc")
    s.arrived("a", "alice", 0.0, prompt_tokens=100)
    s.forget("a")
    assert s.counter("alice") == 0.0 and not s.backlogged("alice") and len(s) == 0


def test_engine_priority_and_no_preemption():
    s = make_service_scheduler("vtc")
    serve(s, "a0", "alice", 99, 3)           # 105
    s.arrived("a1", "alice", 0.0, prompt_tokens=10)
    s.started("a1", 0.0)                     # 115.0
    assert s.engine_priority("a1", 0.0) == 115
    assert s.engine_priority("unknown", 0.0) == 0
    assert not s.preemptible("a1", 0.0)


def test_bad_parameters():
    with pytest.raises(ValueError, match="weights"):
        make_service_scheduler("vtc", weights={"x": 0.0})
    with pytest.raises(ValueError, match="input_weight"):
        make_service_scheduler("vtc", input_weight=-1.0)


def test_an_empty_scheduler_is_still_given():
    """Callers test `if service_priority` for "a scheduler was given": one tracking no request must pass."""
    s = make_service_scheduler("vtc")
    assert len(s) == 0 and bool(s)


def light_runs_then_heavy_backlogs(s: VirtualTokenCounterScheduler, heavy_prompt: int) -> None:
    """light's request r starts at t=0 (light at 10); then heavy runs one request of `heavy_prompt` tokens and
    queues another, so heavy is backlogged at 10 + heavy_prompt (its own lift took it to light's counter)."""
    s.arrived("r", "light", 0.0, prompt_tokens=10)
    s.started("r", 0.0)
    s.arrived("h0", "heavy", 0.0, prompt_tokens=heavy_prompt)
    s.started("h0", 0.0)
    s.arrived("h1", "heavy", 0.0, prompt_tokens=10)
    assert (s.counter("light"), s.counter("heavy")) == (10.0, 10.0 + heavy_prompt)


def test_output_charged_at_the_finish_is_not_paid_again_after_a_lift():
    """r runs from t=0 to t=2 and reports its 100 tokens only at the finish; at t=1 light comes back while heavy is
    backlogged at 1010 and is lifted to it. Charged per step, the 50 tokens made before the lift (100 units) would
    have been inside the max: light ends at 1010 + 2 x 50, not 1010 + 2 x 100."""
    s = make_service_scheduler("vtc")
    light_runs_then_heavy_backlogs(s, 1000)
    s.arrived("r2", "light", 1.0, prompt_tokens=10)           # the lift: 10 -> 1010 (slack 1000)
    assert s.counter("light") == 1010.0
    s.finished("r", 10, 100, 2.0)
    assert s.counter("light") == pytest.approx(1010.0 + 2 * 50)


def test_per_step_reports_are_unchanged_by_a_lift_and_a_small_slack_absorbs_only_itself():
    s = make_service_scheduler("vtc")
    light_runs_then_heavy_backlogs(s, 500)
    s.progressed("r", 10, 100, 1.0)                           # 200 units reported up to t=1: light at 210
    s.arrived("r2", "light", 1.0, prompt_tokens=10)           # lifted to 510; nothing made before it is unpaid
    s.finished("r", 10, 150, 2.0)                             # 50 tokens made after the lift: paid in full
    assert s.counter("light") == pytest.approx(510.0 + 2 * 50)
    # a lift smaller than what was made before it absorbs only its own slack
    s2 = make_service_scheduler("vtc")
    light_runs_then_heavy_backlogs(s2, 60)
    s2.arrived("r2", "light", 1.0, prompt_tokens=10)          # lifted 10 -> 70 (slack 60)
    s2.finished("r", 10, 100, 2.0)                            # 100 units made before the lift: 60 absorbed
    assert s2.counter("light") == pytest.approx(70.0 + 200.0 - 60.0)   # = max(10 + 100, 70) + 100
