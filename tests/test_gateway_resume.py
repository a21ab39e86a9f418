"""Streams that survive their worker (gateway/wire/resume.py): simulated workers drop the connection mid-stream
(simulator/faults.py drop_after_tokens) and the official client still reads one continuous, complete answer."""

from __future__ import annotations

import asyncio
import logging

import httpx
import openai
import orjson

from simulator.tokenizer import count_tokens, render_chat
from simulator.vllm_api import FILLER_WORDS
from tests.helpers import ADMIN, MODEL, running_gateway
from tests.test_gateway_failures import metric

MESSAGES = [{"role": "user", "content": "count for me"}]
HEALTH = {"interval_s": 0.1, "timeout_s": 0.5, "failures_to_eject": 2, "successes_to_restore": 2}


def assert_continuous(text: str, tokens: int) -> None:
    """`text` is `tokens` filler words, each the one after the previous in the simulator's cycle."""
    words = text.split(" ")
    assert len(words) == tokens, text
    idx = [FILLER_WORDS.index(w) for w in words]
    assert all(b == (a + 1) % len(FILLER_WORDS) for a, b in zip(idx, idx[1:], strict=False)), text


async def drop_after(http: httpx.AsyncClient, urls: list[str], tokens: int) -> None:
    for url in urls:
        await http.post(url + "/sim/faults", json={"drop_after_tokens": tokens})


async def test_chat_stream_resumes_twice_and_reads_as_one(sim_fleet, caplog) -> None:
    caplog.set_level(logging.INFO, logger="fleetgate.access")
    fleet = sim_fleet(3, time_scale=20)
    async with running_gateway(fleet.urls, health=HEALTH) as gw, httpx.AsyncClient(timeout=20) as http:
        await drop_after(http, fleet.urls, 4)  # every worker breaks after 4 tokens: 4 + 4 + 2, two resumes
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=20)
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=10, stream=True, seed=7,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        roles = [c for c in chunks if c.choices and c.choices[0].delta.role]
        assert len(roles) == 1 and chunks[0] is roles[0]
        assert len({(c.id, c.created, c.model) for c in chunks}) == 1
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert_continuous(text, 10)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        usage = [c.usage for c in chunks if c.usage is not None]
        assert len(usage) == 1 and not chunks[-1].choices
        assert usage[0].prompt_tokens == count_tokens(render_chat(MESSAGES))  # the original prompt
        assert usage[0].completion_tokens == 10 and usage[0].total_tokens == usage[0].prompt_tokens + 10
        text = (await http.get(gw.url + "/metrics", headers=ADMIN)).text
        assert metric(text, "fleetgate_stream_breaks_total", outcome="resumed") == 2
        assert metric(text, "fleetgate_requests_total", status="200") == 1
        assert metric(text, "fleetgate_requests_total", status="502") == 0
        assert all(f.requests == 0 for f in gw.gateway.store.inflight().values())
    access = [r.fields for r in caplog.records if r.name == "fleetgate.access"]
    assert len(access) == 1 and access[0]["resumes"] == 2 and access[0]["status"] == 200
    assert access[0]["completion_tokens"] == 10 and access[0]["prompt_tokens"] == usage[0].prompt_tokens


