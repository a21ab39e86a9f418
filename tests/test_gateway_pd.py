"""Prefill/decode-disaggregated serving through the gateway, against simulated vLLM producers and consumers.

Every test runs a real gateway on 127.0.0.1 in front of simulated vLLM servers speaking the NIXL
`kv_transfer_params` protocol (simulator/vllm_api.py), with the official openai client where a client is
involved; failures come from the simulator's fault injection (POST /sim/faults).
"""

from __future__ import annotations

import asyncio
import signal
from contextlib import AbstractAsyncContextManager

import aiohttp
import httpx
import openai
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from engine_adapters.vllm.kv_transfer import PREFILL_LEG_PARAMS
from gateway.server import GatewayServer
from simulator.tokenizer import count_tokens, render_chat, synthetic_text
from tests.helpers import ADMIN, MODEL, CliProcess, free_port_range, poll, run_cli, running_gateway
from tests.test_gateway_resume import assert_continuous

PRODUCER = {"role": "kv_producer"}
CONSUMER = {"role": "kv_consumer"}


# --- helpers ------------------------------------------------------------------------------------------------

def gateway(workers: list[tuple[str, str, str]], profile: str = "", **settings) -> AbstractAsyncContextManager[GatewayServer]:
    """A gateway over (id, url, role) workers (of `profile`, when a policy needs their performance model)."""
    settings.setdefault("health", {"interval_s": 0.1, "timeout_s": 0.5})
    return running_gateway(workers=[{"id": i, "url": u, "role": r, "profile": profile} for i, u, r in workers],
                           **settings)


def samples(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


async def metric(http: httpx.AsyncClient, url: str, name: str, **labels: str) -> float:
    return samples((await http.get(url + "/metrics")).text, name, **labels)


async def tokens(http: httpx.AsyncClient, url: str) -> tuple[float, float]:
    """(prompt tokens computed, tokens generated) by a simulated worker."""
    text = (await http.get(url + "/metrics")).text
    return samples(text, "vllm:prompt_tokens_total"), samples(text, "vllm:generation_tokens_total")


def held(gw: GatewayServer, worker: str) -> int:
    f = gw.gateway.store.inflight().get(worker)
    return f.requests if f is not None else 0


def long_chat(key: str, n: int = 1000) -> tuple[list[dict], int]:
    messages = [{"role": "user", "content": synthetic_text(n, key)}]
    return messages, count_tokens(render_chat(messages))


def client(gw: GatewayServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)


async def chat(gw: GatewayServer, messages: list[dict], stream: bool, max_tokens: int = 12,
               request_id: str | None = None) -> tuple[str, int, str | None, str]:
    """(text, completion tokens, finish reason, response id) as an openai client sees them."""
    headers = {"X-Request-Id": request_id} if request_id else None
    kw = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "extra_body": {"ignore_eos": True},
          "extra_headers": headers}
    c = client(gw)
    if not stream:
        r = await c.chat.completions.create(**kw)
        return r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason, r.id
    text, n, finish, rid = "", 0, None, ""
    async for chunk in await c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        rid = chunk.id
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    return text, n, finish, rid


