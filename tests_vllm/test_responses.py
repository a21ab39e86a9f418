"""The Responses API through the gateway in front of real vLLM (the CPU build): the gateway's answer, which a worker
served as a chat completion, equals the server's own chat answer to the same conversation (greedy decoding on
identical weights), streamed and not, and a follow-up through `previous_response_id` sends the whole conversation."""

from __future__ import annotations

from tests_vllm.conftest import MODEL, direct_client

EXACT = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def test_responses_equal_the_servers_chat_answer_and_chain(gateway, vllm_fleet) -> None:  # noqa: ANN001
    direct = direct_client(next(iter(vllm_fleet.servers.values())).url)
    client = gateway.client()
    r = client.responses.create(model=MODEL, instructions="You are terse.", input="Name a color.",
                                max_output_tokens=8, **EXACT)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    ref = direct.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, **EXACT)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == ref.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (ref.usage.prompt_tokens, 8)

    stream = client.responses.create(model=MODEL, input="And another?", previous_response_id=r.id,
                                     max_output_tokens=6, stream=True, **EXACT)
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    msgs = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": r.output_text},
            {"role": "user", "content": "And another?"}]   # instructions are not carried over
    ref = direct.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, **EXACT)
    assert final.output_text == ref.choices[0].message.content
    assert final.usage.input_tokens == ref.usage.prompt_tokens and final.usage.output_tokens == 6
    assert client.responses.retrieve(final.id).output_text == final.output_text
