"""The `hetero` policy: eq. 5-8 by hand, the min-max mapper, completion hooks, and on a strong/weak pair:
work in proportion to speed and balanced completion times (checked by a small continuous-batching model)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from policies.base import make_policy
from policies.hetero import HeteroPolicy, ideal_batch, min_max_choice, request_time, workload
from policies.perf_model import PerfModel
from policies.types import RequestFeatures, WorkerView

HAND = PerfModel(p=(1e-4, 0.0, 0.0, 0.01, 1e-6, 1e-4, 0.0, 0.02), h=1 / 16, j=1, kv_capacity=1000)
STRONG = PerfModel(k1=1e-4, c1=0.01, k2=2e-7, c2=1e-4, c3=0.02, kv_capacity=8000, max_batch=256)
WEAK = PerfModel(k1=4e-4, c1=0.04, k2=8e-7, c2=4e-4, c3=0.08, kv_capacity=2000, max_batch=256)


def req(i: int, l_in: int = 150, out: float = 10, **kw) -> RequestFeatures:
    return RequestFeatures(request_id=f"r{i}", model="m", prompt_tokens=l_in, predicted_output_tokens=out, **kw)


def test_request_time_by_hand():
    # eq. 5: KVSize = 160/16 + 1 = 11 blocks -> b = floor(1000 / 11) = 90 copies
    assert ideal_batch(HAND, 150, 10) == 90
    prefill = 1e-4 * 90 * 150 + 0.01                                   # eq. 3: 1.36 s
    decode = (1e-6 * 90) * (150 * 10 + 55) + (1e-4 * 90 + 0.02) * 10   # eq. 4 closed form: 0.42995 s
    assert request_time(HAND, 150, 10) == pytest.approx((prefill + decode) / 90)  # eq. 6
    assert workload(2.0, 0.5, 2.0) == pytest.approx(2.0 * math.e)                 # eq. 7


def test_policy_workloads_follow_kv_usage():
    p = HeteroPolicy(perf_models={"h": HAND}, theta=2.0)
    ws = [WorkerView(id="a", profile="h")]
    t = request_time(HAND, 150, 10)
    assert p.choose(req(0), ws, 0.0).worker_id == "a"
    p.on_dispatch(req(0), "a", 0.0)
    assert p.load("a") == pytest.approx(t)
    # eq. 8: the first request holds 160 tokens = 11 blocks of 1000 -> kv_usage 0.011
    w2 = p.workloads(req(1), np.array([0]), None)[0]
    assert w2 == pytest.approx(t * math.exp(2.0 * 0.011))
    # The engine reporting more usage than the ledger's counts (other replicas' load).
    assert p.workloads(req(1), np.array([0]), np.array([0.5]))[0] == pytest.approx(t * math.exp(1.0))
    p.on_dispatch(req(1), "a", 0.0)
    p.on_complete(req(0), "a", 1.0)
    p.on_complete(req(1), "a", 1.0)
    p.on_complete(req(1), "a", 1.0)  # twice: ignored
    assert p.load("a") == 0.0
    assert HeteroPolicy(memory_only=True).workloads(req(1), np.array([], dtype=int), None).shape == (0,)


def test_min_max_choice_by_hand():
    assert min_max_choice(np.array([10.0, 0.0]), np.array([1.0, 4.0])) == 1       # max(11, 0) vs max(10, 4)
    assert min_max_choice(np.array([0.0, 0.0]), np.array([1.0, 4.0])) == 0
    assert min_max_choice(np.array([5.0, 5.0]), np.array([1.0, 1.0])) == 0
    # Both 1 and 2 keep the max at 10; 2 ends lower (2 < 3).
    assert min_max_choice(np.array([10.0, 0.0, 0.0]), np.array([1.0, 3.0, 2.0])) == 2
    assert min_max_choice(np.array([3.0]), np.array([1.0])) == 0


def test_registered_and_validated():
    p = make_policy("hetero", perf_models={"s": {"k1": 1e-4}}, theta=1.5)
    assert isinstance(p, HeteroPolicy) and p.theta == 1.5
    assert p.choose(req(0), [], 0.0).worker_id is None
    with pytest.raises(ValueError):
        make_policy("hetero", theta=-1)


def _pair() -> list[WorkerView]:
    return [WorkerView(id="strong", profile="strong"), WorkerView(id="weak", profile="weak")]


def test_work_in_proportion_to_speed():
    big = {"strong": PerfModel.from_dict({**STRONG.to_dict(), "kv_capacity": 1e7}),
           "weak": PerfModel.from_dict({**WEAK.to_dict(), "kv_capacity": 1e7})}
    p = HeteroPolicy(perf_models=big)
    ws = _pair()
    counts = {"strong": 0, "weak": 0}
    for i in range(500):
        r = req(i, l_in=200, out=100)
        w = p.choose(r, ws, 0.0).worker_id
        p.on_dispatch(r, w, 0.0)
        counts[w] += 1
    assert counts["strong"] / counts["weak"] == pytest.approx(4.0, rel=0.1)  # everything 4x faster


def _simulate(model: PerfModel, jobs: list[tuple[int, int]]) -> float:
    """Completion time of FIFO continuous batching: admit while the KV of the whole request fits,
    prefill the admitted (eq. 2, decode stalls), then one decode step (eq. 3) for the batch."""
    t, queue = 0.0, list(jobs)
    l_in = np.zeros(0)
    left = np.zeros(0)
    done_out = np.zeros(0)
    while queue or len(left):
        used = model.kv_blocks(float((l_in + done_out + left).sum()), len(left))
        new = []
        while queue and len(left) + len(new) < model.max_batch:
            i, o = queue[0]
            need = model.kv_blocks(i + o)
            if used + need > model.kv_capacity:
                break
            used += need
            new.append(queue.pop(0))
        if new:
            t += model.prefill_time(sum(i for i, _ in new))
            l_in = np.append(l_in, [i for i, _ in new])
            left = np.append(left, [o for _, o in new])
            done_out = np.append(done_out, np.zeros(len(new)))
        t += model.decode_step(len(left), float((l_in + done_out).mean()))
        left -= 1
        done_out += 1
        keep = left > 0
        l_in, left, done_out = l_in[keep], left[keep], done_out[keep]
    return t


def test_balances_completion_times_better_than_round_robin():
    # All at once (the paper's "inf" rate), enough requests to keep both workers' batches full: the
    # regime of eq. 5's ideal batch. Round robin leaves the weak worker far behind.
    rng = np.random.default_rng(0)
    jobs = [(int(rng.integers(50, 500)), int(rng.integers(20, 300))) for _ in range(1500)]
    p = HeteroPolicy(perf_models={"strong": STRONG, "weak": WEAK})
    ws = _pair()
    assigned: dict[str, list[tuple[int, int]]] = {"strong": [], "weak": []}
    for i, (l_in, out) in enumerate(jobs):  # all at once: no completions in between
        r = req(i, l_in=l_in, out=out)
        w = p.choose(r, ws, 0.0).worker_id
        p.on_dispatch(r, w, 0.0)
        assigned[w].append((l_in, out))
    hetero = {w: _simulate(STRONG if w == "strong" else WEAK, js) for w, js in assigned.items()}
    rr = {"strong": _simulate(STRONG, jobs[0::2]), "weak": _simulate(WEAK, jobs[1::2])}
    assert 2.5 < len(assigned["strong"]) / len(assigned["weak"]) < 3.5
    assert max(hetero.values()) / min(hetero.values()) < 1.35
    assert max(rr.values()) / min(rr.values()) > 3
    assert max(hetero.values()) < 0.5 * max(rr.values())  # makespan: the pair's throughput doubles


def test_bad_prediction_does_not_poison_loads():
    p = HeteroPolicy(perf_models={"h": HAND})
    ws = [WorkerView(id="a", profile="h")]
    bad = RequestFeatures(request_id="nan", model="m", prompt_tokens=150, predicted_output_tokens=float("nan"))
    p.on_dispatch(bad, p.choose(bad, ws, 0.0).worker_id, 0.0)
    assert math.isfinite(p.load("a")) and p.load("a") == pytest.approx(request_time(HAND, 150, 128))
    p.on_complete(bad, "a", 1.0)
    assert p.load("a") == 0.0