# --- the two legs ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [True, False])
async def test_prompt_runs_on_the_prefill_worker_and_the_answer_on_the_decode_worker(sim_fleet, stream: bool) -> None:
    fleet = sim_fleet(fleet={"servers": [PRODUCER, CONSUMER]}, time_scale=20)
    p, d = fleet.urls
    messages, n = long_chat(f"split-{stream}")
    async with gateway([("p0", p, "prefill"), ("d0", d, "decode")]) as gw, httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        text, out, finish, rid = await chat(gw, messages, stream, max_tokens=12, request_id=f"pd-{stream}")
        assert (out, finish, rid) == (12, "length", f"chatcmpl-pd-{stream}")  # D answered under the same id
        assert len(text.split()) == 12
        assert await tokens(http, p) == (n, 1)        # the prompt ran on P (and its one discarded token)
        assert await tokens(http, d) == (0, 12)       # D computed no prompt, generated the answer
        g = (await http.get(gw.url + "/metrics")).text
        assert samples(g, "fleetgate_pd_decisions_total", decision="disaggregated") == 1
        assert samples(g, "fleetgate_pd_phase_seconds_count", phase="prefill") == 1
        assert samples(g, "fleetgate_pd_phase_seconds_count", phase="decode") == 1
        assert samples(g, "fleetgate_pd_phase_seconds_count", phase="transfer_wait") == (1 if stream else 0)
        if stream:  # TTFT as the client sees it includes the whole prefill leg
            assert samples(g, "fleetgate_time_to_first_token_seconds_count") == 1
            assert samples(g, "fleetgate_time_to_first_token_seconds_sum") > \
                samples(g, "fleetgate_pd_phase_seconds_sum", phase="prefill")
        assert samples(g, "fleetgate_requests_total", status="200") == 1
        assert held(gw, "p0") == 0 and held(gw, "d0") == 0
        state = (await http.get(p + "/sim/state")).json()
        assert state["held"] == 0      # D read the pinned KV, P let it go


async def _recorder(target: str, log: list[dict]) -> tuple[web.AppRunner, str]:
    """A pass-through HTTP proxy in front of one simulated server that records each generation request."""
    session = aiohttp.ClientSession()

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        async with session.request(request.method, target + request.path_qs, data=body or None,
                                   headers={k: v for k, v in request.headers.items()
                                            if k.lower() in ("content-type", "x-request-id")}) as r:
            answer = await r.read()
            if request.path.startswith("/v1/") and request.method == "POST":
                log.append({"path": request.path, "headers": {k.lower(): v for k, v in request.headers.items()}, "body": orjson.loads(body),
                            "answer": answer})
            return web.Response(body=answer, status=r.status, content_type=r.content_type)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    app.on_cleanup.append(lambda _: session.close())
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("stream", [True, False])
async def test_the_legs_on_the_wire(sim_fleet, stream: bool) -> None:
    fleet = sim_fleet(fleet={"servers": [PRODUCER, CONSUMER]}, time_scale=20)
    p_log: list[dict] = []
    d_log: list[dict] = []
    p_run, p_url = await _recorder(fleet.urls[0], p_log)
    d_run, d_url = await _recorder(fleet.urls[1], d_log)
    try:
        async with gateway([("p0", p_url, "prefill"), ("d0", d_url, "decode")]) as gw, \
                httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
            body = {"model": MODEL, "prompt": synthetic_text(600, "wire"), "max_tokens": 7, "min_tokens": 3,
                    "ignore_eos": True, "temperature": 0.5, "stream": stream}
            r = await http.post(gw.url + "/v1/completions", json=body, headers={"X-Request-Id": "wire-1"})
            assert r.status_code == 200, r.text
            assert (r.text.endswith("data: [DONE]\n\n") if stream else r.json()["usage"]["completion_tokens"] == 7)
    finally:
        await p_run.cleanup()
        await d_run.cleanup()
    (pre,), (dec,) = p_log, d_log
    assert pre["path"] == dec["path"] == "/v1/completions"
    assert pre["headers"]["x-request-id"] == dec["headers"]["x-request-id"] == "wire-1"
    leg = pre["body"]
    assert leg["kv_transfer_params"] == PREFILL_LEG_PARAMS
    assert leg["stream"] is False and leg["max_tokens"] == 1 and "min_tokens" not in leg
    assert "stream_options" not in leg
    assert {k: v for k, v in leg.items() if k not in ("kv_transfer_params", "stream", "max_tokens")} == \
        {k: v for k, v in body.items() if k not in ("stream", "max_tokens", "min_tokens")}
    returned = orjson.loads(pre["answer"])["kv_transfer_params"]
    assert returned["do_remote_prefill"] is True and returned["remote_block_ids"]
    sent = dec["body"]
    assert sent.pop("kv_transfer_params") == returned                       # copied as an opaque object
    sent.pop("stream_options", None)                                         # the gateway's usage request
    assert sent == body                                                      # otherwise the client's body


# --- conditional disaggregation -------------------------------------------------------------------------------

