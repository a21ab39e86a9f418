"""Workers that die or hang under load, with real processes: each worker a `fleetgate sim --workers 1` process,
the gateway `fleetgate serve`. Streams that survive their worker and hung-worker detection.

- `kill -9` of one of 4 workers under 200 concurrent streams: 0 client-visible failures, 0 error events, every
  stream's text continuous and complete (the simulator's filler words follow a fixed cycle, so a gap or a
  repeat shows);
- `SIGSTOP` of one of 4 workers under streams and non-streaming requests: its requests finish elsewhere within
  5 s of the stall (no client waits more than 5 s for its next chunk or, non-streaming, its answer beyond
  its normal time), then `SIGCONT` and the health checks bring it back.

FLEETGATE_CHAOS_STREAMS sets the number of concurrent streams of the kill scenario (default 200).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from bench.chaos_procs import record
from simulator.vllm_api import FILLER_WORDS
from tests.helpers import ADMIN, MODEL, poll

pytestmark = pytest.mark.timeout(300)

STREAMS = int(os.environ.get("FLEETGATE_CHAOS_STREAMS", "200"))


@dataclass
class Stream:
    """One client stream: its text, the largest wait between two chunks, what went wrong."""

    words: list[str] = field(default_factory=list)
    max_gap_s: float = 0.0
    error: str | None = None
    sent_at: float = 0.0
    done_at: float = 0.0


def write_config(tmp_path: Path, urls: list[str], **extra: object) -> Path:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(json.dumps({"workers": [{"id": f"w{i}", "url": u} for i, u in enumerate(urls)],
                               "health": {"interval_s": 0.5, "timeout_s": 0.5}, **extra}))
    return cfg


def continuous(words: list[str]) -> bool:
    idx = [FILLER_WORDS.index(w) if w in FILLER_WORDS else -1 for w in words]
    return -1 not in idx and all(b == (a + 1) % len(FILLER_WORDS) for a, b in zip(idx, idx[1:], strict=False))


async def stream_chat(http: httpx.AsyncClient, url: str, max_tokens: int, progress: list[int], i: int,
                      content: str | None = None) -> Stream:
    """One streamed chat (`content`: its prompt, default a short one); the bytes are parsed at the end (the
    client must not be the bottleneck)."""
    s = Stream()
    body = {"model": MODEL, "messages": [{"role": "user", "content": content or f"chaos stream {i}"}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    chunks: list[bytes] = []
    s.sent_at = time.monotonic()
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                s.error = f"status {r.status_code}"
                return s
            last = time.monotonic()
            async for chunk in r.aiter_raw():
                now = time.monotonic()
                s.max_gap_s = max(s.max_gap_s, now - last)
                last = now
                chunks.append(chunk)
                progress[i] += 1
    except httpx.HTTPError as e:
        s.error = f"{type(e).__name__}: {e}"
        return s
    s.done_at = time.monotonic()
    judge(s, b"".join(chunks), max_tokens)
    return s


def judge(s: Stream, data: bytes, max_tokens: int) -> None:
    """Read a whole stream's bytes into `s`: its words, or what went wrong (no [DONE], an error event, text not
    continuous or incomplete, usage not exact)."""
    events = [e for e in data.split(b"\n\n") if e]
    if not events or events[-1] != b"data: [DONE]":
        s.error = "no [DONE]"
        return
    objs = [json.loads(e[6:]) for e in events[:-1]]
    errors = [o["error"]["message"] for o in objs if "error" in o]
    if errors:
        s.error = f"error event: {errors[0]}"
        return
    s.words = "".join(c["delta"].get("content") or "" for o in objs for c in o["choices"]).split(" ")
    usage = [o["usage"] for o in objs if o.get("usage")]
    if len(s.words) != max_tokens or not continuous(s.words):
        s.error = f"text not continuous or incomplete ({len(s.words)} words)"
    elif len(usage) != 1 or usage[0]["completion_tokens"] != max_tokens:
        s.error = f"usage {usage}"


async def gateway_metric(url: str, name: str, **labels: str) -> float:
    from tests.test_gateway_failures import metric

    async with httpx.AsyncClient(timeout=10, headers=ADMIN) as http:
        return metric((await http.get(url + "/metrics")).text, name, **labels)


async def test_kill_9_of_a_worker_under_200_streams(sim_fleet_process, gateway_process, tmp_path) -> None:
    fleet = [sim_fleet_process(1, time_scale=0.25, seed=i) for i in range(4)]  # streams of ~15 s
    gw = gateway_process(write_config(tmp_path, [f.urls[0] for f in fleet]))
    url = gw.listening_url(timeout=120)
    max_tokens = 300
    progress = [0] * STREAMS
    limits = httpx.Limits(max_connections=STREAMS + 10, max_keepalive_connections=STREAMS + 10)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0), limits=limits) as http:
        tasks = [asyncio.create_task(stream_chat(http, url, max_tokens, progress, i)) for i in range(STREAMS)]
        # "Under way" is judged by the workers themselves (each serves its share of the streams), not by how many
        # chunks every client has read: on a loaded machine the last of 200 clients may read its first chunks late,
        # and the kill must come while the victim holds streams, whatever the clients' pace.
        async with httpx.AsyncClient(timeout=10) as sims:
            async def serving() -> list[int]:
                return [(await sims.get(f.urls[0] + "/sim/state")).json()["inflight_http"] for f in fleet]

            async def all_at_workers() -> list[int] | None:
                counts = await serving()
                return counts if sum(counts) >= STREAMS or any(t.done() for t in tasks) else None

            await poll(all_at_workers, 120, "every stream at a worker", every=0.2)
            await poll(lambda: sum(p > 0 for p in progress) >= STREAMS * 0.9 or any(t.done() for t in tasks), 120,
                       "most streams delivering tokens", every=0.1)
            assert not any(t.done() for t in tasks), "streams ended before the kill: make them longer"
            inflight = await serving()
        busiest = max(range(4), key=lambda i: inflight[i])
        victim = fleet[busiest].proc
        victim.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        victim.wait(10)
        streams = await asyncio.gather(*tasks)
    failed = [s.error for s in streams if s.error is not None]
    resumed = await gateway_metric(url, "fleetgate_stream_breaks_total", outcome="resumed")
    ended = await gateway_metric(url, "fleetgate_stream_breaks_total", outcome="ended")
    broken_502 = await gateway_metric(url, "fleetgate_requests_total", status="502")
    worst_gap = max(s.max_gap_s for s in streams)
    record("worker_kill_9", streams=STREAMS, on_killed_worker=inflight[busiest], failed=len(failed),
           resumed=int(resumed), ended=int(ended),
           worst_client_gap_s=round(worst_gap, 2), last_done_after_kill_s=round(
               max(s.done_at for s in streams) - t_kill, 2))
    assert failed == [], failed[:10]
    assert inflight[busiest] > 0 and resumed >= inflight[busiest] * 0.9, inflight  # its streams went on elsewhere
    assert ended == 0 and broken_502 == 0


async def chat_once(http: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[float, str | None]:
    """A non-streaming chat: (seconds taken, what went wrong)."""
    t0 = time.monotonic()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hang on"}], "max_tokens": max_tokens,
            "ignore_eos": True}
    try:
        r = await http.post(url + "/v1/chat/completions", json=body)
    except httpx.HTTPError as e:
        return time.monotonic() - t0, f"{type(e).__name__}: {e}"
    if r.status_code != 200:
        return time.monotonic() - t0, f"status {r.status_code}: {r.text[:200]}"
    words = r.json()["choices"][0]["message"]["content"].split(" ")
    ok = len(words) == max_tokens and continuous(words)
    return time.monotonic() - t0, None if ok else "incomplete answer"


async def test_sigstop_of_a_worker_its_requests_finish_elsewhere(sim_fleet_process, gateway_process,
                                                                 tmp_path) -> None:
    fleet = [sim_fleet_process(1, time_scale=1.0, seed=i) for i in range(4)]
    gw = gateway_process(write_config(tmp_path, [f.urls[0] for f in fleet], resume={"ejection_base_s": 3.0}))
    url = gw.listening_url(timeout=120)
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    victim = fleet[0].proc
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0), limits=limits) as http:
        # every worker learns its pace: a few dozen short streams
        warm = [0] * 64
        await asyncio.gather(*(stream_chat(http, url, 8, warm, i) for i in range(64)))
        # the normal time of a non-streaming answer under this load
        normal_s = max([d for d, _ in await asyncio.gather(*(chat_once(http, url, 40) for _ in range(8)))])
        progress = [0] * 40
        streams = [asyncio.create_task(stream_chat(http, url, 200, progress, i)) for i in range(40)]
        await poll(lambda: min(progress) >= 5, 60, "every stream under way")
        singles = [asyncio.create_task(chat_once(http, url, 40)) for _ in range(20)]
        await asyncio.sleep(0.3)  # the non-streaming requests are placed, some on the victim
        victim.send_signal(signal.SIGSTOP)
        t_stop = time.monotonic()
        try:
            results = await asyncio.gather(*streams)
            single = await asyncio.gather(*singles)
            await poll(lambda: not gw_healthy(url, "w0"), 10, "the hung worker out of rotation")
        finally:
            victim.send_signal(signal.SIGCONT)
        await poll(lambda: gw_healthy(url, "w0"), 30, "the worker back in rotation after SIGCONT")
    failed = [s.error for s in results if s.error] + [e for _, e in single if e]
    worst_gap = max(s.max_gap_s for s in results)
    worst_single = max(d for d, _ in single)
    resumed = await gateway_metric(url, "fleetgate_stream_breaks_total", outcome="resumed")
    record("worker_sigstop", streams=40, non_streaming=20, failed=len(failed), resumed=int(resumed),
           worst_client_gap_s=round(worst_gap, 2), worst_non_streaming_s=round(worst_single, 2),
           normal_non_streaming_s=round(normal_s, 2), last_done_after_stop_s=round(
               max(s.done_at for s in results) - t_stop, 2))
    assert failed == [], failed[:10]
    assert resumed >= 1
    assert worst_gap < 5.0  # no stream waited 5 s for its next chunk
    assert worst_single < normal_s + 5.0  # nor a non-streaming answer 5 s beyond its normal time


def gw_healthy(url: str, worker: str) -> bool:
    r = httpx.get(url + "/admin/workers", headers=ADMIN, timeout=5)
    return any(w["id"] == worker and w["healthy"] for w in r.json()["data"])
