"""The simulated vLLM server continues a text as vLLM does: chat `continue_final_message` with
`add_generation_prompt: false`, and a completion prompt that is the original prompt plus the text generated
so far. Over real HTTP."""

from __future__ import annotations

import json

import httpx

from simulator.tokenizer import count_tokens, render_chat

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _chat_text(url: str, body: dict) -> tuple[str, dict]:
    r = httpx.post(url + CHAT, json=body, timeout=30)
    assert r.status_code == 200, r.text
    data = r.json()
    return data["choices"][0]["message"]["content"], data["usage"]


def _split_after(text: str, words: int) -> tuple[str, str]:
    """The text of the first `words` filler tokens and the rest (tokens after the first start with a space)."""
    cut = 3 + 4 * (words - 1)
    return text[:cut], text[cut:]


def test_chat_continue_final_message_goes_on_where_the_text_stopped(sim_url):
    messages = [{"role": "user", "content": "tell me something"}]
    whole, _ = _chat_text(sim_url, {"messages": messages, "max_tokens": 9, "ignore_eos": True})
    assert count_tokens(whole) == 9
    sent, rest = _split_after(whole, 4)
    cont = [*messages, {"role": "assistant", "content": sent}]
    more, usage = _chat_text(sim_url, {"messages": cont, "max_tokens": 5, "ignore_eos": True,
                                       "continue_final_message": True, "add_generation_prompt": False})
    assert more == rest and sent + more == whole
    # the final message stays open: no turn end, no new assistant header
    assert usage["prompt_tokens"] == count_tokens(render_chat(cont, False, continue_final_message=True))
    assert render_chat(cont, False, continue_final_message=True).endswith("<|assistant|>\n" + sent)


def test_chat_continuation_streams_with_its_role_chunk(sim_url):
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "the and"}]
    with httpx.stream("POST", sim_url + CHAT, timeout=30, json={
            "messages": messages, "max_tokens": 3, "ignore_eos": True, "stream": True,
            "continue_final_message": True, "add_generation_prompt": False}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
    deltas = [json.loads(ln[6:])["choices"][0]["delta"] for ln in lines]
    assert deltas[0] == {"role": "assistant", "content": ""}  # vLLM sends the role chunk on every stream
    assert "".join(d.get("content", "") for d in deltas[1:]) == " for was not"


def test_completion_prompt_plus_text_sent_continues(sim_url):
    prompt = "Write a list:"
    r = httpx.post(sim_url + COMPLETIONS, json={"prompt": prompt, "max_tokens": 8, "ignore_eos": True}, timeout=30)
    whole = r.json()["choices"][0]["text"]
    sent, rest = _split_after(whole, 3)
    r = httpx.post(sim_url + COMPLETIONS, json={"prompt": prompt + sent, "max_tokens": 5, "ignore_eos": True},
                   timeout=30)
    assert r.json()["choices"][0]["text"] == rest
    assert r.json()["usage"]["prompt_tokens"] == count_tokens(prompt + sent)


def test_continuation_errors_as_vllm(sim_url):
    both = {"messages": [{"role": "assistant", "content": "the"}], "continue_final_message": True,
            "add_generation_prompt": True}
    r = httpx.post(sim_url + CHAT, json=both, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert "Cannot set both `continue_final_message` and `add_generation_prompt` to True." in err["message"]
    assert err["code"] == 400
    r = httpx.post(sim_url + CHAT, json={"messages": [{"role": "user", "content": "hi"}],
                                         "continue_final_message": True, "add_generation_prompt": False}, timeout=30)
    assert r.status_code == 400 and "last message is not from the assistant" in r.json()["error"]["message"]
