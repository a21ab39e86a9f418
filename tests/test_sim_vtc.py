"""VTC in the virtual-time cluster (simulator/service_sim.py runs policies/service_priority.py's rule): over capacity,
a light tenant's requests wait far less than behind a heavy tenant's backlog in FCFS, and no worker slot idles while
a request waits (the order only sorts the gateway's queue)."""

from __future__ import annotations

import random

import numpy as np

from policies.service_priority import make_service_scheduler
from simulator.cluster import ClusterSim
from simulator.engine import EngineConfig
from simulator.workload import WorkloadRequest

CAP = 8


def workload(rate: float, duration: float, seed: int) -> list[WorkloadRequest]:
    """Poisson arrivals, heavy at 10x light's rate; every request 200 prompt and 100 output tokens, so the light
    tenant's demand in tokens is 1/11 of the total, far below its fair half."""
    rng = random.Random(seed)
    out = []
    for tenant, share in (("heavy", 10 / 11), ("light", 1 / 11)):
        t = rng.expovariate(rate * share)
        while t < duration:
            out.append(WorkloadRequest(f"{tenant}-{len(out)}", t, 200, 100, service=tenant))
            t += rng.expovariate(rate * share)
    return sorted(out, key=lambda r: r.arrival)


def light_ttft_p90(order: str) -> tuple[float, float]:
    wl = workload(rate=20.0, duration=20.0, seed=3)
    sim = ClusterSim("llama3-8b-h100", 1, "least_requests", cap=CAP, engine_config=EngineConfig(max_num_seqs=CAP),
                     service_priority=make_service_scheduler(order), queue_timeout_s=600, slo_ttft_s=600)
    idle = [0.0]
    last = wl[-1].arrival

    def sample(s: ClusterSim, t: float) -> None:
        if s.queue and any(w.inflight < CAP for w in s.workers.values()):
            idle[0] += 0.01
        if t < last or s.queue:
            s.schedule(t + 0.01, sample)

    sim.schedule(0.0, sample)
    res = sim.run(wl)
    light = {r.request_id for r in wl if r.service == "light"}
    ttft = [r.ttft for r in res.results if r.request_id in light and r.completed]
    assert len(ttft) == len(light) and all(r.completed for r in res.results)
    return float(np.percentile(ttft, 90)), idle[0]


def test_light_tenant_waits_less_under_vtc_and_no_slot_idles():
    fcfs, fcfs_idle = light_ttft_p90("fcfs")
    vtc, vtc_idle = light_ttft_p90("vtc")
    assert fcfs > 2.0, "the workload is not over capacity: FCFS should queue the light tenant for seconds"
    assert vtc < fcfs / 4
    assert fcfs_idle == vtc_idle == 0.0
