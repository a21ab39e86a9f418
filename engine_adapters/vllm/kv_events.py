"""vLLM's KV-cache event wire format and its `--kv-events-config` (docs/reference/vllm-interface.md §5.1).

A ZMQ PUB message is three frames: `[topic, seq (uint64 big-endian, per publisher), msgpack(batch)]`. The batch
is an array `[ts, [event, ...], data_parallel_rank]`. Events changed shape between versions:

- "0.11": positional arrays, tag first: `["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium]`,
  `["BlockRemoved", hashes, medium]`, `["AllBlocksCleared"]`;
- "0.33" (already so in 0.32): maps tagged by "type", fields at their default left out:
  `{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": null, "token_ids": [...],
  "block_size": 16, "lora_id": null, "medium": "GPU", "lora_name": null, "group_idx": 0, ...}`.

`decode_batch` reads both (and ignores fields it does not know, as msgspec does). The replay socket is a ROUTER:
a client sends `[b"", start_seq (8 bytes BE)]` and gets `[b"", topic, seq, payload]` per buffered batch with
seq >= start, then `[b"", b"", END_SEQ, b""]`. Source: vllm/distributed/kv_events.py and
vllm/config/kv_events.py, 0.11 and 0.32.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import msgspec

from policies.kv_index import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KvEvent

WIRE_FORMATS = ("0.11", "0.33")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder()


class KvEventsError(ValueError):
    """A malformed message or configuration; the message says which part."""


@dataclass(slots=True)
class KvEventsConfig:
    """vLLM's `KVEventsConfig` (the JSON of `--kv-events-config`), with its defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None           # 0.11 default "null"; 0.33: None = "zmq" when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def active(self) -> bool:
        """Events are published: enabled and the publisher resolves to zmq."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_kv_events_config(raw: str | dict[str, Any] | None) -> KvEventsConfig:
    """`--kv-events-config` as vLLM takes it: a JSON object (unknown keys are an error, as in vLLM)."""
    if raw is None:
        return KvEventsConfig()
    if isinstance(raw, str):
        try:
            raw = msgspec.json.decode(raw.encode())
        except msgspec.DecodeError as exc:
            raise KvEventsError(f"--kv-events-config is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise KvEventsError("--kv-events-config must be a JSON object")
    known = set(KvEventsConfig.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise KvEventsError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    cfg = KvEventsConfig(**raw)
    if cfg.publisher not in (None, "null", "zmq"):
        raise KvEventsError(f"--kv-events-config: publisher must be 'zmq' or 'null', got {cfg.publisher!r}")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise KvEventsError(f"--kv-events-config: {name} must be a non-negative integer, got {v!r}")
    if not isinstance(cfg.endpoint, str) or not cfg.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise KvEventsError(f"--kv-events-config: endpoint must be a tcp://, ipc:// or inproc:// address, "
                            f"got {cfg.endpoint!r}")
    return cfg


def offset_endpoint(endpoint: str | None, offset: int) -> str | None:
    """The endpoint of publisher number `offset` (vLLM offsets the port by the DP rank; port 0 stays 0)."""
    if not endpoint or offset == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{offset}"
    if endpoint.startswith("tcp://") and ":" in endpoint[6:]:
        base, _, port = endpoint.rpartition(":")
        if int(port) == 0:
            return endpoint
        return f"{base}:{int(port) + offset}"
    return endpoint


def binds(endpoint: str) -> bool:
    """vLLM's PUB socket binds wildcard and ipc/inproc endpoints and connects to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def connect_address(endpoint: str, host: str) -> str:
    """Where a subscriber connects for a publisher bound to `endpoint` on machine `host`."""
    if endpoint.startswith("tcp://"):
        addr, _, port = endpoint[6:].rpartition(":")
        if addr in ("*", "0.0.0.0", "::", "[::]", ""):
            addr = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"tcp://{addr}:{port}"
    return endpoint


# ---- encoding ---------------------------------------------------------------------------------------
def _event_011(ev: KvEvent) -> list[Any]:
    if isinstance(ev, BlockStored):
        return ["BlockStored", list(ev.block_hashes), ev.parent_block_hash, list(ev.token_ids), ev.block_size,
                ev.lora_id, ev.medium]
    if isinstance(ev, BlockRemoved):
        return ["BlockRemoved", list(ev.block_hashes), ev.medium]
    return ["AllBlocksCleared"]


