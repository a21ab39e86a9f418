"""The continuation building of gateway/wire/resume.py, without a network: what may resume, what the client has,
the request for the rest, and the continuation's events in the first answer's identity."""

from __future__ import annotations

import orjson

from gateway.wire.resume import (
    FOLD_BYTES,
    Delivered,
    StreamResume,
    continuation_body,
    fold_delivered,
    read_delivered,
    resumable,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "seed": 3,
        "temperature": 0.7, "stream": True}


def ev(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chunk(content: str | None = None, role: bool = False, rid: str = "chatcmpl-a", created: int = 1,
          finish: str | None = None) -> bytes:
    delta = {"role": "assistant", "content": ""} if role else {"content": content}
    return ev({"id": rid, "object": "chat.completion.chunk", "created": created, "model": "m",
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def test_what_may_resume() -> None:
    assert resumable(CHAT, chat=True)
    assert not resumable({**CHAT, "n": 2}, chat=True)
    assert not resumable({**CHAT, "logprobs": True}, chat=True)
    assert not resumable({**CHAT, "response_format": {"type": "json_object"}}, chat=True)
    assert resumable({"prompt": "x"}, chat=False) and resumable({"prompt": ["x"]}, chat=False)
    assert not resumable({"prompt": [1, 2]}, chat=False)
    assert not resumable({"prompt": "x", "echo": True}, chat=False)
    assert not resumable({"prompt": ["a", "b"]}, chat=False)


def test_delivered_text_identity_and_role() -> None:
    d = read_delivered(chunk(role=True) + chunk("the") + chunk(" and"))
    assert (d.text, d.id, d.created, d.model, d.role_sent, d.finish_reason) == ("the and", "chatcmpl-a", 1, "m",
                                                                                 True, None)
    tool = ev({"id": "x", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]})
    assert read_delivered(tool).tool_calls


def test_chat_continuation_body() -> None:
    body = continuation_body(CHAT, True, "the and", 2)
    assert body["messages"] == [*CHAT["messages"], {"role": "assistant", "content": "the and"}]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 8 and body["seed"] == 3 and body["temperature"] == 0.7
    assert CHAT["max_tokens"] == 10 and len(CHAT["messages"]) == 1  # the original is left alone
    assert continuation_body(CHAT, True, "x", 10) is None  # nothing left to generate
    # the client's own continuation grows its final message instead of adding one
    own = {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "Sure:"}],
           "continue_final_message": True, "add_generation_prompt": False, "max_tokens": None,
           "max_completion_tokens": 5}
    body = continuation_body(own, True, " the", 1)
    assert body["messages"][-1] == {"role": "assistant", "content": "Sure: the"}
    assert body["max_completion_tokens"] == 4 and body["max_tokens"] is None


def test_completion_continuation_body() -> None:
    body = continuation_body({"prompt": "List:", "min_tokens": 3}, False, "the and", 2)
    assert body == {"prompt": "List:the and", "min_tokens": 1, "max_tokens": 14}  # vLLM's default 16, less 2
    assert continuation_body({"prompt": ["List:"], "max_tokens": 4}, False, "a", 1)["prompt"] == "List:a"


def test_rewrite_keeps_the_first_identity_drops_the_role_and_sums_usage() -> None:
    r = StreamResume(chat=True, client_usage=True, continuous_usage=False)
    r.note(chunk(role=True) + chunk("the") + chunk(" and"))
    r.broke(2)
    r.prompt_tokens = 9
    r.legs = 1
    leg = (chunk(role=True, rid="chatcmpl-b", created=2) + chunk(" for", rid="chatcmpl-b", created=2, finish="length")
           + ev({"id": "chatcmpl-b", "object": "chat.completion.chunk", "created": 2, "model": "m", "choices": [],
                 "usage": {"prompt_tokens": 13, "total_tokens": 14, "completion_tokens": 1}})
           + b"data: [DONE]\n\n")
    out = r.rewrite(leg).split(b"\n\n")
    assert len(out) == 4 and out[2:] == [b"data: [DONE]", b""]
    first, usage = orjson.loads(out[0][6:]), orjson.loads(out[1][6:])
    assert (first["id"], first["created"], first["choices"][0]["delta"]) == ("chatcmpl-a", 1, {"content": " for"})
    assert usage["usage"] == {"prompt_tokens": 9, "total_tokens": 12, "completion_tokens": 3}
    assert (r.total_usage().prompt_tokens, r.total_usage().completion_tokens) == (9, 3)


def test_rewrite_strips_usage_the_client_did_not_ask_for() -> None:
    r = StreamResume(chat=False, client_usage=False, continuous_usage=False)
    r.broke(0)
    r.legs = 1
    usage = ev({"id": "cmpl-b", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
    text = ev({"id": "cmpl-b", "created": 5, "model": "m", "choices": [{"text": " x"}], "usage": None})
    out = r.rewrite(text + usage + b"data: [DONE]\n\n")
    assert b'"usage":{' not in out and out.endswith(b"data: [DONE]\n\n") and b"cmpl-b" in out
    assert r.total_usage().completion_tokens == 1


def test_a_long_stream_is_folded_into_its_text() -> None:
    r = StreamResume(chat=True, client_usage=False, continuous_usage=False)
    r.note(chunk(role=True))
    words = [f" w{i}" for i in range(20000)]
    for w in words:
        r.note(chunk(w))
    assert 20000 * len(chunk(" w1")) > 2 * FOLD_BYTES >= 2 * sum(len(b) for b in r.sent)  # folded, not piled up
    d = r.broke(20000)
    assert d.text == "".join(words) and d.role_sent and d.id == "chatcmpl-a"


def test_the_fast_fold_reads_what_the_json_parse_reads() -> None:
    texts = ["the", ' "quoted"', " back\\slash", " \u00e9\u4e2d\U0001f600", "\nnew line", " content\":\"x", ""]
    data = chunk(role=True) + b"".join(chunk(t) for t in texts) + chunk(" end", finish="length") + ev(
        {"id": "chatcmpl-a", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 8}})
    fast = Delivered()
    fold_delivered(data, fast)
    slow = read_delivered(data)
    assert fast.text == slow.text == "".join(texts) + " end"
    assert (fast.id, fast.role_sent, fast.finish_reason, fast.tool_calls) == (slow.id, True, "length", False)
    completion = ev({"id": "cmpl-1", "created": 1, "model": "m", "choices": [{"index": 0, "text": " a\\b"}]})
    d = Delivered()
    fold_delivered(completion * 3, d)
    assert d.text == " a\\b" * 3 and d.id == "cmpl-1"
