"""Tool-call streams that survive their worker (gateway/wire/resume.py): tool-call events are held until the call is
complete, so a worker that dies mid-call has delivered none of it and the next worker answers the turn again.
The hold itself without a network, then the official `openai` client over simulated workers that die."""

from __future__ import annotations

import json

import httpx
import openai
import orjson

from gateway.wire.resume import DONE, StreamResume
from tests.helpers import ADMIN, MODEL, metric, running_gateway

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def ev(delta: dict, finish: str | None = None) -> bytes:
    return b"data: " + orjson.dumps({"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 1,
                                     "model": "m", "choices": [{"index": 0, "delta": delta,
                                                                "finish_reason": finish}]}) + b"\n\n"


def call(arguments: str, first: bool = False) -> dict:
    fn = {"name": "read_file", "arguments": arguments} if first else {"arguments": arguments}
    return {"tool_calls": [{"index": 0, **({"id": "call-1", "type": "function"} if first else {}), "function": fn}]}


def test_tool_call_events_wait_for_the_finish() -> None:
    r = StreamResume(chat=True, client_usage=False, continuous_usage=False)
    text = ev({"role": "assistant", "content": ""}) + ev({"content": "Let me look."})
    assert r.note(text) == text                               # text goes out as it comes
    assert r.note(ev(call('{"path": "', first=True))) == b""  # the call waits
    assert r.note(ev(call("a.txt"))) == b""
    closing = ev(call('"}'), "tool_calls")
    out = r.note(closing + DONE)
    assert out == ev(call('{"path": "', first=True)) + ev(call("a.txt")) + closing + DONE
    d = r.broke(4)
    assert d.tool_calls and d.finish_reason == "tool_calls" and d.text == "Let me look."


def test_a_break_mid_call_drops_what_was_held() -> None:
    r = StreamResume(chat=True, client_usage=False, continuous_usage=False)
    r.note(ev({"role": "assistant", "content": ""}) + ev({"content": "Hm."}))
    assert r.note(ev(call('{"path": "', first=True)) + ev(call("a"))) == b""
    assert r.drop_held() == 2                # the output tokens the client never saw
    d = r.broke(1)
    assert not d.tool_calls and d.finish_reason is None and d.text == "Hm."
    # the continuation's call is held afresh, and released with its finish
    assert r.note(ev(call('{"path": "b"}', first=True))) == b""
    assert r.note(ev({}, "tool_calls")) == ev(call('{"path": "b"}', first=True)) + ev({}, "tool_calls")
    # a completions stream or an error event releases too
    assert StreamResume(chat=False, client_usage=False, continuous_usage=False).note(b"data: {}\n\n")
    r = StreamResume(chat=True, client_usage=False, continuous_usage=False)
    r.note(ev(call("{", first=True)))
    err = b'data: {"error": {"message": "x"}}\n\n'
    assert r.note(err + DONE) == ev(call("{", first=True)) + err + DONE


async def test_openai_tool_call_stream_resumes_after_its_worker_dies(sim_fleet) -> None:
    fleet = sim_fleet(2, time_scale=20)
    async with running_gateway(fleet.urls, default_policy="round_robin") as gw, \
            httpx.AsyncClient(timeout=20) as http:
        # round robin's first pick is w0 (ids in sorted order): it dies after 4 tokens of the call
        await http.post(fleet.urls[0] + "/sim/faults", json={"drop_after_tokens": 4})
        c = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=20)
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "show a.txt"}], tools=TOOLS, tool_choice="required",
            max_tokens=30, stream=True, stream_options={"include_usage": True},
            extra_headers={"x-sim-output-tokens": "10"})
        chunks = [ch async for ch in stream]
        assert len({(ch.id, ch.created) for ch in chunks}) == 1       # one stream
        deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or ()]
        assert len([d for d in deltas if d.id]) == 1                   # one call, started once
        args = json.loads("".join(d.function.arguments or "" for d in deltas))
        assert list(args) == ["path"] and len(args["path"].split()) == 10
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
        usage = chunks[-1].usage
        assert usage.completion_tokens == 10 and usage.total_tokens == usage.prompt_tokens + 10
        text = (await http.get(gw.url + "/metrics", headers=ADMIN)).text
        assert metric(text, "fleetgate_stream_breaks_total", {"outcome": "resumed"}) == 1
        assert metric(text, "fleetgate_stream_breaks_total", {"outcome": "not_resumable"}) is None or \
            metric(text, "fleetgate_stream_breaks_total", {"outcome": "not_resumable"}) == 0
        assert metric(text, "fleetgate_requests_total", {"status": "200"}) == 1
