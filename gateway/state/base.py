"""The state-store interface (INTERFACE CONTRACT shared by gateway/ and its tests).

Two backends implement it: `gateway.state.memory.MemoryStore` (default, one process) and
`gateway.state.redis_store.RedisStore` (many gateway replicas acting as one). Reservations are the hot
path: `try_reserve` is called once per request at dispatch and `release` once at completion;
`inflight()` is a synchronous read of a cached view that the dispatcher may call per request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_adapters.types import EngineMetrics
from gateway.state.jobs import JobStore, StoreUnavailableError
from gateway.state.responses import ResponseDocs

if TYPE_CHECKING:
    from gateway.state.ratelimit import Ticket

__all__ = ["EngineMetrics", "Inflight", "StateStore", "StoreUnavailableError", "WorkerRecord"]

WORKER_ACTIVE = "active"
WORKER_DRAINING = "draining"


@dataclass(slots=True)
class WorkerRecord:
    """A registered worker (from config or the admin API)."""

    id: str
    url: str
    role: str = "mixed"                 # mixed | prefill | decode
    models: list[str] = field(default_factory=list)   # filled by discovery from /v1/models when empty
    labels: dict[str, str] = field(default_factory=dict)
    profile: str = ""                   # simulator/perf profile name, informational
    cap: int | None = None              # max concurrent requests the gateway puts on it (None: no cap)
    state: str = WORKER_ACTIVE          # active | draining
    healthy: bool = True
    source: str = "config"              # config | admin


@dataclass(slots=True)
class Inflight:
    requests: int = 0
    tokens: int = 0


class StateStore(JobStore, ResponseDocs, ABC):
    """What the gateway shares between its control loops and, with Redis, between replicas.

    Batch files, batch objects, the durable batch queue and leases: gateway/state/jobs.py (JobStore).
    Stored Responses-API responses: gateway/state/responses.py (ResponseDocs).
    """

    replica_id: str

    async def start(self) -> None:  # noqa: B027 - optional
        """Open connections and start background loops (leases, refresh)."""

    def reachable(self) -> bool:
        """False while a networked store cannot be reached (the gateway runs on local accounting then)."""
        return True

    async def close(self) -> None:  # noqa: B027 - optional
        """Stop loops and release this replica's reservations."""

    # --- registry -------------------------------------------------------------------------------
    @abstractmethod
    async def upsert_worker(self, rec: WorkerRecord) -> None: ...

    @abstractmethod
    async def remove_worker(self, worker_id: str) -> None: ...

    @abstractmethod
    async def list_workers(self) -> list[WorkerRecord]: ...

    # --- scraped engine metrics ------------------------------------------------------------------
    @abstractmethod
    async def put_metrics(self, worker_id: str, metrics: EngineMetrics) -> None: ...

    @abstractmethod
    async def get_metrics(self) -> dict[str, EngineMetrics]: ...

    # --- reservations (hot path) -----------------------------------------------------------------
    @abstractmethod
    async def try_reserve(self, worker_id: str, request_id: str, cap: int | None, tokens: int = 0) -> bool:
        """Atomically: if fewer than `cap` requests (all replicas) are reserved on the worker, reserve one."""

    @abstractmethod
    async def release(self, worker_id: str, request_id: str) -> None: ...

    def release_nowait(self, worker_id: str, request_id: str) -> bool:
        """Release at once when no I/O is needed (True: done, `release` must not follow); False: call `release`.
        Spares the hot path a coroutine (and, with a networked store, the task shielding it from cancellation)."""
        return False

    @abstractmethod
    def inflight(self) -> dict[str, Inflight]:
        """Cached in-flight reservations per worker, summed over replicas (no I/O)."""

    def own_inflight(self, worker_id: str) -> int:
        """This replica's own requests in flight on the worker, exact (no I/O)."""
        f = self.inflight().get(worker_id)
        return f.requests if f is not None else 0

    async def live_replicas(self) -> list[str]:
        """The ids of the gateway replicas sharing this store now (their leases not expired)."""
        return [self.replica_id]

    # --- per-key limits (gateway/state/ratelimit.py) -----------------------------------------------------
    # A request of a limited key has an open ticket from dispatch to its end: its first successful
    # try_reserve also takes the key's request and tokens (atomically with the reservation, or raises
    # RateLimited and reserves nothing); its reservations count against the key's concurrency.
    @abstractmethod
    def open_ticket(self, ticket: Ticket) -> None: ...

    @abstractmethod
    def close_ticket(self, ticket: Ticket, used_tokens: int) -> None:
        """The request ended having used `used_tokens`: return the rest of its reservation (no I/O here;
        a networked store sends it with its next call)."""

    # --- releases elsewhere (the admission queue's wake-up) -------------------------------------------
    def on_remote_release(self, fn: Callable[[str | None], None]) -> None:
        """Call `fn(worker_id)` when another gateway replica frees a slot on a worker while requests wait here
        (`set_waiting`); `fn(None)`: any worker may have room. A store only this process uses never calls it:
        its releases are local."""
        self.__dict__.setdefault("_release_hooks", []).append(fn)

    def remote_release_hooks(self) -> list[Callable[[str | None], None]]:
        return list(self.__dict__.get("_release_hooks", ()))

    def set_waiting(self, waiting: int) -> None:  # noqa: B027 - optional
        """How many requests wait in this replica's admission queues (a networked store tells the others,
        so their releases are announced only while somebody waits)."""

    # --- recovery ----------------------------------------------------------------------------------
    def on_restore(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Call `fn` when the shared store is found empty (restarted without its data): the gateway's
        parts write back what they hold (workers, keys). A store that cannot lose its data never calls it."""
        self.__dict__.setdefault("_restore_hooks", []).append(fn)

    def restore_hooks(self) -> list[Callable[[], Awaitable[None]]]:
        return list(self.__dict__.get("_restore_hooks", ()))

    # --- shared documents (control loops only: fitted models, predictor state) -------------------
    # Small JSON-able dicts under string keys; last writer wins. Not for the hot path.
    async def put_doc(self, key: str, doc: dict) -> None:
        raise NotImplementedError

    async def get_doc(self, key: str) -> dict | None:
        raise NotImplementedError

    async def get_docs(self, prefix: str) -> dict[str, dict]:
        """Every document whose key starts with `prefix`, by key."""
        raise NotImplementedError

    async def delete_doc(self, key: str) -> None:
        raise NotImplementedError
