"""The admission queue's bounded decision cost in virtual time (policies/admission.py): a request that found no
worker is asked about again after a completion, a new worker or a new engine report (a scrape tick), not at every
poll of the queue."""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import Policy, make_policy
from policies.types import Decision, RequestFeatures, WorkerView
from simulator.cluster import ClusterSim
from simulator.workload import WorkloadRequest


class HoldsOne(Policy):
    """least_requests, except that request `held` fits nowhere until `until` (model seconds); counts its checks."""

    name = "holds_one"

    def __init__(self, held: str, until: float) -> None:
        self.inner, self.held, self.until, self.checks = make_policy("least_requests"), held, until, 0

    def choose(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float) -> Decision:
        if request.request_id == self.held:
            self.checks += 1
            if now < self.until:
                return Decision(None, "no_fit")
        return self.inner.choose(request, workers, now)


def run(poll_s: float, until: float) -> tuple[HoldsOne, ClusterSim]:
    pol = HoldsOne("held", until)
    sim = ClusterSim("llama3-8b-h100", 2, pol, queue_poll_s=poll_s, scrape_interval_s=0.5, queue_timeout_s=30.0,
                     slo_ttft_s=30.0)
    wl = [WorkloadRequest("held", 0.0, 100, 10)]
    wl += [WorkloadRequest(f"r{i}", 0.5 * i, 100, 50) for i in range(1, 9)]   # a completion now and then
    sim.run(wl)
    return pol, sim


def test_a_waiting_request_is_checked_on_changes_not_on_every_poll() -> None:
    pol, sim = run(poll_s=0.005, until=4.0)
    res = sim.results["held"]
    assert res.completed and res.dispatched is not None and res.dispatched >= 4.0
    # ~4 s of waiting: 800 polls at 5 ms. Checks: its arrival, one per completion (8) and per scrape tick (~9) while
    # it waits, and the one that placed it.
    assert pol.checks <= 30, pol.checks
    assert sim.queue.skipped > 400
    # Placed at the first change after its policy would take it: the next scrape tick (0.5 s) at the latest.
    assert res.dispatched <= 4.0 + 0.5 + 1e-6
