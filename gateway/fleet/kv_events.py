"""The gateway's exact prefix-cache view: one ZMQ subscriber per worker feeding a KvIndex (policies/kv_index.py).

Every `reconnect_s` the service matches its subscribers to the registry's workers: a worker with a
`kv_events:` entry in the config, or (with `discover`) one whose GET /kv_event_sources lists a publisher
(vLLM >= 0.33; rank 0 is used), gets a subscriber; a worker that left loses it and its index entries.

A subscriber reads `[topic, seq, payload]` messages (engine_adapters/vllm/kv_events.py) and keeps the worker's
sequence:
- first message with seq > 0, or a gap (seq > last + 1): ask the publisher's replay socket for the missing
  batches (from 0, or from last + 1) and apply them in order; if they are gone from its buffer (or there is no
  replay socket) the worker's entries are cleared and the gap counted "lost" (the view then errs towards
  "not cached", never towards a block the engine no longer holds);
- seq <= last, or a replayed batch older than the last one applied: the publisher restarted (a restarted
  vLLM starts at 0 with an empty cache): clear the worker's entries, then catch up from 0;
- AllBlocksCleared (/reset_prefix_cache, /sleep) clears the worker's entries inside the index.
Events are applied on the gateway's event loop, so the index needs no lock; a request's view is read on the
same loop (`request_view`). Metrics: fleetgate_kv_events_* (batches, lag, gaps, resyncs, index size).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge

from engine_adapters.vllm.kv_events import (
    END_SEQ,
    KvEventsError,
    connect_address,
    decode_batch,
    seq_bytes,
    seq_of,
)
from gateway.config import GatewayConfig, KvEventsSource
from gateway.state.outage import stop_task
from gateway.wire.prompt_tokens import PromptTokenizer, make_tokenizer
from gateway.wire.upstream import UpstreamPool
from policies.kv_hash import BlockHasher
from policies.kv_index import EventBatch, KvIndex
from policies.types import NO_CACHED_PREFIX

log = logging.getLogger("fleetgate.kv_events")


@dataclass(frozen=True, slots=True)
class Source:
    endpoint: str
    replay_endpoint: str | None
    topic: str


class KvEventsMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.batches = Counter("fleetgate_kv_events_batches_total", "KV-event batches applied to the index, per worker",
                               ["worker"], registry=registry)
        self.events = Counter("fleetgate_kv_events_total", "KV-cache events applied, per worker and type",
                              ["worker", "type"], registry=registry)
        self.lag = Gauge("fleetgate_kv_events_lag_seconds",
                         "Seconds between a worker publishing its last batch and the gateway applying it",
                         ["worker"], registry=registry)
        self.gaps = Counter("fleetgate_kv_events_gaps_total",
                            "Sequence gaps seen, by outcome (replayed: filled from the replay socket; lost)",
                            ["worker", "outcome"], registry=registry)
        self.resyncs = Counter("fleetgate_kv_events_resyncs_total",
                               "Times a worker's entries were dropped (restart, lost gap, worker gone)",
                               ["worker", "reason"], registry=registry)
        self.malformed = Counter("fleetgate_kv_events_malformed_total", "Messages that could not be decoded",
                                 ["worker"], registry=registry)
        self.blocks = Gauge("fleetgate_kv_events_index_blocks", "Distinct block hashes in the prefix-cache index",
                            registry=registry)
        self.subscribers = Gauge("fleetgate_kv_events_subscribers", "Workers whose KV events are subscribed to",
                                 registry=registry)


class KvEventsService:
    def __init__(self, config: GatewayConfig, registry: Any, metrics_registry: CollectorRegistry) -> None:
        kc = config.kv_events
        self.config = config
        self.kc = kc
        self.registry = registry
        self.hasher = BlockHasher(kc.block_size, kc.hash_algo, kc.hash_seed, kc.hash_style)
        self.index = KvIndex(kc.block_size, kc.max_blocks, kc.key_on, self.hasher)
        self.tokenizer: PromptTokenizer | None = make_tokenizer(kc.tokenizer) if kc.enabled else None
        self.metrics = KvEventsMetrics(metrics_registry)
        self.subscribers: dict[str, Subscriber] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._task: asyncio.Task | None = None
        self._upstream: UpstreamPool | None = None

    @property
    def enabled(self) -> bool:
        return self.kc.enabled

    # ---- lifecycle ------------------------------------------------------------------------------------
    async def start(self, upstream: UpstreamPool | None) -> None:
        if not self.kc.enabled or self._task is not None:
            return
        self._upstream = upstream
        self._ctx = zmq.asyncio.Context()
        await self.reconcile()
        self._task = asyncio.create_task(self._loop(), name="fg-kv-events")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await _cancel(task)
        for sub in list(self.subscribers.values()):
            await sub.stop()
        self.subscribers.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.kc.reconnect_s)
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:  # a control loop must survive anything
                log.exception("KV events: reconcile failed")

    async def reconcile(self) -> None:
        """Subscribe to workers that appeared, drop the ones that left (and their index entries)."""
        workers = dict(self.registry.workers)
        for wid in [w for w in self.subscribers if w not in workers]:
            await self.subscribers.pop(wid).stop()
            self.index.clear_worker(wid)
            self.metrics.resyncs.labels(wid, "worker_gone").inc()
        configured = {w.id: w.kv_events for w in self.config.workers if w.kv_events is not None}
        for wid, ws in workers.items():
            sub = self.subscribers.get(wid)
            if sub is not None and not sub.done():
                continue
            src = await self._source(wid, ws.rec.url, configured.get(wid))
            if src is None:
                continue
            if sub is not None:   # its task ended (it should not): start over from a clean slate
                self.index.clear_worker(wid)
            assert self._ctx is not None
            self.subscribers[wid] = Subscriber(wid, src, self._ctx, self.index, self.metrics, self.kc.replay_timeout_s)
            self.subscribers[wid].start()
        self.metrics.subscribers.set(len(self.subscribers))

    async def _source(self, wid: str, url: str, configured: KvEventsSource | None) -> Source | None:
        host = urlsplit(url).hostname or "127.0.0.1"
        if configured is not None:
            return Source(connect_address(configured.endpoint, host),
                          connect_address(configured.replay_endpoint, host) if configured.replay_endpoint else None,
                          configured.topic)
        if not self.kc.discover or self._upstream is None:
            return None
        try:  # the one client to workers (gateway/wire/upstream.py)
            r = await self._upstream.fetch(url + "/kv_event_sources", self.config.health.timeout_s)
            if r.status != 200:
                return None
            data = orjson.loads(r.body)
        except (OSError, TimeoutError, ValueError):
            return None
        return source_from_listing(data, host)

    # ---- the hot path ---------------------------------------------------------------------------------
    def request_view(self, body: Mapping[str, Any], chat: bool) -> Mapping[str, int] | None:
        """RequestFeatures.cached_prefix_tokens for a request body, or None when it cannot be hashed."""
        tok = self.tokenizer
        if tok is None:
            return None
        try:
            if chat:
                ids = tok.chat(body.get("messages") or [], bool(body.get("add_generation_prompt", True)))
            else:
                ids = tok.completion(body.get("prompt"))
        except (TypeError, AttributeError, ValueError):   # a body the tokenizer cannot read: no view
            return None
        if not ids:
            return None
        salt = body.get("cache_salt")
        hashes = self.hasher.hashes(ids, salt if isinstance(salt, str) else None)
        return self.index.view(hashes, (len(ids) - 1) // self.kc.block_size)

    def cached_tokens(self, worker_id: str, block_hashes: tuple[int, ...]) -> int:
        return self.index.cached_tokens(worker_id, block_hashes)


def cached_prefix_for(service: KvEventsService | None, policy: Any, body: Mapping[str, Any],
                      chat: bool) -> Mapping[str, int]:
    """RequestFeatures.cached_prefix_tokens: the live view for policies that declare `needs_kv_blocks`."""
    if service is None or not service.enabled or not getattr(policy, "needs_kv_blocks", False):
        return NO_CACHED_PREFIX
    view = service.request_view(body, chat)
    return NO_CACHED_PREFIX if view is None else view


async def _cancel(task: asyncio.Task | None) -> None:
    await stop_task(task)


def source_from_listing(data: Any, host: str) -> Source | None:
    """Rank 0 of a GET /kv_event_sources answer ({rank: KVEventsConfig}), if it publishes over ZMQ."""
    if not isinstance(data, dict) or not data:
        return None
    cfg = data.get("0", data.get(0)) if ("0" in data or 0 in data) else next(iter(data.values()))
    if not isinstance(cfg, dict) or not cfg.get("enable_kv_cache_events") or cfg.get("publisher") not in (None, "zmq"):
        return None
    endpoint = cfg.get("endpoint")
    if not isinstance(endpoint, str):
        return None
    replay = cfg.get("replay_endpoint")
    return Source(connect_address(endpoint, host), connect_address(replay, host) if isinstance(replay, str) else None,
                  str(cfg.get("topic") or ""))


class Subscriber:
    """One worker's publisher: SUB socket, sequence tracking, replay on gaps (see the module doc)."""

    def __init__(self, worker_id: str, source: Source, ctx: zmq.asyncio.Context, index: KvIndex,
                 metrics: KvEventsMetrics, replay_timeout_s: float) -> None:
        self.worker_id = worker_id
        self.source = source
        self.ctx = ctx
        self.index = index
        self.metrics = metrics
        self.replay_timeout_s = replay_timeout_s
        self.last_seq: int | None = None
        self.last_ts = 0.0
        self.applied = 0
        self._task: asyncio.Task | None = None
        m = metrics
        self._m_batches = m.batches.labels(worker_id)
        self._m_lag = m.lag.labels(worker_id)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"fg-kv-sub-{self.worker_id}")

    def done(self) -> bool:
        return self._task is None or self._task.done()

    async def stop(self) -> None:
        task, self._task = self._task, None
        await _cancel(task)

    async def _run(self) -> None:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        sock.connect(self.source.endpoint)
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    await self._message(frames)
                except KvEventsError as exc:
                    self.metrics.malformed.labels(self.worker_id).inc()
                    log.warning("KV events from %s: %s", self.worker_id, exc)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("KV events subscriber for %s failed", self.worker_id)
        finally:
            sock.close(linger=0)

    async def _message(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            raise KvEventsError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
        _, seq_frame, payload = frames
        seq = seq_of(seq_frame)
        batch = decode_batch(payload)
        last = self.last_seq
        if last is not None and seq <= last:
            self._resync("restart")
            last = None
        elif last is not None and batch.ts < self.last_ts - 1e-3:
            self._resync("restart")   # a new publisher whose numbering passed ours already
            last = None
        if last is None and seq > 0:
            await self._catch_up(0, seq, first=True)
        elif last is not None and seq > last + 1:
            await self._catch_up(last + 1, seq, first=False)
        self._apply(seq, batch)

    def _resync(self, reason: str) -> None:
        self.index.clear_worker(self.worker_id)
        self.metrics.resyncs.labels(self.worker_id, reason).inc()
        self.last_seq = None
        self.last_ts = 0.0

    def _apply(self, seq: int, batch: EventBatch) -> None:
        self.index.apply(self.worker_id, batch.events)
        self.last_seq = seq
        self.last_ts = max(self.last_ts, batch.ts)
        self.applied += 1
        self._m_batches.inc()
        self._m_lag.set(max(0.0, time.time() - batch.ts))
        m = self.metrics
        for ev in batch.events:
            m.events.labels(self.worker_id, type(ev).__name__).inc()
        m.blocks.set(len(self.index))

    async def _catch_up(self, start: int, until: int, first: bool) -> None:
        """Apply batches start..until-1 from the replay socket; on failure clear the worker's entries."""
        got = await self._replay(start)
        wanted = list(range(start, until))
        by_seq = {s: b for s, b in got if start <= s < until}
        complete = all(s in by_seq for s in wanted)
        if not first and complete and wanted and by_seq[wanted[0]].ts < self.last_ts - 1e-3:
            # What the replay socket holds at our next number is older than what we applied: a restart.
            self._resync("restart")
            await self._catch_up(0, until, first=True)
            return
        if not complete:
            self.metrics.gaps.labels(self.worker_id, "lost").inc()
            self._resync("gap_lost")
            # Keep what we can: the tail of the range that the buffer still has, contiguous up to `until`.
            tail: list[int] = []
            for s in reversed(wanted):
                if s not in by_seq:
                    break
                tail.append(s)
            for s in reversed(tail):
                self._apply(s, by_seq[s])
            return
        if not first:
            self.metrics.gaps.labels(self.worker_id, "replayed").inc()
        for s in wanted:
            self._apply(s, by_seq[s])

    async def _replay(self, start: int) -> list[tuple[int, EventBatch]]:
        if self.source.replay_endpoint is None:
            return []
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, EventBatch]] = []
        try:
            sock.connect(self.source.replay_endpoint)
            await sock.send_multipart([b"", seq_bytes(start)])
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(left * 1000):
                    log.warning("KV events replay from %s timed out", self.worker_id)
                    return out
                frames = await sock.recv_multipart()
                if len(frames) != 4:
                    continue
                _, _, seq_frame, payload = frames
                if seq_frame == END_SEQ:
                    return out
                try:
                    out.append((seq_of(seq_frame), decode_batch(payload)))
                except KvEventsError:
                    self.metrics.malformed.labels(self.worker_id).inc()
        finally:
            sock.close(linger=0)
