"""The data path end to end: the official openai client -> gateway -> simulated vLLM fleet, on loopback."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from gateway.server import GatewayServer
from simulator import tokenizer
from tests.helpers import MODEL
from tests.helpers import running_gateway as gateway

FAST = 20.0
_CREATED = re.compile(rb'"created":\d+')


def client(gw: GatewayServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=20)


async def test_chat_and_completions_usage_equals_worker_counts(sim_fleet) -> None:
    fleet = sim_fleet(2, time_scale=FAST)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something ünïcode."}]
    async with gateway(fleet.urls) as gw:
        oa = client(gw)
        chat = await oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=50,
                                                extra_headers={"x-sim-output-tokens": "7"})
        assert chat.usage.completion_tokens == 7
        assert chat.usage.prompt_tokens == tokenizer.count_tokens(tokenizer.render_chat(messages))
        assert len(chat.choices[0].message.content.split()) == 7
        comp = await oa.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5)
        assert comp.usage.completion_tokens <= 5
        assert comp.usage.prompt_tokens == tokenizer.count_tokens("The quick brown fox")

        # streams: the client did not ask for usage -> none shown; token chunks = the worker's count
        stream = await oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=50, stream=True,
                                                  extra_headers={"x-sim-output-tokens": "9"})
        chunks = [c async for c in stream]
        assert all(c.usage is None for c in chunks)
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 9
        # ... and asked for: exactly one usage chunk, with the worker's numbers
        stream = await oa.completions.create(model=MODEL, prompt="abcd" * 10, max_tokens=50, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_headers={"x-sim-output-tokens": "4"})
        chunks = [c async for c in stream]
        usage = [c.usage for c in chunks if c.usage is not None]
        assert len(usage) == 1 and usage[0].completion_tokens == 4 and usage[0].prompt_tokens == 10

        models = await oa.models.list()
        assert [m.id for m in models.data] == [MODEL]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_stream_bytes_identical_to_what_the_worker_sends(sim_fleet, path: str, include_usage: bool) -> None:
    # Two one-worker fleets with the same seed make the same first answer: one is asked directly, the
    # other through the gateway; apart from the `created` second the bytes must match.
    direct = sim_fleet(1, time_scale=FAST, seed=5)
    behind = sim_fleet(1, time_scale=FAST, seed=5)
    body = {"model": MODEL, "max_tokens": 40, "stream": True}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    headers = {"x-request-id": "same-id-1", "x-sim-output-tokens": "6"}
    async with gateway(behind.urls) as gw, httpx.AsyncClient(timeout=20) as http:
        want = (await http.post(direct.urls[0] + path, json=body, headers=headers)).content
        got = await http.post(gw.url + path, json=body, headers=headers)
    assert got.status_code == 200
    assert got.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert _CREATED.sub(b"", got.content) == _CREATED.sub(b"", want)
    assert (b'"choices":[],"usage"' in got.content) == include_usage
    assert got.content.endswith(b"data: [DONE]\n\n")


async def test_request_id_round_trip(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=FAST)
    async with gateway(fleet.urls) as gw, httpx.AsyncClient(timeout=20) as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
        r = await http.post(gw.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "my-req.42"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "my-req.42"
        assert r.json()["id"] == "chatcmpl-my-req.42"  # the worker saw it (vLLM builds the id from it)
        r = await http.post(gw.url + "/v1/chat/completions", json=body)
        rid = r.headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", rid) and r.json()["id"] == "chatcmpl-" + rid
        # unusable ids (too long, odd characters) are replaced, never forwarded
        r = await http.post(gw.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "a b" * 100})
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
        # errors carry it too
        r = await http.post(gw.url + "/v1/chat/completions", content=b"{", headers={"X-Request-Id": "bad-1"})
        assert r.status_code == 400 and r.headers["x-request-id"] == "bad-1"


async def test_model_may_be_omitted_when_the_fleet_serves_one(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=FAST)
    async with gateway(fleet.urls) as gw, httpx.AsyncClient(timeout=20) as http:
        r = await http.post(gw.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == MODEL
        r = await http.post(gw.url + "/v1/chat/completions", json={"model": "", "stream": True, "max_tokens": 2,
                                                                   "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
