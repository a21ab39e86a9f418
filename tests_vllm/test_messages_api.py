"""Anthropic's Messages API through the gateway against real vLLM (0.32 serves `/v1/messages` itself): the
gateway's translation to chat completions answers what vLLM's own Messages route answers, with the official
`anthropic` SDK on both sides. Greedy decoding on identical weights makes every server answer alike."""

from __future__ import annotations

import anthropic

from tests_vllm.conftest import MODEL

ASK = {"model": MODEL, "max_tokens": 12, "system": "You are terse.",
       "messages": [{"role": "user", "content": "Explain request routing in one sentence."}],
       "extra_body": {"temperature": 0, "ignore_eos": True}}


def _client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)


def test_messages_through_the_gateway_match_vllms_own_route(gateway, vllm_fleet) -> None:  # noqa: ANN001
    msg = _client(gateway.url).messages.create(**ASK)
    assert msg.type == "message" and msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 12
    for server in vllm_fleet.servers.values():
        ref = _client(server.url).messages.create(**ASK)
        assert msg.content[0].text == ref.content[0].text
        assert (msg.usage.input_tokens, msg.usage.output_tokens) == (ref.usage.input_tokens, ref.usage.output_tokens)
    with _client(gateway.url).messages.stream(**ASK) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == msg.content[0].text and streamed.usage.output_tokens == 12
    assert _client(gateway.url).messages.count_tokens(model=MODEL, system=ASK["system"],
                                                      messages=ASK["messages"]).input_tokens > 0