async def test_short_or_cached_prompts_skip_the_prefill_pool(sim_fleet) -> None:
    fleet = sim_fleet(fleet={"servers": [PRODUCER, CONSUMER]}, time_scale=20)
    p, d = fleet.urls
    async with gateway([("p0", p, "prefill"), ("d0", d, "decode")], pd={"local_prefill_tokens": 256}) as gw, \
            httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        short = [{"role": "user", "content": "What is the capital of France?"}]
        await chat(gw, short, stream=False, max_tokens=4)
        assert await tokens(http, p) == (0, 0)
        assert (await tokens(http, d))[0] == count_tokens(render_chat(short))
        messages, n = long_chat("cached")
        await chat(gw, messages, stream=True)        # split: P prefills, D now caches the prompt
        p1, d1 = await tokens(http, p), await tokens(http, d)
        assert p1[0] == n
        await chat(gw, [*messages], stream=True)     # the same prompt: D prefills what it does not cache
        assert await tokens(http, p) == p1
        assert 0 < (await tokens(http, d))[0] - d1[0] <= 16
        g = (await http.get(gw.url + "/metrics")).text
        assert [samples(g, "fleetgate_pd_decisions_total", decision=k)
                for k in ("local_short", "disaggregated", "local_cached")] == [1, 1, 1]


async def test_aladdin_places_the_decode_legs_in_split_phase_mode(sim_fleet) -> None:
    fleet = sim_fleet(fleet={"servers": [PRODUCER, CONSUMER, CONSUMER]}, time_scale=20)
    p, d0, d1 = fleet.urls
    keys = [f"aladdin-{i}" for i in range(4)]
    async with gateway([("p0", p, "prefill"), ("d0", d0, "decode"), ("d1", d1, "decode")], "llama3-8b-h100",
                       pd={"decode_policy": "aladdin", "prefill_overflow": False}) as gw, \
            httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        results = await asyncio.gather(*(chat(gw, long_chat(k)[0], stream=True, max_tokens=8) for k in keys))
        assert [r[1] for r in results] == [8] * len(keys)
        assert (await tokens(http, p))[0] == sum(long_chat(k)[1] for k in keys)
        decode = [await tokens(http, u) for u in (d0, d1)]
        assert sum(t[0] for t in decode) == 0 and sum(t[1] for t in decode) == 8 * len(keys)
        pol = gw.gateway.dispatcher.runtimes[MODEL].placement.pd  # the P/D profile of the placement step
        assert pol.decode_policy_name == "aladdin_decode" and pol.decisions == {"disaggregated": len(keys)}


async def test_pools_follow_registration(sim_fleet) -> None:
    fleet = sim_fleet(fleet={"servers": [PRODUCER, CONSUMER, {}]}, time_scale=20)
    p, d, m = fleet.urls
    messages, n = long_chat("registered")
    async with gateway([("m0", m, "mixed")]) as gw, httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        await chat(gw, messages, stream=False)                       # only a mixed worker: the plain path
        assert (await tokens(http, m))[0] == n
        for wid, url, role in (("p0", p, "prefill"), ("d0", d, "decode")):
            r = await http.post(gw.url + "/admin/workers", json={"id": wid, "url": url, "role": role})
            assert r.status_code == 201 and r.json()["role"] == role
        before = await tokens(http, m)
        await chat(gw, long_chat("registered-2")[0], stream=False)      # now split: P prefills, d0 or m0 decodes
        assert (await tokens(http, p))[0] == long_chat("registered-2")[1]
        assert (await tokens(http, d))[0] + (await tokens(http, m))[0] - before[0] == 0
        r = await http.delete(gw.url + "/admin/workers/p0")
        assert r.status_code in (200, 204)
        await chat(gw, long_chat("registered-3")[0], stream=False)      # no prefill pool: local prefill
        assert (await tokens(http, p))[0] == long_chat("registered-2")[1]
        g = (await http.get(gw.url + "/metrics")).text
        assert samples(g, "fleetgate_pd_decisions_total", decision="disaggregated") == 1
        assert samples(g, "fleetgate_pd_decisions_total", decision="local_no_prefill") == 1


