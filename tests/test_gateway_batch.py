"""OpenAI Batch API on the gateway: the official `openai` client against a simulated fleet, the durable
deadline-ordered queue in both stores, eviction by interactive work, and a gateway restart on Redis."""

from __future__ import annotations

import json
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from gateway.server import GatewayServer
from gateway.state.jobs import QueuedRequest, request_id_for
from gateway.state.memory import MemoryStore
from gateway.state.redis_store import RedisStore
from tests.helpers import MODEL, REDIS_URL, poll, running_gateway

DONE = ("completed", "failed", "cancelled", "expired")


def chat_line(custom_id: str, tokens: int, **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": MODEL, "messages": [{"role": "user", "content": f"hello {custom_id}"}],
                                "max_tokens": tokens, "ignore_eos": True, **body}})


def gateway(urls: list[str], **cfg: Any) -> AbstractAsyncContextManager[GatewayServer]:
    return running_gateway(urls, scrape_interval_s=0.1, health={"interval_s": 0.2}, **cfg)


async def finished(client: AsyncOpenAI, batch_id: str, timeout: float = 15.0) -> Any:
    async def done() -> Any:
        b = await client.batches.retrieve(batch_id)
        return b if b.status in DONE else None
    return await poll(done, timeout, f"batch {batch_id} to finish")


def lines_of(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.strip()]


