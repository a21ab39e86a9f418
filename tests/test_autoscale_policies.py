"""Batch queue, baselines (utilization band, static) and pool-aware routing."""

from __future__ import annotations

import math

import pytest

from policies.autoscale.baselines import StaticProvisioning, UtilizationBand, fleet_utilization
from policies.autoscale.routing import PoolRouter, eviction_victim, has_room, pool_filter, pools_in_use
from policies.base import make_policy
from policies.batch_queue import BatchQueue
from policies.placement import ModelPlacement
from policies.types import CLASS_BATCH, RequestFeatures, WorkerView


# ---- batch queue ----------------------------------------------------------------------------------
def test_queue_is_deadline_ordered_and_fcfs_on_ties():
    q = BatchQueue()
    q.push("c", 300.0, prompt_tokens=30)
    q.push("a", 100.0, prompt_tokens=10)
    q.push("b1", 200.0, prompt_tokens=20)
    q.push("b2", 200.0, prompt_tokens=20)
    assert len(q) == 4 and q.prompt_tokens == 80 and "b2" in q
    assert [i.request_id for i in q] == ["a", "b1", "b2", "c"]
    assert q.deadline_counts() == [(100.0, 1), (200.0, 2), (300.0, 1)]
    assert q.pop().request_id == "a"
    first = q.pop()
    assert first.request_id == "b1"
    q.requeue(first)                                   # evicted: back to its old place, ahead of b2
    assert [q.pop().request_id for _ in range(3)] == ["b1", "b2", "c"]
    assert not q and q.peek() is None and q.prompt_tokens == 0
    with pytest.raises(IndexError):
        q.pop()


def test_queue_cancel_and_bad_input():
    q = BatchQueue()
    q.push("x", 10.0, payload={"k": 1})
    q.push("y", 5.0)
    assert q.remove("y").request_id == "y" and q.remove("y") is None
    assert q.peek().payload == {"k": 1} and q.deadline_counts() == [(10.0, 1)]
    with pytest.raises(ValueError):
        q.push("x", 1.0)
    with pytest.raises(ValueError):
        q.push("z", math.inf)
    with pytest.raises(ValueError):
        q.push("z", 1.0, prompt_tokens=-1)


# ---- baselines ------------------------------------------------------------------------------------
def test_fleet_utilization_counts_queued_demand():
    assert fleet_utilization([0.2, 0.4], 1000) == pytest.approx(0.3)
    assert fleet_utilization([0.2, 0.4], 1000, queued_tokens=1000) == pytest.approx(0.8)
    assert fleet_utilization([], 1000, queued_tokens=1) == math.inf
    assert fleet_utilization([], 1000) == 0.0


def test_utilization_band_steps_one_worker_with_cooldown():
    ub = UtilizationBand(low=0.3, high=0.7, cooldown_s=60, min_workers=1, max_workers=4)
    assert ub.decide(0.5, 2, 0.0) == (2, None)
    assert ub.decide(5.0, 2, 0.0) == (3, "util_high")          # +1 even far above the band
    assert ub.decide(5.0, 3, 30.0) == (3, None)                # cooldown
    assert ub.decide(5.0, 3, 60.0) == (4, "util_high")
    assert ub.decide(5.0, 4, 200.0) == (4, None)               # max
    assert ub.decide(0.1, 4, 300.0) == (3, "util_low")
    assert ub.decide(0.1, 1, 400.0) == (1, None)               # min
    assert ub.decide(0.1, 0, 401.0) == (1, "min")
    with pytest.raises(ValueError):
        UtilizationBand(low=0.8, high=0.7)


def test_static_provisioning():
    st = StaticProvisioning(5)
    assert st.decide(99.0, 5, 0.0) == (5, None)
    assert st.decide(0.0, 3, 0.0) == (5, "static")
    with pytest.raises(ValueError):
        StaticProvisioning(-1)


# ---- routing -------------------------------------------------------------------------------------
def _w(wid: str, pool: str, inflight: int = 0, cap: int = 10, running: int | None = None, waiting: int = 0):
    return WorkerView(wid, inflight=inflight, cap=cap, running=inflight if running is None else running,
                      waiting=waiting, labels={"pool": pool})


def test_placement_prefers_own_pool_then_spills_to_mixed():
    """The placement step's pool filter (the gateway and the simulators share it) with the `least_fill` policy."""
    place = ModelPlacement(make_policy("least_fill")).place
    inter = RequestFeatures("i", "m", 10)
    batch = RequestFeatures("b", "m", 10, request_class=CLASS_BATCH)
    ws = [_w("i1", "interactive", 5), _w("i2", "interactive", 2), _w("m1", "mixed", 0), _w("b1", "batch", 9)]
    assert place(inter, ws, 0).worker_id == "i2"        # own pool, least filled
    assert place(batch, ws, 0).worker_id == "b1"        # own pool even if fuller than mixed
    full = [_w("i1", "interactive", 5, waiting=1), _w("m1", "mixed", 3), _w("b1", "batch", 3, running=2)]
    assert place(inter, full, 0).worker_id == "m1"      # i1's engine queues: spill to mixed
    assert place(batch, full, 0).worker_id == "m1"      # b1 has a request in transit
    assert place(inter, [_w("b1", "batch")], 0).worker_id is None
    assert pool_filter(inter, [_w("b1", "batch")]) == []
    assert has_room(_w("x", "mixed", 3)) and not has_room(_w("x", "mixed", 3, waiting=2))
    # Without pool labels every worker is a candidate and the policy alone decides.
    assert not pools_in_use([WorkerView("a"), WorkerView("b")])
    assert PoolRouter().choose(inter, [_w("a", "mixed", 4), _w("b", "mixed", 1)], 0).worker_id == "b"


def test_eviction_victim_is_the_mixed_worker_with_most_batch_work():
    ws = [_w("i1", "interactive"), _w("m1", "mixed"), _w("m2", "mixed"), _w("b1", "batch")]
    assert eviction_victim(ws, {"m1": 2, "m2": 5, "b1": 9, "i1": 4}) == "m2"
    assert eviction_victim(ws, {"b1": 9}) is None
