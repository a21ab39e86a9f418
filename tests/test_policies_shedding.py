"""Admission that sheds what will miss (policies/shedding.py): the rule by hand on a known
performance model, and at 10x overload in virtual time for several policies (deterministic: no wall clock)."""

from __future__ import annotations

import dataclasses

import pytest

from policies.admission import AdmissionQueue, queue_budget
from policies.base import make_policy
from policies.perf_model import PerfModel
from policies.placement import ModelPlacement
from policies.shedding import WILL_MISS
from policies.types import CLASS_BATCH, RequestFeatures, WorkerView
from simulator.cluster import REFUSED, ClusterSim
from simulator.workload import synthetic_workload

# 1 ms of prefill per prompt token, a cheap decode step: the TTFT on a worker is its queued prompt tokens in ms.
MODEL = PerfModel(k1=1e-3, c1=0.0, k2=1e-9, c2=1e-6, c3=1e-3, h=1.0 / 16, j=1.0, kv_capacity=1e6, max_batch=256,
                  chunk_tokens=100_000)


def feats(rid: str, prompt: int = 100, ttft: float | None = 1.0, tpot: float | None = None, arrival: float = 0.0,
          cls: str = "interactive") -> RequestFeatures:
    return RequestFeatures(rid, "m", prompt, max_tokens=16, predicted_output_tokens=16, slo_ttft_s=ttft,
                           slo_tpot_s=tpot, arrival=arrival, request_class=cls)


def placement(policy: str = "least_requests") -> ModelPlacement:
    p = ModelPlacement(make_policy(policy))
    assert p.shedder is not None and p.shedder.own_tracker
    p.shedder.tracker.set_perf_model("gpu", MODEL)
    return p


def views(n: int = 1) -> list[WorkerView]:
    return [WorkerView(f"w{i}", profile="gpu") for i in range(n)]


def backlog(p: ModelPlacement, ws: list[WorkerView], tokens: int, now: float = 0.0) -> None:
    """Place prompts of `tokens` in all (no TTFT target: never shed) on the first worker."""
    f = feats("bulk", tokens, ttft=None)
    d = p.place(f, ws, now)
    assert d.worker_id is not None
    p.dispatched(f, d, now)


def test_a_request_that_would_wait_past_its_target_is_refused_with_the_predicted_drain_as_retry_after() -> None:
    p, ws = placement(), views(1)
    backlog(p, ws, 5000)                      # 5 s of prefill queued on the only worker
    d = p.place(feats("late", 100, ttft=1.0), ws, 0.0)
    assert d.worker_id is None and d.reason == WILL_MISS
    shed = p.last_shed
    assert shed is not None and 5.0 < shed.predicted_s < 5.3
    assert shed.retry_after_s == 5.0          # ceil(5.1 predicted - 1 target): when the backlog has drained enough
    assert "misses its target of 1000 ms" in shed.message
    # the same request with a target the backlog allows is placed; so is one with no TTFT target or of the batch class
    assert p.place(feats("ok", 100, ttft=6.0), ws, 0.0).worker_id == "w0"
    assert p.place(feats("no-target", 100, ttft=None), ws, 0.0).worker_id == "w0"
    assert p.place(feats("batch", 100, ttft=1.0, cls=CLASS_BATCH), ws, 0.0).worker_id == "w0"
    # the backlog drains in real time: 4.5 s later the request fits
    assert p.place(feats("later", 100, ttft=1.0, arrival=4.5), ws, 4.5).worker_id == "w0"


def test_the_chosen_worker_is_judged_and_a_request_no_idle_worker_can_serve_in_time_is_not_shed() -> None:
    p, ws = placement("round_robin"), views(2)
    backlog(p, ws, 5000)                      # round robin's next choice is w1, idle
    assert p.place(feats("a", 100), ws, 0.0).worker_id == "w1"
    d = p.place(feats("b", 100), ws, 0.0)     # its next choice is w0, 5 s behind: refused though w1 is free
    assert d.reason == WILL_MISS and p.last_shed is not None and p.last_shed.worker_id == "w0"
    # a prompt whose own prefill (3 s) exceeds its target on an idle worker too: best effort, never shed
    assert p.place(feats("huge", 3000, ttft=1.0), ws, 0.0).worker_id is not None


