"""Anthropic's Messages API through the gateway (gateway/api/messages.py), as a user of the official `anthropic`
SDK sees it: over simulated workers that speak only chat completions (vLLM 0.11's routes), through the whole
pipeline, with Anthropic's error shapes and statuses."""

from __future__ import annotations

import anthropic
import httpx
import orjson
import pytest

from simulator.tokenizer import count_tokens, render_chat
from tests.helpers import ADMIN, ADMIN_KEY, MODEL, metric, running_gateway

KEY = "sk-messages-test"
AUTH = {"admin_key": ADMIN_KEY, "keys": [{"key": KEY, "name": "dev"}]}
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def client(gw, **kw) -> anthropic.AsyncAnthropic:  # noqa: ANN001
    return anthropic.AsyncAnthropic(base_url=gw.url, api_key=kw.pop("api_key", KEY), max_retries=0, timeout=30, **kw)


async def test_create_answers_a_message_with_usage(sim_fleet) -> None:
    fleet = sim_fleet(2, time_scale=20)
    async with running_gateway(fleet.urls, auth=AUTH) as gw:
        msg = await client(gw).messages.create(
            model=MODEL, max_tokens=6, system=[{"type": "text", "text": "Be brief.", "cache_control":
                                                 {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": "Say something."}], metadata={"user_id": "conv-1"},
            thinking={"type": "enabled", "budget_tokens": 1024}, cache_control={"type": "ephemeral"},
            extra_body={"ignore_eos": True, "temperature": 0.5, "top_k": 5})
        assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
        assert msg.model == MODEL and msg.stop_reason == "max_tokens"
        assert [b.type for b in msg.content] == ["text"] and len(msg.content[0].text.split(" ")) == 6
        prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
        assert msg.usage.input_tokens == count_tokens(render_chat(prompt))
        assert msg.usage.output_tokens == 6


async def test_stream_reads_as_anthropic_events(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with running_gateway(fleet.urls, auth=AUTH) as gw:
        async with client(gw).messages.stream(
                model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Count."}],
                extra_body={"ignore_eos": True}) as stream:
            kinds = [ev.type async for ev in stream]
            final = await stream.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert "ping" not in kinds or kinds.index("ping") == 1   # the SDK may hide pings
        assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 5
        assert len(final.content[0].text.split(" ")) == 5


async def test_x_api_key_and_bearer_both_authenticate_and_count_tokens(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with running_gateway(fleet.urls, auth=AUTH) as gw, httpx.AsyncClient(timeout=20) as http:
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        for headers in ({"x-api-key": KEY, "anthropic-version": "2023-06-01"}, {"authorization": f"Bearer {KEY}"}):
            r = await http.post(gw.url + "/v1/messages", json=body, headers=headers)
            assert r.status_code == 200 and r.json()["type"] == "message", r.text
        counted = await client(gw).messages.count_tokens(
            model=MODEL, system="Be brief.", messages=[{"role": "user", "content": "hi"}])
        prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        assert counted.input_tokens == count_tokens(render_chat(prompt))
        r = await http.post(gw.url + "/v1/messages/count_tokens", headers={"x-api-key": KEY},
                            json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
        _error(r, 404, "not_found_error")
        r = await http.post(gw.url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": []})
        _error(r, 401, "authentication_error")
        text = (await http.get(gw.url + "/metrics", headers=ADMIN)).text
        assert metric(text, "fleetgate_requests_total", {"status": "200"}) == 2   # through the chat pipeline


def _error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


async def test_errors_have_anthropics_shape_and_status(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    limits = {"max_body_bytes": 4096}
    async with running_gateway(fleet.urls, auth=AUTH, limits=limits) as gw, httpx.AsyncClient(timeout=20) as http:
        url, ok = gw.url + "/v1/messages", {"x-api-key": KEY}
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        _error(await http.post(url, json=body, headers={"x-api-key": "wrong"}), 401, "authentication_error")
        _error(await http.post(url, json=body), 401, "authentication_error")
        _error(await http.post(url, json={**body, "model": "nope"}, headers=ok), 404, "not_found_error")
        bad_block = {**body, "messages": [{"role": "user", "content": [{"type": "text"}]}]}
        assert "messages.0.content.0.text" in _error(await http.post(url, json=bad_block, headers=ok), 400,
                                                     "invalid_request_error")
        _error(await http.post(url, json={**body, "max_tokens": 0}, headers=ok), 400, "invalid_request_error")
        _error(await http.post(url, content=b"{not json", headers=ok), 400, "invalid_request_error")
        big = {**body, "messages": [{"role": "user", "content": "x" * 5000}]}
        _error(await http.post(url, json=big, headers=ok), 413, "request_too_large")
        # the SDK raises its own typed errors for them
        with pytest.raises(anthropic.AuthenticationError):
            await client(gw, api_key="wrong").messages.create(**body)
        with pytest.raises(anthropic.NotFoundError):
            await client(gw).messages.create(**{**body, "model": "nope"})


async def test_no_worker_is_529_overloaded_with_retry_after() -> None:
    workers = [{"id": "w0", "url": "http://127.0.0.1:9", "models": [MODEL]}]   # nothing listens there
    async with running_gateway(workers=workers, auth=AUTH, health={"interval_s": 0.2}) as gw, \
            httpx.AsyncClient(timeout=20) as http:
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        r = await http.post(gw.url + "/v1/messages", json=body, headers={"x-api-key": KEY})
        _error(r, 529, "overloaded_error")
        assert int(r.headers["retry-after"]) >= 1
        with pytest.raises(anthropic.APIStatusError) as e:
            await client(gw).messages.create(**body)
        assert e.value.status_code == 529


async def test_unknown_route_under_messages_is_not_served_as_messages(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with running_gateway(fleet.urls, auth=AUTH) as gw, httpx.AsyncClient(timeout=20) as http:
        r = await http.get(gw.url + "/v1/messages", headers={"x-api-key": KEY})
        assert r.status_code == 405 and r.json()["type"] == "error"
        assert orjson.loads((await http.get(gw.url + "/health")).content) == {"status": "ok"}


async def test_tool_round_trip_with_create(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with running_gateway(fleet.urls, auth=AUTH) as gw:
        c = client(gw)
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        # the simulated model calls the first tool after a user's turn (simulator/tool_calls.py), its words in
        # the schema's first required property
        msg = await c.messages.create(model=MODEL, max_tokens=20, messages=ask, tools=[WEATHER],
                                      tool_choice={"type": "auto"}, extra_headers={"x-sim-output-tokens": "5"})
        assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
        call = msg.content[0]
        assert call.name == "get_weather" and list(call.input) == ["city"] and len(call.input["city"].split()) == 5
        # the result goes back as a tool_result block (is_error, content as blocks): the model answers in text
        follow = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "is_error": False,
                                                "content": [{"type": "text", "text": "Sunny, 21 C"}]}]}]
        answer = await c.messages.create(model=MODEL, max_tokens=4, messages=follow, tools=[WEATHER],
                                         extra_body={"ignore_eos": True})
        assert answer.stop_reason == "max_tokens" and [b.type for b in answer.content] == ["text"]
        # a named tool is called even after a result; `none` never calls one
        named = await c.messages.create(model=MODEL, max_tokens=9, messages=follow, tools=[WEATHER],
                                        tool_choice={"type": "tool", "name": "get_weather"},
                                        extra_headers={"x-sim-output-tokens": "3"})
        assert named.content[-1].type == "tool_use" and named.stop_reason == "tool_use"
        plain = await c.messages.create(model=MODEL, max_tokens=3, messages=ask, tools=[WEATHER],
                                        tool_choice={"type": "none"})
        assert [b.type for b in plain.content] == ["text"]


async def test_tool_call_stream_survives_its_worker(sim_fleet) -> None:
    """The worker serving a tool-call turn dies mid-call: the call was held back, so the client gets one
    complete call from the next worker, and the stream reads as one message."""
    fleet = sim_fleet(2, time_scale=20)
    async with running_gateway(fleet.urls, auth=AUTH, default_policy="round_robin") as gw, \
            httpx.AsyncClient(timeout=20) as http:
        # round robin's first pick is w0 (ids in sorted order): it dies after 3 tokens of the call
        await http.post(fleet.urls[0] + "/sim/faults", json={"drop_after_tokens": 3})
        async with client(gw).messages.stream(
                model=MODEL, max_tokens=20, tools=[WEATHER], tool_choice={"type": "any"},
                messages=[{"role": "user", "content": "Paris?"}], extra_headers={"x-sim-output-tokens": "8"}) as stream:
            events = [ev async for ev in stream]
            final = await stream.get_final_message()
        kinds = [ev.type for ev in events]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "error" not in kinds
        assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
        assert len(final.content[0].input["city"].split()) == 8   # one whole call, nothing repeated
        assert final.usage.output_tokens == 8
        text = (await http.get(gw.url + "/metrics", headers=ADMIN)).text
        assert metric(text, "fleetgate_stream_breaks_total", {"outcome": "resumed"}) == 1
        assert metric(text, "fleetgate_requests_total", {"status": "200"}) == 1


def test_demo_prints_a_messages_example_that_works() -> None:
    import re
    import signal
    import subprocess

    from tests.helpers import CliProcess, free_port_range

    base = free_port_range(2)
    with CliProcess("demo", "--port", str(base), "--workers", "1", "--time-scale", "20", merge_stderr=True) as demo:
        demo.wait_for("fleetgate listening on", timeout=60)
        text = "\n".join(demo.stdout)
        assert f"ANTHROPIC_BASE_URL=http://127.0.0.1:{base}" in text
        example = re.search(r"^  (curl -s \S+/v1/messages .*\n.*)$", text, re.M)
        assert example is not None, text
        r = subprocess.run(["bash", "-c", example.group(1)], capture_output=True, text=True, timeout=30)
        msg = anthropic.types.Message.model_validate_json(r.stdout)
        assert msg.content[0].type == "text" and msg.usage.output_tokens >= 1, r.stdout + r.stderr
        demo.proc.send_signal(signal.SIGINT)
        demo.read_to_end(timeout=20)


async def _finished(http: httpx.AsyncClient, urls: list[str]) -> list[int]:
    return [(await http.get(u + "/sim/state")).json()["stats"]["finished"]["length"] for u in urls]


async def test_metadata_user_id_is_the_session_placement_keeps_together(sim_fleet) -> None:
    fleet = sim_fleet(3, time_scale=20)
    async with running_gateway(fleet.urls, auth=AUTH, default_policy="session_affinity") as gw, \
            httpx.AsyncClient(timeout=20) as http:
        c = client(gw)
        homes = set()
        for conv in ("conv-a", "conv-b", "conv-c", "conv-d"):
            before = await _finished(http, fleet.urls)
            for turn in range(3):
                await c.messages.create(model=MODEL, max_tokens=2, metadata={"user_id": conv},
                                        messages=[{"role": "user", "content": f"turn {turn}"}],
                                        extra_body={"ignore_eos": True})
            grew = [a - b for a, b in zip(await _finished(http, fleet.urls), before, strict=True)]
            assert sorted(grew) == [0, 0, 3], grew   # every turn of a conversation on one worker
            homes.add(grew.index(3))
        assert len(homes) > 1   # and not everything on one worker


async def test_a_keys_own_limit_is_429_rate_limit_error(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    auth = {**AUTH, "keys": [{"key": KEY, "name": "dev", "rpm": 1}]}
    async with running_gateway(fleet.urls, auth=auth) as gw, httpx.AsyncClient(timeout=20) as http:
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        assert (await http.post(gw.url + "/v1/messages", json=body, headers={"x-api-key": KEY})).status_code == 200
        r = await http.post(gw.url + "/v1/messages", json=body, headers={"x-api-key": KEY})
        _error(r, 429, "rate_limit_error")
        assert int(r.headers["retry-after"]) >= 1
        with pytest.raises(anthropic.RateLimitError):
            await client(gw).messages.create(**body)


async def test_text_stream_resumes_twice_and_ends_with_an_error_event_when_nobody_is_left(sim_fleet) -> None:
    fleet = sim_fleet(3, time_scale=20)
    async with running_gateway(fleet.urls, auth=AUTH) as gw, httpx.AsyncClient(timeout=20) as http:
        for url in fleet.urls:   # every worker breaks after 4 tokens: 4 + 4 + 2, two resumes
            await http.post(url + "/sim/faults", json={"drop_after_tokens": 4})
        async with client(gw).messages.stream(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "go"}],
                                              extra_body={"ignore_eos": True}) as stream:
            kinds = [ev.type async for ev in stream]
            final = await stream.get_final_message()
        assert kinds.count("message_start") == 1 and kinds[-1] == "message_stop"
        words = final.content[0].text.split(" ")
        assert len(words) == 10 and final.usage.output_tokens == 10 and final.stop_reason == "max_tokens"
        # 4 + 4 + 4 of 20, then no attempt left: the stream ends with Anthropic's error event
        r = await http.post(gw.url + "/v1/messages", headers={"x-api-key": KEY}, json={
            "model": MODEL, "max_tokens": 20, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "go"}]})
        assert r.status_code == 200
        blocks = [b for b in r.text.split("\n\n") if b]
        assert blocks[-1].startswith("event: error\ndata: ")
        err = orjson.loads(blocks[-1].split("data: ", 1)[1])
        assert err["type"] == "error" and err["error"]["type"] == "api_error"
        text = (await http.get(gw.url + "/metrics", headers=ADMIN)).text
        assert metric(text, "fleetgate_stream_breaks_total", {"outcome": "resumed"}) == 4
