"""Pick the state backend: Redis when a URL is given, otherwise the in-process store."""

from __future__ import annotations

from typing import Any

from gateway.state.base import StateStore


def make_store(redis_url: str | None, replica_id: str | None = None, **opts: Any) -> StateStore:
    """Build (not start) a store. `await store.start()` connects; RedisStore.start raises if Redis is down.

    opts go to RedisStore (key_prefix, lease_ttl_s, refresh_interval_s, socket_timeout_s); MemoryStore
    takes none and rejects them so a typo does not pass silently.
    """
    if redis_url:
        from gateway.state.redis_store import RedisStore

        return RedisStore(redis_url, replica_id=replica_id, **opts)
    from gateway.state.memory import MemoryStore

    if opts:
        raise TypeError(f"MemoryStore takes no options; got {', '.join(sorted(opts))} (set a Redis URL?)")
    return MemoryStore(replica_id=replica_id)