# --- the round trip ---------------------------------------------------------------------------------
async def test_batch_round_trip_with_the_openai_client(sim_fleet, make_client) -> None:
    fleet = sim_fleet(2, time_scale=20)
    async with gateway(fleet.urls, api_keys=["sk-batch"]) as gw:
        with pytest.raises(openai.AuthenticationError):
            await make_client(gw.url, "wrong").batches.list()
        client = make_client(gw.url, "sk-batch")
        good = [chat_line(f"req-{i}", 4 + i) for i in range(6)]
        broken = json.dumps({"custom_id": "broken", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"model": MODEL, "max_tokens": 4}})  # no messages: the gateway's 400
        upload = await client.files.create(file=("jobs.jsonl", ("\n".join([*good, broken]) + "\n").encode()),
                                           purpose="batch")
        assert upload.purpose == "batch" and upload.bytes > 0 and upload.id.startswith("file-")
        assert (await client.files.retrieve(upload.id)).filename == "jobs.jsonl"

        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                            completion_window="24h", metadata={"job": "nightly"})
        assert batch.status == "in_progress" and batch.request_counts.total == 7
        assert batch.expires_at - batch.created_at == 86_400

        done = await finished(client, batch.id)
        assert done.status == "completed", done
        assert (done.request_counts.completed, done.request_counts.failed) == (6, 1)
        assert done.usage.output_tokens == sum(4 + i for i in range(6))
        assert done.completed_at >= done.in_progress_at and done.metadata == {"job": "nightly"}

        out = lines_of((await client.files.content(done.output_file_id)).text)
        assert sorted(x["custom_id"] for x in out) == [f"req-{i}" for i in range(6)]
        for x in out:
            n = int(x["custom_id"].split("-")[1])
            assert x["error"] is None and x["response"]["status_code"] == 200
            assert x["response"]["body"]["usage"]["completion_tokens"] == 4 + n  # ignore_eos: exactly max_tokens
            assert x["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
        err = lines_of((await client.files.content(done.error_file_id)).text)
        assert [x["custom_id"] for x in err] == ["broken"]
        assert err[0]["response"]["status_code"] == 400 and "messages" in err[0]["response"]["body"]["error"]["message"]
        assert (await client.files.retrieve(done.output_file_id)).purpose == "batch_output"

        listed = [b.id async for b in client.batches.list(limit=5)]
        assert listed[0] == batch.id


async def test_cancel_stops_queued_requests_and_keeps_finished_ones(sim_fleet, make_client) -> None:
    fleet = sim_fleet(1, time_scale=10)
    async with gateway(fleet.urls, workers=[{"id": "w0", "url": fleet.urls[0], "cap": 1}]) as gw:
        client = make_client(gw.url, "unused")
        upload = await client.files.create(
            file=("many.jsonl", "\n".join(chat_line(f"c{i}", 200) for i in range(20)).encode()), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        await poll(lambda: gw.gateway.batch.active, what="a request running")
        cancelling = await client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        done = await finished(client, batch.id)
        assert done.status == "cancelled" and done.cancelled_at is not None
        assert done.request_counts.total == 20 and done.request_counts.completed + done.request_counts.failed < 20
        assert (await client.batches.cancel(batch.id)).status == "cancelled"  # idempotent
        snap = await gw.gateway.store.queue_snapshot()
        assert snap.queued == 0 and snap.running == 0


async def test_bad_input_gives_clear_errors(sim_fleet, make_client) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with gateway(fleet.urls) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
        client = make_client(gw.url, "unused")
        with pytest.raises(openai.BadRequestError, match="purpose"):
            await client.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
        with pytest.raises(openai.NotFoundError):
            await client.batches.create(input_file_id="file-missing", endpoint="/v1/chat/completions",
                                        completion_window="24h")
        with pytest.raises(openai.NotFoundError):
            await client.batches.retrieve("batch_nope")
        mixed = "\n".join([chat_line("a", 4), "not json", chat_line("a", 4),
                           json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {}})])
        upload = await client.files.create(file=("bad.jsonl", mixed.encode()), purpose="batch")
        mixed_batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h")
        # bad lines fail into the error file, the good one runs (one bad line must not fail the batch)
        assert mixed_batch.status == "in_progress" and mixed_batch.request_counts.total == 4
        done = await finished(client, mixed_batch.id)
        assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 1, 3)
        err = lines_of((await client.files.content(done.error_file_id)).text)
        assert [(x["custom_id"], x["error"]["code"]) for x in err] == [
            (None, "invalid_json_line"), (None, "duplicate_custom_id"), ("b", "mismatched_endpoint")]
        assert all(x["error"]["message"].startswith(f"Line {n}:") for x, n in zip(err, (2, 3, 4), strict=True))
        empty = await client.files.create(file=("empty.jsonl", b"\n\n"), purpose="batch")
        failed = await client.batches.create(input_file_id=empty.id, endpoint="/v1/chat/completions",
                                             completion_window="24h")
        assert failed.status == "failed" and failed.failed_at is not None
        assert [e.code for e in failed.errors.data] == ["empty_file"]
        with pytest.raises(openai.BadRequestError, match="completion_window"):
            await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                        completion_window="forever")  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError, match="endpoint"):
            await client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
        with pytest.raises(openai.APIStatusError) as exc:
            await client.batches.cancel(failed.id)
        assert exc.value.status_code == 409

        r = await http.post("/v1/files", content=b"plain", headers={"content-type": "text/plain"})
        assert r.status_code == 400 and "multipart" in r.json()["error"]["message"]
        r = await http.get("/v1/batches", params={"limit": "0"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
        r = await http.post("/v1/batches", content=b"[1]", headers={"content-type": "application/json"})
        assert r.status_code == 400


# --- the durable queue ------------------------------------------------------------------------------
def items(batch_id: str, n: int, deadline: float) -> list[QueuedRequest]:
    return [QueuedRequest(request_id_for(batch_id, i), batch_id, i, f"c{i}", "/v1/completions", {"prompt": "x"},
                          deadline, MODEL, 1) for i in range(n)]


@pytest.mark.parametrize("backend", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def test_queue_is_deadline_ordered_and_every_request_resolves_once(backend: str, request) -> None:
    if backend == "redis":
        store = RedisStore(REDIS_URL, key_prefix=request.getfixturevalue("redis_prefix"))
    else:
        store = MemoryStore()
    await store.start()
    try:
        await store.enqueue_batch("late", items("late", 3, 2000.0))
        await store.enqueue_batch("soon", items("soon", 2, 1000.0))
        snap = await store.queue_snapshot()
        assert snap.depth == {MODEL: 5} and snap.deadlines == [(1000.0, 2), (2000.0, 3)]

        first = await store.claim_next("r1", 30)
        second = await store.claim_next("r1", 30)
        assert [first.request_id, second.request_id] == ["soon-000000", "soon-000001"]
        await store.requeue(first)  # evicted: back to its old place, ahead of the later deadline
        assert (await store.claim_next("r1", 30)).request_id == "soon-000000"
        assert await store.finish_request(first, True, '{"ok":1}', 5, 7) == 1
        assert await store.finish_request(first, True, '{"again":1}') == -1  # a re-run's result is ignored
        assert await store.finish_request(second, False, '{"err":1}') == 0
        out, err = await store.batch_results("soon")
        assert out == {0: '{"ok":1}'} and err == {1: '{"err":1}'}
        stats = await store.batch_stats("soon")
        assert (stats.completed, stats.failed, stats.pending, stats.output_tokens) == (1, 1, 0, 7)
        assert await store.claim_final("soon", "r1") and not await store.claim_final("soon", "r2")

        lost = await store.claim_next("dead-replica", 0.05)  # its holder stops renewing
        assert lost.request_id == "late-000000"
        assert await poll(store.reap_claims, what="the unrenewed claim to expire and be reaped") == 1
        assert (await store.queue_snapshot()).queued == 3
        assert await store.drop_queued("late", 3, "window over") == 3
        _, err = await store.batch_results("late")
        assert sorted(err) == [0, 1, 2] and json.loads(err[0])["error"]["code"] == "batch_expired"
        assert (await store.batch_stats("late")).pending == 0
        assert await store.claim_next("r1", 30) is None

        assert await store.acquire_lease("leader", "a", 5) and not await store.acquire_lease("leader", "b", 5)
        await store.release_lease("leader", "a")
        assert await store.acquire_lease("leader", "b", 5)
    finally:
        await store.close()


# --- eviction ----------------------------------------------------------------------------------------
async def test_interactive_request_evicts_batch_work_which_then_completes(sim_fleet, make_client) -> None:
    fleet = sim_fleet(1, time_scale=5)
    async with gateway(fleet.urls, workers=[{"id": "w0", "url": fleet.urls[0], "cap": 2}]) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        client = make_client(gw.url, "unused")
        upload = await client.files.create(
            file=("long.jsonl", "\n".join(chat_line(f"b{i}", 1500) for i in range(3)).encode()), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        runner = gw.gateway.batch
        await poll(lambda: sum(1 for r in runner.active.values() if r.worker == "w0") == 2, what="worker full")
        r = await http.post("/v1/chat/completions", headers={"x-sim-output-tokens": "4"},
                            json={"model": MODEL, "messages": [{"role": "user", "content": "now"}], "max_tokens": 4})
        assert r.status_code == 200
        assert runner.evictions == 1
        # a batch request takes ~2.2 s here: the interactive one was answered while the batch work it displaced
        # and the one beside it still ran, so it did not wait for either (an event, not a stopwatch)
        assert (await client.batches.retrieve(batch.id)).request_counts.completed == 0
        done = await finished(client, batch.id, timeout=20)
        assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 3, 0)


# --- a restart on Redis -------------------------------------------------------------------------------
@pytest.mark.redis
@pytest.mark.slow  # two gateway processes start (~3 s each on a busy machine)
async def test_batch_survives_a_gateway_restart_on_redis(sim_fleet, redis_prefix, tmp_path, make_client,
                                                        gateway_process) -> None:
    fleet = sim_fleet(1, time_scale=4)
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(json.dumps({
        "workers": [{"id": "w0", "url": fleet.urls[0]}], "redis_url": REDIS_URL, "redis_key_prefix": redis_prefix,
        "scrape_interval_s": 0.2, "health": {"interval_s": 0.2},
        # max_inflight < slots_per_worker: the killed replica's reservations (leased for 10 s in Redis) leave
        # the worker room for its successor
        "batch": {"lease_s": 1.0, "slots_per_worker": 4, "max_inflight": 2, "poll_s": 0.05}}))
    first = gateway_process(cfg)
    client = make_client(first.listening_url(), "unused")
    upload = await client.files.create(
        file=("jobs.jsonl", "\n".join(chat_line(f"r{i}", 120) for i in range(16)).encode()), purpose="batch")
    batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")

    async def some_done() -> bool:
        b = await client.batches.retrieve(batch.id)
        return b.request_counts.completed >= 2
    await poll(some_done, 15, "the first gateway to finish some requests")
    first.kill()  # SIGKILL: requests it held stay claimed in Redis until their lease runs out

    client = make_client(gateway_process(cfg).listening_url(), "unused")
    done = await finished(client, batch.id, timeout=30)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 16, 0)
    out = lines_of((await client.files.content(done.output_file_id)).text)
    assert sorted(x["custom_id"] for x in out) == sorted(f"r{i}" for i in range(16))