def _event_033(ev: KvEvent) -> dict[str, Any]:
    if isinstance(ev, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored", "block_hashes": list(ev.block_hashes), "parent_block_hash": ev.parent_block_hash,
            "token_ids": list(ev.token_ids), "block_size": ev.block_size, "lora_id": ev.lora_id,
            "medium": ev.medium, "lora_name": None,
        }
        if ev.extra_keys is not None:
            out["extra_keys"] = [list(k) if k is not None else None for k in ev.extra_keys]
        out["group_idx"] = 0
        return out
    if isinstance(ev, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(ev.block_hashes), "medium": ev.medium, "group_idx": 0}
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: EventBatch, wire_format: str = "0.11") -> bytes:
    if wire_format == "0.11":
        events = [_event_011(e) for e in batch.events]
    elif wire_format == "0.33":
        events = [_event_033(e) for e in batch.events]
    else:
        raise KvEventsError(f"wire format must be one of {WIRE_FORMATS}, got {wire_format!r}")
    return _ENCODER.encode([batch.ts, events, batch.data_parallel_rank])


# ---- decoding ---------------------------------------------------------------------------------------
def decode_batch(payload: bytes) -> EventBatch:
    """A published payload (either wire format) as an EventBatch; KvEventsError if it is not one."""
    try:
        raw = _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise KvEventsError(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise KvEventsError("an event batch is an array [ts, events, data_parallel_rank]")
    ts = raw[0]
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise KvEventsError("the batch timestamp is not a number")
    rank = raw[2] if len(raw) > 2 else None
    return EventBatch(float(ts), [_decode_event(e) for e in raw[1]], rank)


def _hashes(v: Any) -> tuple[int | bytes, ...]:
    if not isinstance(v, list) or not all(isinstance(h, int | bytes) and not isinstance(h, bool) for h in v):
        raise KvEventsError("block_hashes must be an array of integers or byte strings")
    return tuple(v)


def _decode_event(e: Any) -> KvEvent:
    if isinstance(e, list) and e:
        tag, fields = e[0], e[1:]
        if tag == "BlockStored" and len(fields) >= 5:
            hashes, parent, tokens, block_size, lora_id = fields[:5]
            medium = fields[5] if len(fields) > 5 else None
            return _stored(hashes, parent, tokens, block_size, lora_id, medium, None)
        if tag == "BlockRemoved" and len(fields) >= 1:
            return BlockRemoved(_hashes(fields[0]), fields[1] if len(fields) > 1 else None)
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        raise KvEventsError(f"unknown or short event {str(e)[:80]}")
    if isinstance(e, dict):
        tag = e.get("type")
        if tag == "BlockStored":
            try:
                return _stored(e["block_hashes"], e["parent_block_hash"], e["token_ids"], e["block_size"],
                               e.get("lora_id"), e.get("medium"), e.get("extra_keys"))
            except KeyError as exc:
                raise KvEventsError(f"BlockStored without {exc}") from None
        if tag == "BlockRemoved":
            if "block_hashes" not in e:
                raise KvEventsError("BlockRemoved without block_hashes")
            return BlockRemoved(_hashes(e["block_hashes"]), e.get("medium"))
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        raise KvEventsError(f"unknown event type {tag!r}")
    raise KvEventsError(f"an event is an array or a map, got {type(e).__name__}")


def _stored(hashes: Any, parent: Any, tokens: Any, block_size: Any, lora_id: Any, medium: Any,
            extra: Any) -> BlockStored:
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise KvEventsError("token_ids must be an array of integers")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise KvEventsError("block_size must be a positive integer")
    if parent is not None and not isinstance(parent, int | bytes):
        raise KvEventsError("parent_block_hash must be an integer, bytes or null")
    extra_keys = tuple(tuple(k) if isinstance(k, list) else None for k in extra) if isinstance(extra, list) else None
    return BlockStored(_hashes(hashes), parent, tuple(tokens), block_size, lora_id, medium, extra_keys)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def seq_of(frame: bytes) -> int:
    """A sequence frame; the replay end marker reads as -1."""
    if len(frame) != 8:
        raise KvEventsError(f"a sequence frame has 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=frame == END_SEQ)
