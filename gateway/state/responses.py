"""Stored Responses-API responses (gateway/api/responses.py): a response and the conversation it ends, kept so
that `previous_response_id` rebuilds the conversation on any replica and any worker.

`ResponseDocs` is the interface (StateStore inherits it); `MemoryResponses` and `RedisResponses` are the two
implementations, mixed into MemoryStore and RedisStore as the batch work is (gateway/state/jobs.py). A record is
an opaque JSON document the front door builds, keyed by tenant and response id, so another key's id is simply not
found. Each record expires `ttl_s` after it was written. Size bounds: the front door stores no record over
`responses.max_bytes`; the in-memory store also keeps at most `responses.max_total_bytes` of records, dropping the
oldest first; Redis keeps what its own `maxmemory` policy allows (the keys have a TTL, so `volatile-*` policies
can evict them).

Redis keys (after the store's prefix):
  resp:<tenant id>:<response id>   str   the record (JSON), with a PX expiry
"""

from __future__ import annotations

import time
from collections import OrderedDict

from gateway.state.jobs_redis import _guard


class ResponseDocs:
    """Stored responses, by tenant and id. With Redis, a call while it is away raises StoreUnavailableError."""

    async def put_response(self, tenant: str, rid: str, record: bytes, ttl_s: float,
                           max_total_bytes: int | None = None) -> None:
        """Keep `record` for `ttl_s` seconds (`max_total_bytes`: the in-process store's bound on all records)."""
        raise NotImplementedError

    async def get_response(self, tenant: str, rid: str) -> bytes | None:
        raise NotImplementedError

    async def delete_response(self, tenant: str, rid: str) -> bool:
        """True if it was there."""
        raise NotImplementedError


class MemoryResponses(ResponseDocs):
    """Records in insertion order (the oldest is dropped first when `max_total_bytes` is reached)."""

    def _records(self) -> OrderedDict[tuple[str, str], tuple[float, bytes]]:
        return self.__dict__.setdefault("_responses", OrderedDict())

    async def put_response(self, tenant: str, rid: str, record: bytes, ttl_s: float,
                           max_total_bytes: int | None = None) -> None:
        recs = self._records()
        now = time.monotonic()
        total = self.__dict__.get("_responses_bytes", 0)
        old = recs.pop((tenant, rid), None)
        if old is not None:
            total -= len(old[1])
        recs[(tenant, rid)] = (now + ttl_s, record)
        total += len(record)
        while recs and (next(iter(recs.values()))[0] <= now
                        or (max_total_bytes is not None and total > max_total_bytes and len(recs) > 1)):
            _, (_, dropped) = recs.popitem(last=False)
            total -= len(dropped)
        self.__dict__["_responses_bytes"] = total

    async def get_response(self, tenant: str, rid: str) -> bytes | None:
        hit = self._records().get((tenant, rid))
        if hit is None or hit[0] <= time.monotonic():
            return None
        return hit[1]

    async def delete_response(self, tenant: str, rid: str) -> bool:
        hit = self._records().pop((tenant, rid), None)
        if hit is None:
            return False
        self.__dict__["_responses_bytes"] = self.__dict__.get("_responses_bytes", 0) - len(hit[1])
        return hit[0] > time.monotonic()


class RedisResponses(ResponseDocs):
    """Uses the host RedisStore's binary client (`_binary()`), key prefix (`_k()`) and outage state."""

    def _rkey(self, tenant: str, rid: str) -> str:
        return self._k(f"resp:{tenant}:{rid}")  # type: ignore[attr-defined]

    @_guard
    async def put_response(self, tenant: str, rid: str, record: bytes, ttl_s: float,
                           max_total_bytes: int | None = None) -> None:
        ttl_ms = max(1, int(ttl_s * 1000))
        await self._binary().set(self._rkey(tenant, rid), record, px=ttl_ms)  # type: ignore[attr-defined]

    @_guard
    async def get_response(self, tenant: str, rid: str) -> bytes | None:
        return await self._binary().get(self._rkey(tenant, rid))  # type: ignore[attr-defined]

    @_guard
    async def delete_response(self, tenant: str, rid: str) -> bool:
        return bool(await self._binary().delete(self._rkey(tenant, rid)))  # type: ignore[attr-defined]
