"""Evicted batch work continues where it stopped (gateway/batch/runner.py): the runner streams to the worker,
an interactive request evicts it mid-generation, and its next run is the continuation of the tokens it had.
The output line reads as one uninterrupted non-streaming answer. Real HTTP, simulated workers, the Batch API
through the gateway with the `openai` client."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import httpx
import pytest

from tests.helpers import MODEL, poll
from tests.test_gateway_batch import finished, gateway, lines_of
from tests.test_gateway_resume import assert_continuous

TOKENS = 400
SEED = 11


def request_of(url: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": TOKENS, "ignore_eos": True, "seed": SEED}
    if url == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "write a long story"}]
    else:
        body["prompt"] = "Once upon a time"
    return body


def text_of(body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.parametrize("url", ["/v1/chat/completions", "/v1/completions"])
async def test_evicted_batch_request_continues_and_reads_as_one_answer(url: str, sim_fleet, make_client,
                                                                       caplog) -> None:
    caplog.set_level(logging.INFO, logger="fleetgate.batch")
    fleet = sim_fleet(1, time_scale=2)   # ~280 tokens/s: the 400-token line runs ~1.5 s
    async with gateway(fleet.urls, workers=[{"id": "w0", "url": fleet.urls[0], "cap": 1}]) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        client = make_client(gw.url, "unused")
        line = json.dumps({"custom_id": "long", "method": "POST", "url": url, "body": request_of(url)})
        upload = await client.files.create(file=("one.jsonl", line.encode()), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint=url, completion_window="24h")
        runner = gw.gateway.batch
        # some tokens streamed in, far from all of them
        await poll(lambda: any(len(r.chunks) >= 5 for r in runner.active.values()), what="batch tokens arriving")

        r = await http.post("/v1/completions", headers={"x-sim-output-tokens": "4"},
                            json={"model": MODEL, "prompt": "now", "max_tokens": 4})
        assert r.status_code == 200
        assert (runner.evictions, runner.continued, runner.restarted) == (1, 1, 0)
        kept = [int(m.group(1)) for rec in caplog.records
                if (m := re.search(r"evicted after (\d+) tokens: it continues", rec.getMessage()))]
        assert len(kept) == 1 and 0 < kept[0] < TOKENS

        done = await finished(client, batch.id, timeout=30)
        assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 1, 0)
        assert done.usage.output_tokens == TOKENS
        [out] = lines_of((await client.files.content(done.output_file_id)).text)
        assert out["error"] is None and out["response"]["status_code"] == 200
        folded = out["response"]["body"]

        # the same request, uninterrupted and non-streaming (seeded: the simulator answers it the same way)
        ref = (await http.post(url, json=request_of(url))).json()
        assert text_of(folded) == text_of(ref)
        assert_continuous(text_of(folded), TOKENS)
        assert folded["usage"] == ref["usage"]
        assert folded["usage"]["completion_tokens"] == TOKENS
        assert sorted(folded) == sorted(ref) and sorted(folded["choices"][0]) == sorted(ref["choices"][0])
        if "message" in ref["choices"][0]:
            assert folded["choices"][0]["message"] == ref["choices"][0]["message"]
        assert folded["choices"][0]["finish_reason"] == "length"
        assert folded["object"] == ref["object"] and folded["model"] == MODEL
        assert isinstance(folded["created"], int) and folded["id"].startswith(("chatcmpl-", "cmpl-"))
        assert not runner.produced   # nothing held once the line is written


async def test_request_that_cannot_continue_restarts(sim_fleet, make_client) -> None:
    """A request asking for logprobs is not resumable: it runs non-streaming as before and an eviction restarts
    it."""
    fleet = sim_fleet(1, time_scale=2)
    async with gateway(fleet.urls, workers=[{"id": "w0", "url": fleet.urls[0], "cap": 1}]) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        client = make_client(gw.url, "unused")
        body = {**request_of("/v1/completions"), "logprobs": 1, "max_tokens": 200}
        line = json.dumps({"custom_id": "logprobs", "method": "POST", "url": "/v1/completions", "body": body})
        upload = await client.files.create(file=("logprobs.jsonl", line.encode()), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                            completion_window="24h")
        runner = gw.gateway.batch
        await poll(lambda: any(r.worker == "w0" for r in runner.active.values()), what="the batch request placed")
        r = await http.post("/v1/completions", headers={"x-sim-output-tokens": "4"},
                            json={"model": MODEL, "prompt": "now", "max_tokens": 4})
        assert r.status_code == 200
        assert (runner.evictions, runner.continued, runner.restarted) == (1, 0, 1)
        done = await finished(client, batch.id, timeout=30)
        assert (done.status, done.request_counts.completed) == ("completed", 1)
        [out] = lines_of((await client.files.content(done.output_file_id)).text)
        assert out["response"]["body"]["usage"]["completion_tokens"] == 200
