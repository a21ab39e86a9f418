"""The pure Messages <-> chat completions translation (engine_adapters/apis/messages.py): requests, answers,
streams and errors, each output checked against the official `anthropic` SDK's own types."""

from __future__ import annotations

import anthropic.types as at
import orjson
import pytest
from pydantic import TypeAdapter

from engine_adapters.apis.messages import (
    MessagesError,
    MessagesTranslator,
    error_from_openai,
    to_chat,
    to_message,
)

BASE = {"model": "m", "max_tokens": 10}
EVENTS = TypeAdapter(at.RawMessageStreamEvent)


def test_request_blocks_become_chat_messages() -> None:
    req = {**BASE, "system": [{"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}},
                              {"type": "text", "text": "B"}],
           "messages": [
               {"role": "user", "content": [{"type": "text", "text": "look"},
                                            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                         "data": "AAAA"}}]},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                 {"type": "text", "text": "ok"},
                                                 {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                             "content": [{"type": "text", "text": "boom"}]},
                                            {"type": "text", "text": "again"}]}],
           "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
           "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
           "stop_sequences": ["END"], "temperature": 0.2, "top_k": 3, "stream": True,
           "metadata": {"user_id": "u-1"}, "thinking": {"type": "enabled", "budget_tokens": 100}}
    chat = to_chat(req)
    assert chat.conversation == "u-1"
    b = chat.body
    assert b["messages"] == [
        {"role": "system", "content": "A\nB"},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: boom"},
        {"role": "user", "content": "again"}]
    assert b["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                            "description": "d"}}]
    assert b["tool_choice"] == "required" and b["parallel_tool_calls"] is False
    assert b["stop"] == ["END"] and b["temperature"] == 0.2 and b["top_k"] == 3 and b["max_tokens"] == 10
    assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
    assert "thinking" not in b and "metadata" not in b
    # Claude Code (2.1) sends a system message among the turns, and text documents are text
    turns = to_chat({**BASE, "messages": [
        {"role": "user", "content": [{"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                                                      "data": "DOC"}}]},
        {"role": "system", "content": [{"type": "text", "text": "reminder"}]}]}).body["messages"]
    assert turns == [{"role": "user", "content": "DOC"}, {"role": "system", "content": "reminder"}]
    named = to_chat({**BASE, "messages": [{"role": "user", "content": "x"}],
                     "tool_choice": {"type": "tool", "name": "f"}}).body
    assert named["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert to_chat({**BASE, "messages": [{"role": "user", "content": "x"}],
                    "tool_choice": {"type": "none"}}).body["tool_choice"] == "none"


@pytest.mark.parametrize(("req", "where"), [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({**BASE, "max_tokens": 0}, "max_tokens"),
    ({**BASE, "messages": []}, "messages"),
    ({**BASE, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages.0.content.0.text"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]},
     "messages.0.content.0.type"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages.0.content.0.tool_use_id"),
    ({**BASE, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305",
                                                                        "name": "s"}]}, "tools.0.type"),
    ({**BASE, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "some"}}, "tool_choice.type"),
    ({**BASE, "messages": [{"role": "user", "content": "x"}], "stop_sequences": "END"}, "stop_sequences"),
    ([1, 2], "JSON object"),
])
def test_malformed_requests_are_400_naming_the_field(req: object, where: str) -> None:
    with pytest.raises(MessagesError) as e:
        to_chat(req)
    assert e.value.status == 400 and where in e.value.message
    body = orjson.loads(e.value.body())
    assert body == {"type": "error", "error": {"type": "invalid_request_error", "message": e.value.message}}


def _chat(message: dict, finish: str, stop_reason: str | None = None) -> dict:
    return {"id": "chatcmpl-abc", "model": "m", "choices": [{"index": 0, "message": message,
                                                             "finish_reason": finish, "stop_reason": stop_reason}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}


def test_answers_become_messages_the_sdk_parses() -> None:
    m = at.Message.model_validate(to_message(_chat({"content": "hi END"}, "stop", "END"), stop_sequences=["END"]))
    assert m.id == "msg_abc" and m.stop_reason == "stop_sequence" and m.stop_sequence == "END"
    assert m.usage.input_tokens == 7 and m.usage.output_tokens == 3 and m.content[0].text == "hi END"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": [1]}'}}
    m = at.Message.model_validate(to_message(_chat({"content": None, "tool_calls": [call]}, "tool_calls")))
    assert m.stop_reason == "tool_use" and m.content[0].input == {"x": [1]} and m.content[0].id == "c1"
    assert at.Message.model_validate(to_message(_chat({"content": "a"}, "length"))).stop_reason == "max_tokens"
    assert at.Message.model_validate(to_message(_chat({"content": "a"}, "stop"))).stop_reason == "end_turn"


def _sse(events: bytes) -> list:
    out = []
    for block in events.split(b"\n\n"):
        if block:
            name, data = block.split(b"\n")
            obj = orjson.loads(data[len(b"data: "):])
            assert name == b"event: " + obj["type"].encode()
            out.append(obj)
    return out


def test_a_chat_stream_becomes_the_event_sequence() -> None:
    t = MessagesTranslator("m", 5)
    chunks = [
        {"id": "chatcmpl-z", "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"id": "chatcmpl-z", "choices": [{"index": 0, "delta": {"content": "Let"}}]},
        {"id": "chatcmpl-z", "choices": [{"index": 0, "delta": {"content": " me"}}]},
        {"id": "chatcmpl-z", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}]}}]},
        {"id": "chatcmpl-z", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": ": 2}"}}]}, "finish_reason": "tool_calls"}]},
        {"id": "chatcmpl-z", "choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 4}},
    ]
    raw = t.stream_start() + b"".join(t.stream_data(orjson.dumps(c)) for c in chunks) + t.stream_end()
    events = _sse(raw)
    for e in events:
        EVENTS.validate_python(e) if e["type"] != "ping" else None
    assert [e["type"] for e in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert events[0]["message"]["id"] == "msg_z" and events[0]["message"]["usage"]["input_tokens"] == 5
    assert events[6]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f", "input": {}}
    assert "".join(e["delta"]["partial_json"] for e in events[7:9]) == '{"a": 2}'
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    assert events[-2]["usage"] == {"input_tokens": 6, "output_tokens": 4}
    assert t.stream_end() == b""   # closed once


def test_a_mid_stream_error_is_an_error_event() -> None:
    t = MessagesTranslator("m")
    t.stream_data(orjson.dumps({"id": "x", "choices": [{"index": 0, "delta": {"content": "a"}}]}))
    out = _sse(t.stream_data(orjson.dumps({"error": {"message": "worker died", "type": "upstream_error"}})))
    assert out == [{"type": "error", "error": {"type": "api_error", "message": "worker died"}}]
    assert t.stream_end() == b""


@pytest.mark.parametrize(("status", "code", "want"), [
    (400, None, (400, "invalid_request_error")), (401, "invalid_api_key", (401, "authentication_error")),
    (403, None, (403, "permission_error")), (404, "model_not_found", (404, "not_found_error")),
    (413, "request_too_large", (413, "request_too_large")), (429, "rate_limit_exceeded", (429, "rate_limit_error")),
    (429, "capacity_exceeded", (529, "overloaded_error")), (503, "no_healthy_worker", (529, "overloaded_error")),
    (429, "slo_unattainable", (529, "overloaded_error")),
    (502, "worker_failed", (500, "api_error")), (504, None, (500, "api_error")), (500, None, (500, "api_error")),
    (422, None, (400, "invalid_request_error")),
])
def test_pipeline_errors_map_to_anthropics_statuses(status: int, code: str | None, want: tuple) -> None:
    got, body = error_from_openai(status, orjson.dumps({"error": {"message": "m", "type": "t", "code": code}}))
    parsed = orjson.loads(body)
    assert (got, parsed["error"]["type"]) == want and parsed["type"] == "error" and parsed["error"]["message"] == "m"
    if code not in ("capacity_exceeded", "slo_unattainable"):   # without a body only the status tells
        assert MessagesTranslator().json_body(status, b"not json")[0] == want[0]
