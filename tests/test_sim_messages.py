"""The simulated worker serves Anthropic's Messages API as vLLM 0.33 does (simulator/messages_api.py), and not
when it imitates 0.11; the official `anthropic` SDK talks to it directly."""

from __future__ import annotations

import anthropic
import httpx

from simulator.tokenizer import count_tokens, render_chat
from tests.helpers import MODEL

TOOL = {"name": "grep", "input_schema": {"type": "object", "properties": {"pattern": {"type": "string"}}}}


async def test_033_serves_messages_and_011_does_not(sim_fleet) -> None:
    new = sim_fleet(1, time_scale=20, kv_events_format="0.33").urls[0]
    old = sim_fleet(1, time_scale=20).urls[0]
    c = anthropic.AsyncAnthropic(base_url=new, api_key="unused", max_retries=0, timeout=20)
    msg = await c.messages.create(model=MODEL, max_tokens=4, system="Terse.",
                                  messages=[{"role": "user", "content": "hello"}], extra_body={"ignore_eos": True})
    assert msg.stop_reason == "max_tokens" and len(msg.content[0].text.split()) == 4
    prompt = [{"role": "system", "content": "Terse."}, {"role": "user", "content": "hello"}]
    assert msg.usage.input_tokens == count_tokens(render_chat(prompt)) and msg.usage.output_tokens == 4
    async with c.messages.stream(model=MODEL, max_tokens=10, tools=[TOOL], tool_choice={"type": "any"},
                                 messages=[{"role": "user", "content": "find it"}],
                                 extra_headers={"x-sim-output-tokens": "3"}) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].name == "grep"
    assert list(final.content[0].input) == ["pattern"] and len(final.content[0].input["pattern"].split()) == 3
    counted = await c.messages.count_tokens(model=MODEL, system="Terse.",
                                            messages=[{"role": "user", "content": "hello"}])
    assert counted.input_tokens == msg.usage.input_tokens
    async with httpx.AsyncClient(timeout=20) as http:
        r = await http.post(new + "/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": [
            {"role": "user", "content": "x " * 600_000}]})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"   # over the context
        r = await http.post(new + "/v1/messages", json={"model": MODEL, "messages": []})
        assert r.status_code == 400 and r.json()["type"] == "error"
        r = await http.post(old + "/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": [
            {"role": "user", "content": "hi"}]})
        assert r.status_code == 404
