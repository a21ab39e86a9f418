"""The pipeline's pure core that the gateway and the simulator share: the admission queue's rules
(policies/admission.py) and the placement step (policies/placement.py)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from policies.admission import AdmissionQueue, queue_budget
from policies.base import Policy, make_policy
from policies.length_predictor import LengthPredictor
from policies.pd import PdPolicy
from policies.placement import TOO_LONG, ModelPlacement, servable
from policies.types import CLASS_BATCH, ROLE_DECODE, ROLE_PREFILL, Decision, RequestFeatures, WorkerView


def feats(i: int, prompt: int = 100, **kw) -> RequestFeatures:
    kw.setdefault("slo_ttft_s", 1.0)
    return RequestFeatures(f"r{i}", "m", prompt, **kw)


# --- admission queue --------------------------------------------------------------------------------
def drain(q: AdmissionQueue, fits: set[str]) -> list[str]:
    """One drain: place every candidate whose id is in `fits`; the ids placed, in order."""
    placed = []
    for w in q.candidates():
        if w.features.request_id in fits:
            q.remove(w)
            placed.append(w.features.request_id)
    return placed


def test_head_of_line_by_default_and_lookahead_past_a_head_that_does_not_fit() -> None:
    q = AdmissionQueue(10, lookahead=1, timeout_s=5)
    for i in range(4):
        q.enter(feats(i), 0.0)
    assert not q.admits_directly()              # somebody waits: a newcomer queues behind
    assert drain(q, {"r1", "r2"}) == []          # the head does not fit: nobody overtakes it
    assert drain(q, {"r0", "r1", "r3"}) == ["r0", "r1"]   # heads go one after another until one does not fit
    q = AdmissionQueue(10, lookahead=2, timeout_s=5)
    for i in range(4):
        q.enter(feats(i), 0.0)
    assert q.admits_directly() is False and len(q) == 4
    assert drain(q, {"r1", "r3"}) == ["r1"]      # r0 misses, r1 placed, r2 misses: two misses end the drain
    assert drain(q, {"r0", "r2", "r3"}) == ["r0", "r2", "r3"]
    assert q.admits_directly() and q.peak == 4


def test_deadlines_follow_the_ttft_budget_and_the_timeout() -> None:
    q = AdmissionQueue(10, lookahead=1, timeout_s=5.0)
    a = q.enter(feats(0, slo_ttft_s=0.6, arrival=10.0), 10.2)             # 0.4 s of its TTFT left
    b = q.enter(feats(1, slo_ttft_s=None, arrival=10.0), 10.2)            # no target: the timeout
    c = q.enter(feats(2, request_class=CLASS_BATCH, arrival=10.0), 10.2)  # batch waits the timeout
    assert (a.deadline, b.deadline, c.deadline) == (pytest.approx(10.6), 15.2, 15.2)
    assert "TTFT target of 600 ms" in a.reason and "5s" in b.reason
    a.retry_at = 10.45
    assert q.next_wake() == pytest.approx(10.45)
    assert q.expired(10.59) == [] and q.expired(10.6) == [a] and len(q) == 2
    assert queue_budget(feats(3, slo_ttft_s=0.5, arrival=0.0), 2.0, 5.0) == (0.0, pytest.approx(
        "its TTFT target of 500 ms passed while queued"))
    full = AdmissionQueue(1)
    full.enter(feats(4), 0.0)
    assert full.full()
    with pytest.raises(ValueError):
        AdmissionQueue(1, lookahead=0)


def test_a_waiter_removed_during_the_drain_is_skipped() -> None:
    q = AdmissionQueue(10, lookahead=3, timeout_s=5)
    ws = [q.enter(feats(i), 0.0) for i in range(3)]
    seen = []
    for w in q.candidates():
        seen.append(w.features.request_id)
        if w is ws[0]:
            q.remove(ws[1])   # e.g. its client left while the drain awaited
    assert seen == ["r0", "r2"] and len(q) == 2 and q.next_wake() == 1.0   # their TTFT deadlines


def test_a_request_that_found_no_worker_waits_for_a_change_not_for_the_next_poll() -> None:
    """Bounded decision cost: tried and not placed, a request is tried again only after `changed` (capacity may
    have been freed) or once its policy's retry_at came; polls in between skip it without asking the policy."""
    q = AdmissionQueue(10, lookahead=4, timeout_s=5)
    a = q.enter(feats(0), 0.0, tried=True)               # tried on arrival: found no worker
    b = q.enter(feats(1), 0.0)                           # queued behind others, never tried
    c = q.enter(feats(2), 0.0, retry_at=0.3)             # tried; its policy asked for 0.3 s
    assert [w.features.request_id for w in q.candidates(now=0.1)] == ["r1"]
    q.tried(b, False)
    assert list(q.candidates(now=0.2)) == [] and q.skipped == 2 + 3   # a poll: nothing changed for anybody
    assert [w.features.request_id for w in q.candidates(now=0.3)] == ["r2"]   # its retry time came
    q.tried(c, False, retry_at=None)
    q.changed()                                          # a completion: every one is worth a try again
    seen = [w.features.request_id for w in q.candidates(now=0.4)]
    assert seen == ["r0", "r1", "r2"]
    for w in (a, b, c):
        q.tried(w, False)
    assert list(q.candidates(now=0.5)) == []
    assert [w.features.request_id for w in q.candidates()] == ["r0", "r1", "r2"]   # no clock: every one, as before


