"""A simulated engine's KV-cache event publisher: vLLM's ZMQ PUB socket, sequence numbers and replay ROUTER.

Behaves as vLLM's `ZmqEventPublisher` (docs/reference/vllm-interface.md §5.1; engine_adapters/vllm/kv_events.py
has the wire format): the engine loop hands each step's events to `publish` (a queue, never blocking the loop);
a thread numbers the batches 0, 1, 2... per publisher, sends `[topic, seq, payload]` on the PUB socket (binding
`tcp://*:port`-style endpoints, connecting to the others), keeps the last `buffer_steps` payloads, and answers
replay requests on the ROUTER socket: every buffered batch with seq >= start, then the end marker. A restarted
engine starts again at seq 0 (subscribers detect the restart that way).

    pub = KvEventPublisher(parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "zmq",
                                                   "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'))
    pub.publish(core.take_kv_events())
    pub.close()
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import zmq

from engine_adapters.vllm.kv_events import (
    END_SEQ,
    KvEventsConfig,
    KvEventsError,
    binds,
    encode_batch,
    offset_endpoint,
    seq_bytes,
)
from policies.kv_index import BlockRemoved, EventBatch, KvEvent

log = logging.getLogger("simulator.kv_events")
_POLL_S = 0.02


class KvEventPublisher:
    def __init__(self, config: KvEventsConfig, wire_format: str = "0.11", offset: int = 0,
                 data_parallel_rank: int = 0) -> None:
        if not config.active:
            raise KvEventsError("KV events are not enabled in this config (enable_kv_cache_events, publisher zmq)")
        self.config = config
        self.wire_format = wire_format
        self.rank = data_parallel_rank
        self.endpoint = offset_endpoint(config.endpoint, offset)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, offset)
        self.topic = config.topic.encode()
        self._queue: queue.Queue[list[KvEvent] | None] = queue.Queue(maxsize=max(1, config.max_queue_size))
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, config.buffer_steps))
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            if binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise KvEventsError(f"KV events: cannot open {self.endpoint} / {self.replay_endpoint}: {exc}") from None
        self.published = 0
        self.dropped = 0
        self._running = True
        self._thread = threading.Thread(target=self._loop, name=f"kv-events-{self.endpoint}", daemon=True)
        self._thread.start()

    def source(self) -> dict[str, Any]:
        """This publisher's resolved config, as vLLM 0.33's GET /kv_event_sources lists it per DP rank."""
        cfg = self.config.to_dict()
        cfg.update(enable_kv_cache_events=True, publisher="zmq", endpoint=self.endpoint,
                   replay_endpoint=self.replay_endpoint)
        return cfg

    def publish(self, events: list[KvEvent], ts: float | None = None) -> None:
        """Queue one step's events (no-op when empty); a full queue drops the batch, as a full ZMQ HWM would."""
        if not events or not self._running:
            return
        try:
            self._queue.put_nowait((ts if ts is not None else time.time(), events))  # type: ignore[arg-type]
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 1.0) -> None:
        if not self._running:
            return
        self._running = False
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    # ---- the publisher thread (owns both sockets from here on) ----------------------------------------
    def _loop(self) -> None:
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError as exc:  # a replay client vanished mid-answer: keep publishing
                    log.warning("KV events replay failed: %s", exc)
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item  # type: ignore[misc]
            events = one_hash_per_removal(events)
            payload = encode_batch(EventBatch(ts, events, self.rank), self.wire_format)
            # A connecting PUB with no peer yet (or at its HWM) loses the batch; it stays replayable.
            with contextlib.suppress(zmq.Again):
                self._pub.send_multipart((self.topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)
            self._buffer.append((seq, payload))
            seq += 1
            self.published = seq

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()  # type: ignore[union-attr]
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("invalid KV events replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self.topic, seq_bytes(seq), payload))  # type: ignore[union-attr]
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))  # type: ignore[union-attr]


def one_hash_per_removal(events: list[KvEvent]) -> list[KvEvent]:
    """vLLM emits one BlockRemoved per evicted hash; the engine records an eviction run as one event."""
    if not any(isinstance(e, BlockRemoved) and len(e.block_hashes) > 1 for e in events):
        return events
    out: list[KvEvent] = []
    for e in events:
        if isinstance(e, BlockRemoved) and len(e.block_hashes) > 1:
            out.extend(BlockRemoved((h,), e.medium) for h in e.block_hashes)
        else:
            out.append(e)
    return out
