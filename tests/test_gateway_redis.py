"""Two `fleetgate serve` processes sharing one real Redis act as one gateway: a worker's cap holds across both.

Uses FLEETGATE_TEST_REDIS_URL (default redis://127.0.0.1:6379/15) and a unique key prefix; fails (does not
skip) with instructions when Redis is down.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.helpers import ADMIN, MODEL, REDIS_URL, poll, running_gateway

pytestmark = [pytest.mark.redis, pytest.mark.slow]

CAP = 4


async def test_two_gateways_on_one_redis_never_exceed_the_worker_cap(sim_fleet, redis_prefix, tmp_path,
                                                                     gateway_process) -> None:
    fleet = sim_fleet(1, time_scale=4)
    worker = fleet.urls[0]
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        f"workers:\n  - {{id: only, url: '{worker}', cap: {CAP}}}\n"
        f"redis_key_prefix: '{redis_prefix}'\n"
        "limits: {queue_size: 64, queue_timeout_s: 20}\n"
        "health: {interval_s: 0.5}\n"
    )
    # A and B carry the load; C shares their state but gives up queueing after 0.3 s
    impatient = {"FLEETGATE_LIMITS__QUEUE_TIMEOUT_S": "0.3"}
    procs = [gateway_process(cfg, "--redis-url", REDIS_URL), gateway_process(cfg, "--redis-url", REDIS_URL),
             gateway_process(cfg, "--redis-url", REDIS_URL, env=impatient)]
    urls = [p.listening_url() for p in procs]
    impatient_url = urls.pop()
    # Each request lasts several times longer than the 16 take to reach the gateways (slow on a loaded host),
    # so every request beyond the cap finds it full and queues.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True}
    peak = 0
    samples = 0
    done = asyncio.Event()

    async with httpx.AsyncClient(headers=ADMIN, timeout=60) as http:
        async def sample() -> None:
            nonlocal peak, samples
            while not done.is_set():
                state = (await http.get(worker + "/sim/state")).json()
                peak = max(peak, state["inflight_http"], state["running"] + state["waiting"])
                samples += 1
                await asyncio.sleep(0.005)

        async def one(i: int) -> httpx.Response:
            return await http.post(urls[i % 2] + "/v1/chat/completions", json=body,
                                   headers={"x-sim-output-tokens": "200"})

        sampler = asyncio.create_task(sample())
        responses = await asyncio.gather(*(one(i) for i in range(16)))
        done.set()
        await sampler

        assert [r.status_code for r in responses] == [200] * 16
        assert all(r.text.endswith("data: [DONE]\n\n") for r in responses)
        assert samples > 10
        assert peak == CAP  # the cap was reached (real concurrency) and never exceeded
        waited = 0.0
        for u in urls:
            text = (await http.get(u + "/metrics")).text
            waited += sum(float(line.split()[-1]) for line in text.splitlines()
                          if line.startswith("fleetgate_queue_wait_seconds_count"))
        assert waited >= 16 - CAP  # everyone beyond the cap queued (in either gateway)

        # A holds every slot: C (another process) cannot place a request, queues 0.3 s, then 429
        long = {**body, "max_tokens": 100_000}
        holders = [asyncio.create_task(http.post(urls[0] + "/v1/chat/completions", json=long,
                                                 headers={"x-sim-output-tokens": "100000"}))
                   for _ in range(CAP)]

        async def worker_full() -> bool:
            return (await http.get(worker + "/sim/state")).json()["inflight_http"] >= CAP

        await poll(worker_full, what="A's requests to hold every slot", every=0.01)
        t = time.monotonic()
        r = await http.post(impatient_url + "/v1/chat/completions", json=body)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1 and time.monotonic() - t >= 0.3
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert (await http.get(worker + "/sim/state")).json()["inflight_http"] == CAP
        for h in holders:
            h.cancel()
        await asyncio.gather(*holders, return_exceptions=True)

        # every reservation is released: all replicas see an idle worker once their cached view of the
        # other replicas' load refreshes (RedisStore refresh interval)
        for u in [*urls, impatient_url]:
            async def idle(u: str = u) -> bool:
                listed = (await http.get(u + "/admin/workers")).json()["data"]
                return [(w["id"], w["inflight"]) for w in listed] == [("only", 0)]

            await poll(idle, what=f"{u} to see the worker idle")


async def test_a_release_on_another_replica_wakes_this_replicas_queue(sim_fleet, redis_prefix) -> None:
    """Two replicas, one worker with one slot, polling every 5 s: replica B's queued request goes as soon as
    replica A's request ends (announced through Redis while B has waiters), not at B's next poll."""
    fleet = sim_fleet(1, time_scale=10)
    settings = {"workers": [{"id": "only", "url": fleet.urls[0], "cap": 1}], "redis_url": REDIS_URL,
                "redis_key_prefix": redis_prefix, "limits": {"queue_poll_s": 5.0, "queue_timeout_s": 30}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}
    async with running_gateway(**settings) as a, running_gateway(**settings) as b, \
            httpx.AsyncClient(timeout=60) as http:
        holder = asyncio.create_task(http.post(a.url + "/v1/chat/completions", json=body,    # ~0.4 s of decoding
                                               headers={"x-sim-output-tokens": "500"}))
        await poll(lambda: a.gateway.store.inflight().get("only") is not None
                   and a.gateway.store.inflight()["only"].requests == 1, what="A holds the slot")
        waiter = asyncio.create_task(http.post(b.url + "/v1/chat/completions", json=body,
                                               headers={"x-sim-output-tokens": "4"}))
        await poll(lambda: (rt := b.gateway.dispatcher.runtimes.get(MODEL)) is not None and len(rt.queue) == 1,
                   what="B's request queued")
        assert (await holder).status_code == 200
        t_released = time.monotonic()
        r = await waiter
        assert r.status_code == 200
        assert time.monotonic() - t_released < 2.0     # well before B's 5 s poll