# --- placement step -----------------------------------------------------------------------------------
class Log(Policy):
    """least_requests that logs every hook in order."""

    name = "log"

    def __init__(self) -> None:
        self.inner = make_policy("least_requests")
        self.calls: list[tuple] = []

    def choose(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float) -> Decision:
        self.calls.append(("choose", tuple(w.id for w in workers)))
        return self.inner.choose(request, workers, now)

    def on_dispatch(self, request: RequestFeatures, worker_id: str, now: float) -> None:
        self.calls.append(("dispatch", worker_id))

    def report_progress(self, request_id: str, tokens: int, now: float) -> None:
        self.calls.append(("progress", tokens))

    def observe_completion(self, request: RequestFeatures, output_tokens: int, now: float) -> None:
        self.calls.append(("completion", output_tokens))

    def on_complete(self, request: RequestFeatures, worker_id: str, now: float) -> None:
        self.calls.append(("complete", worker_id))


def test_feedback_reaches_the_policy_and_the_predictor_in_one_order() -> None:
    pol, pred = Log(), LengthPredictor()
    step = ModelPlacement(pol, observe_length=pred.observe)
    f = feats(0)
    d = step.place(f, [WorkerView("a"), WorkerView("b", inflight=2)], 0.0)
    assert d.worker_id == "a"
    step.dispatched(f, d, 0.0)
    step.progress(f, 1, 0.1)
    step.finished(f, "a", 42, 0.5)
    assert pol.calls == [("choose", ("a", "b")), ("dispatch", "a"), ("progress", 1), ("completion", 42),
                         ("complete", "a")]
    assert pred.count("m") == 1
    pol.calls.clear()
    step.finished(feats(1), "b", 0, 0.6)       # failed: no length, no completion report
    assert pol.calls == [("complete", "b")] and pred.count("m") == 1


def test_too_long_for_every_candidate_is_refused_not_placed() -> None:
    step = ModelPlacement(make_policy("round_robin"))
    ws = [WorkerView("a", max_model_len=4096), WorkerView("b", max_model_len=8192)]
    assert step.place(feats(0, 8192), ws, 0.0).reason == TOO_LONG
    assert step.place(feats(1, 5000), ws, 0.0).worker_id in ("a", "b")
    assert step.place(feats(2, 8000, max_tokens=500), ws, 0.0).reason == TOO_LONG  # prompt + max_tokens
    assert servable(feats(3, 10**6), None)      # a context limit nobody reported: the worker decides


