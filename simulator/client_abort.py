"""A client that goes away, in the virtual-time cluster: what the gateway does when a client closes its stream
(the leg is cancelled, the engine aborts the request, the reservation is given back and the placement step hears
that the request ended on its worker with no output), as a ClusterSim event.

    sim.schedule(t, lambda s, now: abort_request(s, "r7", now))

The parity test (tests/test_pipeline_parity_stream.py) replays a client's closes on both sides with it.
"""

from __future__ import annotations

from simulator.cluster import ClusterSim

ABORTED = "abort"


def abort_request(sim: ClusterSim, request_id: str, now: float) -> bool:
    """Abort a request in flight (False: it is not in flight, e.g. it finished or was refused)."""
    entry = sim._pending.pop(request_id, None)
    if entry is None:
        return False
    r, feats = entry
    res = sim.results[request_id]
    w = sim.workers.get(res.worker_id or "")
    if w is None:
        sim._pending[request_id] = entry
        return False
    if w.step_end is not None and w.step_end > now:
        sim._truncate(w, now)
    w.engine.abort(request_id, now)
    res.finish_reason, res.finished = ABORTED, now
    sim._complete(w, r, feats, now)
    return True
