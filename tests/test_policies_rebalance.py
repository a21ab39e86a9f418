"""The rebalancer's rules both sides run (policies/rebalance.py): which requests may move, the budget, and where a
moved request is placed again."""

from __future__ import annotations

from policies.baselines import LeastRequests
from policies.perf_model import PerfModel
from policies.placement import ModelPlacement
from policies.rebalance import LegSeen, budget_for, move_exclusions, propose_moves, queued_legs, step_ratio
from policies.types import RequestFeatures, WorkerView
from simulator.profiles import load_profile


def _leg(rid: str, worker: str, sent: float, tokens: int = 0, movable: bool = True) -> LegSeen:
    return LegSeen(rid, worker, RequestFeatures(rid, "m", 100), tokens, sent, movable)


def test_only_the_last_waiting_of_a_workers_tokenless_movable_requests_may_move() -> None:
    legs = [_leg("c", "w0", 3.0), _leg("a", "w0", 1.0), _leg("b", "w0", 2.0), _leg("d", "w0", 4.0, tokens=5),
            _leg("e", "w0", 5.0, movable=False), _leg("f", "w1", 1.0)]
    q = queued_legs(legs, {"w0": 2, "w1": 0})
    assert list(q) == ["b", "c"] and q["b"][0] == "w0"       # in sent order, the engine's queue is its tail
    assert queued_legs(legs, {"w1": 3}) == {"f": ("w1", legs[-1].feats)}   # a worker not seen: nothing of it


def test_moves_stay_within_the_budget_and_the_moved_request_prefers_its_destination() -> None:
    placement = ModelPlacement(LeastRequests())
    views = [WorkerView("w0", inflight=5), WorkerView("w1"), WorkerView("w2")]
    queued = {f"r{i}": ("w0", RequestFeatures(f"r{i}", "m", 100)) for i in range(5)}
    budget = budget_for(2.0)
    moves = propose_moves(placement, queued, views, 0.0, {"w0": 10.0}, 3.0, budget, 0.0)
    assert len(moves) == 2 and {m.src for m in moves} == {"w0"} and "w0" not in {m.dst for m in moves}
    budget.spend(len(moves))
    assert propose_moves(placement, queued, views, 0.0, {"w0": 10.0}, 3.0, budget, 0.0) == []   # spent
    assert propose_moves(placement, {}, views, 0.0, {}, 3.0, budget_for(2.0), 0.0) == []
    assert move_exclusions("w1", ["w0", "w1", "w2"], ("w0",)) == [["w0", "w2"], ("w0",)]
    assert move_exclusions(None, ["w0", "w1"], ("w0",)) == [("w0",)]


def test_a_request_queued_on_a_slow_worker_moves_only_to_a_worker_with_room() -> None:
    """Off slow workers (a policy without Algorithm 2): a destination at its cap cannot take the request, which
    would then be refused where it could have waited; the moves proposed count toward the caps."""
    placement = ModelPlacement(LeastRequests())
    queued = {f"r{i}": ("w0", RequestFeatures(f"r{i}", "m", 100)) for i in range(4)}
    full = [WorkerView("w0", inflight=6, cap=6), WorkerView("w1", inflight=6, cap=6),
            WorkerView("w2", inflight=6, cap=6)]
    assert propose_moves(placement, queued, full, 0.0, {"w0": 10.0}, 3.0, budget_for(10.0), 0.0) == []
    one_free = [WorkerView("w0", inflight=6, cap=6), WorkerView("w1", inflight=5, cap=6),
                WorkerView("w2", inflight=6, cap=6)]
    moves = propose_moves(placement, queued, one_free, 0.0, {"w0": 10.0}, 3.0, budget_for(10.0), 0.0)
    assert [(m.request_id, m.dst) for m in moves] == [("r0", "w1")]


def test_step_ratio_is_observed_over_the_perf_models_decode_step() -> None:
    pm = PerfModel.from_step_profile(load_profile("llama3-8b-h100"))
    step = pm.decode_step(2, 1000.0)
    assert step_ratio([(10 * step * 4, 10), (10 * step * 4, 10)], [1000, 1000], 1, pm) == 4.0
    assert step_ratio([], [1000], 1, pm) is None