def test_pd_is_a_profile_of_the_same_step() -> None:
    built: list[PdPolicy] = []

    def factory() -> PdPolicy:
        built.append(PdPolicy("least_requests", local_prefill_tokens=64))
        return built[-1]

    step = ModelPlacement(make_policy("least_requests"), factory)
    mixed = [WorkerView("m0"), WorkerView("m1")]
    assert step.place(feats(0, 500), mixed, 0.0).prefill_worker_id is None and not built  # no P/D fleet
    pd_fleet = [WorkerView("p0", role=ROLE_PREFILL), WorkerView("d0", role=ROLE_DECODE)]
    f = feats(1, 500)
    d = step.place(f, pd_fleet, 0.0)
    assert (d.worker_id, d.prefill_worker_id, d.reason) == ("d0", "p0", "disaggregated") and len(built) == 1
    assert step.dispatched(f, d, 0.0)   # the P/D profile placed it (the gateway keeps that in the request)
    short = feats(2, 10)
    d = step.place(short, pd_fleet, 0.0)
    assert (d.worker_id, d.prefill_worker_id, d.reason) == ("d0", None, "local_short")
    step.finished(f, "d0", 7, 1.0)
    assert f.request_id not in step._via_pd   # noqa: SLF001 - its ledger forgot the request
    # Without a P/D factory, prefill/decode workers are not candidates of a plain policy.
    plain = ModelPlacement(make_policy("least_requests"))
    assert plain.place(feats(3), [*pd_fleet, WorkerView("m0")], 0.0).worker_id == "m0"


def test_rebalancing_moves_requests_that_have_not_started_and_loses_none() -> None:
    """The live rebalancer's rules in the simulator (SimSpec.rebalance_s; simulator/rebalance_sim.py over
    policies/rebalance.py): a request still queued in an engine (by the scraped queue) may move, within the move
    budget, once; it is placed again through the placement step, on another worker, and runs there, once, to
    completion."""
    from policies.rebalance import MAX_MOVES_PER_S
    from simulator.simulate import SimSpec, build_sim, build_workload

    # engines that queue (the rebalancer reads their scraped queues): 30 req/s on four workers
    # (shed=False: requests the admission rule would refuse are the ones that wait in engine queues to be moved)
    spec = SimSpec(trace="sharegpt", rate=30, workers=4, policy="aladdin", policy_params={"fit": "worst"},
                   queue_lookahead=16, duration=30, seed=0, rebalance_s=0.5, shed=False)
    workload = build_workload(spec)
    sim = build_sim(spec, workload)
    moved: list[tuple[str, str, str]] = []
    looks: list[tuple[float, int]] = []
    look = sim.rebalancer.look

    def recorded(now: float) -> list:
        made = look(now)
        moved.extend((m.request_id, m.src, m.dst) for m in made)
        looks.append((now, len(made)))
        return made

    sim.rebalancer.look = recorded
    res = sim.run(workload)
    assert sim.moves == len(moved) > 0
    assert len({rid for rid, _, _ in moved}) == len(moved)              # never moved twice
    # the budget: at most MAX_MOVES_PER_S a second (a burst of that many), over any window of looks
    for i, (t0, _) in enumerate(looks):
        in_window = sum(n for t, n in looks[i:] if t < t0 + 10.0)
        assert in_window <= MAX_MOVES_PER_S * 10.0 + MAX_MOVES_PER_S, (t0, in_window)
    by_id = {r.request_id: r for r in res.results}
    assert len(by_id) == len(workload)
    for rid, src, _ in moved:
        assert by_id[rid].worker_id != src and by_id[rid].completed, by_id[rid]
    assert all(r.completed for r in res.results if r.finish_reason not in ("refused", "rejected_too_long"))

    off = SimSpec(**{**spec.__dict__, "rebalance_s": None})
    off_sim = build_sim(off, build_workload(off))
    off_sim.run(build_workload(off))
    assert off_sim.moves == 0
