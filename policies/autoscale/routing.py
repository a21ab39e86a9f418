"""Pool-aware routing for Chiron's worker types (section 3), as a routing policy.

A request goes to its own pool first (interactive -> `interactive` workers, batch -> `batch` workers) and
spills to `mixed` workers when its own pool has no room (`has_room`: under its cap, and its engine
queues nothing); within a pool, the worker with the lowest in-flight / cap ratio wins. A worker's pool is its `labels["pool"]`; unlabelled workers are mixed.
When an interactive request finds no room at all, `eviction_victim` names a mixed worker whose batch
request can be sent back to the queue (mixed workers are preemptible, section 3).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from policies.autoscale.global_ import POOL_BATCH, POOL_INTERACTIVE, POOL_MIXED
from policies.base import Policy
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


class PoolRouter(Policy):
    name = "pool_router"

    def choose(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float) -> Decision:
        for pool in PREFERENCE.get(request.request_class, DEFAULT_PREFERENCE):
            best: WorkerView | None = None
            best_key: tuple[float, int] | None = None
            for w in workers:
                if pool_of(w) != pool or not has_room(w):
                    continue
                key = _fill(w)
                if best_key is None or key < best_key:
                    best, best_key = w, key
            if best is not None:
                return Decision(best.id, f"pool:{pool}")
        return Decision(None, "no room in own pool or mixed")


def eviction_victim(workers: Sequence[WorkerView], batch_inflight: Mapping[str, int]) -> str | None:
    """The mixed worker to free a slot on for an interactive request: the one running the most batch work."""
    best: str | None = None
    most = 0
    for w in workers:
        n = batch_inflight.get(w.id, 0)
        if pool_of(w) == POOL_MIXED and n > most:
            best, most = w.id, n
    return best
