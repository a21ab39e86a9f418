"""Every error the gateway produces: status, OpenAI-style body, Retry-After; and no 500 for any input."""

from __future__ import annotations

import asyncio
import random
import time
from contextlib import AbstractAsyncContextManager

import httpx
import openai
import orjson
import pytest

from gateway.server import GatewayServer
from tests.helpers import MODEL, running_gateway

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}


def gateway(urls: list[str], **settings) -> AbstractAsyncContextManager[GatewayServer]:
    # one failed probe ejects (the tests here fail a worker's health on purpose), but a probe a loaded machine
    # answers slowly is not a failure: a 0.5 s timeout ejected a healthy worker and 503'd the queue test
    settings.setdefault("health", {"interval_s": 0.1, "timeout_s": 5.0, "failures_to_eject": 1})
    return running_gateway(urls, **settings)


def assert_error(r: httpx.Response, status: int, type_: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if type_ is not None:
        assert body["error"]["type"] == type_
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


BAD_BODIES = [
    (b"{not json", None),
    (b"", None),
    (b"[1, 2]", None),
    (b'"a string"', None),
    (b"null", None),
    (b'{"model": 5, "messages": [{"role": "user", "content": "x"}]}', "model"),
    (b'{"model": "%s"}' % MODEL.encode(), "messages"),
    (b'{"messages": "hello"}', "messages"),
    (b'{"messages": []}', "messages"),
    (b'{"messages": [5]}', "messages[0]"),
    (b'{"messages": [{"content": "no role"}]}', "messages[0]"),
    (b'{"messages": [{"role": "user", "content": 7}]}', "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream": 1}', "stream"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2.5}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": true}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}', "max_completion_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream": true, "stream_options": 3}', "stream_options"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e400}', None),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 99999999999999999999999999}', None),
]


async def test_bad_request_bodies_get_400_with_the_field_named(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with gateway(fleet.urls) as gw, httpx.AsyncClient(timeout=20) as http:
        for raw, param in BAD_BODIES:
            r = await http.post(gw.url + "/v1/chat/completions", content=raw,
                                headers={"content-type": "application/json"})
            err = assert_error(r, 400, "invalid_request_error")
            if param is not None:
                assert err["param"] == param, raw
        for raw, param in [(b"{}", "prompt"), (b'{"prompt": 5}', "prompt"), (b'{"prompt": [1, "a"]}', "prompt"),
                           (b'{"prompt": [[1], []]}', "prompt"), (b'{"prompt": []}', "prompt")]:
            assert_error(await http.post(gw.url + "/v1/completions", content=raw), 400, param=param)
        # the official client sees a BadRequestError with the message
        oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            await oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=-3)


async def test_unknown_model_404_names_the_served_models(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with gateway(fleet.urls) as gw:
        oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError) as exc:
            await oa.completions.create(model="gpt-17", prompt="x", max_tokens=2)
        err = exc.value.body
        assert err["param"] == "model" and "gpt-17" in err["message"] and MODEL in err["message"]


