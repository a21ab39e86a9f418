"""MemoryStore: registry and metrics round-trip, exact cap under concurrent coroutines, exact counters."""

from __future__ import annotations

import asyncio

import pytest

from gateway.state.base import EngineMetrics, Inflight, WorkerRecord
from gateway.state.factory import make_store
from gateway.state.memory import MemoryStore


async def test_registry_round_trip_and_copies():
    store = MemoryStore(replica_id="r1")
    rec = WorkerRecord(id="w1", url="http://127.0.0.1:9001", models=["m"], labels={"zone": "a"}, cap=8)
    await store.upsert_worker(rec)
    await store.upsert_worker(WorkerRecord(id="w2", url="http://127.0.0.1:9002", role="decode"))
    rec.models.append("mutated-after-upsert")
    listed = {r.id: r for r in await store.list_workers()}
    assert listed["w1"] == WorkerRecord(id="w1", url="http://127.0.0.1:9001", models=["m"], labels={"zone": "a"}, cap=8)
    assert listed["w2"].role == "decode"
    listed["w1"].labels["zone"] = "b"  # a caller's edit must not leak into the store
    assert (await store.list_workers())[0].labels == {"zone": "a"}
    await store.remove_worker("w1")
    await store.remove_worker("absent")
    assert [r.id for r in await store.list_workers()] == ["w2"]


async def test_metrics_round_trip():
    store = MemoryStore()
    m = EngineMetrics(running=3, waiting=1, kv_usage=0.42, num_gpu_blocks=1000, block_size=16, scraped_at=12.5)
    await store.put_metrics("w1", m)
    assert (await store.get_metrics()) == {"w1": m}
    await store.remove_worker("w1")
    assert await store.get_metrics() == {}


async def test_cap_exact_under_concurrent_coroutines():
    store = MemoryStore()
    held = 0
    max_held = 0

    async def client(i: int) -> int:
        nonlocal held, max_held
        wins = 0
        for j in range(50):
            rid = f"c{i}-{j}"
            if await store.try_reserve("w", rid, cap=5, tokens=10):
                wins += 1
                held += 1
                max_held = max(max_held, held)
                assert store.inflight()["w"].requests <= 5
                await asyncio.sleep(0)
                held -= 1
                await store.release("w", rid)
            else:
                await asyncio.sleep(0)
        return wins

    wins = await asyncio.gather(*(client(i) for i in range(20)))
    assert max_held == 5  # the cap was reached and never exceeded
    assert sum(wins) >= 5
    assert store.inflight()["w"] == Inflight(0, 0)


async def test_inflight_counts_tokens_and_is_a_snapshot():
    store = MemoryStore()
    assert await store.try_reserve("w1", "a", cap=None, tokens=100)
    assert await store.try_reserve("w1", "b", cap=None, tokens=50)
    assert await store.try_reserve("w2", "c", cap=1, tokens=7)
    assert not await store.try_reserve("w2", "d", cap=1, tokens=7)
    snap = store.inflight()
    assert snap == {"w1": Inflight(2, 150), "w2": Inflight(1, 7)}
    # Same request twice is one reservation; unknown and double releases are no-ops.
    assert await store.try_reserve("w1", "a", cap=2, tokens=100)
    await store.release("w1", "zzz")
    await store.release("w1", "a")
    await store.release("w1", "a")
    assert store.inflight()["w1"] == Inflight(1, 50)
    assert snap["w1"] == Inflight(2, 150)  # the earlier snapshot did not change under us


def test_factory_picks_backend():
    assert isinstance(make_store(None, replica_id="x"), MemoryStore)
    assert make_store("", replica_id="x").replica_id == "x"
    with pytest.raises(TypeError, match="lease_ttl_s"):
        make_store(None, lease_ttl_s=1.0)
    from gateway.state.redis_store import RedisStore

    store = make_store("redis://127.0.0.1:6379/15", replica_id="r9", key_prefix="fgtest:")
    assert isinstance(store, RedisStore) and store.replica_id == "r9"