def test_a_request_that_would_slow_its_decodes_past_the_tpot_target_is_refused() -> None:
    p, ws = placement(), views(1)
    for i in range(200):                      # 200 decodes of 1000-token contexts: eq. 3 step ~ 1 + 0.2 + 0.2 ms
        f = feats(f"d{i}", 1000, ttft=None)
        p.dispatched(f, p.place(f, ws, 0.0), 0.0)
    led = p.shedder.tracker.ledger
    led.advance(led.rows_for_views(ws), 300.0)      # every prefill done long ago
    assert p.place(feats("loose", 10, ttft=10.0, tpot=0.01, arrival=300.0), ws, 300.0).worker_id == "w0"
    d = p.place(feats("tight", 10, ttft=10.0, tpot=0.0012, arrival=300.0), ws, 300.0)
    assert d.reason == WILL_MISS and p.last_shed is not None and "time per output token" in p.last_shed.message


def test_a_queued_request_s_budget_ends_its_predicted_prefill_before_its_target() -> None:
    f = feats("q", 300, ttft=1.0, arrival=10.0)
    assert queue_budget(f, 10.0, 5.0)[0] == pytest.approx(1.0)            # before: the whole target
    budget, why = queue_budget(f, 10.0, 5.0, prefill_s=0.3)
    assert budget == pytest.approx(0.7) and "could no longer start in time" in why
    assert queue_budget(f, 10.5, 5.0, prefill_s=0.3)[0] == pytest.approx(0.2)
    assert queue_budget(feats("b", 300, ttft=1.0, cls=CLASS_BATCH), 10.0, 5.0, prefill_s=0.3)[0] == 5.0
    p, ws = placement(), views(1)
    assert p.queue_prefill_s(f, ws) == pytest.approx(0.3)                 # eq. 2: 300 tokens at 1 ms
    w = AdmissionQueue().enter(f, 10.0, prefill_s=p.queue_prefill_s(f, ws))
    assert w.deadline == pytest.approx(10.7)


def overload(policy: str, shed: bool) -> tuple[int, int, int]:
    """Two H100 workers offered ~10x what they serve within a 600 ms TTFT and 30 ms TPOT (chat-sized prompts):
    (admitted, admitted that met their SLO, refused)."""
    wl = synthetic_workload(6000, 1000.0, (20, 200), (50, 200), seed=1)
    res = ClusterSim("llama3-8b-h100", 2, policy, slo_ttft_s=0.6, slo_tpot_s=0.03, shed=shed).run(wl)
    admitted = [r for r in res.results if r.finish_reason != REFUSED]
    return len(admitted), sum(1 for r in admitted if r.slo_met), len(res.results) - len(admitted)


@pytest.mark.parametrize("policy", ["round_robin", "least_tokens", "aladdin"])
def test_at_10x_overload_without_caps_at_least_99_percent_of_admitted_requests_meet_their_slo(policy: str) -> None:
    admitted, met, refused = overload(policy, shed=True)
    assert refused > 0.5 * (admitted + refused)           # most of a 10x overload is refused ...
    assert met >= 0.99 * admitted and met > 1000          # ... and what is admitted is served within its SLO


def test_without_the_rule_a_10x_overload_admits_everything_and_almost_nothing_meets_its_slo() -> None:
    admitted, met, refused = overload("least_tokens", shed=False)
    assert refused == 0 and met < 0.1 * admitted


def test_a_burst_of_prefills_predicts_no_slower_decode_step_than_one_carrying_a_full_chunk() -> None:
    """Prefill work placed faster than the worker computes it (k1·ρ >= 1) queues; a decode step carries at most
    a chunk of it (vLLM's max_num_batched_tokens): the predicted ATGT stays at that step's time, not seconds."""
    p, ws = placement(), views(1)
    p.shedder.tracker.set_perf_model("gpu", dataclasses.replace(MODEL, chunk_tokens=512))
    for i in range(20):                       # 20 x 1000 prompt tokens at once: 20 s of prefill at 1 ms a token
        f = feats(f"p{i}", 1000, ttft=None)
        p.dispatched(f, p.place(f, ws, 0.0), 0.0)
    cons, led = p.shedder.tracker.constraints, p.shedder.tracker.ledger
    rows = led.rows_for_views(ws)
    led.advance(rows, 0.5)
    atgt, b, _, _ = cons.paced_atgt(feats("x", 10, tpot=1.0), rows, 0.5)
    assert led.k1[0] * led.placed_rate_now(rows, 0.5)[0][0] > 1.0          # the burst's rate: past the worker's
    assert float(atgt[0]) <= 1e-3 * 512 + 0.01                              # about one full chunk's step, 0.5 s
    assert float(atgt[0]) > 1e-3 * (512 - float(b[0])) * 0.9