async def test_completion_stream_resumes_without_usage_when_not_asked(sim_fleet) -> None:
    fleet = sim_fleet(2, time_scale=20)
    async with running_gateway(fleet.urls, health=HEALTH) as gw, httpx.AsyncClient(timeout=20) as http:
        await drop_after(http, fleet.urls, 5)
        r = await http.post(gw.url + "/v1/completions", json={
            "model": MODEL, "prompt": "List:", "max_tokens": 8, "ignore_eos": True, "stream": True})
        events = [e for e in r.content.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        objs = [orjson.loads(e[6:]) for e in events[:-1]]
        assert all("error" not in o and o["choices"] for o in objs)  # no error event, no usage event
        assert len({(o["id"], o["created"]) for o in objs}) == 1
        assert_continuous("".join(o["choices"][0]["text"] for o in objs), 8)


async def test_out_of_workers_ends_with_an_error_event_counted_as_502(sim_fleet) -> None:
    fleet = sim_fleet(2, time_scale=20)
    async with running_gateway(fleet.urls, health=HEALTH) as gw, httpx.AsyncClient(timeout=20) as http:
        await drop_after(http, fleet.urls, 3)
        r = await http.post(gw.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": MESSAGES, "max_tokens": 20, "ignore_eos": True, "stream": True})
        events = [e for e in r.content.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        assert orjson.loads(events[-2][6:])["error"]["type"] == "upstream_error"
        text = "".join(orjson.loads(e[6:])["choices"][0]["delta"].get("content") or "" for e in events[:-2])
        assert_continuous(text, 6)  # 3 from each worker, then nobody left to try
        # a stream that cannot resume (logprobs requested) ends as before
        r = await http.post(gw.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": MESSAGES, "max_tokens": 20, "ignore_eos": True, "stream": True,
            "logprobs": True})
        assert b'"error"' in r.content and r.content.endswith(b"data: [DONE]\n\n")
        text = (await http.get(gw.url + "/metrics", headers=ADMIN)).text
        assert metric(text, "fleetgate_stream_breaks_total", outcome="resumed") == 1
        assert metric(text, "fleetgate_stream_breaks_total", outcome="ended") == 1
        assert metric(text, "fleetgate_stream_breaks_total", outcome="not_resumable") == 1
        assert metric(text, "fleetgate_requests_total", status="502") == 2
        assert metric(text, "fleetgate_requests_total", status="200") == 0


async def test_stalled_worker_is_suspected_and_its_stream_finishes_elsewhere(sim_fleet) -> None:
    fleet = sim_fleet(2, time_scale=20)
    resume = {"gap_floor_s": 0.5, "first_token_floor_s": 1.0, "cold_gap_s": 1.0, "cold_first_token_s": 2.0,
              "ejection_base_s": 2.0, "probe_timeout_s": 1.0}
    async with running_gateway(fleet.urls, health=HEALTH, resume=resume, default_policy="round_robin") as gw, \
            httpx.AsyncClient(timeout=30) as http:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=30)
        for _ in range(20):  # both workers get a pace
            await client.completions.create(model=MODEL, prompt="warm", max_tokens=4)
        before = await served(http, fleet.urls)
        await client.completions.create(model=MODEL, prompt="warm", max_tokens=4)
        after = await served(http, fleet.urls)
        # round robin sends the stream to the worker the last warm-up did not go to: armed before the request,
        # its engine freezes after the stream's 5th token (its /health still answers), however loaded the host
        idx = 0 if after[1] > before[1] else 1
        sick_url = fleet.urls[idx]
        await http.post(sick_url + "/sim/faults", json={"stall_after_tokens": 5})
        tokens_before = [await generated(http, u) for u in fleet.urls]
        t0 = asyncio.get_running_loop().time()
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=400, stream=True, extra_body={"ignore_eos": True},
            extra_headers={"x-request-id": "stall-1"})
        parts = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
        took = asyncio.get_running_loop().time() - t0
        assert_continuous("".join(parts), 400)
        assert took < 8.0  # the 60 s idle timeout never came into it
        assert (await http.get(sick_url + "/sim/state")).json()["stalled"]
        tokens_after = [await generated(http, u) for u in fleet.urls]
        assert tokens_after[idx] - tokens_before[idx] == 5  # 5 tokens there, the other 395 on the other worker
        assert tokens_after[1 - idx] - tokens_before[1 - idx] == 395
        text = (await http.get(gw.url + "/metrics", headers=ADMIN)).text
        assert metric(text, "fleetgate_stream_breaks_total", outcome="resumed") == 1
        sick = gw.gateway.registry.workers[f"w{idx}"]
        assert (await http.get(sick_url + "/health")).status_code == 200
        assert not sick.healthy  # left rotation at once, and stays out its hold time though /health answers
        await http.delete(sick_url + "/sim/faults")  # it recovers: a probe generation brings it back
        await poll_until(lambda: sick.healthy, 15.0)


async def served(http: httpx.AsyncClient, urls: list[str]) -> list[int]:
    """Requests each simulated worker finished by length (the warm-ups)."""
    return [(await http.get(u + "/sim/state")).json()["stats"]["finished"]["length"] for u in urls]


async def generated(http: httpx.AsyncClient, url: str) -> int:
    """Tokens the simulated worker's engine generated so far."""
    return (await http.get(url + "/sim/state")).json()["stats"]["generation_tokens"]


async def poll_until(cond, timeout_s: float) -> None:  # noqa: ANN001
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_a_worker_failing_every_request_is_ejected_though_its_health_answers(sim_fleet) -> None:
    fleet = sim_fleet(2, time_scale=20)
    resume = {"eject_after_errors": 3, "ejection_base_s": 1.0}
    async with running_gateway(fleet.urls, health=HEALTH, resume=resume, default_policy="round_robin") as gw, \
            httpx.AsyncClient(timeout=20) as http:
        await http.post(fleet.urls[0] + "/sim/faults", json={"error_status": 500})
        bad = gw.gateway.registry.workers["w0"]
        for _ in range(8):  # w0's failures are retried on w1: the clients see none
            r = await http.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert r.status_code == 200
        assert not bad.healthy  # out after 3 in a row, though /health answers 200
        text = (await http.get(gw.url + "/metrics", headers=ADMIN)).text
        assert metric(text, "fleetgate_upstream_errors_total", worker="w0", kind="status_5xx") == 3
        await http.delete(fleet.urls[0] + "/sim/faults")
        await poll_until(lambda: bad.healthy, 10.0)  # back after its hold, by the health checks
