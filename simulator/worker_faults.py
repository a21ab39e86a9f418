"""A worker that fails, in the virtual-time cluster: every request that reaches it is answered 5xx before a byte
(what `POST /sim/faults {"error_status": 500}` does to a simulated vLLM server), and the simulator does what the
gateway does about it, with the same rules:

- the attempt loop's RETRY (gateway/pipeline/attempts.py `place_again`): the reservation is given back, the
  placement step hears that the request ended there with no output, and it is placed again through the placement
  step without the workers it tried; no worker with room: the worker's 500 is the answer (the gateway relays the
  last failure once nobody else can take the request);
- a P/D request (placed by the P/D profile: `ModelPlacement.dispatched`) whose decode worker fails its decode
  leg (with the prefill worker's KV, or prefilling locally) has its decode leg placed again as the attempt loop's
  RETRY does for P/D (`place_again` -> `_place_decode`): the old reservation is given back without telling the
  placement step, the P/D policy picks another decode-capable worker it has not tried (`retry_decode`), the
  placement step hears the move (`moved`), and that worker prefills locally; none: the placement step forgets the
  request and the 500 is its answer;
- a P/D prefill leg that fails on its prefill worker is placed again as the attempt loop's REPLACE_PREFILL does
  (`_prefill` -> `_another_prefill`): another prefill worker it has not tried (`retry_prefill`), at most
  `attempts` prefill legs; none: the decode worker prefills locally;
- outlier ejection (gateway/fleet/registry.py `note_outcome`): `error_streak` of policies/pace.py with the
  gateway's default `resume.eject_after_errors`; an ejected worker leaves the simulated fleet (the gateway holds
  it out and probes it with a generation, which a failing worker fails, so it stays out).

    faults = WorkerFaults.install(sim)
    sim.schedule(t, lambda s, now: faults.fail("w2"))
"""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.pace import EJECT_AFTER_ERRORS, error_streak
from policies.placement import has_room, reserved_tokens
from policies.types import ROLE_DECODE, ROLE_MIXED, ROLE_PREFILL, RequestFeatures
from simulator.cluster import ClusterSim, SimWorker, _PdLeg
from simulator.workload import WorkloadRequest

FAILED = "failed"   # RequestResult.finish_reason of a request whose last worker failed it
ATTEMPTS = 3        # legs a request may take per kind: the gateway's default limits.retries (2) + 1
LOCAL = "local"     # a re-placed prefill leg's destination when no prefill worker takes it


