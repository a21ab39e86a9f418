"""`RedisStore`: the state store in Redis, shared by many gateway replicas. The key layout, the admission
scripts, leases and failing open are described in gateway/state/redis_scripts.py, beside the scripts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import socket
import time
from urllib.parse import urlsplit, urlunsplit

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from gateway.state.base import EngineMetrics, Inflight, StateStore, WorkerRecord
from gateway.state.jobs_redis import RedisJobs
from gateway.state.ratelimit import LocalBuckets, Ticket, refused
from gateway.state.redis_records import RedisRecords
from gateway.state.redis_scripts import (
    _DOWN_ERRORS,
    _GET_DOCS,
    _HEARTBEAT,
    _KEYED_RESERVE,
    _LEASE,
    _REFRESH,
    _RELEASE,
    _RESERVE,
    _RETURN,
)
from gateway.state.responses import RedisResponses

log = logging.getLogger("fleetgate.state.redis")


REMIND_S = 30.0  # while Redis stays away, a reminder this often (one line)


class RedisUnavailableError(RuntimeError):
    """Redis could not be reached when the store started."""


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


class RedisStore(RedisJobs, RedisResponses, RedisRecords, StateStore):
    def __init__(
        self,
        url: str,
        replica_id: str | None = None,
        key_prefix: str = "fg:",
        lease_ttl_s: float = 10.0,
        refresh_interval_s: float = 0.1,
        socket_timeout_s: float = 1.0,
        max_connections: int = 64,
        lease_block: int = 1,
        lease_idle_s: float = 1.0,
    ) -> None:
        if lease_ttl_s <= 0 or refresh_interval_s <= 0:
            raise ValueError("lease_ttl_s and refresh_interval_s must be positive")
        if lease_block < 1 or lease_idle_s <= 0:
            raise ValueError("lease_block must be at least 1 and lease_idle_s positive")
        self.url = url
        self.replica_id = replica_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        if "|" in self.replica_id:
            raise ValueError("replica_id must not contain '|'")
        self.prefix = key_prefix
        self.lease_ttl_s = lease_ttl_s
        self.refresh_interval_s = refresh_interval_s
        self._ttl_ms = max(1, int(lease_ttl_s * 1000))
        self._socket_timeout_s = socket_timeout_s
        self._max_connections = max_connections
        self._redis: aioredis.Redis | None = None
        self._tasks: list[asyncio.Task] = []
        self._ok = False
        # This replica's reservations: (worker, request_id) -> tokens, and per-worker totals.
        self._own: dict[tuple[str, str], int] = {}
        self._own_by_worker: dict[str, Inflight] = {}
        # Last refresh: other replicas' load per worker. The served view is others + own.
        self._others: dict[str, Inflight] = {}
        self._view: dict[str, Inflight] = {}
        # Leases: the leased slot each lease-held reservation uses, free leased slots per worker (members), when a
        # worker's free slots were last added to or taken from, the next slot number; other replicas waiting.
        self.lease_block = lease_block
        self.lease_idle_s = lease_idle_s
        self._slot_of: dict[tuple[str, str], str] = {}
        self._free: dict[str, list[str]] = {}
        self._free_touched: dict[str, float] = {}
        self._lease_seq = 0
        self._others_waiting = False
        # Releases to replay: ones that raced an in-flight heartbeat, and ones made while Redis was down.
        self._hb_running = False
        self._released_during_hb: list[tuple[list[str], list[str | int]]] = []   # _RELEASE's keys and args
        self._returned_during_hb: list[tuple[str, str]] = []      # leased slots: (worker, member)
        self._pending_release: list[tuple[str, str]] = []         # (worker, member)
        # Last known registry and metrics, served while Redis is down; registry writes made meanwhile.
        self._workers_cache: dict[str, WorkerRecord] = {}
        self._metrics_cache: dict[str, EngineMetrics] = {}
        self._pending_registry: dict[str, WorkerRecord | None] = {}
        # Last known shared documents (key -> JSON), served while Redis is down; writers re-put them.
        self._docs_cache: dict[str, str | bytes] = {}
        # Per-key limits: open tickets by request id, settlements not sent yet, this replica's own buckets
        # (used while Redis is away).
        self._tickets: dict[str, Ticket] = {}
        self._settle_q: list[tuple[str, int, int]] = []
        self._local_buckets = LocalBuckets()
        # The store's epoch as last seen (None: not read yet); a different or missing one: Redis lost its data.
        self._epoch: str | None = None
        self._restoring: asyncio.Task | None = None
        self._waiting = False     # requests wait in this replica's admission queues (we are in `waiters`)
        self._down_since = 0.0
        self._reminded = 0.0
        self._bin: aioredis.Redis | None = None  # undecoded replies (file contents)

    # --- keys -----------------------------------------------------------------------------------
    def _k(self, name: str) -> str:
        return self.prefix + name

    def _member(self, request_id: str) -> str:
        return f"{self.replica_id}|{request_id}"

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._redis is not None:
            return
        pool = aioredis.BlockingConnectionPool.from_url(
            self.url,
            decode_responses=True,
            max_connections=self._max_connections,
            timeout=self._socket_timeout_s,
            socket_timeout=self._socket_timeout_s,
            socket_connect_timeout=self._socket_timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        client = aioredis.Redis(connection_pool=pool)
        try:
            await asyncio.wait_for(client.ping(), timeout=self._socket_timeout_s * 3)
        except _DOWN_ERRORS as exc:
            await client.aclose()
            raise RedisUnavailableError(
                f"cannot reach Redis at {_redact(self.url)} ({exc.__class__.__name__}: {exc}). Start one with "
                "`redis-server --daemonize yes --port 6379` or `docker run -p 6379:6379 redis:7`, "
                "or run without --redis-url to keep state in this process."
            ) from exc
        self._redis = client
        self._bin = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
            self.url, max_connections=8, timeout=self._socket_timeout_s, socket_timeout=self._socket_timeout_s,
            socket_connect_timeout=self._socket_timeout_s, retry=Retry(NoBackoff(), 1)))
        self._reserve_script = client.register_script(_RESERVE)
        self._keyed_reserve_script = client.register_script(_KEYED_RESERVE)
        self._release_script = client.register_script(_RELEASE)
        self._lease_script = client.register_script(_LEASE)
        self._return_script = client.register_script(_RETURN)
        self._heartbeat_script = client.register_script(_HEARTBEAT)
        self._refresh_script = client.register_script(_REFRESH)
        self._get_docs_script = client.register_script(_GET_DOCS)
        self._ok = True
        await client.set(self._k("alive"), secrets.token_hex(8), nx=True)
        self._epoch = await client.get(self._k("alive"))
        await self._heartbeat()
        await self._refresh()
        self._tasks = [
            asyncio.create_task(self._heartbeat_loop(), name=f"fg-redis-heartbeat-{self.replica_id}"),
            asyncio.create_task(self._refresh_loop(), name=f"fg-redis-refresh-{self.replica_id}"),
            asyncio.create_task(self._release_listener(), name=f"fg-redis-released-{self.replica_id}"),
        ]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            # redis-py can lose a cancellation that lands during a command's read (the command returns
            # normally and the loop sleeps on): cancel again until the loop has really stopped.
            while not t.done():
                await asyncio.wait({t}, timeout=0.05)
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        if self._restoring is not None:
            self._restoring.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._restoring
            self._restoring = None
        r = self._redis
        if r is None:
            return
        self._redis = None
        if self._bin is not None:
            await self._bin.aclose()
            self._bin = None
        if self._ok:
            try:
                pipe = r.pipeline(transaction=False)
                for wid, member in self._held():
                    pipe.zrem(self._k(f"res:{wid}"), member)
                pipe.delete(self._k(f"load:{self.replica_id}"))
                pipe.zrem(self._k("replicas"), self.replica_id)
                await pipe.execute()
            except _DOWN_ERRORS as exc:
                log.warning("could not remove this replica's reservations from Redis on close: %s", exc)
        self._own.clear()
        self._own_by_worker.clear()
        self._slot_of.clear()
        self._free.clear()
        self._ok = False
        await r.aclose()

    def reachable(self) -> bool:
        return self._ok

    def _client(self) -> aioredis.Redis:
        if self._redis is None:
            raise RuntimeError("RedisStore is not started: call `await store.start()` first")
        return self._redis

    def _binary(self) -> aioredis.Redis:
        if self._bin is None:
            raise RuntimeError("RedisStore is not started: call `await store.start()` first")
        return self._bin

    @property
    def available(self) -> bool:
        """Redis answered the last call (False from the first failure until a probe succeeds)."""
        return self._ok

    def _mark_down(self, exc: BaseException) -> None:
        if self._ok:
            self._ok = False
            self._down_since = self._reminded = time.monotonic()
            log.warning(
                "Redis at %s unreachable (%s: %s); falling back to local accounting until it answers again",
                _redact(self.url), type(exc).__name__, exc,
            )

    def _remind(self) -> None:
        now = time.monotonic()
        if now - self._reminded >= REMIND_S:
            self._reminded = now
            log.warning("Redis at %s still unreachable (%.0f s); serving from local state", _redact(self.url),
                        now - self._down_since)

    async def _mark_up(self) -> None:
        """Redis answers again: replay releases and registry writes, re-add reservations made meanwhile, and
        only then say so. A Redis just thawed may still be working through a backlog: if the replay times out,
        the outage goes on (no "reachable again" line followed at once by another "unreachable")."""
        await self._replay_pending()
        await self._heartbeat()  # re-adds reservations made while Redis was away, rewrites the load hash
        while self._pending_release or self._pending_registry:  # queued while the calls above waited
            await self._replay_pending()
        self._ok = True
        log.warning("Redis at %s reachable again after %.1f s; shared state resumed", _redact(self.url),
                    time.monotonic() - self._down_since)

    async def _replay_pending(self) -> None:
        releases, registry = self._pending_release, self._pending_registry
        self._pending_release, self._pending_registry = [], {}
        pipe = self._client().pipeline(transaction=False)
        for wid, member in releases:
            pipe.zrem(self._k(f"res:{wid}"), member)
        for wid, rec in registry.items():
            if rec is None:
                pipe.hdel(self._k("workers"), wid)
                pipe.hdel(self._k("metrics"), wid)
            else:
                pipe.hset(self._k("workers"), wid, orjson.dumps(dataclasses.asdict(rec)))
        try:
            await pipe.execute()
        except BaseException:
            # Still down: keep what was queued, writes queued during the attempt taking precedence.
            self._pending_release = releases + self._pending_release
            registry.update(self._pending_registry)
            self._pending_registry = registry
            raise

    # --- background loops -----------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        interval = self.lease_ttl_s / 3  # re-score leases three times per TTL
        while True:
            await asyncio.sleep(interval)
            if not self._ok:
                continue  # the refresh loop probes and restores
            try:
                await self._heartbeat()
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
            except Exception:
                log.exception("lease heartbeat failed")

    # --- other replicas' releases -------------------------------------------------------------------
    def set_waiting(self, waiting: int) -> None:
        """Join the `waiters` set while requests wait here, leave it when none do (one call per change)."""
        now_waiting = waiting > 0
        if now_waiting == self._waiting or self._redis is None:
            return
        self._waiting = now_waiting
        task = asyncio.get_running_loop().create_task(self._announce_waiting(now_waiting))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())   # a lost update costs a poll, no more

    async def _announce_waiting(self, waiting: bool) -> None:
        r = self._client()
        if not waiting:
            await r.srem(self._k("waiters"), self.replica_id)
            return
        await r.sadd(self._k("waiters"), self.replica_id)
        # A release between this replica's enqueue and the SADD was not announced: look once more now.
        await self._refresh()
        for fn in self.remote_release_hooks():
            fn(None)

    async def _release_listener(self) -> None:
        """Another replica freed a slot while requests wait here: refresh the view of every replica's load (the
        placement filters on it) and tell the hooks (the dispatcher kicks the queues of that worker's models)."""
        while True:
            pubsub = self._client().pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._k("released"))
                async for msg in pubsub.listen():
                    replica, _, worker = str(msg.get("data", "")).partition("|")
                    if replica == self.replica_id or not self._waiting:
                        continue
                    with contextlib.suppress(*_DOWN_ERRORS):
                        await self._refresh()
                    for fn in self.remote_release_hooks():
                        fn(worker or None)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - Redis down or a bad message: the queues still poll; try again
                await asyncio.sleep(max(self.refresh_interval_s, 0.5))
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _refresh_loop(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.refresh_interval_s if self._ok else max(self.refresh_interval_s, 0.5))
            try:
                if not self._ok:
                    self._remind()
                    await self._client().ping()
                    await self._mark_up()
                await self._refresh()
                if self._free:
                    await self._trim_leases()
                failing = False
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
            except Exception:
                if not failing:  # once per run of failures, not every 0.1 s
                    log.exception("in-flight refresh failed")
                failing = True

    # --- a Redis that lost its data ---------------------------------------------------------------
    def _check_epoch(self, seen: str | None) -> bool:
        """True when `seen` is this store's epoch; otherwise start the restore (once) and return False."""
        if seen is not None and seen == self._epoch:
            return True
        if self._restoring is None or self._restoring.done():
            self._restoring = asyncio.get_running_loop().create_task(self._restore(), name="fg-redis-restore")
        return False

    async def _restore(self) -> None:
        log.warning("Redis at %s answered without this fleet's state (restarted empty or flushed); writing back "
                    "the workers, keys and reservations this replica holds", _redact(self.url))
        for fn in self.restore_hooks():
            try:
                await fn()
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
                return  # the next answer from Redis starts over
            except Exception:
                log.exception("writing back %s after a Redis restart failed", getattr(fn, "__qualname__", fn))
        try:
            await self._heartbeat()
            r = self._client()
            if self._waiting:
                await r.sadd(self._k("waiters"), self.replica_id)
            await r.set(self._k("alive"), secrets.token_hex(8), nx=True)
            self._epoch = await r.get(self._k("alive"))
        except _DOWN_ERRORS as exc:
            self._mark_down(exc)
            return
        log.warning("Redis state restored from this replica (%d worker(s) known, %d reservation(s))",
                    len(self._workers_cache), len(self._own))

    # --- per-key limits ---------------------------------------------------------------------------
    def open_ticket(self, ticket: Ticket) -> None:
        self._tickets[ticket.request_id] = ticket

    def close_ticket(self, ticket: Ticket, used_tokens: int) -> None:
        if self._tickets.get(ticket.request_id) is ticket:
            del self._tickets[ticket.request_id]
        self._local_buckets.unhold(ticket)
        tpm = ticket.limits.tpm
        if ticket.charged and tpm is not None and ticket.cost != used_tokens:
            if len(self._settle_q) < 100_000:  # bounded while Redis is away
                self._settle_q.append((ticket.tenant_id, tpm, ticket.cost - used_tokens))
            self._local_buckets.settle(ticket.tenant_id, tpm, ticket.cost - used_tokens, time.monotonic() * 1000)

    def _take_settlements(self) -> tuple[list[tuple[str, int, int]], list[str | int]]:
        q, self._settle_q = self._settle_q, []
        args: list[str | int] = [len(q)]
        for tid, tpm, delta in q:
            args += (tid, tpm, delta)
        return q, args

    def _keyed_args(self, t: Ticket, worker_id: str, cap: int | None, tokens: int) -> tuple[list[str], list]:
        lim = t.limits
        keys = [self._k(f"res:{worker_id}"), self._k(f"load:{self.replica_id}"), self._k("resworkers"),
                self._k("replicas"), self._k(f"kb:{t.tenant_id}"), self._k(f"kc:{t.tenant_id}")]
        args = [self._member(t.request_id), -1 if cap is None else cap, self._ttl_ms, worker_id, tokens,
                self.replica_id, "0" if t.charged else "1", _or_none(lim.rpm), _or_none(lim.tpm),
                _or_none(lim.max_concurrency), t.cost, self.prefix]
        return keys, args

    async def _reserve_keyed(self, t: Ticket, worker_id: str, cap: int | None, tokens: int) -> bool:
        keys, args = self._keyed_args(t, worker_id, cap, tokens)
        q, settle = self._take_settlements()
        try:
            status, wait, rl, tl = await self._keyed_reserve_script(keys=keys, args=args + settle,
                                                                    client=self._client())
        except BaseException:
            self._settle_q[:0] = q  # not applied: send them with the next call
            raise
        status = int(status)
        if status == 0:
            return False
        if status < 0:
            reason = {-1: "requests", -2: "tokens", -3: "concurrency", -4: "too_large"}[status]
            raise refused(t, reason, float(wait), float(rl), float(tl))
        if not t.charged:
            t.charged = True
            t.note(float(rl), float(tl))
        return True

    def _hold(self, t: Ticket) -> None:
        t.holds += 1
        self._local_buckets.hold(t)

    async def _heartbeat(self) -> None:
        held = list(self._held())
        args: list[str | int] = [self.prefix, self.replica_id, self._ttl_ms, len(held)]
        for wid, member in held:
            args += (wid, member)
        limited = [t for t in self._tickets.values() if t.holds > 0 and t.limits.max_concurrency is not None]
        args.append(len(limited))
        for t in limited:
            args += (t.tenant_id, self._member(t.request_id))
        for wid, cur in self._own_by_worker.items():
            if cur.requests:
                args += (f"r:{wid}", cur.requests, f"t:{wid}", cur.tokens)
        keys = [self._k("replicas"), self._k(f"load:{self.replica_id}"), self._k("resworkers")]
        self._hb_running = True
        try:
            await self._heartbeat_script(keys=keys, args=args)
        finally:
            self._hb_running = False
            raced, self._released_during_hb = self._released_during_hb, []
            returned, self._returned_during_hb = self._returned_during_hb, []
        if returned:  # leased slots given back while the heartbeat may have re-added them
            pipe = self._client().pipeline(transaction=False)
            for wid, member in returned:
                pipe.zrem(self._k(f"res:{wid}"), member)
            await pipe.execute()
        for keys, args in raced:  # released while the heartbeat may have re-added them: the same release again
            await self._release_script(keys=keys, args=args)

    async def _refresh(self) -> None:
        q, settle = self._take_settlements()
        leasing = self.lease_block > 1
        load: list[str | int] = [-1]
        if leasing:  # no call per reservation tells Redis this replica's load: each refresh does
            load = [0]
            for wid, cur in self._own_by_worker.items():
                if cur.requests:
                    load += (f"r:{wid}", cur.requests, f"t:{wid}", cur.tokens)
            load[0] = (len(load) - 1) // 2
        try:
            flat = await self._refresh_script(args=[self.prefix, self.replica_id, *settle, self._ttl_ms, *load])
        except BaseException:
            self._settle_q[:0] = q
            raise
        self._check_epoch(flat[0])
        self._others_waiting = int(flat[1]) > 0
        others: dict[str, Inflight] = {}
        for i in range(2, len(flat), 5):
            wid, total, other_tokens, own_then = flat[i], int(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3])
            # Leased slots count in the zset but are not requests: with leases, the other replicas' own counts.
            other_requests = int(flat[i + 4]) if leasing else total - own_then
            others[wid] = Inflight(max(0, other_requests), max(0, other_tokens))
        self._others = others
        view = dict(others)
        for wid, own in self._own_by_worker.items():
            o = view.get(wid)
            view[wid] = own if o is None else Inflight(o.requests + own.requests, o.tokens + own.tokens)
        self._view = view

    # --- leases ---------------------------------------------------------------------------------------
    def _held(self) -> list[tuple[str, str]]:
        """(worker, member) of every slot this replica holds in Redis: its reservations and its free leased slots."""
        held = [(wid, self._slot_of.get((wid, rid)) or self._member(rid)) for wid, rid in self._own]
        for wid, free in self._free.items():
            held += ((wid, m) for m in free)
        return held

    async def _lease(self, worker_id: str, cap: int | None, tokens: int) -> list[str] | None:
        """Lease up to `lease_block` slots on the worker (None: Redis unreachable, [] the worker is full)."""
        seq = self._lease_seq
        self._lease_seq += self.lease_block  # reserved before the await: a concurrent lease numbers its own
        own = self._own_by_worker.get(worker_id) or Inflight()
        try:
            got = await self._lease_script(
                keys=[self._k(f"res:{worker_id}"), self._k("resworkers"), self._k("replicas"), self._k("waiters"),
                      self._k(f"load:{self.replica_id}")],
                args=[self.replica_id, -1 if cap is None else cap, self._ttl_ms, worker_id, self.lease_block, seq,
                      own.requests + 1, own.tokens + tokens],
                client=self._client())
        except _DOWN_ERRORS as exc:
            self._mark_down(exc)
            return None
        return [f"{self.replica_id}|{seq + j}~" for j in range(int(got))]

    def _keep_free(self, worker_id: str, members: list[str]) -> None:
        self._free.setdefault(worker_id, []).extend(members)
        self._free_touched[worker_id] = time.monotonic()

    async def _return_slots(self, worker_id: str, members: list[str]) -> None:
        """Give leased slots back to Redis (announced to replicas with requests waiting)."""
        if self._hb_running:
            self._returned_during_hb += ((worker_id, m) for m in members)
        if self._ok:
            own = self._own_by_worker.get(worker_id) or Inflight()
            try:
                await self._return_script(keys=[self._k(f"res:{worker_id}"), self._k("waiters"),
                                                self._k(f"load:{self.replica_id}")],
                                          args=[self._k("released"), f"{self.replica_id}|{worker_id}", worker_id,
                                                own.requests, own.tokens, self._ttl_ms, *members],
                                          client=self._client())
                return
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
        self._pending_release += ((worker_id, m) for m in members)

    async def _trim_leases(self) -> None:
        """Free slots back to Redis: all of them while another replica waits or once unused for lease_idle_s,
        else those beyond one spare block."""
        now = time.monotonic()
        for wid in list(self._free):
            free = self._free[wid]
            idle = now - self._free_touched.get(wid, 0.0) >= self.lease_idle_s
            keep = 0 if self._others_waiting or idle else self.lease_block
            if len(free) > keep:
                give = free[keep:]
                del free[keep:]
                if not free:
                    del self._free[wid]
                await self._return_slots(wid, give)

    # --- local accounting -----------------------------------------------------------------------
    def _add_local(self, worker_id: str, request_id: str, tokens: int) -> None:
        self._own[(worker_id, request_id)] = tokens
        cur = self._own_by_worker.get(worker_id)
        self._own_by_worker[worker_id] = (
            Inflight(1, tokens) if cur is None else Inflight(cur.requests + 1, cur.tokens + tokens)
        )
        v = self._view.get(worker_id)
        self._view[worker_id] = Inflight(1, tokens) if v is None else Inflight(v.requests + 1, v.tokens + tokens)

    def _remove_local(self, worker_id: str, tokens: int) -> None:
        cur = self._own_by_worker[worker_id]
        if cur.requests <= 1:
            del self._own_by_worker[worker_id]
        else:
            self._own_by_worker[worker_id] = Inflight(cur.requests - 1, cur.tokens - tokens)
        v = self._view.get(worker_id)
        if v is not None:
            self._view[worker_id] = Inflight(max(0, v.requests - 1), max(0, v.tokens - tokens))

    # --- reservations (hot path) -----------------------------------------------------------------
    async def try_reserve(self, worker_id: str, request_id: str, cap: int | None, tokens: int = 0) -> bool:
        r = self._client()
        if (worker_id, request_id) in self._own:
            return True  # idempotent
        tokens = int(tokens)
        ticket = self._tickets.get(request_id) if self._tickets else None
        if ticket is not None:
            return await self._try_reserve_keyed(ticket, worker_id, request_id, cap, tokens)
        if self.lease_block > 1:
            free = self._free.get(worker_id)
            if free:  # a slot this replica already leased: no Redis call
                self._slot_of[(worker_id, request_id)] = free.pop()
                self._free_touched[worker_id] = time.monotonic()
                self._add_local(worker_id, request_id, tokens)
                return True
            if self._ok:
                slots = await self._lease(worker_id, cap, tokens)
                if slots is not None:
                    if not slots:
                        return False
                    if (worker_id, request_id) in self._own:  # reserved meanwhile: keep them all
                        self._keep_free(worker_id, slots)
                        return True
                    self._slot_of[(worker_id, request_id)] = slots[0]
                    if len(slots) > 1:
                        self._keep_free(worker_id, slots[1:])
                    self._add_local(worker_id, request_id, tokens)
                    return True
        elif self._ok:
            try:
                got = await self._reserve_script(
                    keys=[
                        self._k(f"res:{worker_id}"), self._k(f"load:{self.replica_id}"),
                        self._k("resworkers"), self._k("replicas"),
                    ],
                    args=[self._member(request_id), -1 if cap is None else cap, self._ttl_ms, worker_id, tokens,
                          self.replica_id],
                    client=r,
                )
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
            else:
                if got:
                    self._add_local(worker_id, request_id, tokens)
                return bool(got)
        # Fail open: admit against the last known view (other replicas' load as of the last refresh).
        cur = self._view.get(worker_id)
        if cap is not None and cur is not None and cur.requests >= cap:
            return False
        self._add_local(worker_id, request_id, tokens)
        return True

    async def _try_reserve_keyed(self, t: Ticket, worker_id: str, request_id: str, cap: int | None,
                                 tokens: int) -> bool:
        """try_reserve for a request of a limited key (one call: cap, buckets, concurrency, reservation)."""
        if self._ok:
            try:
                got = await self._reserve_keyed(t, worker_id, cap, tokens)
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
            else:
                if got:
                    self._add_local(worker_id, request_id, tokens)
                    self._hold(t)
                return got
        cur = self._view.get(worker_id)
        if cap is not None and cur is not None and cur.requests >= cap:
            return False
        if not t.charged:  # Redis away: this replica's own buckets
            self._local_buckets.charge(t, time.monotonic() * 1000)
            t.charged = True
        self._add_local(worker_id, request_id, tokens)
        self._hold(t)
        return True

    def release_nowait(self, worker_id: str, request_id: str) -> bool:
        """A leased slot goes back among the free ones with no Redis call (unless another replica waits)."""
        key = (worker_id, request_id)
        if key not in self._slot_of or not self._ok or self._others_waiting:
            return False
        self._remove_local(worker_id, self._own.pop(key))
        self._keep_free(worker_id, [self._slot_of.pop(key)])
        return True

    async def release(self, worker_id: str, request_id: str) -> None:
        if self.release_nowait(worker_id, request_id):
            return
        r = self._client()
        tokens = self._own.pop((worker_id, request_id), None)
        if tokens is None:
            return  # unknown or already released
        self._remove_local(worker_id, tokens)
        slot = self._slot_of.pop((worker_id, request_id), None)
        if slot is not None:  # a leased slot: kept for the next request here, unless another replica waits
            if self._ok and not self._others_waiting:
                self._keep_free(worker_id, [slot])
            else:
                await self._return_slots(worker_id, [slot])
            return
        keys = [self._k(f"res:{worker_id}"), self._k(f"load:{self.replica_id}"), self._k("waiters")]
        t = self._tickets.get(request_id) if self._tickets else None
        if t is not None:
            t.holds -= 1
            if t.holds <= 0:
                self._local_buckets.unhold(t)
                if t.limits.max_concurrency is not None:
                    keys.append(self._k(f"kc:{t.tenant_id}"))
        args: list[str | int] = [self._member(request_id), worker_id, tokens, self._k("released"), self.replica_id]
        if self._hb_running:
            self._released_during_hb.append((keys, args))
        if not self._ok:
            self._pending_release.append((worker_id, self._member(request_id)))
            return
        try:
            await self._release_script(keys=keys, args=args, client=r)
        except _DOWN_ERRORS as exc:
            self._mark_down(exc)
            self._pending_release.append((worker_id, self._member(request_id)))

    def inflight(self) -> dict[str, Inflight]:
        return dict(self._view)

    def own_inflight(self, worker_id: str) -> int:
        own = self._own_by_worker.get(worker_id)
        return own.requests if own is not None else 0

    async def live_replicas(self) -> list[str]:
        """Every refresh drops the replicas whose lease expired from the set; Redis down: this one only."""
        if self._ok:
            try:
                return list(await self._client().zrange(self._k("replicas"), 0, -1))
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
        return [self.replica_id]


def _or_none(limit: int | None) -> int:
    return -1 if limit is None else limit


