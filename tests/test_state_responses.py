"""Stored Responses-API responses in both state backends (gateway/state/responses.py): keyed by tenant, expiring,
and bounded in memory."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from gateway.state.jobs import StoreUnavailableError
from gateway.state.memory import MemoryStore
from gateway.state.redis_store import RedisStore


async def check_tenant_keyed_and_expiring(store) -> None:  # noqa: ANN001
    await store.put_response("ta", "resp_1", b'{"a": 1}', 30.0)
    assert await store.get_response("ta", "resp_1") == b'{"a": 1}'
    assert await store.get_response("tb", "resp_1") is None     # another tenant's id: not found
    assert await store.delete_response("tb", "resp_1") is False
    assert await store.get_response("ta", "resp_1") == b'{"a": 1}'
    assert await store.delete_response("ta", "resp_1") is True
    assert await store.get_response("ta", "resp_1") is None
    await store.put_response("ta", "resp_2", b"{}", 0.05)
    await asyncio.sleep(0.3)
    assert await store.get_response("ta", "resp_2") is None


async def test_memory_store_keeps_responses_by_tenant_with_a_ttl_and_a_total_bound() -> None:
    store = MemoryStore()
    await check_tenant_keyed_and_expiring(store)
    for i in range(10):
        await store.put_response("t", f"r{i}", b"x" * 100, 30.0, max_total_bytes=450)
    kept = [i for i in range(10) if await store.get_response("t", f"r{i}") is not None]
    assert kept == [6, 7, 8, 9]    # the oldest dropped first, at most 450 bytes kept
    await store.put_response("t", "big", b"y" * 1000, 30.0, max_total_bytes=450)
    assert await store.get_response("t", "big") is not None   # one record over the bound alone is still kept


@pytest.mark.redis
async def test_redis_store_keeps_responses_by_tenant_with_a_ttl(redis_url, redis_prefix) -> None:
    store = RedisStore(redis_url, replica_id="resp-a", key_prefix=redis_prefix)
    await store.start()
    try:
        await check_tenant_keyed_and_expiring(store)
        await store.put_response("ta", "resp_3", b"{}", 60.0)
        raw = aioredis.from_url(redis_url)
        ttl = await raw.pttl(redis_prefix + "resp:ta:resp_3")
        await raw.aclose()
        assert 50_000 < ttl <= 60_000
        other = RedisStore(redis_url, replica_id="resp-b", key_prefix=redis_prefix)
        await other.start()
        try:
            assert await other.get_response("ta", "resp_3") == b"{}"   # another replica reads it
        finally:
            await other.close()
    finally:
        await store.close()
    with pytest.raises((StoreUnavailableError, RuntimeError)):
        await store.get_response("ta", "resp_3")   # closed: never a silent None
