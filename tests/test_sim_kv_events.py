"""Simulated engines produce vLLM's KV-cache events at vLLM's moments, and publish them as vLLM does (ZMQ)."""

from __future__ import annotations

import json

import httpx
import pytest
import zmq

from engine_adapters.vllm.kv_events import END_SEQ, decode_batch, seq_bytes, seq_of
from policies.kv_hash import BlockHasher
from policies.kv_index import AllBlocksCleared, BlockRemoved, BlockStored
from simulator import tokenizer
from simulator.cluster import ClusterSim
from simulator.engine import EngineConfig, EngineCore, SimRequest
from simulator.vllm_api import ConfigError, ServerConfig, SimServer
from simulator.workload import WorkloadRequest
from tests.helpers import free_port_range, free_ports, poll_sync

# ---- the engine: events at the moments vLLM emits them ---------------------------------------------


def _run(core: EngineCore, t: float = 0.0) -> float:
    while core.has_work():
        dur = core.plan_step(t)
        assert dur is not None
        t += dur
        core.finish_step(t)
    return t


def test_engine_stores_on_commit_removes_on_eviction_clears_on_reset() -> None:
    core = EngineCore("llama3-8b-h100", EngineConfig(num_gpu_blocks=8, kv_events=True))
    toks = list(range(40))
    core.add(SimRequest("a", 40, [1, 2], 1, 1, token_ids=toks), 0.0)
    assert core.take_kv_events() == []                         # nothing cached before a step computed it
    t = _run(core)
    assert core.take_kv_events() == [BlockStored((1, 2), None, tuple(toks[:32]), 16)]
    # same prefix + one more full block: the hits are not stored again, the new block is, chained to block 2
    core.add(SimRequest("b", 56, [1, 2, 3], 1, 1, token_ids=toks[:32] + list(range(900, 924))), t)
    t = _run(core, t)
    assert core.take_kv_events() == [BlockStored((3,), 2, tuple(range(900, 916)), 16)]
    # a request needing every block evicts the cached ones, oldest-freed first (tail blocks first, as vLLM)
    core.add(SimRequest("c", 120, [], 1, 1), t)
    t = _run(core, t)
    removed = [h for e in core.take_kv_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == [1, 2, 3] and removed[0] == 3
    core.add(SimRequest("d", 20, [7], 1, 1), t)
    _run(core, t)
    core.take_kv_events()
    assert core.reset_prefix_cache()
    assert core.take_kv_events() == [AllBlocksCleared()]


def test_engine_without_kv_events_records_nothing() -> None:
    core = EngineCore("llama3-8b-h100", EngineConfig(num_gpu_blocks=8))
    core.add(SimRequest("a", 40, [1, 2], 1, 1), 0.0)
    _run(core)
    assert core.take_kv_events() == []


def test_cluster_index_mirrors_every_engine_cache() -> None:
    """In virtual time the engines' events feed the index synchronously: after every step the index holds
    exactly the blocks each engine's prefix cache holds (small caches, so evictions happen all the time)."""
    reqs = []
    for i in range(300):
        shared = i % 7
        blocks = tuple(range(shared * 1000, shared * 1000 + 20)) + tuple(range(10**6 + i * 100, 10**6 + i * 100 + 8))
        reqs.append(WorkloadRequest(f"r{i}", i * 0.05, 28 * 16 + 5, 20, blocks))
    sim = ClusterSim("llama3-8b-h100", 3, "precise_prefix", engine_config=EngineConfig(num_gpu_blocks=120))
    checks = []

    def check(s: ClusterSim, wid: str, events: list, now: float) -> None:
        w = s.workers[wid]
        checks.append(s.kv_view.index.blocks_of(wid) == w.engine.snapshot()["cached_blocks"])

    sim.on_kv_events.append(check)
    res = sim.run(reqs)
    assert len(checks) > 100 and all(checks)
    d = res.to_dict()
    assert d["completed"] == 300 and d["prefix_cache_hit_rate"] > 0.4
    hits = {r.request_id: r.num_cached_tokens for r in res.results}
    assert any(v >= 20 * 16 for v in hits.values())


# ---- the HTTP server's publisher over ZMQ ------------------------------------------------------------


def _kv_config(port: int, replay: int | None = None, topic: str = "kv") -> str:
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": topic}
    if replay:
        cfg["replay_endpoint"] = f"tcp://*:{replay}"
    return json.dumps(cfg)


def _subscribe(ctx: zmq.Context, port: int, topic: bytes = b"kv") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


def _recv_all(sub: zmq.Socket, until, timeout: float = 10.0) -> list[tuple[bytes, int, object]]:  # noqa: ANN001
    got: list[tuple[bytes, int, object]] = []

    def more() -> bool:
        while sub.poll(0):
            topic, seq, payload = sub.recv_multipart()
            got.append((topic, seq_of(seq), decode_batch(payload)))
        return until(got)

    poll_sync(more, timeout, "KV events")
    return got


def _complete(url: str, prompt: str, salt: str | None = None) -> None:
    body = {"prompt": prompt, "max_tokens": 2}
    if salt:
        body["cache_salt"] = salt
    r = httpx.post(url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("fmt", ["0.11", "0.33"])
def test_server_publishes_stored_blocks_with_vllm_hashes(sim_fleet, fmt: str) -> None:  # noqa: ANN001
    port, replay = free_ports(2)
    fleet = sim_fleet(1, time_scale=50, kv_events_config=_kv_config(port, replay), kv_events_format=fmt,
                      prefix_caching_hash_algo="sha256_cbor", hash_seed="7")
    url = fleet.urls[0]
    ctx = zmq.Context.instance()
    sub = _subscribe(ctx, port)
    try:
        text = tokenizer.synthetic_text(100, key="p")
        poll_sync(lambda: (_complete(url, text), sub.poll(100))[1], 10, "the subscription to connect")
        got = _recv_all(sub, lambda g: any(isinstance(e, BlockStored) for _, _, b in g for e in b.events))
        topic, _, batch = got[0]
        assert topic == b"kv" and batch.data_parallel_rank == 0
        stored = next(e for _, _, b in got for e in b.events if isinstance(e, BlockStored))
        ids = tokenizer.encode(text)
        expected = BlockHasher(16, "sha256_cbor", "7", "0.11" if fmt == "0.11" else "0.32").hashes(ids)
        assert list(stored.block_hashes) == expected[:len(stored.block_hashes)] and len(expected) == 6
        assert stored.parent_block_hash is None and stored.token_ids == tuple(ids[:16 * len(stored.block_hashes)])
        seqs = [s for _, s, _ in got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        # replay: every buffered batch from 0, then the end marker
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        dealer.send_multipart([b"", seq_bytes(0)])
        replayed = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                break
            replayed.append(seq_of(frames[2]))
        dealer.close()
        assert replayed[0] == 0 and replayed == list(range(len(replayed))) and replayed[-1] >= seqs[-1]
        # /kv_event_sources: only 0.33-style servers have it
        r = httpx.get(url + "/kv_event_sources", timeout=5)
        if fmt == "0.33":
            src = r.json()["0"]
            assert src["endpoint"] == f"tcp://*:{port}" and src["replay_endpoint"] == f"tcp://*:{replay}"
            assert src["topic"] == "kv" and src["enable_kv_cache_events"] is True
        else:
            assert r.status_code == 404
        # reset_prefix_cache: AllBlocksCleared goes out with the next step's batch, as in vLLM
        assert httpx.post(url + "/reset_prefix_cache", timeout=5).status_code == 200
        _complete(url, "x" * 8)
        got = _recv_all(sub, lambda g: any(isinstance(e, AllBlocksCleared) for _, _, b in g for e in b.events))
    finally:
        sub.close()


def test_fleet_worker_i_publishes_on_port_plus_i(sim_fleet) -> None:  # noqa: ANN001
    base = free_port_range(2)
    fleet = sim_fleet(2, time_scale=50, kv_events_config=_kv_config(base, topic=""))
    assert [s.driver.publisher.endpoint for s in fleet.servers] == [f"tcp://*:{base}", f"tcp://*:{base + 1}"]
    ctx = zmq.Context.instance()
    sub = _subscribe(ctx, base + 1, b"")
    try:
        text = tokenizer.synthetic_text(40, key="q")
        poll_sync(lambda: (_complete(fleet.urls[1], text), sub.poll(100))[1], 10, "events from worker 1")
    finally:
        sub.close()


def test_bad_kv_events_settings_are_config_errors() -> None:
    for kw in ({"kv_events_config": '{"bogus": 1}'}, {"kv_events_format": "0.2"},
               {"prefix_caching_hash_algo": "md5"}):
        with pytest.raises(ConfigError):
            SimServer(ServerConfig(**kw))
