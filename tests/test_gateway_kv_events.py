"""The gateway's KV-event subscribers and exact prefix-cache view: real ZMQ, real HTTP, simulated engines.

- Subscriber: a scripted publisher (real PUB/XPUB + ROUTER sockets) drives sequence gaps, replay, lost
  batches and restarts, and the index must end up exactly as the engine's cache would be.
- End to end: a gateway in front of simulated vLLM servers publishing KV events; `precise_prefix` sends
  shared-prefix requests where the prefix is cached, and the index's prediction equals the engine's hits.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, generate_latest

from engine_adapters.vllm.kv_events import END_SEQ, encode_batch, seq_bytes
from gateway.fleet.kv_events import KvEventsMetrics, Source, Subscriber, source_from_listing
from policies.kv_index import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KvIndex
from simulator import tokenizer
from tests.helpers import ADMIN, free_port_range, metric, poll, running_gateway


class ScriptedPublisher:
    """A publisher whose every batch we choose: XPUB (so we know when the subscriber is there) + replay ROUTER."""

    def __init__(self, fmt: str = "0.11") -> None:
        self.fmt = fmt
        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")   # bound at once: no port to lose meanwhile
        self.buffer: dict[int, bytes] = {}
        self.ts = 1000.0
        self._router = self.ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self.replay_port = self._router.bind_to_random_port("tcp://127.0.0.1")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    @property
    def source(self) -> Source:
        return Source(f"tcp://127.0.0.1:{self.port}", f"tcp://127.0.0.1:{self.replay_port}", "")

    def wait_subscriber(self, timeout_ms: int = 5000) -> None:
        assert self.pub.poll(timeout_ms), "no subscriber"
        assert self.pub.recv()[0] == 1   # a subscription frame

    def batch(self, seq: int, events: list, *, send: bool = True, keep: bool = True) -> None:
        self.ts += 1.0
        payload = encode_batch(EventBatch(self.ts, events, 0), self.fmt)
        if keep:
            self.buffer[seq] = payload
        if send:
            self.pub.send_multipart([b"", seq_bytes(seq), payload])

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(20):
                continue
            client, _, start = self._router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq in sorted(self.buffer):
                if seq >= first:
                    self._router.send_multipart([client, b"", b"", seq_bytes(seq), self.buffer[seq]])
            self._router.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.pub.close()
        self._router.close()


def _stored(*hashes: int) -> BlockStored:
    return BlockStored(tuple(hashes), None, tuple(range(16 * len(hashes))), 16)


@pytest.mark.parametrize("fmt", ["0.11", "0.33"])
async def test_subscriber_replays_gaps_resyncs_on_restart_and_loss(fmt: str) -> None:
    pub = ScriptedPublisher(fmt)
    reg = CollectorRegistry()
    metrics = KvEventsMetrics(reg)
    idx = KvIndex(16)
    ctx = zmq.asyncio.Context()
    sub = Subscriber("w0", pub.source, ctx, idx, metrics, replay_timeout_s=2.0)
    sub.start()
    try:
        await asyncio.to_thread(pub.wait_subscriber)
        # the subscriber joined late: seq 0 went out before, so its first message (seq 1) triggers a replay
        pub.batch(0, [_stored(1, 2)], send=False)
        pub.batch(1, [_stored(3)])
        await poll(lambda: sub.last_seq == 1, what="seq 1 applied")
        assert idx.prefix_blocks([1, 2, 3]) == {"w0": 3}
        # a gap (seq 2 lost on the wire but in the replay buffer) is filled in order
        pub.batch(2, [BlockRemoved((1,))], send=False)
        pub.batch(3, [_stored(9)])
        await poll(lambda: sub.last_seq == 3, what="seq 3 applied")
        assert idx.blocks_of("w0") == 3 and idx.prefix_blocks([1]) == {}
        text = generate_latest(reg).decode()
        assert metric(text, "fleetgate_kv_events_gaps_total", {"worker": "w0", "outcome": "replayed"}) == 1.0
        # a gap the buffer no longer holds: the worker's entries are dropped (never trust a stale view)
        pub.batch(4, [BlockRemoved((2,))], send=False, keep=False)
        pub.batch(5, [_stored(5)])
        await poll(lambda: sub.last_seq == 5, what="seq 5 applied")
        assert idx.blocks_of("w0") == 1 and idx.prefix_blocks([5]) == {"w0": 1}
        text = generate_latest(reg).decode()
        assert metric(text, "fleetgate_kv_events_gaps_total", {"worker": "w0", "outcome": "lost"}) == 1.0
        # AllBlocksCleared (reset_prefix_cache / sleep)
        pub.batch(6, [AllBlocksCleared(), _stored(7)])
        await poll(lambda: sub.last_seq == 6, what="seq 6 applied")
        assert idx.blocks_of("w0") == 1 and idx.prefix_blocks([7]) == {"w0": 1}
        # the engine restarted: numbering starts over at 0 with an empty cache
        pub.buffer.clear()
        pub.batch(0, [_stored(8)])
        await poll(lambda: sub.last_seq == 0, what="the restart's seq 0")
        assert idx.blocks_of("w0") == 1 and idx.prefix_blocks([8]) == {"w0": 1} and idx.prefix_blocks([7]) == {}
        text = generate_latest(reg).decode()
        assert metric(text, "fleetgate_kv_events_resyncs_total", {"worker": "w0", "reason": "restart"}) == 1.0
        assert metric(text, "fleetgate_kv_events_batches_total", {"worker": "w0"}) >= 7
        assert metric(text, "fleetgate_kv_events_lag_seconds", {"worker": "w0"}) is not None
        # garbage is counted, not fatal
        pub.pub.send_multipart([b"", seq_bytes(1), b"\xc1"])
        pub.batch(1, [_stored(4)])
        await poll(lambda: sub.last_seq == 1, what="the batch after a malformed one")
        assert metric(generate_latest(reg).decode(), "fleetgate_kv_events_malformed_total", {"worker": "w0"}) == 1.0
    finally:
        await sub.stop()
        ctx.destroy(linger=0)
        pub.close()


def test_source_from_kv_event_sources_listing() -> None:
    listing = {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:6001",
                     "replay_endpoint": "tcp://*:6002", "topic": "t"}}
    assert source_from_listing(listing, "10.0.0.9") == Source("tcp://10.0.0.9:6001", "tcp://10.0.0.9:6002", "t")
    assert source_from_listing({}, "h") is None
    assert source_from_listing({"0": {"enable_kv_cache_events": False}}, "h") is None


# ---- end to end --------------------------------------------------------------------------------------


def _kv_json(port: int, replay: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                       "replay_endpoint": f"tcp://*:{replay}"})


def _stats(url: str) -> dict:
    return httpx.get(url + "/sim/state", timeout=5).json()["stats"]


@pytest.mark.parametrize("mode", ["configured", "discovered", "token_ids"])
async def test_gateway_routes_to_the_cached_prefix_and_predicts_the_hits(sim_fleet, make_client, mode: str) -> None:  # noqa: ANN001
    """configured: 0.11 engines with sha256_cbor and a shared PYTHONHASHSEED, endpoints in the config;
    discovered: 0.33-style engines found through GET /kv_event_sources; token_ids: 0.11 engines with their
    default sha256 and no seed (a random NONE_HASH per engine, irreproducible): keys rebuilt from token ids."""
    base = free_port_range(4)   # server i publishes on base + i, replays on base + 2 + i
    replay = base + 2
    fmt = "0.33" if mode == "discovered" else "0.11"
    engine = {"prefix_caching_hash_algo": "sha256_cbor", "hash_seed": "11"} if mode != "token_ids" else {}
    fleet = sim_fleet(2, time_scale=50, kv_events_config=_kv_json(base, replay), kv_events_format=fmt, **engine)
    workers = []
    for i, url in enumerate(fleet.urls):
        w = {"id": f"w{i}", "url": url}
        if mode != "discovered":
            w["kv_events"] = {"endpoint": f"tcp://*:{base + i}", "replay_endpoint": f"tcp://*:{replay + i}"}
        workers.append(w)
    kv = {"enabled": True, "hash_algo": "sha256_cbor", "hash_seed": "11", "hash_style": "0.11" if fmt == "0.11"
          else "0.32", "tokenizer": "sim", "reconnect_s": 0.2, "key_on": "token_ids" if mode == "token_ids"
          else "block_hash"}
    async with running_gateway(workers=workers, default_policy="precise_prefix", kv_events=kv) as gw:
        service = gw.gateway.kv_events
        await poll(lambda: len(service.subscribers) == 2, what="both workers subscribed")
        client = make_client(gw.url)
        system = tokenizer.synthetic_text(400, key="system")      # 25 full blocks shared by every request
        await client.chat.completions.create(model="meta-llama/Llama-3.1-8B-Instruct", max_tokens=2, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": "first question"}])
        await poll(lambda: len(service.index) >= 25, what="the first prompt's blocks in the index")
        holder = service.index.workers()[0]
        other = next(w for w in ("w0", "w1") if w != holder)
        urls = {"w0": fleet.urls[0], "w1": fleet.urls[1]}
        before = {w: _stats(u)["prefix_cache_hits"] for w, u in urls.items()}
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "second question"}]
        predicted = service.request_view({"messages": messages}, chat=True)
        assert predicted.get(holder, 0) >= 25 * 16 and predicted.get(other, 0) == 0
        await client.chat.completions.create(model="meta-llama/Llama-3.1-8B-Instruct", max_tokens=2,
                                             messages=messages)
        after = {w: _stats(u)["prefix_cache_hits"] for w, u in urls.items()}
        assert after[holder] - before[holder] == predicted[holder]     # the index's prediction is the engine's hit
        assert after[other] == before[other]
        async with httpx.AsyncClient(timeout=5) as http:   # the gateway runs on this loop: no blocking calls
            text = (await http.get(gw.url + "/metrics")).text
            where = (await http.post(gw.url + "/admin/prefix_cache", json={"messages": messages}, headers=ADMIN)).json()
            bad = await http.post(gw.url + "/admin/prefix_cache", json={"neither": 1}, headers=ADMIN)
        assert where["hashed"] and where["workers"] == {holder: predicted[holder]} and where["block_size"] == 16
        assert sorted(where["subscribed"]) == ["w0", "w1"]
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
        assert metric(text, "fleetgate_kv_events_subscribers") == 2.0
        assert metric(text, "fleetgate_kv_events_batches_total", {"worker": holder}) >= 1
        # reset_prefix_cache on the holder: AllBlocksCleared reaches the index with the holder's next step's
        # batch (vLLM publishes a step's events when it ends), so give the holder a step of its own
        assert httpx.post(urls[holder] + "/reset_prefix_cache", timeout=5).status_code == 200
        await asyncio.to_thread(httpx.post, urls[holder] + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                                timeout=5)
        await poll(lambda: service.request_view({"messages": messages}, chat=True).get(holder, 0) == 0,
                   timeout=10, what="the holder's entries cleared")