async def test_no_decode_capable_worker_is_a_clear_503(sim_fleet) -> None:
    fleet = sim_fleet(fleet={"servers": [PRODUCER]}, time_scale=20)
    async with gateway([("p0", fleet.urls[0], "prefill")]) as gw, httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        r = await http.post(gw.url + "/v1/chat/completions",
                            json={"model": MODEL, "messages": long_chat("none")[0], "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_worker"
        assert r.headers["retry-after"]


# --- failures ---------------------------------------------------------------------------------------------------

async def test_prefill_failure_retries_another_prefill_worker(sim_fleet) -> None:
    fleet = sim_fleet(fleet={"servers": [PRODUCER, PRODUCER, CONSUMER]}, time_scale=20)
    p0, p1, d = fleet.urls
    messages, n = long_chat("retry-p")
    async with gateway([("p0", p0, "prefill"), ("p1", p1, "prefill"), ("d0", d, "decode")]) as gw, \
            httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        await http.post(p0 + "/sim/faults", json={"error_status": 503})   # p0 is the first choice (ties by id)
        _, out, finish, _ = await chat(gw, messages, stream=True)
        assert (out, finish) == (12, "length")
        assert await tokens(http, p0) == (0, 0)
        assert await tokens(http, p1) == (n, 1)
        assert await tokens(http, d) == (0, 12)        # the KV still came from a prefill worker
        g = (await http.get(gw.url + "/metrics")).text
        assert samples(g, "fleetgate_pd_decisions_total", decision="prefill_retry") == 1
        assert samples(g, "fleetgate_upstream_errors_total", worker="p0", kind="pd_prefill") == 1
        assert all(held(gw, w) == 0 for w in ("p0", "p1", "d0"))


@pytest.mark.parametrize("fault", [{"error_status": 500}, {"hang": True}], ids=["5xx", "hang"])
async def test_prefill_failure_everywhere_falls_back_to_local_prefill(sim_fleet, fault: dict) -> None:
    fleet = sim_fleet(fleet={"servers": [PRODUCER, CONSUMER]}, time_scale=20)
    p, d = fleet.urls
    messages, n = long_chat("fallback")
    async with gateway([("p0", p, "prefill"), ("d0", d, "decode")], resume={"cold_first_token_s": 0.5}) as gw, \
            httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        await http.post(p + "/sim/faults", json=fault)
        text, out, finish, _ = await chat(gw, messages, stream=False)
        assert (out, finish) == (12, "length") and len(text.split()) == 12
        assert await tokens(http, d) == (n, 12)        # the decode worker prefilled locally
        g = (await http.get(gw.url + "/metrics")).text
        assert samples(g, "fleetgate_pd_decisions_total", decision="prefill_fallback_local") == 1
        assert samples(g, "fleetgate_requests_total", status="200") == 1
        assert held(gw, "p0") == 0 and held(gw, "d0") == 0


@pytest.mark.parametrize("stream, fault", [(True, {"error_status": 503}), (False, {"drop_after_tokens": 0})],
                         ids=["5xx-stream", "dropped-unary"])
async def test_decode_failure_before_first_byte_moves_to_a_decode_worker_that_prefills(sim_fleet, stream: bool,
                                                                                       fault: dict) -> None:
    fleet = sim_fleet(fleet={"servers": [PRODUCER, CONSUMER, CONSUMER]}, time_scale=20)
    p, d0, d1 = fleet.urls
    messages, n = long_chat(f"retry-d-{stream}")
    async with gateway([("p0", p, "prefill"), ("d0", d0, "decode"), ("d1", d1, "decode")]) as gw, \
            httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        await http.post(d0 + "/sim/faults", json=fault)   # d0 is least_requests' first choice (ties by id)
        _, out, finish, _ = await chat(gw, messages, stream=stream)
        assert (out, finish) == (12, "length")
        assert (await tokens(http, p))[0] == n
        assert await tokens(http, d1) == (n, 12)          # the second decode worker prefilled locally
        g = (await http.get(gw.url + "/metrics")).text
        assert samples(g, "fleetgate_pd_decisions_total", decision="decode_retry_local") == 1
        assert samples(g, "fleetgate_requests_total", status="200") == 1
        assert all(held(gw, w) == 0 for w in ("p0", "d0", "d1"))


async def test_decode_re_placements_keep_every_count_exact(sim_fleet) -> None:
    """A decode leg placed again elsewhere is `released` from its old worker and `placed` on
    the new one for every request hook, so the class router's per-worker counts (the autoscaler's busy measure),
    the reservations and the in-flight gauges all return to zero once the fleet is idle. (The re-placement once
    skipped both hooks: the old worker's count never came down.)"""
    fleet = sim_fleet(fleet={"servers": [PRODUCER, CONSUMER, CONSUMER, CONSUMER]}, time_scale=20)
    p, d0, d1, d2 = fleet.urls
    workers = [("p0", p, "prefill"), ("d0", d0, "decode"), ("d1", d1, "decode"), ("d2", d2, "decode")]
    async with gateway(workers) as gw, httpx.AsyncClient(headers=ADMIN, timeout=30) as http:
        await http.post(d0 + "/sim/faults", json={"drop_after_tokens": 0})   # d0 dies under every leg sent to it
        answers = await asyncio.gather(*(chat(gw, long_chat(f"counts-{i}")[0], stream=i % 2 == 0,
                                              request_id=f"counts-{i}") for i in range(8)))
        assert [a[1:3] for a in answers] == [(12, "length")] * 8
        g = (await http.get(gw.url + "/metrics")).text
        assert samples(g, "fleetgate_pd_decisions_total", decision="decode_retry_local") >= 1
        assert gw.gateway.batch.class_counts() == {}
        assert all(held(gw, w) == 0 for w, _, _ in workers)

        async def gauges_zero() -> bool:
            g = (await http.get(gw.url + "/metrics")).text
            return samples(g, "fleetgate_worker_inflight") == 0

        await poll(gauges_zero, timeout=10, what="every worker's in-flight gauge back to zero")


async def test_params_expired_at_the_producer_fall_back_to_local_prefill(sim_fleet) -> None:
    # P keeps the KV 1 model-ms only (VLLM_NIXL_ABORT_REQUEST_TIMEOUT): by the time D asks, it is gone
    fleet = sim_fleet(fleet={"servers": [{**PRODUCER, "kv_lease_s": 0.001}, CONSUMER]}, time_scale=20)
    p, d = fleet.urls
    messages, n = long_chat("expired-p")
    async with gateway([("p0", p, "prefill"), ("d0", d, "decode")]) as gw, httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        _, out, _, _ = await chat(gw, messages, stream=True)
        assert out == 12
        assert (await tokens(http, p))[0] == n and await tokens(http, d) == (n, 12)


async def test_params_the_gateway_knows_are_stale_are_not_sent(sim_fleet) -> None:
    fleet = sim_fleet(fleet={"servers": [PRODUCER, CONSUMER]}, time_scale=20)
    p, d = fleet.urls
    messages, n = long_chat("expired-g")
    async with gateway([("p0", p, "prefill"), ("d0", d, "decode")], pd={"kv_hold_s": 1e-6}) as gw, \
            httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        _, out, _, _ = await chat(gw, messages, stream=False)
        assert out == 12
        assert (await tokens(http, p))[0] == n and await tokens(http, d) == (n, 12)
        g = (await http.get(gw.url + "/metrics")).text
        assert samples(g, "fleetgate_pd_decisions_total", decision="expired_params") == 1


# --- reservations ---------------------------------------------------------------------------------------------

async def test_each_worker_is_reserved_while_its_leg_runs(sim_fleet) -> None:
    fleet = sim_fleet(fleet={"servers": [PRODUCER, CONSUMER]}, time_scale=20)
    p, d = fleet.urls
    messages, n = long_chat("reserve", 4000)
    async with gateway([("p0", p, "prefill"), ("d0", d, "decode")]) as gw, httpx.AsyncClient(headers=ADMIN, timeout=30) as http:
        await http.post(p + "/sim/faults", json={"slowdown": 200.0})    # a slow prefill leg
        task = asyncio.create_task(chat(gw, messages, stream=True, max_tokens=400))
        await poll(lambda: held(gw, "p0") == 1 and held(gw, "d0") == 1, what="both reservations during prefill")
        assert gw.gateway.store.inflight()["p0"].tokens == n       # a prefill leg reserves its prompt tokens
        await http.delete(p + "/sim/faults")
        await poll(lambda: held(gw, "p0") == 0 and held(gw, "d0") == 1 and not task.done(),
                   what="only the decode reservation while decoding")
        _, out, _, _ = await task
        assert out == 400 and held(gw, "p0") == 0 and held(gw, "d0") == 0


async def test_client_leaving_during_prefill_releases_everything(sim_fleet) -> None:
    fleet = sim_fleet(fleet={"servers": [PRODUCER, CONSUMER]}, time_scale=20)
    p, d = fleet.urls
    async with gateway([("p0", p, "prefill"), ("d0", d, "decode")]) as gw, httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        await http.post(p + "/sim/faults", json={"slowdown": 500.0})
        body = {"model": MODEL, "messages": long_chat("leave", 4000)[0], "max_tokens": 10}
        with pytest.raises(httpx.ReadTimeout):
            await http.post(gw.url + "/v1/chat/completions", json=body, timeout=0.5)

        async def aborted() -> bool:
            return await metric(http, p, "vllm:request_success_total", finished_reason="abort") == 1

        await poll(aborted, what="the prefill worker to abort the leg")
        await poll(lambda: held(gw, "p0") == 0 and held(gw, "d0") == 0, what="reservations released")
        g = (await http.get(gw.url + "/metrics")).text
        assert samples(g, "fleetgate_requests_total", status="499") == 1


# --- fleetgate demo --pd ---------------------------------------------------------------------------------------

def test_demo_pd_serves_split_requests_and_stops_cleanly() -> None:
    base = free_port_range(3)  # the demo's gateway port, then the P and D ports in a row
    gw_port, sim_port = base, base + 1
    with CliProcess("demo", "--port", str(gw_port), "--base-port", str(sim_port), "--pd", "1:1", "--time-scale", "20",
                    merge_stderr=True) as demo:
        line = demo.wait_for("fleetgate listening on", timeout=60)
        assert line.startswith(f"fleetgate listening on http://127.0.0.1:{gw_port}"), demo.describe()
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{gw_port}/v1", api_key="x", max_retries=0, timeout=20)
        messages, n = long_chat("demo")
        r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
        assert r.usage.completion_tokens >= 1
        prefill = samples(httpx.get(f"http://127.0.0.1:{sim_port}/metrics").text, "vllm:prompt_tokens_total")
        decode = samples(httpx.get(f"http://127.0.0.1:{sim_port + 1}/metrics").text, "vllm:prompt_tokens_total")
        assert (prefill, decode) == (n, 0)
        admin_key = next(x for x in demo.stdout if x.startswith("admin key")).split()[-1]  # the demo prints it
        workers = httpx.get(f"http://127.0.0.1:{gw_port}/admin/workers",
                            headers={"authorization": f"Bearer {admin_key}"}).json()["data"]
        assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
        assert demo.send_signal(signal.SIGINT, timeout=20) == 0


def test_demo_pd_bad_split_is_refused() -> None:
    r = run_cli("demo", "--pd", "0:2")
    assert r.returncode == 2 and "--pd" in r.stderr and "P:D" in r.stderr


async def test_plain_and_pd_requests_take_one_path(sim_fleet, monkeypatch) -> None:
    """The same placement step (policies/placement.py), reservation code and admission queue place a plain
    request and a P/D one: only the profile the step picks differs (P/D runs its two legs afterwards)."""
    from policies.placement import ModelPlacement

    seen: list[tuple[str, str, str | None]] = []
    place = ModelPlacement.place

    def spy(self, feats, views, now, swap_s=0.0):  # noqa: ANN001, ANN202
        d = place(self, feats, views, now, swap_s)
        seen.append((feats.request_id, d.reason, d.prefill_worker_id))
        return d

    monkeypatch.setattr(ModelPlacement, "place", spy)
    fleet = sim_fleet(fleet={"servers": [PRODUCER, CONSUMER, {}]}, time_scale=20)
    p, d, m = fleet.urls
    messages, _ = long_chat("one-path", 1500)
    # A plain fleet, then a P/D fleet, each capped at one request per worker so the second request queues.
    for workers, kind in (([("m0", m, "mixed")], "plain"), ([("p0", p, "prefill"), ("d0", d, "decode")], "pd")):
        caps = [{"id": i, "url": u, "role": r, "cap": 1} for i, u, r in workers]
        async with running_gateway(workers=caps, health={"interval_s": 0.1, "timeout_s": 0.5}) as gw, \
                httpx.AsyncClient(timeout=30) as http:
            seen.clear()
            rs = await asyncio.gather(*(chat(gw, messages, stream=True, max_tokens=60, request_id=f"{kind}-{i}")
                                        for i in range(2)))
            assert [r[1] for r in rs] == [60, 60]
            reasons = {reason for _, reason, _ in seen}
            if kind == "pd":
                assert any(pre == "p0" for _, _, pre in seen) and "disaggregated" in reasons
            else:
                assert all(pre is None for _, _, pre in seen) and reasons <= {"least_tokens", "no_workers", ""}
            # the second request found the one worker (pair) full and waited in the model's admission queue
            assert {rid for rid, *_ in seen} == {f"{kind}-0", f"{kind}-1"} and len(seen) >= 3
            assert await metric(http, gw.url, "fleetgate_queue_wait_seconds_count", model=MODEL) == 1


# --- the decode leg as any leg: resume, progress -----------------------------------------------------------

async def test_a_decode_worker_dying_mid_stream_is_resumed_on_another_decode_worker(sim_fleet) -> None:
    fleet = sim_fleet(fleet={"servers": [PRODUCER, CONSUMER, CONSUMER]}, time_scale=20)
    p, d0, d1 = fleet.urls
    messages, _ = long_chat("pd-resume")
    async with gateway([("p0", p, "prefill"), ("d0", d0, "decode"), ("d1", d1, "decode")]) as gw, \
            httpx.AsyncClient(headers=ADMIN, timeout=20) as http:
        await http.post(d0 + "/sim/faults", json={"drop_after_tokens": 5})  # d0: least_requests' first choice
        text, out, finish, _ = await chat(gw, messages, stream=True, max_tokens=40)
        assert (out, finish) == (40, "length")  # one stream, every token, the usage of the whole answer
        assert_continuous(text, 40)
        g = (await http.get(gw.url + "/metrics")).text
        assert samples(g, "fleetgate_stream_breaks_total", outcome="resumed") == 1
        assert samples(g, "fleetgate_requests_total", status="200") == 1
        prompt, generated = await tokens(http, d1)
        assert generated == 35 and prompt > 0  # the rest of the answer, its prompt prefilled there
        assert all(held(gw, w) == 0 for w in ("p0", "d0", "d1"))


async def test_the_decode_policy_hears_the_progress_of_its_streams(sim_fleet) -> None:
    fleet = sim_fleet(fleet={"servers": [PRODUCER, CONSUMER]}, time_scale=5)
    p, d = fleet.urls
    async with gateway([("p0", p, "prefill"), ("d0", d, "decode")], learning={"interval_s": 0.05}) as gw:
        await chat(gw, long_chat("warm")[0], stream=False)  # builds the P/D profile's policy
        pd = gw.gateway.dispatcher.runtime(MODEL).placement.pd
        heard: list[tuple[str, int]] = []
        forward = pd.report_progress

        def report(request_id: str, generated: int, now: float) -> None:  # the real policy still hears it
            heard.append((request_id, generated))
            forward(request_id, generated, now)

        pd.report_progress = report
        _, out, _, _ = await chat(gw, long_chat("progress")[0], stream=True, max_tokens=200, request_id="prog-1")
        assert out == 200
        counts = [n for rid, n in heard if rid == "prog-1"]
        assert len(counts) >= 2 and counts == sorted(counts) and 0 < counts[-1] <= 200
