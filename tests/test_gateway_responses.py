"""OpenAI's Responses API through the gateway (gateway/api/responses.py), as a user runs it: the official `openai`
client over loopback HTTP, simulated vLLM workers, the gateway's state store (in memory, or a real Redis shared by
two `fleetgate serve` processes). Workers get chat completions; conversation state lives in the gateway."""

from __future__ import annotations

import logging

import httpx
import openai
import orjson
import pytest

from simulator.tokenizer import count_tokens, render_chat
from tests.helpers import ADMIN, MODEL, REDIS_URL, running_gateway
from tests.test_gateway_failures import metric
from tests.test_gateway_resume import HEALTH, assert_continuous, drop_after

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
KEYS = ["sk-tenant-a-0123456789", "sk-tenant-b-0123456789"]


def client(url: str, key: str = "x") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def tokens(n: int) -> dict:
    """The simulated worker generates exactly `n` tokens (forwarded by the gateway like any end-to-end header)."""
    return {"x-sim-output-tokens": str(n)}


def prompt_tokens(messages: list[dict]) -> int:
    """What the worker counts for these chat messages: the input tokens a response reports."""
    return count_tokens(render_chat(messages))


async def read_stream(stream) -> list:  # noqa: ANN001
    events = [ev async for ev in stream]
    assert [e.sequence_number for e in events] == list(range(len(events))), "sequence numbers not contiguous"
    return events


async def test_create_plain_and_streamed_then_get_list_delete(sim_fleet) -> None:
    fleet = sim_fleet(2, time_scale=20)
    async with running_gateway(fleet.urls) as gw:
        c = client(gw.url)
        r = await c.responses.create(model=MODEL, input="Say something.", instructions="Be brief.",
                                     max_output_tokens=20, metadata={"case": "plain"}, extra_headers=tokens(6))
        assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
        assert r.model == MODEL and r.metadata == {"case": "plain"} and r.instructions == "Be brief."
        assert_continuous(r.output_text, 6)
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
        assert r.usage.input_tokens == prompt_tokens(msgs)
        assert r.usage.output_tokens == 6 and r.usage.total_tokens == r.usage.input_tokens + 6

        stream = await c.responses.create(model=MODEL, input="Stream it.", max_output_tokens=5, stream=True)
        events = await read_stream(stream)
        kinds = [e.type for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.incomplete"]   # capped at 5 tokens
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        final = events[-1].response
        assert final.incomplete_details.reason == "max_output_tokens" and final.usage.output_tokens == 5
        assert "".join(deltas) == final.output_text and len(deltas) == 5

        async with c.responses.stream(model=MODEL, input="Helper.", max_output_tokens=8,
                                      extra_headers=tokens(3)) as helper:   # the SDK's own stream accumulator
            done = await helper.get_final_response()
        assert done.status == "completed" and len(done.output_text.split()) == 3

        got = await c.responses.retrieve(r.id)
        assert got.id == r.id and got.output_text == r.output_text
        items = await c.responses.input_items.list(r.id)
        assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Say something.")]
        assert items.first_id == items.last_id == items.data[0].id and not items.has_more
        await c.responses.delete(r.id)
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(r.id)
        # store: false keeps nothing
        nostore = await c.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=3)
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(nostore.id)


async def test_three_turn_chain_survives_a_worker_dying_in_turn_two(sim_fleet) -> None:
    fleet = sim_fleet(3, time_scale=20)
    async with running_gateway(fleet.urls, health=HEALTH) as gw, httpx.AsyncClient(timeout=20) as http:
        c = client(gw.url)
        t1 = await c.responses.create(model=MODEL, input="Turn one.", max_output_tokens=16, extra_headers=tokens(4))
        await drop_after(http, fleet.urls, 4)   # every worker now drops its connection after 4 tokens: 4 + 4 + 2
        stream = await c.responses.create(model=MODEL, input="Turn two.", previous_response_id=t1.id, stream=True,
                                          max_output_tokens=10, extra_headers=tokens(10))
        events = await read_stream(stream)
        for url in fleet.urls:
            await http.delete(url + "/sim/faults")
        kinds = [e.type for e in events]
        assert kinds.count("response.created") == 1 and kinds.count("response.output_item.added") == 1
        assert "error" not in kinds and "response.failed" not in kinds and kinds[-1] == "response.incomplete"
        t2 = events[-1].response
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert_continuous(text, 10)   # no token lost or repeated across the two resumes
        assert t2.output_text == text and t2.usage.output_tokens == 10 and t2.previous_response_id == t1.id
        assert metric((await http.get(gw.url + "/metrics", headers=ADMIN)).text,
                      "fleetgate_stream_breaks_total", outcome="resumed") == 2

        t3 = await c.responses.create(model=MODEL, input="Turn three.", previous_response_id=t2.id,
                                      max_output_tokens=16, extra_headers=tokens(3))
        history = [{"role": "user", "content": "Turn one."}, {"role": "assistant", "content": t1.output_text},
                   {"role": "user", "content": "Turn two."}, {"role": "assistant", "content": t2.output_text},
                   {"role": "user", "content": "Turn three."}]
        assert t3.status == "completed" and t3.usage.input_tokens == prompt_tokens(history)
        assert (await c.responses.retrieve(t2.id)).output_text == text


