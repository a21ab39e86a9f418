"""In-process state store: plain dicts, exact counters, nothing to start.

The default backend for a single gateway process. asyncio runs one coroutine at a time and
`try_reserve` never awaits between its check and its update, so the cap holds exactly.
"""

from __future__ import annotations

import copy
import os
import socket
import time

import orjson

from gateway.state.base import EngineMetrics, Inflight, StateStore, WorkerRecord
from gateway.state.jobs_memory import MemoryJobs
from gateway.state.ratelimit import LocalBuckets, Ticket
from gateway.state.responses import MemoryResponses


def default_replica_id() -> str:
    """host-pid: unique enough for one machine, readable in Redis keys and logs."""
    return f"{socket.gethostname()}-{os.getpid()}"


class MemoryStore(MemoryJobs, MemoryResponses, StateStore):
    """All state in this process. `inflight()` is exact and costs O(workers) for the copy only."""

    def __init__(self, replica_id: str | None = None) -> None:
        self.replica_id = replica_id or default_replica_id()
        self._workers: dict[str, WorkerRecord] = {}
        self._metrics: dict[str, EngineMetrics] = {}
        # worker -> {request_id: tokens}; the source of truth for release.
        self._reservations: dict[str, dict[str, int]] = {}
        # worker -> running totals. Inflight objects are replaced, never mutated, so a dict returned by
        # inflight() is a true snapshot.
        self._inflight: dict[str, Inflight] = {}
        self._docs: dict[str, bytes] = {}
        self._tickets: dict[str, Ticket] = {}  # request id -> ticket of a limited key (gateway/state/ratelimit.py)
        self._buckets = LocalBuckets()

    async def close(self) -> None:
        self.close_files()

    # --- registry -------------------------------------------------------------------------------
    async def upsert_worker(self, rec: WorkerRecord) -> None:
        self._workers[rec.id] = copy.deepcopy(rec)

    async def remove_worker(self, worker_id: str) -> None:
        # Reservations stay: requests already on the worker still finish and release.
        self._workers.pop(worker_id, None)
        self._metrics.pop(worker_id, None)

    async def list_workers(self) -> list[WorkerRecord]:
        return [copy.deepcopy(rec) for rec in self._workers.values()]

    # --- scraped engine metrics ------------------------------------------------------------------
    async def put_metrics(self, worker_id: str, metrics: EngineMetrics) -> None:
        self._metrics[worker_id] = copy.copy(metrics)

    async def get_metrics(self) -> dict[str, EngineMetrics]:
        return {wid: copy.copy(m) for wid, m in self._metrics.items()}

    # --- reservations (hot path) -----------------------------------------------------------------
    async def try_reserve(self, worker_id: str, request_id: str, cap: int | None, tokens: int = 0) -> bool:
        held = self._reservations.get(worker_id)
        if held is None:
            held = self._reservations[worker_id] = {}
        elif request_id in held:
            return True  # idempotent: the same request already holds a slot here
        if cap is not None and len(held) >= cap:
            return False
        t = self._tickets.get(request_id) if self._tickets else None
        if t is not None:
            if not t.charged:
                self._buckets.charge(t, time.monotonic() * 1000)  # raises RateLimited: nothing reserved
                t.charged = True
            t.holds += 1
            self._buckets.hold(t)
        held[request_id] = tokens
        cur = self._inflight.get(worker_id)
        self._inflight[worker_id] = (
            Inflight(1, tokens) if cur is None else Inflight(cur.requests + 1, cur.tokens + tokens)
        )
        return True

    async def release(self, worker_id: str, request_id: str) -> None:
        self.release_nowait(worker_id, request_id)

    def release_nowait(self, worker_id: str, request_id: str) -> bool:
        held = self._reservations.get(worker_id)
        if not held or request_id not in held:
            return True  # unknown or already released: releasing twice is harmless
        tokens = held.pop(request_id)
        cur = self._inflight[worker_id]
        self._inflight[worker_id] = Inflight(cur.requests - 1, cur.tokens - tokens)
        t = self._tickets.get(request_id) if self._tickets else None
        if t is not None:
            t.holds -= 1
            if t.holds <= 0:
                self._buckets.unhold(t)
        return True

    # --- per-key limits --------------------------------------------------------------------------------
    def open_ticket(self, ticket: Ticket) -> None:
        self._tickets[ticket.request_id] = ticket

    def close_ticket(self, ticket: Ticket, used_tokens: int) -> None:
        if self._tickets.get(ticket.request_id) is ticket:
            del self._tickets[ticket.request_id]
        self._buckets.unhold(ticket)
        if ticket.charged and ticket.limits.tpm is not None:
            self._buckets.settle(ticket.tenant_id, ticket.limits.tpm, ticket.cost - used_tokens,
                                 time.monotonic() * 1000)

    def inflight(self) -> dict[str, Inflight]:
        return dict(self._inflight)

    # --- shared documents ------------------------------------------------------------------------
    # Stored as JSON, as the Redis store keeps them: the same documents round-trip the same way on both
    # backends, and encoding + decoding is ~5x cheaper than copy.deepcopy (learning samples run to thousands).
    async def put_doc(self, key: str, doc: dict) -> None:
        self._docs[key] = orjson.dumps(doc)

    async def get_doc(self, key: str) -> dict | None:
        raw = self._docs.get(key)
        return orjson.loads(raw) if raw is not None else None

    async def get_docs(self, prefix: str) -> dict[str, dict]:
        return {k: orjson.loads(v) for k, v in self._docs.items() if k.startswith(prefix)}

    async def delete_doc(self, key: str) -> None:
        self._docs.pop(key, None)
