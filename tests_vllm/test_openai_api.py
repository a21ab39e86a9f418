"""Chat and completions through the gateway with the official openai client, checked against the servers.

Greedy decoding (temperature 0) on identical weights makes both servers answer a request identically, so
the gateway's answer must equal the direct one whichever server it picked: text, usage and finish reason.
"""

from __future__ import annotations

import pytest

from tests_vllm.conftest import MODEL, direct_client

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Explain request routing in one sentence."}]
PROMPT = "def route(request, workers):\n    "
EXACT = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def direct(vllm_fleet):  # noqa: ANN001, ANN201
    return [direct_client(s.url) for s in vllm_fleet.servers.values()]


def _usage(u) -> tuple[int, int, int]:  # noqa: ANN001
    return (u.prompt_tokens, u.completion_tokens, u.total_tokens)


def test_chat_matches_the_servers_and_stops_at_max_tokens(gateway, direct) -> None:  # noqa: ANN001
    resp = gateway.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, **EXACT)
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
    for client in direct:
        ref = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, **EXACT)
        assert choice.message.content == ref.choices[0].message.content
        assert _usage(resp.usage) == _usage(ref.usage)


def test_completion_matches_the_servers_and_stops_at_max_tokens(gateway, direct) -> None:  # noqa: ANN001
    resp = gateway.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, **EXACT)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 16
    for client in direct:
        ref = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, **EXACT)
        assert resp.choices[0].text == ref.choices[0].text
        assert _usage(resp.usage) == _usage(ref.usage)


def test_natural_finish_reason_and_usage_match_the_server(gateway, direct) -> None:  # noqa: ANN001
    # No ignore_eos: the model may emit </s> ("stop") or run to max_tokens ("length"); both servers agree.
    resp = gateway.client().completions.create(model=MODEL, prompt="import os\n", max_tokens=200, temperature=0)
    ref = direct[0].completions.create(model=MODEL, prompt="import os\n", max_tokens=200, temperature=0)
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.choices[0].finish_reason == ref.choices[0].finish_reason
    assert resp.choices[0].text == ref.choices[0].text
    assert _usage(resp.usage) == _usage(ref.usage)
    assert resp.usage.completion_tokens <= 200


def test_chat_stream_relays_deltas_finish_reason_and_usage(gateway, direct) -> None:  # noqa: ANN001
    ref = direct[1].chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, **EXACT)
    stream = gateway.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, stream=True, stream_options={"include_usage": True}, **EXACT)
    chunks = list(stream)
    content_chunks = [c for c in chunks if c.choices]
    usage_chunks = [c for c in chunks if c.usage is not None]
    # vLLM: first delta carries the role; the last content chunk the finish reason; then one usage-only chunk.
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert content_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == ref.choices[0].message.content
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0] and usage_chunks[0].choices == []
    assert _usage(usage_chunks[0].usage) == _usage(ref.usage)
    assert len({c.id for c in chunks}) == 1


def test_completion_stream_relays_text_and_usage(gateway, direct) -> None:  # noqa: ANN001
    ref = direct[0].completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, **EXACT)
    stream = gateway.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, stream=True, stream_options={"include_usage": True}, **EXACT)
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == ref.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and _usage(chunks[-1].usage) == _usage(ref.usage)


def test_stream_without_include_usage_has_no_usage_chunk(gateway) -> None:  # noqa: ANN001
    # The gateway may ask the engine for usage to count tokens, but must not show it to a client that didn't.
    stream = gateway.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, stream=True, **EXACT)
    chunks = list(stream)
    assert chunks and all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