async def test_function_tool_round_trip_streamed_and_not(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with running_gateway(fleet.urls) as gw:
        c = client(gw.url)
        r = await c.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                     tool_choice={"type": "function", "name": "get_weather"},
                                     max_output_tokens=20, extra_headers=tokens(3))
        (call,) = r.output
        assert call.type == "function_call" and call.name == "get_weather" and call.call_id
        args = orjson.loads(call.arguments)   # the simulated model fills the schema's first property
        assert_continuous(args["city"], 3)
        r2 = await c.responses.create(
            model=MODEL, previous_response_id=r.id, tools=[WEATHER], max_output_tokens=20, extra_headers=tokens(4),
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
        assert r2.output[0].type == "message" and r2.status == "completed"
        chat = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]
        assert r2.usage.input_tokens == prompt_tokens(chat)

        stream = await c.responses.create(model=MODEL, input="And Rome?", tools=[WEATHER], tool_choice="required",
                                          stream=True, max_output_tokens=20, extra_headers=tokens(4))
        events = await read_stream(stream)
        kinds = [e.type for e in events]
        deltas = kinds.count("response.function_call_arguments.delta")
        assert deltas >= 1 and kinds[2:] == ["response.output_item.added"] + [
            "response.function_call_arguments.delta"] * deltas + [
            "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
        done = events[-1].response.output[0]
        assert done.type == "function_call" and done.name == "get_weather"
        assert "".join(e.delta for e in events if e.type.endswith("arguments.delta")) == done.arguments
        assert_continuous(orjson.loads(done.arguments)["city"], 4)


async def test_a_response_belongs_to_its_key(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with running_gateway(fleet.urls, api_keys=KEYS) as gw:
        a, b = client(gw.url, KEYS[0]), client(gw.url, KEYS[1])
        r = await a.responses.create(model=MODEL, input="mine", max_output_tokens=4)
        with pytest.raises(openai.NotFoundError) as e:
            await b.responses.retrieve(r.id)
        assert e.value.body["code"] == "not_found"
        with pytest.raises(openai.NotFoundError) as e:
            await b.responses.create(model=MODEL, input="yours?", previous_response_id=r.id)
        assert e.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.NotFoundError):
            await b.responses.input_items.list(r.id)
        with pytest.raises(openai.NotFoundError):
            await b.responses.delete(r.id)
        with pytest.raises(openai.AuthenticationError):
            await client(gw.url, "sk-wrong").responses.create(model=MODEL, input="x")
        assert (await a.responses.retrieve(r.id)).id == r.id   # still there for its owner


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": MODEL}, 400, "input"),
    ({"model": MODEL, "input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"model": MODEL, "input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"model": MODEL, "input": "x", "max_output_tokens": -5}, 400, "max_output_tokens"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text"}]}]}, 400,
     "input[0].content[0].text"),
    ({"model": MODEL, "input": [{"type": "function_call", "name": "f"}]}, 400, "input[0].call_id"),
    ({"model": MODEL, "input": [7]}, 400, "input[0]"),
    ({"model": MODEL, "input": "x", "tool_choice": {"type": "web_search"}}, 400, "tool_choice"),
    ({"model": MODEL, "input": "x", "temperature": 9}, 400, "temperature"),
    ({"model": "no-such-model", "input": "x"}, 404, "model"),
    ({"model": MODEL, "input": "x" * 5000}, 413, None),
])
async def test_bad_input_gets_an_openai_error(sim_fleet, body, status, param) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with running_gateway(fleet.urls, limits={"max_body_bytes": 4096}) as gw, \
            httpx.AsyncClient(timeout=20) as http:
        for stream in (False, True):
            r = await http.post(gw.url + "/v1/responses", json={**body, "stream": stream})
            assert r.status_code == status, r.text
            assert r.headers["content-type"].startswith("application/json")
            err = r.json()["error"]
            assert err["param"] == param and err["message"] and err["type"]
        r = await http.post(gw.url + "/v1/responses", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


async def test_simulated_worker_serves_responses_as_vllm_0_11_and_0_33_do(sim_fleet) -> None:
    for fmt in ("0.11", "0.33"):
        c = client(sim_fleet(1, time_scale=20, kv_events_format=fmt).urls[0])
        r = await c.responses.create(model=MODEL, input="hi", max_output_tokens=8, extra_headers=tokens(5))
        assert r.status == "completed" and r.usage.output_tokens == 5
        assert_continuous(r.output_text, 5)
        events = await read_stream(await c.responses.create(model=MODEL, input="hi", stream=True,
                                                            max_output_tokens=3))
        assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 3
        with pytest.raises(openai.NotFoundError):   # vLLM without its store: no previous responses
            await c.responses.create(model=MODEL, input="again", previous_response_id=r.id)
        with pytest.raises(openai.BadRequestError):
            await c.responses.create(model=MODEL, input=[{"type": "bogus"}])


@pytest.mark.redis
async def test_chain_across_two_gateway_replicas_sharing_redis(sim_fleet, redis_prefix, tmp_path,
                                                               gateway_process) -> None:
    fleet = sim_fleet(2, time_scale=20)
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("workers:\n" + "".join(f"  - {{id: w{i}, url: '{u}'}}\n" for i, u in enumerate(fleet.urls))
                   + f"redis_key_prefix: '{redis_prefix}'\napi_keys: {KEYS!r}\nhealth: {{interval_s: 0.5}}\n")
    a, b = (client(gateway_process(cfg, "--redis-url", REDIS_URL).listening_url(), KEYS[0]) for _ in range(2))
    t1 = await a.responses.create(model=MODEL, input="one", max_output_tokens=8, extra_headers=tokens(2))
    t2 = await b.responses.create(model=MODEL, input="two", previous_response_id=t1.id, max_output_tokens=8,
                                  extra_headers=tokens(3))
    events = await read_stream(await a.responses.create(model=MODEL, input="three", previous_response_id=t2.id,
                                                        max_output_tokens=8, stream=True, extra_headers=tokens(2)))
    t3 = events[-1].response
    history = [{"role": "user", "content": "one"}, {"role": "assistant", "content": t1.output_text},
               {"role": "user", "content": "two"}, {"role": "assistant", "content": t2.output_text},
               {"role": "user", "content": "three"}]
    assert t3.status == "completed" and t3.usage.input_tokens == prompt_tokens(history)
    assert (await b.responses.retrieve(t3.id)).output_text == t3.output_text   # stored by A, read on B
    other = client(str(b.base_url).removesuffix("/v1/"), KEYS[1])
    with pytest.raises(openai.NotFoundError):
        await other.responses.retrieve(t3.id)
    await b.responses.delete(t1.id)
    with pytest.raises(openai.NotFoundError):
        await a.responses.retrieve(t1.id)
    # t2 keeps its whole conversation: deleting t1 does not break the chain after it
    t4 = await a.responses.create(model=MODEL, input="four", previous_response_id=t2.id, max_output_tokens=4)
    assert t4.status in ("completed", "incomplete")


async def test_a_conversation_is_one_session_for_placement(sim_fleet, caplog) -> None:
    caplog.set_level(logging.INFO, logger="fleetgate.access")
    fleet = sim_fleet(4, time_scale=20)
    async with running_gateway(fleet.urls, default_policy="session_affinity") as gw:
        c = client(gw.url)
        prev = None
        for turn in range(3):   # a chain: its first response id is the session of every turn
            r = await c.responses.create(model=MODEL, input=f"turn {turn}", previous_response_id=prev,
                                         max_output_tokens=4)
            prev = r.id
        for _ in range(2):      # store: false with the history resent, tied together by prompt_cache_key
            await c.responses.create(model=MODEL, input="again", store=False, prompt_cache_key="codex-session-1",
                                     max_output_tokens=4)
    access = [r.fields for r in caplog.records if r.name == "fleetgate.access"]
    assert len(access) == 5 and all(a["reason"] == "session_hash" for a in access)
    assert len({a["worker"] for a in access[:3]}) == 1 and len({a["worker"] for a in access[3:]}) == 1


async def test_a_chain_that_outgrows_the_body_limit_is_a_413_naming_it(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with running_gateway(fleet.urls, limits={"max_body_bytes": 4096}) as gw:
        c = client(gw.url)
        prev = None
        for turn in range(2):
            prev = (await c.responses.create(model=MODEL, input=f"{turn} " + "words " * 250, max_output_tokens=4,
                                             previous_response_id=prev)).id
        with pytest.raises(openai.APIStatusError) as e:   # each request is small; the whole conversation is not
            await c.responses.create(model=MODEL, input="words " * 250, previous_response_id=prev)
        assert e.value.status_code == 413 and e.value.body["param"] == "previous_response_id"
        assert e.value.body["code"] == "request_too_large"


async def test_turn_two_worker_process_killed_mid_stream_the_chain_goes_on(sim_fleet_process) -> None:
    procs = [sim_fleet_process(1, time_scale=0.5) for _ in range(3)]   # ~20 ms a token: time to kill mid-stream
    urls = [p.urls[0] for p in procs]
    async with running_gateway(urls, health=HEALTH) as gw:
        c = client(gw.url)
        t1 = await c.responses.create(model=MODEL, input="one", max_output_tokens=8, extra_headers=tokens(3))
        stream = await c.responses.create(model=MODEL, input="two", previous_response_id=t1.id, stream=True,
                                          max_output_tokens=40, extra_headers=tokens(40))
        events, killed = [], None
        async for ev in stream:
            events.append(ev)
            if killed is None and sum(e.type == "response.output_text.delta" for e in events) == 5:
                busy = [wid for wid, f in gw.gateway.store.inflight().items() if f.requests]
                assert len(busy) == 1
                killed = int(busy[0].removeprefix("w"))
                procs[killed].proc.kill()   # SIGKILL the worker serving turn 2
        assert killed is not None
        assert [e.sequence_number for e in events] == list(range(len(events)))
        kinds = [e.type for e in events]
        assert "error" not in kinds and kinds.count("response.created") == 1 and kinds[-1] == "response.incomplete"
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert_continuous(text, 40)
        t2 = events[-1].response
        assert t2.output_text == text and t2.usage.output_tokens == 40
        t3 = await c.responses.create(model=MODEL, input="three", previous_response_id=t2.id, max_output_tokens=8,
                                      extra_headers=tokens(2))
        history = [{"role": "user", "content": "one"}, {"role": "assistant", "content": t1.output_text},
                   {"role": "user", "content": "two"}, {"role": "assistant", "content": text},
                   {"role": "user", "content": "three"}]
        assert t3.status == "completed" and t3.usage.input_tokens == prompt_tokens(history)


async def test_input_items_pages_like_openai(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with running_gateway(fleet.urls) as gw:
        c = client(gw.url)
        said = ["a", "b", "c"]
        r = await c.responses.create(model=MODEL, max_output_tokens=3,
                                     input=[{"role": "user", "content": s} for s in said])
        page = await c.responses.input_items.list(r.id, limit=2, order="asc")
        assert [i.content[0].text for i in page.data] == ["a", "b"] and page.has_more
        rest = await c.responses.input_items.list(r.id, limit=2, order="asc", after=page.last_id)
        assert [i.content[0].text for i in rest.data] == ["c"] and not rest.has_more
        newest = await c.responses.input_items.list(r.id)    # OpenAI's default order: newest first
        assert [i.content[0].text for i in newest.data] == ["c", "b", "a"]
        with pytest.raises(openai.BadRequestError):
            await c.responses.input_items.list(r.id, limit=0)


async def test_odd_response_ids_are_not_found(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with running_gateway(fleet.urls) as gw, httpx.AsyncClient(timeout=20) as http:
        for rid in ("a:b", "x" * 200, "%2F..%2Fetc"):
            r = await http.get(f"{gw.url}/v1/responses/{rid}")
            # an id with a path in it may not even reach the route: then it is the gateway's "no route" 404
            assert r.status_code == 404 and r.json()["error"]["code"] in ("not_found", "no_route", None), r.text
        r = await http.post(gw.url + "/v1/responses",
                            json={"model": MODEL, "input": "x", "previous_response_id": "a:b"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "previous_response_not_found"


async def test_a_response_over_responses_max_bytes_is_answered_not_continued(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with running_gateway(fleet.urls, responses={"max_bytes": 4096}) as gw:
        c = client(gw.url)
        big = await c.responses.create(model=MODEL, input="words " * 800, max_output_tokens=4)
        assert big.status in ("completed", "incomplete") and big.output_text
        assert (await c.responses.retrieve(big.id)).id == big.id    # still listed
        with pytest.raises(openai.BadRequestError) as e:
            await c.responses.create(model=MODEL, input="more", previous_response_id=big.id)
        assert e.value.body["code"] == "previous_response_too_large" and "store: false" in e.value.body["message"]
        small = await c.responses.create(model=MODEL, input="hi", max_output_tokens=4)
        assert (await c.responses.create(model=MODEL, input="more", previous_response_id=small.id,
                                         max_output_tokens=4)).output_text
