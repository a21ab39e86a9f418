"""Files and batches per key: ownership (another key gets 404), DELETE, the per-key storage quota, expiry,
uploads streamed to the store (RSS of a real gateway process), and batches whose bad lines fail alone and
whose blocked lines do not hold back other work."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from tests.helpers import ADMIN, MODEL, REDIS_URL, poll, running_gateway
from tests.test_gateway_batch import chat_line, finished, lines_of

KEYS = {"keys": [{"key": "sk-tenant-alpha", "name": "alpha"}, {"key": "sk-tenant-bravo", "name": "bravo"}]}


def jsonl(*lines: str) -> bytes:
    return ("\n".join(lines) + "\n").encode()


async def test_files_and_batches_belong_to_the_key_that_made_them(sim_fleet, make_client) -> None:
    fleet = sim_fleet(1, time_scale=50)
    async with running_gateway(fleet.urls, auth=KEYS) as gw:
        alpha: AsyncOpenAI = make_client(gw.url, "sk-tenant-alpha")
        bravo: AsyncOpenAI = make_client(gw.url, "sk-tenant-bravo")
        up = await alpha.files.create(file=("a.jsonl", jsonl(chat_line("x", 3))), purpose="batch")
        assert up.expires_at is not None and up.expires_at - up.created_at == 30 * 86_400  # the default
        batch = await alpha.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions",
                                           completion_window="24h")
        done = await finished(alpha, batch.id)
        assert done.status == "completed"
        # bravo sees none of it, and cannot use alpha's file for a batch
        assert [f.id async for f in bravo.files.list()] == []
        assert [b.id async for b in bravo.batches.list()] == []
        for call in (lambda: bravo.files.retrieve(up.id), lambda: bravo.files.content(up.id),
                     lambda: bravo.files.content(done.output_file_id), lambda: bravo.batches.retrieve(batch.id),
                     lambda: bravo.batches.cancel(batch.id), lambda: bravo.files.delete(up.id),
                     lambda: bravo.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h")):
            with pytest.raises(openai.NotFoundError):
                await call()
        mine = {f.id async for f in alpha.files.list()}
        assert mine == {up.id, done.output_file_id}
        assert (await alpha.files.retrieve(done.output_file_id)).expires_at is not None
        # DELETE
        deleted = await alpha.files.delete(up.id)
        assert deleted.deleted and deleted.id == up.id
        with pytest.raises(openai.NotFoundError):
            await alpha.files.retrieve(up.id)
        assert {f.id async for f in alpha.files.list()} == {done.output_file_id}


async def test_storage_quota_and_expiry(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=50)
    async with running_gateway(fleet.urls, auth=KEYS, batch={"storage_per_key_bytes": 4096, "file_ttl_s": 1.5}) \
            as gw, httpx.AsyncClient(base_url=gw.url, timeout=20) as http:
        alpha = {"authorization": "Bearer sk-tenant-alpha"}

        async def upload(n: int, **extra: str) -> httpx.Response:
            return await http.post("/v1/files", headers=alpha, data={"purpose": "batch", **extra},
                                   files={"file": ("f.jsonl", b"x" * n)})
        assert (await upload(3000)).status_code == 200
        r = await upload(2000)  # 3000 + 2000 > 4096
        assert r.status_code == 400 and r.json()["error"]["code"] == "storage_quota_exceeded"
        assert len((await http.get("/v1/files", headers=alpha)).json()["data"]) == 1  # the refused one is gone
        ok = await http.post("/v1/files", headers={"authorization": "Bearer sk-tenant-bravo"},
                             data={"purpose": "batch"}, files={"file": ("f.jsonl", b"y" * 3000)})
        assert ok.status_code == 200  # the quota is per key
        # expires_after: OpenAI's bounds are checked; the configured default here is 1.5 s
        r = await upload(10, **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "expires_after"

        async def none_left() -> bool:
            return (await http.get("/v1/files", headers=alpha)).json()["data"] == []
        await poll(none_left, 5, "the file to expire")
        assert (await upload(3000)).status_code == 200  # expired files no longer count


@pytest.mark.parametrize("backend", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
def test_uploads_stream_to_the_store_not_into_memory(backend, sim_fleet, gateway_process, tmp_path: Path,
                                                     redis_prefix) -> None:
    fleet = sim_fleet(1, time_scale=50)
    cfg = tmp_path / "gw.yaml"
    conf = {"workers": [{"id": "w0", "url": fleet.urls[0]}], "batch": {"max_file_bytes": 20 * 1024 * 1024}}
    if backend == "redis":
        conf |= {"redis_url": REDIS_URL, "redis_key_prefix": redis_prefix}
    cfg.write_text(json.dumps(conf))
    proc = gateway_process(cfg)
    url = proc.listening_url()
    line = chat_line("c", 4).encode() + b"\n"
    ten_mb = line * (10 * 1024 * 1024 // len(line))

    def rss_mb() -> float:
        for row in Path(f"/proc/{proc.proc.pid}/status").read_text().splitlines():
            if row.startswith("VmRSS:"):
                return int(row.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def upload() -> None:
        r = httpx.post(url + "/v1/files", data={"purpose": "batch"}, files={"file": ("big.jsonl", ten_mb)},
                       timeout=60)
        assert r.status_code == 200, r.text
    upload()  # warm up: parsers, pools, allocator arenas
    before = rss_mb()
    for _ in range(10):
        upload()
    growth = rss_mb() - before
    files = httpx.get(url + "/v1/files", timeout=10).json()["data"]
    assert len(files) == 11 and all(f["bytes"] == len(ten_mb) for f in files)
    first = httpx.get(url + f"/v1/files/{files[0]['id']}/content", timeout=30)
    assert first.content == ten_mb
    assert growth < 25, f"RSS grew {growth:.1f} MB over 10 uploads of 10 MB ({backend})"


async def test_a_line_that_cannot_run_never_blocks_other_work(sim_fleet, make_client) -> None:
    fleet = sim_fleet(fleet={"servers": [{"model": "m-slow"}, {"model": MODEL}]}, time_scale=50)
    workers = [{"id": "slow", "url": fleet.urls[0]}, {"id": "main", "url": fleet.urls[1]}]
    async with running_gateway(workers=workers, health={"interval_s": 0.2}, batch={"poll_s": 0.05}) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=20, headers=ADMIN) as http:
        client = make_client(gw.url, "unused")
        # m-slow's only worker leaves rotation: its requests have no room (the model stays known)
        assert (await http.post("/admin/workers/slow/drain")).status_code == 200
        blocked_line = json.dumps({"custom_id": "blocked", "method": "POST", "url": "/v1/chat/completions",
                                   "body": {"model": "m-slow", "messages": [{"role": "user", "content": "x"}],
                                            "max_tokens": 3}})
        first = await client.files.create(file=("first.jsonl", jsonl(blocked_line, chat_line("ok-1", 3))),
                                          purpose="batch")
        b1 = await client.batches.create(input_file_id=first.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
        unknown = json.dumps({"custom_id": "unknown", "method": "POST", "url": "/v1/chat/completions",
                              "body": {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}})
        second = await client.files.create(file=("second.jsonl", jsonl(unknown, chat_line("ok-2", 3))),
                                           purpose="batch")
        b2 = await client.batches.create(input_file_id=second.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
        done2 = await finished(client, b2.id, timeout=10)  # behind b1's blocked line, finished anyway
        assert (done2.status, done2.request_counts.completed, done2.request_counts.failed) == ("completed", 1, 1)
        err = lines_of((await client.files.content(done2.error_file_id)).text)
        assert [(x["custom_id"], x["error"]["code"]) for x in err] == [("unknown", "model_not_found")]

        async def b1_progress() -> bool:
            b = await client.batches.retrieve(b1.id)
            return b.request_counts.completed == 1 and b.status == "in_progress"
        await poll(b1_progress, 10, "b1's runnable line to finish while its blocked line waits")
        assert (await http.post("/admin/workers/slow/activate")).status_code == 200
        done1 = await finished(client, b1.id, timeout=10)
        assert (done1.status, done1.request_counts.completed) == ("completed", 2)


async def test_a_batch_expires_on_time_with_blocked_lines(sim_fleet, make_client) -> None:
    fleet = sim_fleet(1, time_scale=50)
    workers = [{"id": "w0", "url": fleet.urls[0]}]
    async with running_gateway(workers=workers, health={"interval_s": 0.2}) as gw, \
            httpx.AsyncClient(base_url=gw.url, timeout=20, headers=ADMIN) as http:
        client = make_client(gw.url, "unused")
        assert (await http.post("/admin/workers/w0/drain")).status_code == 200
        up = await client.files.create(file=("x.jsonl", jsonl(*(chat_line(f"c{i}", 3) for i in range(3)))),
                                       purpose="batch")
        t0 = time.monotonic()
        b = await client.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions",
                                        completion_window="2s")  # type: ignore[arg-type]
        done = await finished(client, b.id, timeout=10)
        assert done.status == "expired" and time.monotonic() - t0 < 2 + 3  # window + the 1 s sweep, with margin
        err = lines_of((await client.files.content(done.error_file_id)).text)
        assert sorted(x["custom_id"] for x in err) == ["c0", "c1", "c2"]
        assert {x["error"]["code"] for x in err} == {"batch_expired"}
        await asyncio.sleep(0)
