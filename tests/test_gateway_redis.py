"""Two `fleetgate serve` processes sharing one real Redis act as one gateway: a worker's cap holds across both.

Uses FLEETGATE_TEST_REDIS_URL (default redis://127.0.0.1:6379/15) and a unique key prefix; fails (does not
skip) with instructions when Redis is down.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis

pytestmark = [pytest.mark.redis, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
REDIS_URL = os.environ.get("FLEETGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CAP = 4


@pytest.fixture
def redis_prefix():
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1, socket_timeout=1).ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis is not reachable at {REDIS_URL} ({exc}). Start it with "
                    "`redis-server --daemonize yes --port 6379` or point FLEETGATE_TEST_REDIS_URL at one.")
    prefix = f"fgtest-gw:{uuid.uuid4().hex[:12]}:"
    yield prefix
    r = redis.Redis.from_url(REDIS_URL)
    keys = list(r.scan_iter(match=prefix + "*", count=1000))
    if keys:
        r.delete(*keys)
    r.close()


def spawn_gateway(config: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", "0",
         "--redis-url", REDIS_URL],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def listening_url(proc: subprocess.Popen) -> str:
    """The URL from the gateway's `fleetgate listening on ...` line."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("fleetgate listening on "):
            return line.split()[-1]
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"gateway did not start: {proc.stderr.read()[-2000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


async def test_two_gateways_on_one_redis_never_exceed_the_worker_cap(sim_fleet, redis_prefix, tmp_path) -> None:
    fleet = sim_fleet(1, time_scale=4)
    worker = fleet.urls[0]
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        f"workers:\n  - {{id: only, url: '{worker}', cap: {CAP}}}\n"
        f"redis_key_prefix: '{redis_prefix}'\n"
        "limits: {queue_size: 64, queue_timeout_s: 20}\n"
        "health: {interval_s: 0.5}\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # A and B carry the load; C shares their state but gives up queueing after 0.3 s
    impatient = {**env, "FLEETGATE_LIMITS__QUEUE_TIMEOUT_S": "0.3"}
    procs = [spawn_gateway(cfg, env), spawn_gateway(cfg, env), spawn_gateway(cfg, impatient)]
    try:
        urls = [listening_url(p) for p in procs]
        impatient_url = urls.pop()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True}
        peak = 0
        samples = 0
        done = asyncio.Event()

        async with httpx.AsyncClient(timeout=60) as http:
            async def sample() -> None:
                nonlocal peak, samples
                while not done.is_set():
                    state = (await http.get(worker + "/sim/state")).json()
                    peak = max(peak, state["inflight_http"], state["running"] + state["waiting"])
                    samples += 1
                    await asyncio.sleep(0.005)

            async def one(i: int) -> httpx.Response:
                return await http.post(urls[i % 2] + "/v1/chat/completions", json=body,
                                       headers={"x-sim-output-tokens": "40"})

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
            deadline = time.monotonic() + 10
            while (await http.get(worker + "/sim/state")).json()["inflight_http"] < CAP:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
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
                deadline = time.monotonic() + 5
                while True:
                    listed = (await http.get(u + "/admin/workers")).json()["data"]
                    if [(w["id"], w["inflight"]) for w in listed] == [("only", 0)]:
                        break
                    assert time.monotonic() < deadline, listed
                    await asyncio.sleep(0.02)
    finally:
        for proc in procs:
            stop(proc)
