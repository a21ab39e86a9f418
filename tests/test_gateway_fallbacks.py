"""Model aliases and fallbacks: an alias served by its target and listed; a request its model cannot serve before
the first byte (no worker, the gateway's 429, a worker's 5xx, a prompt over the context) served by a fallback
model; never after bytes were streamed; the config errors."""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import httpx
import orjson
import pytest

from gateway.server import GatewayServer
from tests.helpers import ADMIN, MODEL, free_port, poll, running_gateway
from tests.helpers import run_cli as fleetgate
from tests.test_gateway_failures import metric

PRIMARY = "primary-model"
CHAT = {"model": PRIMARY, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


def gateway(workers: list[dict], **settings) -> AbstractAsyncContextManager[GatewayServer]:
    settings.setdefault("health", {"interval_s": 0.1, "timeout_s": 0.5, "failures_to_eject": 2,
                                   "successes_to_restore": 2})
    return running_gateway(workers=workers, **settings)


def two_models(primary_url: str, backup_url: str) -> list[dict]:
    return [{"id": "p0", "url": primary_url, "models": [PRIMARY]}, {"id": "b0", "url": backup_url, "models": [MODEL]}]


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


async def finished_on(http: httpx.AsyncClient, url: str) -> int:
    return sum((await http.get(url + "/sim/state")).json()["stats"]["finished"].values())


async def test_an_alias_is_served_by_its_target_and_listed(sim_fleet, make_client) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with gateway([{"id": "w0", "url": fleet.urls[0]}], models={MODEL: {}},
                       aliases={"chat-default": MODEL}) as gw:
        client = make_client(gw.url)
        raw = await client.chat.completions.with_raw_response.create(
            model="chat-default", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        answer = raw.parse()
        assert answer.model == MODEL                       # as the serving vLLM reports it
        assert raw.headers["x-served-model"] == MODEL
        assert answer.usage.completion_tokens == 5
        models = {m.id: m for m in (await client.models.list()).data}
        alias, target = models["chat-default"], models[MODEL]
        assert alias.root == target.root and alias.parent is None
        assert alias.max_model_len == target.max_model_len
        text = (await httpx.AsyncClient().get(gw.url + "/metrics", headers=ADMIN)).text
        assert metric(text, "fleetgate_requests_total", model=MODEL, status="200") == 1
        assert metric(text, "fleetgate_requests_total", model="chat-default") == 0


async def test_no_worker_in_rotation_falls_back(sim_fleet) -> None:
    backup = sim_fleet(1, time_scale=20)
    async with gateway(two_models(closed_port_url(), backup.urls[0]),
                       models={PRIMARY: {"fallbacks": [MODEL]}}) as gw, \
            httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        await poll(lambda: not gw.gateway.registry.workers["p0"].healthy, what="p0 out of rotation")
        r = await http.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == MODEL and r.headers["x-served-model"] == MODEL
        text = (await http.get(gw.url + "/metrics")).text
        assert metric(text, "fleetgate_fallbacks_total", model=PRIMARY, to=MODEL, reason="no_worker") == 1
        assert metric(text, "fleetgate_requests_total", model=MODEL, status="200") == 1
        assert metric(text, "fleetgate_requests_total", model=PRIMARY) == 0


async def test_a_configured_model_without_any_worker_falls_back(sim_fleet) -> None:
    backup = sim_fleet(1, time_scale=20)
    async with gateway([{"id": "b0", "url": backup.urls[0], "models": [MODEL]}],
                       models={PRIMARY: {"fallbacks": [MODEL]}}) as gw, \
            httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        r = await http.post(gw.url + "/v1/completions", json={"model": PRIMARY, "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == MODEL and r.headers["x-served-model"] == MODEL
        # a model with no fallbacks and no worker is still unknown
        r = await http.post(gw.url + "/v1/completions", json={"model": "nobody", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_a_5xx_before_the_first_byte_falls_back_after_the_retries(sim_fleet) -> None:
    primary, backup = sim_fleet(2, time_scale=20, model=PRIMARY), sim_fleet(1, time_scale=20)
    workers = [{"id": f"p{i}", "url": u, "models": [PRIMARY]} for i, u in enumerate(primary.urls)]
    workers.append({"id": "b0", "url": backup.urls[0], "models": [MODEL]})
    async with gateway(workers, models={PRIMARY: {"fallbacks": ["backup"]}}, aliases={"backup": MODEL}) as gw, \
            httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        for u in primary.urls:
            await http.post(u + "/sim/faults", json={"error_status": 503})
        r = await http.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == MODEL and r.headers["x-served-model"] == MODEL
        async with http.stream("POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as s:
            assert s.status_code == 200 and s.headers["x-served-model"] == MODEL
            events = [line for line in [x async for x in s.aiter_lines()] if line.startswith("data: {")]
        assert {orjson.loads(e[6:])["model"] for e in events} == {MODEL}
        text = (await http.get(gw.url + "/metrics")).text
        assert metric(text, "fleetgate_fallbacks_total", model=PRIMARY, to=MODEL, reason="error") == 2
        assert metric(text, "fleetgate_retries_total", model=PRIMARY) == 2   # both primary workers first
        assert metric(text, "fleetgate_upstream_errors_total", kind="status_5xx") == 4
        assert metric(text, "fleetgate_requests_total", model=MODEL, status="200") == 2
        # without a fallback left (the backup fails too) the client gets the worker's own answer
        await http.post(backup.urls[0] + "/sim/faults", json={"error_status": 500})
        r = await http.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code in (500, 503) and r.json()["error"]["message"].startswith("Simulated fault")


async def test_workers_answering_429_fall_back_to_the_configured_model(sim_fleet, make_client) -> None:
    """A worker's own 429 (a rate limiter or router in front of it) is a refusal, not a fault: the request tries the
    model's other worker, then its fallback; the workers stay in rotation."""
    primary, backup = sim_fleet(2, time_scale=20, model=PRIMARY), sim_fleet(1, time_scale=20)
    workers = [{"id": f"p{i}", "url": u, "models": [PRIMARY]} for i, u in enumerate(primary.urls)]
    workers.append({"id": "b0", "url": backup.urls[0], "models": [MODEL]})
    async with gateway(workers, models={PRIMARY: {"fallbacks": [MODEL]}}) as gw, \
            httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        for u in primary.urls:
            assert (await http.post(u + "/sim/faults", json={"error_status": 429})).status_code == 200
        raw = await make_client(gw.url).chat.completions.with_raw_response.create(
            model=PRIMARY, messages=CHAT["messages"], max_tokens=4)
        assert raw.headers["x-served-model"] == MODEL and raw.parse().model == MODEL
        async with http.stream("POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as s:
            assert s.status_code == 200 and s.headers["x-served-model"] == MODEL
            assert "".join([x async for x in s.aiter_text()]).rstrip().endswith("data: [DONE]")
        text = (await http.get(gw.url + "/metrics")).text
        assert metric(text, "fleetgate_fallbacks_total", model=PRIMARY, to=MODEL, reason="refused") == 2
        assert metric(text, "fleetgate_upstream_errors_total", kind="status_429") == 4   # both workers, twice
        assert metric(text, "fleetgate_requests_total", model=MODEL, status="200") == 2
        assert all(gw.gateway.registry.workers[f"p{i}"].healthy for i in range(2))
        assert await finished_on(http, primary.urls[0]) + await finished_on(http, primary.urls[1]) == 0
        # a model without a fallback hands the worker's 429 to the client as it is
        await http.post(backup.urls[0] + "/sim/faults", json={"error_status": 429})
        r = await http.post(gw.url + "/v1/chat/completions", json={**CHAT, "model": MODEL})
        assert r.status_code == 429 and r.json()["error"]["message"].startswith("Simulated fault")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_hung_model_falls_back_when_its_first_byte_times_out(sim_fleet, stream: bool) -> None:
    primary, backup = sim_fleet(1, time_scale=20, model=PRIMARY), sim_fleet(1, time_scale=20)
    async with gateway(two_models(primary.urls[0], backup.urls[0]), models={PRIMARY: {"fallbacks": [MODEL]}},
                       timeouts={"first_byte_s": 1.0}) as gw, httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        await http.post(primary.urls[0] + "/sim/faults", json={"hang": True})
        t = time.perf_counter()
        r = await http.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream})
        assert r.status_code == 200, r.text
        assert r.headers["x-served-model"] == MODEL
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]") and f'"model":"{MODEL}"' in r.text.replace(" ", "")
        else:
            assert r.json()["model"] == MODEL
        assert time.perf_counter() - t < 10
        text = (await http.get(gw.url + "/metrics")).text
        assert metric(text, "fleetgate_fallbacks_total", model=PRIMARY, to=MODEL, reason="timeout") == 1


async def test_the_gateways_own_429_falls_back(sim_fleet) -> None:
    primary, backup = sim_fleet(1, time_scale=1, model=PRIMARY), sim_fleet(1, time_scale=20)
    workers = two_models(primary.urls[0], backup.urls[0])
    workers[0]["cap"] = 1
    async with gateway(workers, models={PRIMARY: {"fallbacks": [MODEL]}}, limits={"queue_size": 0}) as gw, \
            httpx.AsyncClient(headers=ADMIN, timeout=30) as http:
        long = asyncio.create_task(http.post(gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 5000},
                                             headers={"x-sim-output-tokens": "5000"}))
        await poll(lambda: (f := gw.gateway.store.inflight().get("p0")) is not None and f.requests == 1,
                   what="the long request to hold p0's one slot")
        r = await http.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        assert r.headers["x-served-model"] == MODEL
        text = (await http.get(gw.url + "/metrics")).text
        assert metric(text, "fleetgate_fallbacks_total", model=PRIMARY, to=MODEL, reason="refused") == 1
        assert not long.done()   # the slot was still held: the answer came from the fallback, not a wait
        long.cancel()


async def test_a_prompt_over_the_context_goes_to_a_context_window_fallback(sim_fleet) -> None:
    small = sim_fleet(1, time_scale=20, model=PRIMARY, profile_overrides={"max_model_len": 1024})
    big = sim_fleet(1, time_scale=20)
    async with gateway(two_models(small.urls[0], big.urls[0]),
                       models={PRIMARY: {"context_window_fallbacks": [MODEL]}}) as gw, \
            httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        r = await http.post(gw.url + "/v1/chat/completions", json=CHAT)   # fits: served by the primary
        assert r.status_code == 200 and r.headers["x-served-model"] == PRIMARY
        long = {**CHAT, "messages": [{"role": "user", "content": "word " * 2000}]}   # ~2.5k tokens
        r = await http.post(gw.url + "/v1/chat/completions", json=long)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == MODEL and r.headers["x-served-model"] == MODEL
        assert r.json()["usage"]["prompt_tokens"] > 1024
        text = (await http.get(gw.url + "/metrics")).text
        assert metric(text, "fleetgate_fallbacks_total", reason="context_window", to=MODEL) == 1
        assert metric(text, "fleetgate_fallbacks_total", reason="error") == 0


async def test_too_long_without_a_context_window_fallback_is_vllms_400(sim_fleet) -> None:
    small = sim_fleet(1, time_scale=20, model=PRIMARY, profile_overrides={"max_model_len": 1024})
    big = sim_fleet(1, time_scale=20)
    # `fallbacks` covers failures, not prompts over the context
    async with gateway(two_models(small.urls[0], big.urls[0]), models={PRIMARY: {"fallbacks": [MODEL]}}) as gw, \
            httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        long = {**CHAT, "messages": [{"role": "user", "content": "word " * 2000}]}
        r = await http.post(gw.url + "/v1/chat/completions", json=long)
        assert r.status_code == 400 and "maximum context length is 1024" in r.json()["error"]["message"]
        assert await finished_on(http, big.urls[0]) == 0


async def test_a_stream_that_sent_bytes_never_falls_back(sim_fleet) -> None:
    primary, backup = sim_fleet(1, time_scale=20, model=PRIMARY), sim_fleet(1, time_scale=20)
    async with gateway(two_models(primary.urls[0], backup.urls[0]), models={PRIMARY: {"fallbacks": [MODEL]}}) as gw, \
            httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        await http.post(primary.urls[0] + "/sim/faults", json={"drop_after_tokens": 3})
        async with http.stream("POST", gw.url + "/v1/chat/completions",
                               json={**CHAT, "max_tokens": 20, "stream": True}) as s:
            assert s.status_code == 200 and s.headers["x-served-model"] == PRIMARY
            body = "".join([x async for x in s.aiter_text()])
        assert '"error"' in body                     # the break is reported in the stream, not hidden
        assert await finished_on(http, backup.urls[0]) == 0
        # the same fault on a non-streamed request fails before the client saw a byte: that one falls back
        r = await http.post(gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 20})
        assert r.status_code == 200 and r.headers["x-served-model"] == MODEL
        text = (await http.get(gw.url + "/metrics")).text
        assert metric(text, "fleetgate_fallbacks_total", model=PRIMARY) == 1
        assert metric(text, "fleetgate_stream_breaks_total", model=PRIMARY) == 1


BAD = """\
workers:
  - {id: a, url: "http://127.0.0.1:8101", models: [m1]}
models:
  m1: {fallbacks: [m1, ghost]}
  m2: {context_window_fallbacks: [also-ghost]}
aliases:
  chat-default: nowhere
  m2: m1
"""


def test_config_check_lists_alias_and_fallback_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    r = fleetgate("config", "check", str(bad))
    assert r.returncode == 1
    for line in ("aliases.chat-default: unknown model 'nowhere'",
                 "aliases.m2: shadows the served model 'm2'",
                 "models.m1.fallbacks[0]: 'm1' is the model itself",
                 "models.m1.fallbacks[1]: unknown model 'ghost'",
                 "models.m2.context_window_fallbacks[0]: unknown model 'also-ghost'"):
        assert line in r.stderr, r.stderr
    good = tmp_path / "good.yaml"
    good.write_text(BAD.split("\nmodels:")[0] + "\nmodels:\n  m2: {fallbacks: [m1]}\naliases:\n  chat-default: m2\n")
    r = fleetgate("config", "check", str(good))
    assert r.returncode == 0, r.stderr
