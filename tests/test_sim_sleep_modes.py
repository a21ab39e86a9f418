"""vLLM 0.33 sleep semantics of the simulated server (docs/reference/vllm-interface.md §6.1): levels 0-2, the
pause modes abort / wait / keep, partial wake-up by tags and vllm:engine_sleep_state; over real HTTP."""

from __future__ import annotations

import asyncio
import time

import httpx

from simulator.engine import EngineCore, SimRequest
from simulator.tokenizer import synthetic_text
from tests.helpers import poll as apoll
from tests.test_sim_server import metrics

LONG = {"prompt": synthetic_text(300, "sleepy"), "max_tokens": 400, "ignore_eos": True}


def _state(url: str) -> str:
    return next(k.split("sleep_state=")[1].rstrip("}") for k, v in metrics(url).items()
                if k.startswith("vllm:engine_sleep_state") and v == 1)


async def _running(client: httpx.AsyncClient) -> None:
    async def cond():
        return (await client.get("/sim/state")).json()["running"] == 1
    await apoll(cond, what="the request runs")


async def test_keep_level1_drops_kv_and_finishes_after_wake(sim_fleet):
    url = sim_fleet(1, time_scale=10).urls[0]
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        assert _state(url) == "awake"
        pending = asyncio.ensure_future(client.post("/v1/completions", json=LONG))
        await _running(client)
        r = await client.post("/sleep", params={"level": 1, "mode": "keep"})
        assert r.json() == {"status": "sleeping", "level": 1}
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
        assert _state(url) == "weights_offloaded"
        await apoll(lambda: metrics(url)["vllm:num_preemptions_total"] == 1, what="KV dropped: one recompute")
        assert not pending.done()
        t0 = time.perf_counter()
        r = await client.post("/wake_up")
        assert r.json() == {"status": "awake", "tags": None} and time.perf_counter() - t0 >= 0.09
        assert _state(url) == "awake"
        assert (await pending).json()["usage"]["completion_tokens"] == 400


async def test_abort_mode_aborts_in_flight(sim_fleet):
    url = sim_fleet(1, time_scale=10).urls[0]
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        pending = asyncio.ensure_future(client.post("/v1/completions", json=LONG))
        await _running(client)
        r = await client.post("/sleep", params={"level": 2, "mode": "abort"})
        assert r.json() == {"status": "sleeping", "level": 2}
        await pending
        assert metrics(url)["vllm:request_success_total{finished_reason=abort}"] == 1
        assert _state(url) == "discard_all"
        # Level 2 discarded the weights: the wake-up reloads them over the host link on top of the wake-up.
        t0 = time.perf_counter()
        await client.post("/wake_up")
        assert time.perf_counter() - t0 >= (1.0 + 16.06e9 / 25e9) / 10 - 0.01


async def test_level0_pauses_and_resumes_by_tag(sim_fleet):
    url = sim_fleet(1, time_scale=10).urls[0]
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        pending = asyncio.ensure_future(client.post("/v1/completions", json=LONG))
        await _running(client)
        r = await client.post("/sleep", params={"level": 0, "mode": "keep"})
        assert r.json() == {"status": "sleeping", "level": 0}
        states = {k: v for k, v in metrics(url).items() if k.startswith("vllm:engine_sleep_state")}
        assert len(states) == 3 and set(states.values()) == {0}         # as vLLM 0.32: no series is 1
        done = (await client.get("/sim/state")).json()["stats"]["generation_tokens"]
        await asyncio.sleep(0.2)                                        # 2 model seconds: nothing decodes
        assert (await client.get("/sim/state")).json()["stats"]["generation_tokens"] == done
        r = await client.post("/wake_up", params={"tags": "scheduling"})
        assert r.json() == {"status": "awake", "tags": ["scheduling"]}
        assert (await pending).json()["usage"]["completion_tokens"] == 400
        assert metrics(url)["vllm:num_preemptions_total"] == 0          # the KV stayed


async def test_partial_wake_and_wait_mode(sim_fleet):
    url = sim_fleet(1, time_scale=5).urls[0]
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        pending = asyncio.ensure_future(client.post("/v1/completions", json={**LONG, "max_tokens": 200}))
        await _running(client)
        r = await client.post("/sleep", params={"level": 1, "mode": "wait"})   # returns once the request ended
        assert r.json() == {"status": "sleeping", "level": 1}
        state = (await client.get("/sim/state")).json()
        assert (state["running"], state["waiting"], state["stats"]["generation_tokens"]) == (0, 0, 200)
        assert (await pending).json()["usage"]["completion_tokens"] == 200      # completed, not aborted
        r = await client.post("/wake_up", params={"tags": "weights"})
        assert r.json() == {"status": "sleeping", "tags": ["weights"]}
        r = await client.post("/wake_up", params={"tags": "kv_cache"})
        assert r.json() == {"status": "awake", "tags": ["kv_cache"]}


def test_bad_sleep_parameters_are_400(sim_url):
    for params in ({"level": 3, "mode": "keep"}, {"level": 1, "mode": "later"}, {"level": "x"}):
        r = httpx.post(sim_url + "/sleep", params=params)
        assert r.status_code == 400, params
    assert httpx.get(sim_url + "/is_sleeping").json() == {"is_sleeping": False}


def test_engine_drop_kv_requeues_running_requests_in_order():
    core = EngineCore("llama3-8b-h100")
    for i in range(2):
        core.add(SimRequest(f"r{i}", 100, [], 20, 20), 0.0)
    t = 0.0
    for _ in range(5):
        t += core.plan_step(t)
        core.finish_step(t)
    assert core.num_running == 2 and core.kv_usage > 0
    assert core.drop_kv() == 2
    assert (core.num_running, core.num_waiting, core.kv_usage, core.stats.preemptions) == (0, 2, 0.0, 2)
    done = []
    while core.has_work():
        t += core.plan_step(t)
        done += [ev.record for ev in core.finish_step(t) if ev.finished]
    assert [r.request_id for r in done] == ["r0", "r1"] and all(r.num_output == 20 for r in done)
