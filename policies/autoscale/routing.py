"""Pool-aware routing for Chiron's worker types (section 3): the placement step's pool filter and a policy.

A request goes to its own pool first (interactive -> `interactive` workers, batch -> `batch` workers) and
spills to `mixed` workers when its own pool has no room (`has_room`: under its cap, and its engine
queues nothing); within a pool, the worker with the lowest in-flight / cap ratio wins. A worker's pool is its `labels["pool"]`; unlabelled workers are mixed.
When an interactive request finds no room at all, `eviction_victim` names a mixed worker whose batch
request can be sent back to the queue (mixed workers are preemptible, section 3).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from policies.autoscale.global_ import POOL_BATCH, POOL_INTERACTIVE, POOL_MIXED
from policies.base import Policy, register
from policies.types import CLASS_BATCH, Decision, RequestFeatures, WorkerView

PREFERENCE = {CLASS_BATCH: (POOL_BATCH, POOL_MIXED)}
DEFAULT_PREFERENCE = (POOL_INTERACTIVE, POOL_MIXED)


def pool_of(w: WorkerView) -> str:
    return w.labels.get("pool", POOL_MIXED)


def _fill(w: WorkerView) -> tuple[float, int]:
    return (w.inflight / w.cap if w.cap else w.inflight / 1e9), w.inflight


def has_room(w: WorkerView) -> bool:
    """The engine runs everything sent to it (as of its last scrape): nothing waits inside it.

    The cluster already filtered on the cap; this keeps queueing at the gateway, where a request can
    still go elsewhere (or be evicted back to the batch queue), instead of behind work inside an engine.
    """
    return w.waiting == 0 and w.inflight <= w.running


def pools_in_use(workers: Sequence[WorkerView]) -> bool:
    """Do any of the workers carry a pool label other than mixed (Chiron's worker types in use)?"""
    return any(w.labels.get("pool", POOL_MIXED) != POOL_MIXED for w in workers)


def pool_filter(request: RequestFeatures, workers: Sequence[WorkerView]) -> list[WorkerView]:
    """The workers a request may use: those with room in its own pool, else those with room in the mixed pool
    (Chiron section 3); empty when neither has room (the request waits at the gateway, where it can still go
    elsewhere or, being batch work, be evicted back to the batch queue)."""
    for pool in PREFERENCE.get(request.request_class, DEFAULT_PREFERENCE):
        mine = [w for w in workers if pool_of(w) == pool and has_room(w)]
        if mine:
            return mine
    return []


@register("least_fill")
class PoolRouter(Policy):
    """The worker with the lowest in-flight / cap ratio (ties: fewer in flight); with the placement step's pool
    filter (policies/placement.py) in front, Chiron's routing of section 3."""

    name = "least_fill"

    def choose(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float) -> Decision:
        best: WorkerView | None = None
        best_key: tuple[float, int] | None = None
        for w in workers:
            key = _fill(w)
            if best_key is None or key < best_key:
                best, best_key = w, key
        if best is None:
            return Decision(None, "no_workers")
        return Decision(best.id, f"pool:{pool_of(best)}")


def eviction_victim(workers: Sequence[WorkerView], batch_inflight: Mapping[str, int]) -> str | None:
    """The mixed worker to free a slot on for an interactive request: the one running the most batch work."""
    best: str | None = None
    most = 0
    for w in workers:
        n = batch_inflight.get(w.id, 0)
        if pool_of(w) == POOL_MIXED and n > most:
            best, most = w.id, n
    return best