async def test_model_required_when_several_are_served(sim_fleet) -> None:
    fleet = sim_fleet(fleet={"servers": [{"model": "model-a"}, {"model": "model-b"}]}, time_scale=20)
    async with gateway(fleet.urls) as gw, httpx.AsyncClient(timeout=20) as http:
        err = assert_error(await http.post(gw.url + "/v1/completions", json={"prompt": "x"}), 400, param="model")
        assert "model-a" in err["message"] and "model-b" in err["message"]
        r = await http.post(gw.url + "/v1/completions", json={"prompt": "x", "model": "model-b", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "model-b"
        ids = [m["id"] for m in (await http.get(gw.url + "/v1/models")).json()["data"]]
        assert ids == ["model-a", "model-b"]


async def test_body_over_the_limit_is_413_by_header_and_by_streamed_size(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with gateway(fleet.urls, limits={"max_body_bytes": 4096}) as gw, httpx.AsyncClient(timeout=20) as http:
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
        assert_error(await http.post(gw.url + "/v1/chat/completions", json=big), 413)
        payload = orjson.dumps(big)

        async def chunks():  # no Content-Length: chunked transfer encoding
            for i in range(0, len(payload), 1000):
                yield payload[i:i + 1000]

        assert_error(await http.post(gw.url + "/v1/chat/completions", content=chunks()), 413)
        ok = {**CHAT, "messages": [{"role": "user", "content": "x" * 3000}]}
        assert (await http.post(gw.url + "/v1/chat/completions", json=ok)).status_code == 200


async def test_api_keys_guard_proxy_models_and_admin(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    admin = "admin-key-0123456789abcdef"
    async with gateway(fleet.urls, api_keys=["k-1", "k-2"], auth={"admin_key": admin}) as gw, \
            httpx.AsyncClient(timeout=20) as http:
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "k-1"},
                        {"authorization": "Bearer k-1"}):  # an inference key is not an admin key
            if headers.get("authorization") != "Bearer k-1":
                assert_error(await http.post(gw.url + "/v1/chat/completions", json=CHAT, headers=headers), 401,
                             "authentication_error")
                assert_error(await http.get(gw.url + "/v1/models", headers=headers), 401)
            assert_error(await http.get(gw.url + "/admin/workers", headers=headers), 401)
        ok = await http.get(gw.url + "/admin/workers", headers={"authorization": f"Bearer {admin}"})
        assert ok.status_code == 200 and [w["id"] for w in ok.json()["data"]] == ["w0"]
        oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k-2", max_retries=0)
        assert (await oa.chat.completions.create(**CHAT)).usage.completion_tokens >= 1
        bad = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k-3", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(**CHAT)
        # health, readiness and metrics stay open for probes and Prometheus
        for path in ("/health", "/ready", "/metrics"):
            assert (await http.get(gw.url + path)).status_code == 200


async def test_no_healthy_worker_is_503_with_retry_after(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with gateway(fleet.urls) as gw, httpx.AsyncClient(timeout=20) as http:
        await http.post(fleet.urls[0] + "/sim/faults", json={"health_fail": True})
        deadline = time.monotonic() + 5
        while gw.gateway.registry.any_healthy():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        r = await http.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert_error(r, 503, "service_unavailable_error")
        assert int(r.headers["retry-after"]) >= 1
        r = await http.get(gw.url + "/ready")
        assert_error(r, 503)
        assert int(r.headers["retry-after"]) >= 1
        assert (await http.get(gw.url + "/health")).status_code == 200


async def test_full_workers_queue_then_429_with_retry_after(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=1.0)
    workers = [{"id": "w0", "url": fleet.urls[0], "cap": 1}]
    limits = {"queue_size": 1, "queue_timeout_s": 0.4}
    long = {**CHAT, "max_tokens": 100_000, "stream": True}
    async with gateway([], workers=workers, limits=limits) as gw, httpx.AsyncClient(timeout=20) as http, \
            http.stream("POST", gw.url + "/v1/chat/completions", json=long,
                        headers={"x-sim-output-tokens": "100000"}) as holder:
        assert holder.status_code == 200
        t = time.monotonic()
        waiting = asyncio.create_task(http.post(gw.url + "/v1/chat/completions", json=CHAT))
        while not len(gw.gateway.dispatcher.runtimes[MODEL].queue):
            await asyncio.sleep(0.005)
        # the queue (size 1) is full: refused at once, for that reason (not after waiting its turn, which a
        # loaded machine could make look the same on a clock)
        r = await http.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert_error(r, 429, "rate_limit_error")
        assert int(r.headers["retry-after"]) >= 1 and "admission queue full" in r.json()["error"]["message"]
        # the queued one gives up after queue_timeout_s
        r = await waiting
        assert_error(r, 429, "rate_limit_error")
        assert "retry-after" in r.headers and time.monotonic() - t >= 0.4
        assert "admission queue full" not in r.json()["error"]["message"]
    # FIFO queue: requests beyond the cap wait and each gets the slot as soon as it frees
    limits = {"queue_size": 8, "queue_timeout_s": 10}
    async with gateway([], workers=workers, limits=limits) as gw, httpx.AsyncClient(timeout=20) as http:
        short = {**CHAT, "max_tokens": 30}
        rs = await asyncio.gather(*(http.post(gw.url + "/v1/chat/completions", json=short,
                                              headers={"x-sim-output-tokens": "30"}) for _ in range(4)))
        assert [r.status_code for r in rs] == [200] * 4
        text = (await http.get(gw.url + "/metrics")).text
        assert f'fleetgate_queue_wait_seconds_count{{model="{MODEL}"}} 3.0' in text


async def test_wrong_method_and_unknown_route_get_error_bodies(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with gateway(fleet.urls) as gw, httpx.AsyncClient(timeout=20) as http:
        assert_error(await http.get(gw.url + "/v1/chat/completions"), 405)
        assert_error(await http.get(gw.url + "/v1/nope"), 404)
        assert_error(await http.post(gw.url + "/admin/workers/w0/explode"), 404)
    async with gateway(fleet.urls, auth={}) as gw, httpx.AsyncClient(timeout=20) as http:
        # no admin key configured: the admin API is off, whatever is sent
        r = await http.get(gw.url + "/admin/workers", headers={"authorization": "Bearer anything-at-all"})
        assert assert_error(r, 404)["code"] == "admin_disabled"


def _junk(rng: random.Random, depth: int = 0):  # noqa: ANN202
    kinds = ["int", "float", "str", "bool", "null", "list", "dict"] if depth < 4 else ["int", "str", "null"]
    k = rng.choice(kinds)
    if k == "int":
        return rng.choice([0, -1, 2**63 - 1, -(2**63), rng.randint(-10**6, 10**6)])
    if k == "float":
        return rng.choice([0.5, -1e308, 1e-300, 3.14])
    if k == "str":
        return "".join(chr(rng.randint(1, 0x2FFF)) for _ in range(rng.randint(0, 20)))
    if k == "bool":
        return rng.random() < 0.5
    if k == "null":
        return None
    if k == "list":
        return [_junk(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = ["model", "messages", "prompt", "stream", "max_tokens", "role", "content", "stream_options", "x"]
    return {rng.choice(keys): _junk(rng, depth + 1) for _ in range(rng.randint(0, 5))}


async def test_fuzz_garbage_never_gets_a_500(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=50)
    rng = random.Random(1234)
    bodies: list[bytes] = [bytes(rng.randrange(256) for _ in range(rng.randint(1, 300))) for _ in range(40)]
    bodies += [orjson.dumps(_junk(rng)) for _ in range(80)]
    bodies += [b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000, b"\xff\xfe{}", b"1" * 100_000,
               b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
               b'{"prompt": "x", "max_tokens": 18446744073709551616}']
    # valid envelopes with junk inside go all the way to the worker
    for _ in range(30):
        msg = {"role": rng.choice(["user", "system", "tool", "x"]), "content": _junk(rng)}
        extra = {rng.choice(["temperature", "n", "stop", "logprobs", "seed"]): _junk(rng)}
        bodies.append(orjson.dumps({"model": MODEL, "messages": [msg], "max_tokens": 3, **extra}))
    async with gateway(fleet.urls) as gw, httpx.AsyncClient(timeout=20) as http:
        for i, raw in enumerate(bodies):
            path = "/v1/chat/completions" if i % 2 else "/v1/completions"
            r = await http.post(gw.url + path, content=raw)
            assert r.status_code != 500 and r.status_code < 600, (raw[:80], r.status_code, r.text[:200])
            if r.status_code >= 400:
                assert "error" in r.json(), raw[:80]
        text = (await http.get(gw.url + "/metrics")).text
        assert 'status="500"' not in text
