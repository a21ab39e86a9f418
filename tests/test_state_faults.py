"""The state store failing under the gateway: Redis wiped (restarted empty, flushed) and Redis unreachable.

An empty store never empties the fleet: the gateway writes back its workers, keys and reservations; an outage
costs one log line when it starts and one when it ends (plus a reminder every 30 s), not a traceback per loop.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess

import httpx
import pytest
import redis

from gateway.state.base import WorkerRecord
from gateway.state.redis_store import RedisStore
from tests.helpers import ADMIN, MODEL, free_port, poll, require_command, running_gateway

pytestmark = pytest.mark.redis

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def wipe(url: str, prefix: str) -> int:
    """What a Redis restarted without persistence looks like to this fleet: none of its keys."""
    r = redis.Redis.from_url(url)
    keys = list(r.scan_iter(match=prefix + "*", count=1000))
    if keys:
        r.delete(*keys)
    r.close()
    return len(keys)


async def test_a_wiped_store_is_refilled_from_the_replicas_state(redis_url, redis_prefix) -> None:
    s = RedisStore(redis_url, replica_id="r1", key_prefix=redis_prefix, refresh_interval_s=0.05)
    restored: list[str] = []

    async def hook() -> None:
        restored.append("called")
        await s.upsert_worker(WorkerRecord(id="w1", url="http://127.0.0.1:1", models=[MODEL]))
    s.on_restore(hook)
    await s.start()
    try:
        await s.upsert_worker(WorkerRecord(id="w1", url="http://127.0.0.1:1", models=[MODEL]))
        assert await s.try_reserve("w1", "req-1", cap=4, tokens=10)
        assert [w.id for w in await s.list_workers()] == ["w1"]
        assert wipe(redis_url, redis_prefix) > 0
        # reads right after the wipe serve the last known fleet, never the empty one
        for _ in range(20):
            assert [w.id for w in await s.list_workers()] == ["w1"]
            await asyncio.sleep(0.01)
        await poll(lambda: restored, 2, "the restore hook")
        r = redis.Redis.from_url(redis_url, decode_responses=True)
        await poll(lambda: r.get(redis_prefix + "alive") is not None, 2, "a new epoch")
        assert r.hexists(redis_prefix + "workers", "w1")
        assert r.zcard(redis_prefix + "res:w1") == 1  # the reservation, rebuilt by the heartbeat
        assert s.inflight()["w1"].requests == 1
        await s.release("w1", "req-1")
        await poll(lambda: r.zcard(redis_prefix + "res:w1") == 0, 2, "the release")
        assert restored == ["called"]  # once, not once per read
        r.close()
    finally:
        await s.close()


async def test_the_gateway_keeps_its_fleet_and_keys_when_redis_is_wiped(sim_fleet, redis_url, redis_prefix) -> None:
    fleet = sim_fleet(3, time_scale=50)
    cfg = {"redis_url": redis_url, "redis_key_prefix": redis_prefix, "api_keys": ["sk-boot-key-1"],
           "health": {"interval_s": 0.2}}
    async with running_gateway(fleet.urls[:2], **cfg) as gw, httpx.AsyncClient(base_url=gw.url, timeout=20) as http:
        # an engine of its own: one listed twice is refused (409 engine_exists)
        made = (await http.post("/admin/workers", headers=ADMIN, json={"id": "added", "url": fleet.urls[2]}))
        assert made.status_code == 201
        key = (await http.post("/admin/keys", headers=ADMIN, json={"name": "k"})).json()["key"]
        wipe(redis_url, redis_prefix)
        failures = 0
        for _ in range(40):  # two seconds of traffic across the wipe
            for k in ("sk-boot-key-1", key):
                r = await http.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {k}"})
                failures += r.status_code != 200
            await asyncio.sleep(0.05)
        assert failures == 0
        ids = sorted(w["id"] for w in (await http.get("/admin/workers", headers=ADMIN)).json()["data"])
        assert ids == ["added", "w0", "w1"]
        r = redis.Redis.from_url(redis_url, decode_responses=True)
        assert sorted(r.hkeys(redis_prefix + "workers")) == ["added", "w0", "w1"]
        assert any(k.startswith("apikey:") for k in r.hkeys(redis_prefix + "docs"))
        r.close()


async def test_recovery_is_announced_only_once_the_replay_succeeds(redis_url, redis_prefix, caplog) -> None:
    """A Redis just thawed from SIGSTOP answers a PING and then times out on the backlog behind it: the store
    stays down (no "reachable again" line followed by a new "unreachable"), keeps what it queued, and announces
    the recovery once its replay and heartbeat went through."""
    from redis.exceptions import TimeoutError as RedisTimeoutError

    s = RedisStore(redis_url, replica_id="r1", key_prefix=redis_prefix, refresh_interval_s=0.05)
    await s.start()
    try:
        await s.upsert_worker(WorkerRecord(id="w1", url="http://127.0.0.1:1", models=[MODEL]))
        assert await s.try_reserve("w1", "req-1", cap=4, tokens=10)
        assert await s.try_reserve("w1", "req-2", cap=4, tokens=10)
        caplog.set_level(logging.INFO, logger="fleetgate.state.redis")
        caplog.clear()
        s._mark_down(RedisTimeoutError("frozen"))  # what the first timed-out call does
        await s.release("w1", "req-1")  # queued while down
        real, attempts = s._heartbeat, []

        async def slow_once() -> None:
            attempts.append(1)
            if len(attempts) == 1:
                raise RedisTimeoutError("Timeout reading from socket")
            await real()
        s._heartbeat = slow_once
        await poll(lambda: s.available, 5, "the store to come back")
        r = redis.Redis.from_url(redis_url, decode_responses=True)
        assert r.zrange(redis_prefix + "res:w1", 0, -1) == [s._member("req-2")]  # released once back, req-2 kept
        r.close()
        lines = [x.getMessage() for x in caplog.records if x.levelno >= logging.WARNING]
        assert len(attempts) >= 2
        assert [x.split(" (")[0].split(" after")[0] for x in lines] == [
            f"Redis at {redis_url} unreachable", f"Redis at {redis_url} reachable again"], lines
    finally:
        await s.close()


async def test_an_outage_is_logged_once_not_per_loop(sim_fleet, tmp_path, caplog) -> None:
    port = free_port()
    cmd = [require_command("redis-server"), "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    await poll(lambda: _pings(url), 5, "redis-server to start")
    fleet = sim_fleet(1, time_scale=50)
    try:
        async with running_gateway(fleet.urls, redis_url=url, batch={"poll_s": 0.05},
                                   learning={"interval_s": 0.1, "sync_interval_s": 0.2},
                                   autoscale={"sample_s": 0.1}) as gw, \
                httpx.AsyncClient(base_url=gw.url, timeout=20) as http:
            caplog.set_level(logging.INFO)
            caplog.clear()
            proc.terminate()
            proc.wait(10)
            failures = 0
            for _ in range(30):  # 3 s of traffic and control loops with Redis gone
                failures += (await http.post("/v1/chat/completions", json=CHAT)).status_code != 200
                await asyncio.sleep(0.1)
            r = await http.get("/v1/batches")
            assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
            await poll(lambda: _pings(url), 5, "redis-server to restart")
            await poll(lambda: gw.gateway.store.available, 5, "the gateway to see Redis again")
            await poll(lambda: _pings(url) and redis.Redis.from_url(url).hlen("fg:workers") == 1, 5,
                       "the worker written back into the empty Redis")
            assert failures == 0
            noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
            tracebacks = [r for r in noisy if r.exc_info]
            assert tracebacks == [], [r.getMessage() for r in tracebacks]
            assert len(noisy) <= 5, [r.getMessage() for r in noisy]  # down, up, restore x2 (+1 spare)
    finally:
        proc.terminate()
        proc.wait(10)


def _pings(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.2).ping())
    except redis.RedisError:
        return False