@dataclass
class WorkerFaults:
    """The failing workers of one ClusterSim and what their failures did."""

    eject_after_errors: int = EJECT_AFTER_ERRORS
    attempts: int = ATTEMPTS
    failing: set[str] = field(default_factory=set)
    retries: list[tuple[str, str]] = field(default_factory=list)   # (request, the worker that failed it)
    # P/D re-placements, in order: (request, the worker that failed the leg, where the leg went: a worker id,
    # LOCAL for a prefill leg the decode worker takes over, or None when nobody took a decode leg)
    decode_replacements: list[tuple[str, str, str | None]] = field(default_factory=list)
    prefill_replacements: list[tuple[str, str, str]] = field(default_factory=list)
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

    def _failed(self, sim: ClusterSim, w: SimWorker, now: float) -> None:
        """The leg runner's report of a failure: the worker's error streak, ejected at `eject_after_errors`."""
        self._in_row[w.id], eject = error_streak(self._in_row.get(w.id, 0), False, self.eject_after_errors)
        if eject:
            self.ejected.append((w.id, now))
            sim.remove_worker(w.id, now)

    def fails(self, sim: ClusterSim, w: SimWorker, r: WorkloadRequest, feats: RequestFeatures, now: float,
              pd: bool = False) -> bool:
        """Called as a request is sent to w (its answer comes at once: a failing worker answers before its
        engine sees the request): False when w serves it; True when w failed it (and the request was placed
        again, or answered with the failure). `pd`: the P/D profile placed it (its decode worker prefills
        locally): its decode leg is placed again (module docstring)."""
        if w.id not in self.failing:
            return False
        rid = r.request_id
        if pd:
            w.reserve(reserved_tokens(feats), -1)
            self._failed(sim, w, now)
            self._replace_decode(sim, r, feats, w, now)
            return True
        del sim._pending[rid]
        w.reserve(reserved_tokens(feats), -1)
        sim.placement.finished(feats, w.id, 0, now)
        self.retries.append((rid, w.id))
        self._failed(sim, w, now)
        tried = self._tried.setdefault(rid, set())
        tried.add(w.id)
        if sim._try_dispatch(r, feats, now, tried) is not None:   # nobody else: the failure is its answer
            sim._reject(r, FAILED, 500, f"worker {w.id} answered 500", now)
        return True

    def decode_leg_fails(self, sim: ClusterSim, leg: _PdLeg, now: float) -> bool:
        """Called as a P/D request's decode leg (with the prefill worker's KV) is sent: False when its decode
        worker serves it; True when it failed it (the leg was placed again, prefilling locally)."""
        w = leg.decode
        if w.id not in self.failing:
            return False
        r, feats = sim._pending[leg.request_id]
        w.reserve(reserved_tokens(feats), -1)
        self._failed(sim, w, now)
        new = self._replace_decode(sim, r, feats, w, now)
        if new is not None:
            leg.decode = new   # the producer's KV is let go at the new leg's first token, as before
        return True

    def _replace_decode(self, sim: ClusterSim, r: WorkloadRequest, feats: RequestFeatures, old: SimWorker,
                        now: float) -> SimWorker | None:
        """Another decode-capable worker for the request's decode leg (it prefills locally), or its failure."""
        rid = r.request_id
        tried = self._tried.setdefault(rid, set())
        tried.add(old.id)
        views = [sim._view(x, now) for x in sim.workers.values()
                 if not x.draining and x.role in (ROLE_DECODE, ROLE_MIXED) and x.id not in tried
                 and has_room(x.inflight, x.cap)]
        wid = sim.placement.retry_decode(feats, views, now) if views else None
        new = sim.workers.get(wid) if wid is not None else None
        res = sim.results[rid]
        self.decode_replacements.append((rid, old.id, new.id if new is not None else None))
        if new is None:
            sim.placement.finished(feats, old.id, 0, now)
            del sim._pending[rid]
            leg = sim._pd_legs.pop(rid, None)
            if leg is not None:        # the producer's KV is not read: let it go
                leg.prefill.engine.release_remote(leg.prefill_id, now)
            sim._reject(r, FAILED, 500, f"worker {old.id} answered 500", now)
            sim._maybe_retire(old, now)
            return None
        sim.placement.moved(feats, old.id, new.id, now)
        new.reserve(reserved_tokens(feats))
        res.worker_id, res.dispatched = new.id, now
        sim._maybe_retire(old, now)
        sim._send(new, rid, now)
        return new

    def prefill_leg(self, sim: ClusterSim, r: WorkloadRequest, feats: RequestFeatures, wp: SimWorker,
                    now: float) -> SimWorker | None:
        """Called as a P/D request's prefill leg is sent to wp (reserved): the prefill worker that serves it,
        or None when the decode worker prefills locally (module docstring)."""
        rid = r.request_id
        tried: set[str] = set()
        for attempt in range(self.attempts):
            if wp.id not in self.failing:
                return wp
            wp.reserve(r.prompt_tokens, -1)
            self._failed(sim, wp, now)
            tried.add(wp.id)
            nxt = None
            if attempt + 1 < self.attempts:
                views = [sim._view(x, now) for x in sim.workers.values()
                         if not x.draining and x.role == ROLE_PREFILL and x.id not in tried
                         and has_room(x.inflight, x.cap)]
                wid = sim.placement.retry_prefill(feats, views) if views else None
                nxt = sim.workers.get(wid) if wid is not None else None
            self.prefill_replacements.append((rid, wp.id, nxt.id if nxt is not None else LOCAL))
            sim._maybe_retire(wp, now)
            if nxt is None:
                return None
            nxt.reserve(r.prompt_tokens)
            wp = nxt
        return None
