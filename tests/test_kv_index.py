"""Block hashing as vLLM does it, the KV-event wire format, and the exact prefix-cache index (pure parts)."""

from __future__ import annotations

import msgspec
import pytest

from engine_adapters.vllm.kv_events import (
    KvEventsError,
    connect_address,
    decode_batch,
    encode_batch,
    offset_endpoint,
    parse_kv_events_config,
    seq_bytes,
    seq_of,
)
from policies.kv_hash import BlockHasher, external_hash, sha256_cbor
from policies.kv_index import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KvIndex

TOKENS = list(range(100, 140))

# Computed by vLLM 0.32's own code (vllm.v1.core.kv_cache_utils.hash_block_tokens after init_none_hash, with
# PYTHONHASHSEED=42, as ints via maybe_convert_block_hash); tests_vllm/test_kv_events.py recomputes them live.
VLLM_032_SEED42 = {
    "sha256_cbor": ([6658331277240515430, 8353329011930047756], 6262276978698744771),
    "sha256": ([1381363090197472084, 17395668330357163136], 1820248832345516052),
}


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256"])
def test_block_hashes_equal_vllms(algo: str) -> None:
    chain, salted_first = VLLM_032_SEED42[algo]
    h = BlockHasher(16, algo, "42", "0.32")
    assert h.hashes(TOKENS) == chain                       # 40 tokens: two full blocks, the rest is not hashed
    assert h.hashes(TOKENS[:16], cache_salt="s1") == [salted_first]
    assert h.hashes(TOKENS[:15]) == []


def test_hash_chaining_and_salt_rules() -> None:
    h = BlockHasher(4, "sha256_cbor", "0")
    a = h.hashes([1, 2, 3, 4, 5, 6, 7, 8])
    b = h.hashes([1, 2, 3, 4, 9, 9, 9, 9])
    assert a[0] == b[0] and a[1] != b[1]                   # equal prefixes share a head
    assert h.hashes([5, 6, 7, 8])[0] != a[1]               # block 1 depends on block 0 (chained)
    assert h.hashes([1, 2, 3, 4], "x") != h.hashes([1, 2, 3, 4])
    # the salt enters block 0 only, in 0.11's untagged form by default
    d0 = h.digests([1, 2, 3, 4], "x")[0]
    assert d0 == sha256_cbor((h.none_hash, (1, 2, 3, 4), ("x",)))
    assert BlockHasher(4, "sha256_cbor", "1").hashes([1, 2, 3, 4]) != h.hashes([1, 2, 3, 4])  # seed matters
    assert external_hash(b"\x00" * 24 + b"\x01" * 8) == int.from_bytes(b"\x01" * 8, "big")
    with pytest.raises(ValueError):
        BlockHasher(16, "md5")


def test_wire_formats_round_trip_and_shapes() -> None:
    events = [BlockStored((11, 12), None, tuple(range(32)), 16), BlockRemoved((11,)), AllBlocksCleared()]
    batch = EventBatch(1700000000.5, events, 0)
    raw11 = msgspec.msgpack.decode(encode_batch(batch, "0.11"))
    assert raw11 == [1700000000.5, [["BlockStored", [11, 12], None, list(range(32)), 16, None, "GPU"],
                                    ["BlockRemoved", [11], "GPU"], ["AllBlocksCleared"]], 0]
    raw33 = msgspec.msgpack.decode(encode_batch(batch, "0.33"))
    assert raw33[1][0]["type"] == "BlockStored" and raw33[1][0]["block_hashes"] == [11, 12]
    assert raw33[1][1] == {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU", "group_idx": 0}
    assert raw33[1][2] == {"type": "AllBlocksCleared"}
    for fmt in ("0.11", "0.33"):
        back = decode_batch(encode_batch(batch, fmt))
        assert back.ts == batch.ts and back.data_parallel_rank == 0
        assert back.events == events


def test_decode_rejects_garbage_and_reads_foreign_fields() -> None:
    with pytest.raises(KvEventsError):
        decode_batch(b"\xc1")
    with pytest.raises(KvEventsError):
        decode_batch(msgspec.msgpack.encode({"ts": 1}))
    with pytest.raises(KvEventsError):
        decode_batch(msgspec.msgpack.encode([1.0, [["Nope"]], 0]))
    # a 0.33 map with fields this reader does not know (lookahead_token_ids) and raw 32-byte hashes
    digest = bytes(range(32))
    ev = {"type": "BlockStored", "block_hashes": [digest], "parent_block_hash": None, "token_ids": [1] * 16,
          "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "lookahead_token_ids": [7]}
    b = decode_batch(msgspec.msgpack.encode([2.0, [ev], 0]))
    assert b.events[0].block_hashes == (digest,)


def test_config_parsing_and_endpoints() -> None:
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}')
    assert cfg.active and cfg.buffer_steps == 10_000 and cfg.topic == ""
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').active
    assert parse_kv_events_config('{"enable_kv_cache_events": true}').active   # 0.33: publisher None = zmq
    for bad in ('{"enable_kv_cache_events": tru', '{"bogus": 1}', '{"publisher": "kafka"}', '{"endpoint": "http://x"}',
                '{"hwm": -1}', "[1]"):
        with pytest.raises(KvEventsError):
            parse_kv_events_config(bad)
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    assert connect_address("tcp://*:5557", "10.0.0.5") == "tcp://10.0.0.5:5557"
    assert connect_address("tcp://0.0.0.0:5557", "::1") == "tcp://[::1]:5557"
    assert connect_address("tcp://10.1.1.1:5557", "10.0.0.5") == "tcp://10.1.1.1:5557"
    assert seq_of(seq_bytes(7)) == 7 and seq_of(b"\xff" * 8) == -1


def _stored(hashes: list[int], parent: int | None = None, bs: int = 4, tokens: tuple[int, ...] = ()) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tokens, bs)


