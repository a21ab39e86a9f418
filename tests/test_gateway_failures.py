"""Failures on the data path: client disconnects, unhealthy and dead workers, 5xx, hangs, broken streams."""

from __future__ import annotations

import asyncio
import re
import time
from contextlib import AbstractAsyncContextManager

import httpx
import openai
import orjson
import pytest

from gateway.server import GatewayServer
from tests.helpers import ADMIN, MODEL, poll, running_gateway

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 20}


def gateway(urls: list[str], **settings) -> AbstractAsyncContextManager[GatewayServer]:
    settings.setdefault("health", {"interval_s": 0.1, "timeout_s": 0.5, "failures_to_eject": 2,
                                   "successes_to_restore": 2})
    return running_gateway(urls, **settings)


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{.*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


async def worker_metric(http: httpx.AsyncClient, url: str, name: str, **labels: str) -> float:
    return metric((await http.get(url + "/metrics")).text, name, **labels)


async def finished_on(http: httpx.AsyncClient, url: str) -> int:
    return sum((await http.get(url + "/sim/state")).json()["stats"]["finished"].values())


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts_the_upstream_request(sim_fleet, stream: bool) -> None:
    fleet = sim_fleet(1, time_scale=1.0)
    url = fleet.urls[0]
    body = {**CHAT, "max_tokens": 100_000, "stream": stream}
    long = {"x-sim-output-tokens": "100000"}
    async with gateway(fleet.urls) as gw, httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        assert await worker_metric(http, url, "vllm:request_success_total", finished_reason="abort") == 0
        if stream:
            async with http.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=long) as r:
                assert r.status_code == 200
                seen = 0
                async for _ in r.aiter_bytes():
                    seen += 1
                    if seen >= 3:
                        break  # leaving the block closes the connection mid-stream
        else:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(gw.url + "/v1/chat/completions", json=body, headers=long, timeout=0.5)

        async def aborted() -> bool:
            running = await worker_metric(http, url, "vllm:num_requests_running")
            aborts = await worker_metric(http, url, "vllm:request_success_total", finished_reason="abort")
            return running == 0 and aborts == 1

        await poll(aborted, what="the worker to abort the request")
        await poll(lambda: gw.gateway.store.inflight().get("w0") is None
                   or gw.gateway.store.inflight()["w0"].requests == 0, what="the reservation to be released")
        text = (await http.get(gw.url + "/metrics")).text
        assert metric(text, "fleetgate_requests_total", status="499") == 1


async def test_worker_failing_health_checks_leaves_and_rejoins_rotation(sim_fleet) -> None:
    fleet = sim_fleet(2, time_scale=20)
    w0, w1 = fleet.urls
    async with gateway(fleet.urls) as gw, httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        async def healthy(wid: str) -> bool:
            workers = (await http.get(gw.url + "/admin/workers")).json()["data"]
            return next(w for w in workers if w["id"] == wid)["healthy"]

        assert await healthy("w1")
        await http.post(w1 + "/sim/faults", json={"health_fail": True})
        await poll(lambda: _not(healthy("w1")), what="w1 to leave rotation")
        assert metric((await http.get(gw.url + "/metrics")).text, "fleetgate_worker_healthy", worker="w1") == 0
        before = (await finished_on(http, w0), await finished_on(http, w1))
        for _ in range(6):
            r = await http.post(gw.url + "/v1/chat/completions", json=CHAT)
            assert r.status_code == 200
        after = (await finished_on(http, w0), await finished_on(http, w1))
        assert after[0] - before[0] == 6 and after[1] == before[1]

        await http.delete(w1 + "/sim/faults")
        await poll(lambda: healthy("w1"), what="w1 to rejoin rotation")
        assert metric((await http.get(gw.url + "/metrics")).text, "fleetgate_worker_healthy", worker="w1") == 1
        assert (await http.get(gw.url + "/ready")).status_code == 200


async def _not(coro) -> bool:  # noqa: ANN001
    return not await coro


async def test_dead_worker_before_first_byte_is_retried_elsewhere(sim_fleet) -> None:
    alive = sim_fleet(1, time_scale=20)
    doomed = sim_fleet(1, time_scale=20)
    # active checks far apart: the gateway learns about the death on the data path only
    health = {"interval_s": 60, "timeout_s": 0.5, "failures_to_eject": 2, "successes_to_restore": 1}
    async with gateway([alive.urls[0], doomed.urls[0]], default_policy="round_robin", health=health) as gw:
        oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=20)
        await oa.chat.completions.create(**CHAT)  # both workers are healthy and pooled
        await oa.chat.completions.create(**CHAT)
        doomed.stop()
        for stream in (False, True, False, True):
            if stream:
                s = await oa.chat.completions.create(**CHAT, stream=True)
                assert [c async for c in s]
            else:
                r = await oa.chat.completions.create(**CHAT)
                assert r.usage.completion_tokens >= 1
        async with httpx.AsyncClient(headers=ADMIN, ) as http:
            text = (await http.get(gw.url + "/metrics")).text
        assert metric(text, "fleetgate_upstream_errors_total", worker="w1", kind="connect") >= 1
        assert metric(text, "fleetgate_retries_total") >= 1
        assert metric(text, "fleetgate_requests_total", status="200") == 6
        assert not gw.gateway.registry.workers["w1"].healthy  # passive failures ejected it


