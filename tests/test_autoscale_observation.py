"""The one FleetObservation builder (policies/autoscale/observation.py) that the gateway's autoscaler and the
simulator both call, and the definitions it settles."""

from __future__ import annotations

import math

import pytest

from policies.autoscale.global_ import POOL_BATCH, POOL_INTERACTIVE, POOL_MIXED
from policies.autoscale.observation import (
    MIN_OUTPUT_SAMPLES,
    FleetTick,
    ObservationBuilder,
    OutputStats,
    WindowSum,
    WorkerTick,
    interactive_busy,
    output_length,
)
from simulator.autoscale_sim import Arm, AutoscaleSim, Scenario, stepped_arrivals, tag_requests


def test_window_sum_drops_samples_older_than_its_window() -> None:
    w = WindowSum(10.0)
    for t, v in ((0.0, 4.0), (5.0, 2.0), (9.0, 6.0)):
        w.add(t, v)
    assert (w.total(9.0), w.mean(9.0), w.max(9.0)) == (12.0, 4.0, 6.0)
    assert (w.total(12.0), w.mean(12.0), w.max(12.0)) == (8.0, 4.0, 6.0)     # the sample at t=0 left
    assert (w.total(30.0), w.mean(30.0), w.max(30.0)) == (0.0, None, None)


def test_output_length_falls_back_to_the_predictor_then_uses_the_sample_statistics() -> None:
    out = OutputStats()
    for n in range(MIN_OUTPUT_SAMPLES - 1):
        out.add(100 + n)
    assert output_length((out.n, out.total, out.total_sq), 321.0) == (321.0, 0.0)
    out.add(200)
    lengths = [100 + n for n in range(MIN_OUTPUT_SAMPLES - 1)] + [200]
    mean = sum(lengths) / len(lengths)
    sample_std = math.sqrt(sum((x - mean) ** 2 for x in lengths) / (len(lengths) - 1))
    got = output_length((out.n, out.total, out.total_sq), 321.0)
    assert got[0] == pytest.approx(mean) and got[1] == pytest.approx(sample_std)


def test_busy_counts_interactive_and_mixed_workers_and_waiting_requests_in_workers_worth() -> None:
    workers = [WorkerTick("a", POOL_INTERACTIVE, 2.0, cap=4), WorkerTick("b", POOL_MIXED, 12.0, cap=8),
               WorkerTick("c", POOL_BATCH, 30.0, cap=16), WorkerTick("d", POOL_MIXED, 4.0, cap=None)]
    # a: 2/4; b: min(1, 12/8); c: a batch worker, not counted; d: no cap -> busy_cap 16; waiting / median cap (12)
    assert interactive_busy(workers, 6.0, busy_cap=16) == pytest.approx(0.5 + 1.0 + 0.25 + 6.0 / 12)


def test_builder_rate_and_batch_throughput_windows() -> None:
    b = ObservationBuilder(rate_window_s=10.0, throughput_window_s=10.0, t0=0.0)
    mixed = WorkerTick("m", POOL_MIXED, 1.0, cap=4, tokens_per_s=50.0, full=True)
    quiet = FleetTick([mixed], arrivals=5)
    obs = b.build(quiet, 5.0)
    assert obs.interactive_rate == pytest.approx(5 / 5.0)             # the window is still shorter than 10 s
    assert obs.batch_tokens_per_s == 0.0 and obs.worker_tokens_per_s == 50.0   # best worker: the last resort
    busy = FleetTick([mixed], arrivals=10, queue=((100.0, 3),), batch_inflight=2, batch_tokens_per_s=40.0)
    obs = b.build(busy, 10.0)
    assert obs.interactive_rate == pytest.approx(15 / 10.0)
    assert (obs.batch_tokens_per_s, obs.worker_tokens_per_s) == (40.0, 50.0)   # a full mixed worker's rate
    batch_worker = WorkerTick("x", POOL_BATCH, 0.0, cap=64, tokens_per_s=300.0)
    obs = b.build(FleetTick([mixed, batch_worker], queue=((100.0, 3),), batch_inflight=2, batch_tokens_per_s=80.0),
                  15.0)
    assert obs.batch_tokens_per_s == pytest.approx(60.0)              # the mean of the per-tick rates
    assert obs.worker_tokens_per_s == 300.0                           # the batch pool's own rate first
    assert obs.workers == {POOL_INTERACTIVE: 0, POOL_MIXED: 1, POOL_BATCH: 1}
    obs = b.build(FleetTick([mixed]), 16.0)                           # no batch work: the batch window restarts
    assert obs.batch_tokens_per_s == 0.0


def test_the_simulator_observes_through_the_builder_with_a_time_averaged_queue() -> None:
    """One worker with a cap of 1 and a burst: requests wait in the admission queue part of the tick; the waiting
    count the simulator reports is its time average over the tick, which lies between its extremes."""
    reqs = tag_requests(stepped_arrivals("azure_conv", [(20.0, 4.0)], seed=3), "i")
    sc = Scenario("burst", reqs, [], "llama3-8b-a100", horizon_s=40.0, initial_workers=1, max_workers=1, seed=3)
    sim = AutoscaleSim(sc, Arm("static", static_workers=1, static_cap=1))
    seen: list[tuple[float, float, int]] = []

    def tick(s: AutoscaleSim, now: float) -> None:
        queued_now = len(s.queue)
        obs = s.observe_fleet(now)
        s._last_global = now
        seen.append((now, obs.interactive_busy, queued_now))
        if now < 20.0:
            s.schedule(now + 5.0, tick)

    sim.schedule(5.0, tick)
    sim.run(sc.interactive, until=sc.horizon_s)
    assert len(seen) == 4
    # a closed queue that grows during the burst: the averaged busy count is above the one running worker
    assert max(busy for _, busy, _ in seen) > 1.0
    assert sim.observations.rate_window_s == Arm().rate_window_s