def test_index_store_remove_clear_and_prefix_lengths() -> None:
    idx = KvIndex(block_size=4)
    idx.apply("a", [_stored([1, 2, 3])])
    idx.apply("b", [_stored([1, 2]), _stored([9])])
    assert idx.prefix_blocks([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert idx.prefix_blocks([1, 2, 3], workers=["b"]) == {"b": 2}
    assert idx.cached_tokens("a", [1, 2, 3, 4]) == 12 and idx.cached_tokens("zz", [1]) == 0
    idx.apply("a", [BlockRemoved((2,))])                      # a hole: vLLM's lookup stops at the first miss
    assert idx.prefix_blocks([1, 2, 3]) == {"a": 1, "b": 2}
    view = idx.view([1, 2, 3])
    assert dict(view) == {"a": 4, "b": 8}
    idx.apply("b", [AllBlocksCleared()])
    assert dict(view) == {"a": 4}                              # the view reads the live index
    assert view.get("b", 0) == 0 and len(idx) == 2             # hashes 1 and 3 are still held by a
    idx.clear_worker("a")
    assert len(idx) == 0 and idx.prefix_blocks([1]) == {}


def test_index_is_bounded_lru() -> None:
    idx = KvIndex(block_size=4, max_blocks=3)
    idx.apply("a", [_stored([1, 2, 3])])
    idx.apply("c", [_stored([1])])                             # storing 1 again refreshes it
    idx.apply("b", [_stored([7])])
    assert len(idx) == 3 and idx.stats.evicted == 1
    assert idx.prefix_blocks([1, 2]) == {"a": 1, "c": 1}       # 2 was the least recently stored
    assert idx.prefix_blocks([3]) == {"a": 1} and idx.cached_tokens("a", [1, 2]) == 4


def test_index_keyed_on_token_ids_matches_request_hashes() -> None:
    """Engine hashes the gateway cannot reproduce (another seed): keys are recomputed from the tokens."""
    ours = BlockHasher(4, "sha256_cbor", "gateway-seed")
    engine = BlockHasher(4, "sha256", "engine-random")
    prompt = list(range(1, 13))
    eh = engine.hashes(prompt)
    idx = KvIndex(4, key_on="token_ids", hasher=ours)
    idx.apply("w", [BlockStored(tuple(eh[:2]), None, tuple(prompt[:8]), 4)])
    idx.apply("w", [BlockStored((eh[2],), eh[1], tuple(prompt[8:12]), 4)])        # chained from its parent
    assert idx.prefix_blocks(ours.hashes(prompt)) == {"w": 3}
    idx.apply("w", [BlockRemoved((eh[1],))])
    assert idx.prefix_blocks(ours.hashes(prompt)) == {"w": 1}
    idx.apply("v", [BlockStored((123,), 999, (1, 2, 3, 4), 4)])                      # unknown parent: skipped
    assert idx.stats.unresolved == 1 and idx.blocks_of("v") == 0
    # a salted first block (0.32 events carry per-block extra keys)
    salted = BlockHasher(4, "sha256_cbor", "gateway-seed", "0.32")
    idx2 = KvIndex(4, key_on="token_ids", hasher=salted)
    idx2.apply("w", [BlockStored((5,), None, (1, 2, 3, 4), 4, extra_keys=(("s",),))])
    assert idx2.prefix_blocks(salted.hashes([1, 2, 3, 4], "s")) == {"w": 1}
    assert idx2.prefix_blocks(salted.hashes([1, 2, 3, 4])) == {}


def test_index_skips_what_it_cannot_use() -> None:
    idx = KvIndex(block_size=4)
    idx.apply("a", [BlockStored((1,), None, (), 4, lora_id=3), BlockStored((2,), None, (), 4, medium="CPU"),
                    BlockStored((3,), None, (), 16)])
    assert len(idx) == 0 and idx.stats.skipped == 3
    with pytest.raises(ValueError):
        KvIndex(4, key_on="bogus")