async def test_5xx_before_any_byte_is_retried_and_the_last_answer_passed_through(sim_fleet) -> None:
    fleet = sim_fleet(2, time_scale=20)
    async with gateway(fleet.urls, default_policy="round_robin") as gw, httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        await http.post(fleet.urls[1] + "/sim/faults", json={"error_status": 503})
        for _ in range(4):
            r = await http.post(gw.url + "/v1/chat/completions", json=CHAT)
            assert r.status_code == 200
        text = (await http.get(gw.url + "/metrics")).text
        assert metric(text, "fleetgate_upstream_errors_total", worker="w1", kind="status_5xx") >= 1
        # every worker fails: the client gets the last worker's own status and body, unchanged
        await http.post(fleet.urls[0] + "/sim/faults", json={"error_status": 500})
        direct = await http.post(fleet.urls[0] + "/v1/chat/completions", json=CHAT)
        r = await http.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code in (500, 503)
        assert r.json()["error"]["message"].startswith("Simulated fault")
        assert set(r.json()["error"]) == set(direct.json()["error"])


async def test_a_retry_whose_other_workers_are_full_waits_for_a_slot_instead_of_failing(sim_fleet) -> None:
    """w0 holds its one slot with a long answer; a request placed on w1 gets a 503 from it before any byte. The
    retry finds no free worker (w0 at its cap, w1 tried): it waits in the admission queue and runs on w0 once the
    long answer is done, where it would otherwise have failed with w1's 503."""
    fleet = sim_fleet(2, time_scale=20)
    w0, w1 = fleet.urls
    settings = {"workers": [{"id": "w0", "url": w0, "cap": 1}, {"id": "w1", "url": w1, "cap": 1}],
                "limits": {"queue_timeout_s": 30}, "default_policy": "round_robin"}
    async with gateway(fleet.urls, **settings) as gw, httpx.AsyncClient(headers=ADMIN, timeout=60) as http:
        await http.post(w1 + "/sim/faults", json={"error_status": 503})
        # the long answer (~2 s at time scale 20) pins w0's slot; round robin sends it to w0 first
        long = asyncio.create_task(http.post(gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2000},
                                             headers={"x-sim-output-tokens": "2000"}))
        await poll(lambda: (gw.gateway.store.inflight().get("w0") or None) is not None
                   and gw.gateway.store.inflight()["w0"].requests == 1, what="w0 holding its slot")
        r = await http.post(gw.url + "/v1/chat/completions", json=CHAT)   # w1 (503), then waits for w0
        assert r.status_code == 200, r.text
        assert (await long).status_code == 200
        text = (await http.get(gw.url + "/metrics")).text
        assert metric(text, "fleetgate_upstream_errors_total", worker="w1", kind="status_5xx") >= 1
        assert metric(text, "fleetgate_requests_total", status="200") == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_hung_worker_times_out_before_headers_and_is_retried(sim_fleet, stream: bool) -> None:
    fleet = sim_fleet(2, time_scale=20)
    # a hung worker is given up after first_byte_s, long before idle_s: the bound below tells the two apart with a
    # margin no loaded machine eats
    timeouts = {"connect_s": 1, "first_byte_s": 0.3, "idle_s": 60}
    async with gateway(fleet.urls, default_policy="round_robin", timeouts=timeouts) as gw, \
            httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        await http.post(fleet.urls[0] + "/sim/faults", json={"hang": True})
        for _ in range(2):
            t = time.monotonic()
            r = await http.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream})
            assert r.status_code == 200 and time.monotonic() - t < 20
        text = (await http.get(gw.url + "/metrics")).text
        assert metric(text, "fleetgate_upstream_errors_total", worker="w0", kind="timeout") >= 1
        await http.delete(fleet.urls[0] + "/sim/faults")


async def test_worker_dying_mid_stream_ends_with_an_error_event(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with gateway(fleet.urls) as gw, httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        await http.post(fleet.urls[0] + "/sim/faults", json={"drop_after_tokens": 3})
        r = await http.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                            headers={"x-sim-output-tokens": "10"})
        assert r.status_code == 200
        events = [e for e in r.content.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        err = orjson.loads(events[-2][len(b"data: "):])
        assert err["error"]["type"] == "upstream_error" and err["error"]["message"]
        tokens = [e for e in events if b'"content":"' in e and b'"content":""' not in e]
        assert len(tokens) == 3
        # the official client surfaces it as an API error instead of hanging
        oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=20)
        with pytest.raises(openai.APIError):
            s = await oa.chat.completions.create(**CHAT, stream=True, extra_headers={"x-sim-output-tokens": "10"})
            async for _ in s:
                pass
        text = (await http.get(gw.url + "/metrics")).text
        assert metric(text, "fleetgate_upstream_errors_total", worker="w0", kind="midstream") == 2
        assert gw.gateway.store.inflight()["w0"].requests == 0
