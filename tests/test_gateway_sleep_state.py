"""The gateway routes nothing to a sleeping engine: the registry reads each worker's
vllm:engine_sleep_state from its scraped /metrics (docs/reference/vllm-interface.md §6.1) and takes a sleeping
or paused worker out of the candidates until it is awake again; fleetgate_engine_state reports it. Real HTTP,
simulated vLLM servers, the official openai client."""

from __future__ import annotations

import asyncio

import httpx
import openai

from engine_adapters.vllm.metrics_parser import parse_vllm_metrics
from tests.helpers import ADMIN_KEY, MODEL, metric, poll
from tests.helpers import running_gateway as gateway


def test_parser_reads_the_sleep_state():
    text = ('vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 0.0\n'
            'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="weights_offloaded"} 1.0\n'
            'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="discard_all"} 0.0\n')
    assert parse_vllm_metrics(text).sleep_state == "weights_offloaded"
    assert parse_vllm_metrics(text.replace("1.0", "0.0").replace('awake"} 0.0', 'awake"} 1.0')).sleep_state == "awake"
    assert parse_vllm_metrics("vllm:num_requests_running 1\n").sleep_state == "awake"   # 0.11: no series
    # vLLM 0.32 CPU after /sleep?level=0: awake 0 and nothing else 1 (docs/reference/vllm-cpu.md)
    assert parse_vllm_metrics(text.replace("1.0", "0.0")).sleep_state == "paused"


def _generated(url: str) -> int:
    return httpx.get(url + "/sim/state").json()["stats"]["generation_tokens"]


async def test_nothing_is_routed_to_a_sleeping_engine(sim_fleet) -> None:
    fleet = sim_fleet(2, time_scale=20)
    awake, sleeper = fleet.urls
    async with gateway(fleet.urls, scrape_interval_s=0.05, default_policy="round_robin") as gw:
        oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=20)

        async def engine_state(worker: str, state: str) -> bool:
            async with httpx.AsyncClient() as c:
                text = (await c.get(gw.url + "/metrics")).text
            return metric(text, "fleetgate_engine_state", {"worker": worker, "model": MODEL, "state": state}) == 1

        await poll(lambda: engine_state("w1", "awake"), what="w1 awake in fleetgate_engine_state")
        assert httpx.post(sleeper + "/sleep", params={"level": 1, "mode": "keep"}).json()["status"] == "sleeping"
        await poll(lambda: engine_state("w1", "weights_offloaded"), what="the registry sees w1 asleep")
        before = _generated(sleeper)
        for _ in range(6):
            r = await oa.completions.create(model=MODEL, prompt="hello there", max_tokens=3)
            assert r.usage.completion_tokens == 3
        assert _generated(sleeper) == before                  # all six went to the awake worker
        httpx.post(sleeper + "/wake_up")
        await poll(lambda: engine_state("w1", "awake"), what="the registry sees w1 awake again")
        for _ in range(4):
            await oa.completions.create(model=MODEL, prompt="hello there", max_tokens=3)
        assert _generated(sleeper) > before                   # round robin uses it again
        assert _generated(awake) > 0


async def test_every_engine_asleep_is_an_openai_error_not_a_hang(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with gateway(fleet.urls, scrape_interval_s=0.05, limits={"queue_timeout_s": 0.5}) as gw:
        oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=20)
        await oa.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        httpx.post(fleet.urls[0] + "/sleep", params={"level": 0, "mode": "keep"})

        async def asleep() -> bool:
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as c:
                workers = (await c.get(gw.url + "/admin/workers")).json()["data"]
            return any(w["engine"]["sleep_state"] == "paused" for w in workers)

        await poll(asleep, what="the registry sees the worker paused")
        try:
            await oa.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        except openai.APIStatusError as exc:
            assert exc.status_code in (429, 503), exc
            assert exc.body and "message" in exc.body
        else:
            raise AssertionError("a request was served by a paused engine")


async def test_a_scrape_older_than_the_swap_controllers_word_does_not_undo_it() -> None:
    """A scrape sent before the swap controller's /wake_up came back may answer "asleep" after it: the
    controller's word (Registry.set_sleep) stands until a scrape sent later says otherwise. Trusting the late
    answer took the woken engine out of rotation and made the controller wake it a second time (seen against
    real vLLM: tests_vllm/test_shared_hosts.py counted three wake-ups for two swaps)."""
    from aiohttp import web

    from engine_adapters.types import AWAKE
    from tests.helpers import loopback_app

    state = {"asleep": True}
    answer = asyncio.Event()
    asked = asyncio.Event()

    async def metrics(_: web.Request) -> web.Response:
        gauge = ("weights_offloaded", "awake") if state["asleep"] else ("awake", "weights_offloaded")
        text = (f'vllm:engine_sleep_state{{engine="0",model_name="{MODEL}",sleep_state="{gauge[0]}"}} 1.0\n'
                f'vllm:engine_sleep_state{{engine="0",model_name="{MODEL}",sleep_state="{gauge[1]}"}} 0.0\n')
        asked.set()
        await answer.wait()
        return web.Response(text=text)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    async with loopback_app(app) as url, gateway([url], scrape_interval_s=3600) as gw:
        registry = gw.gateway.registry
        ws = registry.workers["w0"]
        answer.set()
        await registry.scrape(ws)
        assert not ws.awake                                 # the engine said it sleeps

        answer.clear()
        asked.clear()
        late = asyncio.create_task(registry.scrape(ws))     # sent while the engine still sleeps ...
        await asked.wait()
        state["asleep"] = False
        registry.set_sleep("w0", False, AWAKE)              # ... the controller's /wake_up came back ...
        answer.set()
        await late                                          # ... and the old answer arrives after it
        assert ws.awake and registry.candidates(MODEL) == (ws,)

        state["asleep"] = True                              # a scrape sent afterwards is believed again
        await registry.scrape(ws)
        assert not ws.awake and registry.candidates(MODEL) == ()
