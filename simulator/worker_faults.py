"""A worker that fails, in the virtual-time cluster: every request that reaches it is answered 5xx before a byte
(what `POST /sim/faults {"error_status": 500}` does to a simulated vLLM server), and the simulator does what the
gateway does about it, with the same rules:

- the attempt loop's RETRY (gateway/pipeline/attempts.py `place_again`): the reservation is given back, the
  placement step hears that the request ended there with no output, and it is placed again through the placement
  step without the workers it tried; no worker with room: the worker's 500 is the answer (the gateway relays the
  last failure once nobody else can take the request);
- outlier ejection (gateway/fleet/registry.py `note_outcome`): `error_streak` of policies/pace.py with the
  gateway's default `resume.eject_after_errors`; an ejected worker leaves the simulated fleet (the gateway holds
  it out and probes it with a generation, which a failing worker fails, so it stays out).

    faults = WorkerFaults.install(sim)
    sim.schedule(t, lambda s, now: faults.fail("w2"))
"""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.pace import EJECT_AFTER_ERRORS, error_streak
from policies.placement import reserved_tokens
from policies.types import RequestFeatures
from simulator.cluster import ClusterSim, SimWorker
from simulator.workload import WorkloadRequest

FAILED = "failed"   # RequestResult.finish_reason of a request whose last worker failed it


@dataclass
class WorkerFaults:
    """The failing workers of one ClusterSim and what their failures did."""

    eject_after_errors: int = EJECT_AFTER_ERRORS
    failing: set[str] = field(default_factory=set)
    retries: list[tuple[str, str]] = field(default_factory=list)   # (request, the worker that failed it)
    ejected: list[tuple[str, float]] = field(default_factory=list)
    _in_row: dict[str, int] = field(default_factory=dict)
    _tried: dict[str, set[str]] = field(default_factory=dict)

    @classmethod
    def install(cls, sim: ClusterSim, eject_after_errors: int = EJECT_AFTER_ERRORS) -> WorkerFaults:
        sim.faults = faults = cls(eject_after_errors)
        return faults

    def fail(self, worker_id: str) -> None:
        """From now on every request reaching `worker_id` fails before its first byte."""
        self.failing.add(worker_id)

    def fails(self, sim: ClusterSim, w: SimWorker, r: WorkloadRequest, feats: RequestFeatures, now: float) -> bool:
        """Called as a request is sent to w (its answer comes at once: a failing worker answers before its
        engine sees the request): False when w serves it; True when w failed it (and the request was placed
        again, or answered with the failure)."""
        if w.id not in self.failing:
            return False
        rid = r.request_id
        del sim._pending[rid]
        w.reserve(reserved_tokens(feats), -1)
        sim.placement.finished(feats, w.id, 0, now)
        self.retries.append((rid, w.id))
        self._in_row[w.id], eject = error_streak(self._in_row.get(w.id, 0), False, self.eject_after_errors)
        if eject:
            self.ejected.append((w.id, now))
            sim.remove_worker(w.id, now)
        tried = self._tried.setdefault(rid, set())
        tried.add(w.id)
        if sim._try_dispatch(r, feats, now, tried) is not None:   # nobody else: the failure is its answer
            sim._reject(r, FAILED, 500, f"worker {w.id} answered 500", now)
        return True
