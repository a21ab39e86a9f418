"""Model fallbacks in the virtual-time simulator, by the gateway's rules (policies/fallbacks.py): a request its
model could not serve before a byte (refused at the caps, its worker's 5xx with nobody else free, no worker)
moves to the first of the model's `fallbacks` it has not tried, as the gateway's attempt loop does
(gateway/pipeline/attempts.py `place_again`, FALL_BACK; no chains: a fallback's own list is not followed).

Each model is one ClusterSim (its workers, placement step and admission queue). A fallback model's run cannot
change the requested model's (a request only ever moves forward through the list, and nothing flows back), so
the runs go one after the other, each fallback model's arrivals being the requests that moved to it, at the
instant they left the model before it: the same events, in the same order, as one loop over all of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from policies.fallbacks import failure_reason, fallback_targets, refusal_reason
from simulator.cluster import ClusterSim, RequestResult
from simulator.workload import WorkloadRequest


@dataclass(frozen=True, slots=True)
class Served:
    """Where a request ended: the model whose simulator answered it, and its result there."""

    model: str
    result: RequestResult


def fallback_reason(res: RequestResult) -> str | None:
    """Why a request's result lets it fall back (policies/fallbacks.py), or None: a refusal by the gateway (429 at
    the caps or the queue, 503 no worker), or its last worker's 5xx."""
    if res.status in (429, 503):
        return refusal_reason(res.status)
    if res.status is not None and res.status >= 500:
        return failure_reason(res.status, False, False)
    return None


def run_with_fallbacks(sims: Mapping[str, ClusterSim], model: str, fallbacks: Sequence[str],
                       workload: Sequence[WorkloadRequest], until: float | None = None) -> dict[str, Served]:
    """Run `workload` for `model` (sims[model]), then each of its `fallbacks` in order (sims[name]) over the
    requests that moved to it; request id -> where it ended."""
    by_id = {r.request_id: r for r in workload}
    out = {r.request_id: Served(model, r) for r in sims[model].run(workload, until=until).results}
    tried = {rid: [model] for rid in out}
    for target in fallbacks:
        moving = []
        for rid, served in out.items():
            reason = fallback_reason(served.result)
            if reason is None:
                continue
            targets = fallback_targets(fallbacks, (), reason, {}, tried[rid])
            if targets and targets[0] == target:
                moving.append(replace(by_id[rid], arrival=served.result.finished))
        if not moving:
            continue
        for r in sims[target].run(moving, until=until).results:
            out[r.request_id] = Served(target, r)
            tried[r.request_id].append(target)
    return out
