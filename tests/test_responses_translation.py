"""engine_adapters/apis/responses.py: Responses <-> chat completions, checked against the openai SDK's own types."""

from __future__ import annotations

import orjson
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from engine_adapters.apis import responses as R
from gateway.api.translated import SseSplitter

EVENTS = TypeAdapter(ResponseStreamEvent)


def chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> bytes:
    c: dict = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        c["usage"] = usage
    return orjson.dumps(c)


def events(tr: R.ResponsesTranslator, datas: list[bytes]) -> list:
    raw = tr.stream_start() + b"".join(tr.stream_data(d) for d in datas) + tr.stream_end()
    out = []
    for ev in SseSplitter().feed(raw):
        parsed = EVENTS.validate_python(orjson.loads(ev.data))
        assert parsed.type == ev.event
        out.append(parsed)
    assert [e.sequence_number for e in out] == list(range(len(out)))
    return out


def test_input_items_become_chat_messages():
    req = R.parse_request({"model": "m", "instructions": "be brief", "max_output_tokens": 50, "temperature": 0.5,
                           "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
                           "tool_choice": {"type": "function", "name": "get_weather"},
                           "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
                           "input": [
                               {"role": "user", "content": "weather?"},
                               {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                               {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                               {"role": "developer", "content": [{"type": "input_text", "text": "dev"}]}]})
    history = R.normalize_input([{"role": "assistant", "content": "earlier"}])
    chat = R.chat_body(req, history)
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "assistant", "content": "earlier"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "system", "content": "dev"}]
    assert chat["max_tokens"] == 50 and chat["temperature"] == 0.5 and "stream" not in chat
    assert chat["tools"][0] == {"type": "function", "function": {"name": "get_weather",
                                                                 "parameters": {"type": "object"}}}
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"]["json_schema"]["name"] == "x"
    assert all(it["id"] for it in req.input_items) and req.store is True


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": "9"}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
    ({"input": [{"type": "bogus"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input[0].content[0].type"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "hi", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "store": "yes"}, "store"),
    ({"input": "hi", "previous_response_id": 5}, "previous_response_id"),
])
def test_bad_requests_name_their_parameter(body, param):
    with pytest.raises(R.ResponsesRequestError) as e:
        R.parse_request(body)
    assert e.value.param == param and e.value.status == 400


def test_chat_completion_becomes_a_response_object():
    req = R.parse_request({"model": "m", "input": "hi"})
    tr = R.ResponsesTranslator(req, "resp_1", "m")
    chat = {"id": "c", "model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "let me check", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}
    status, body = tr.json_body(200, orjson.dumps(chat))
    resp = Response.model_validate(orjson.loads(body))
    assert status == 200 and resp.id == "resp_1" and resp.status == "completed"
    assert resp.output_text == "let me check"
    assert resp.output[1].type == "function_call" and resp.output[1].call_id == "call_1"
    assert resp.usage.input_tokens == 7 and resp.usage.output_tokens == 3 and resp.usage.total_tokens == 10
    assert tr.response["id"] == "resp_1"
    err = orjson.dumps({"error": {"message": "nope", "type": "invalid_request_error", "param": None, "code": None}})
    assert R.ResponsesTranslator(req, "resp_2", "m").json_body(400, err) == (400, err)


def test_text_then_tool_call_stream_is_the_responses_event_sequence():
    req = R.parse_request({"model": "m", "input": "hi", "stream": True})
    tr = R.ResponsesTranslator(req, "resp_1", "m")
    evs = events(tr, [
        chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}), chunk({"content": "lo"}),
        chunk({"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                               "function": {"name": "f", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"x"'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 2}"}}]}, "tool_calls"),
        chunk(usage={"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9})])
    assert [e.type for e in evs] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    done = evs[-1].response
    assert done.status == "completed" and done.output_text == "Hello" and done.usage.total_tokens == 9
    assert done.output[1].arguments == '{"x": 2}' and done.output[1].call_id == "call_9"
    assert evs[6].text == "Hello" and evs[12].arguments == '{"x": 2}'


def test_broken_stream_ends_failed_and_length_ends_incomplete():
    req = R.parse_request({"input": "hi", "stream": True})
    tr = R.ResponsesTranslator(req, "resp_1", "m")
    evs = events(tr, [chunk({"content": "a"}), orjson.dumps({"error": {"message": "worker died", "code": "x"}})])
    assert [e.type for e in evs][-2:] == ["error", "response.failed"]
    assert evs[-1].response.error.message == "worker died" and tr.status == "failed"
    tr = R.ResponsesTranslator(req, "resp_2", "m")
    evs = events(tr, [chunk({"content": "a"}, "length")])
    assert evs[-1].type == "response.incomplete" and evs[-1].response.incomplete_details.reason == "max_output_tokens"


def test_hosted_tools_are_dropped_namespaces_flattened_and_system_messages_joined():
    """What the Codex CLI sends: developer messages first, a `namespace` of functions, a hosted web_search tool."""
    req = R.parse_request({"input": [{"role": "developer", "content": "a"}, {"role": "developer", "content": "b"},
                                     {"role": "user", "content": "go"}],
                           "instructions": "base", "tools": [
                               {"type": "function", "name": "exec_command", "parameters": {}},
                               {"type": "namespace", "name": "agents", "tools": [
                                   {"type": "function", "name": "spawn", "parameters": {}}]},
                               {"type": "web_search", "external_web_access": False}]})
    chat = R.chat_body(req)
    assert [t["function"]["name"] for t in chat["tools"]] == ["exec_command", "spawn"]
    assert chat["messages"] == [{"role": "system", "content": "base\n\na\n\nb"}, {"role": "user", "content": "go"}]
    tr = R.ResponsesTranslator(req, "resp_1", "m")
    body = {"choices": [{"finish_reason": "tool_calls", "message": {"tool_calls": [
        {"id": "c1", "function": {"name": "spawn", "arguments": "{}"}}]}}]}
    resp = Response.model_validate(orjson.loads(tr.json_body(200, orjson.dumps(body))[1]))
    assert resp.output[0].namespace == "agents" and resp.output[0].name == "spawn"


def test_reasoning_text_becomes_a_reasoning_item_before_the_message():
    req = R.parse_request({"input": "think", "stream": True})
    tr = R.ResponsesTranslator(req, "resp_1", "m")
    evs = events(tr, [chunk({"reasoning_content": "hmm, "}), chunk({"reasoning_content": "yes"}),
                      chunk({"content": "42"}, "stop")])
    assert [e.type for e in evs][2:6] == ["response.output_item.added", "response.reasoning_text.delta",
                                          "response.reasoning_text.delta", "response.reasoning_text.done"]
    final = evs[-1].response
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == "hmm, yes"
    assert final.output_text == "42"
    whole = R.ResponsesTranslator(R.parse_request({"input": "think"}), "resp_2", "m")
    body = {"choices": [{"finish_reason": "stop", "message": {"content": "42", "reasoning": "because"}}]}
    resp = Response.model_validate(orjson.loads(whole.json_body(200, orjson.dumps(body))[1]))
    assert [o.type for o in resp.output] == ["reasoning", "message"] and resp.output[0].content[0].text == "because"
    # a reasoning item given back as input is dropped: the next turn's chat has no trace of it
    nxt = R.parse_request({"input": [final.output[0].model_dump(), {"role": "user", "content": "more"}]})
    assert R.chat_body(nxt)["messages"] == [{"role": "user", "content": "more"}]
