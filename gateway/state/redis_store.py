"""Redis-backed state store: many gateway replicas share one registry and one set of reservations.

Keys (prefix `fg:` by default; docs/design.md "Shared state"):
  fg:workers            hash  worker id -> JSON WorkerRecord
  fg:metrics            hash  worker id -> JSON EngineMetrics
  fg:res:<worker>       zset  "<replica>|<request_id>" scored by lease expiry (ms, Redis TIME)
  fg:resworkers         set   workers that may have reservations (so the refresh needs no SCAN)
  fg:load:<replica>     hash  "r:<worker>" -> requests, "t:<worker>" -> tokens this replica holds;
                              PEXPIRE'd with the lease and rewritten from local truth by each heartbeat
  fg:replicas           zset  replica id scored by lease expiry (ms)
  fg:docs               hash  document key -> JSON (fitted models, predictor state; control loops only)

Admission is one Lua script (DESIGN principle 3): drop expired members, compare ZCARD with the cap,
ZADD. Each replica re-scores its own members every lease_ttl/3, so a SIGKILLed replica's reservations
expire after the TTL while a live one's never do. Token counts live in the per-replica load hash
(the zset counts requests; tokens of dead replicas vanish when their hash's TTL runs out).

`inflight()` is a cache: every `refresh_interval_s` one script returns, atomically, each worker's
ZCARD, other replicas' tokens and this replica's own counts; the cache is
(total - own at that instant) + own now, so this replica's reserve/release show up at once and a
refresh racing a reserve never double-counts or loses it.

Losing Redis after start fails open (DESIGN principle 6): reservations fall back to local accounting
against the last cached view, one warning is logged, and when Redis answers again the next heartbeat
re-adds the reservations made meanwhile. The scripts build key names from the prefix inside Lua, so
this targets a standalone Redis (or one shard), not Redis Cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import socket
from urllib.parse import urlsplit, urlunsplit

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.state.base import EngineMetrics, Inflight, StateStore, WorkerRecord
from gateway.state.jobs import RedisJobs

log = logging.getLogger("fleetgate.state.redis")

# Errors that make us fail open: Redis unreachable, slow, or refusing writes (OOM, READONLY replica).
_DOWN_ERRORS = (RedisError, RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)

_NOW_MS = """
if redis.replicate_commands then pcall(redis.replicate_commands) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: res:<worker>, load:<replica>, resworkers, replicas
# ARGV: member, cap (-1 = none), ttl_ms, worker, tokens, replica
_RESERVE = _NOW_MS + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local cap = tonumber(ARGV[2])
if cap >= 0 and redis.call('ZCARD', KEYS[1]) >= cap then return 0 end
local ttl = tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('HINCRBY', KEYS[2], 'r:' .. ARGV[4], 1)
redis.call('HINCRBY', KEYS[2], 't:' .. ARGV[4], ARGV[5])
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('SADD', KEYS[3], ARGV[4])
redis.call('ZADD', KEYS[4], 'GT', now + ttl, ARGV[6])
return 1
"""

# KEYS: res:<worker>, load:<replica>; ARGV: member, worker, tokens
# Counts drop only if the member was there, so replaying a release that raced a heartbeat is safe.
_RELEASE = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 and redis.call('EXISTS', KEYS[2]) == 1 then
  local r = redis.call('HINCRBY', KEYS[2], 'r:' .. ARGV[2], -1)
  redis.call('HINCRBY', KEYS[2], 't:' .. ARGV[2], -tonumber(ARGV[3]))
  if r <= 0 then redis.call('HDEL', KEYS[2], 'r:' .. ARGV[2], 't:' .. ARGV[2]) end
end
return 1
"""

# KEYS: replicas, load:<replica>, resworkers
# ARGV: prefix, replica, ttl_ms, n, then n x (worker, member), then (field, value) pairs for the load hash
_HEARTBEAT = _NOW_MS + """
local P, ttl = ARGV[1], tonumber(ARGV[3])
local exp = now + ttl
redis.call('ZADD', KEYS[1], exp, ARGV[2])
local n = tonumber(ARGV[4])
local i = 5
for _ = 1, n do
  redis.call('ZADD', P .. 'res:' .. ARGV[i], exp, ARGV[i + 1])
  redis.call('SADD', KEYS[3], ARGV[i])
  i = i + 2
end
redis.call('DEL', KEYS[2])
while i < #ARGV do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  i = i + 2
end
if n > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
return n
"""

# ARGV: prefix, replica. Returns flat [worker, zcard, other replicas' tokens, own requests] per worker.
_REFRESH = _NOW_MS + """
local P, me = ARGV[1], ARGV[2]
redis.call('ZREMRANGEBYSCORE', P .. 'replicas', '-inf', now)
local tok = {}
for _, rep in ipairs(redis.call('ZRANGE', P .. 'replicas', 0, -1)) do
  if rep ~= me then
    local h = redis.call('HGETALL', P .. 'load:' .. rep)
    for j = 1, #h, 2 do
      if string.sub(h[j], 1, 2) == 't:' then
        local w = string.sub(h[j], 3)
        tok[w] = (tok[w] or 0) + tonumber(h[j + 1])
      end
    end
  end
end
local own = {}
local h = redis.call('HGETALL', P .. 'load:' .. me)
for j = 1, #h, 2 do
  if string.sub(h[j], 1, 2) == 'r:' then own[string.sub(h[j], 3)] = tonumber(h[j + 1]) end
end
local out = {}
for _, w in ipairs(redis.call('SMEMBERS', P .. 'resworkers')) do
  local key = P .. 'res:' .. w
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local c = redis.call('ZCARD', key)
  if c == 0 then redis.call('SREM', P .. 'resworkers', w) end
  out[#out + 1] = w
  out[#out + 1] = c
  out[#out + 1] = tok[w] or 0
  out[#out + 1] = own[w] or 0
end
return out
"""


class RedisUnavailableError(RuntimeError):
    """Redis could not be reached when the store started."""


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def _record_from(raw: str | bytes) -> WorkerRecord:
    d = orjson.loads(raw)
    names = {f.name for f in dataclasses.fields(WorkerRecord)}
    return WorkerRecord(**{k: v for k, v in d.items() if k in names})


def _metrics_from(raw: str | bytes) -> EngineMetrics:
    d = orjson.loads(raw)
    names = {f.name for f in dataclasses.fields(EngineMetrics)}
    return EngineMetrics(**{k: v for k, v in d.items() if k in names})


class RedisStore(RedisJobs, StateStore):
    def __init__(
        self,
        url: str,
        replica_id: str | None = None,
        key_prefix: str = "fg:",
        lease_ttl_s: float = 10.0,
        refresh_interval_s: float = 0.1,
        socket_timeout_s: float = 1.0,
        max_connections: int = 64,
    ) -> None:
        if lease_ttl_s <= 0 or refresh_interval_s <= 0:
            raise ValueError("lease_ttl_s and refresh_interval_s must be positive")
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
        # Releases to replay: ones that raced an in-flight heartbeat, and ones made while Redis was down.
        self._hb_running = False
        self._released_during_hb: list[tuple[str, str, int]] = []
        self._pending_release: list[tuple[str, str, int]] = []
        # Last known registry and metrics, served while Redis is down; registry writes made meanwhile.
        self._workers_cache: dict[str, WorkerRecord] = {}
        self._metrics_cache: dict[str, EngineMetrics] = {}
        self._pending_registry: dict[str, WorkerRecord | None] = {}
        # Last known shared documents (key -> JSON), served while Redis is down; writers re-put them.
        self._docs_cache: dict[str, str | bytes] = {}

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
        self._reserve_script = client.register_script(_RESERVE)
        self._release_script = client.register_script(_RELEASE)
        self._heartbeat_script = client.register_script(_HEARTBEAT)
        self._refresh_script = client.register_script(_REFRESH)
        self._ok = True
        await self._heartbeat()
        await self._refresh()
        self._tasks = [
            asyncio.create_task(self._heartbeat_loop(), name=f"fg-redis-heartbeat-{self.replica_id}"),
            asyncio.create_task(self._refresh_loop(), name=f"fg-redis-refresh-{self.replica_id}"),
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
        r = self._redis
        if r is None:
            return
        self._redis = None
        if self._ok:
            try:
                pipe = r.pipeline(transaction=False)
                for wid, rid in self._own:
                    pipe.zrem(self._k(f"res:{wid}"), self._member(rid))
                pipe.delete(self._k(f"load:{self.replica_id}"))
                pipe.zrem(self._k("replicas"), self.replica_id)
                await pipe.execute()
            except _DOWN_ERRORS as exc:
                log.warning("could not remove this replica's reservations from Redis on close: %s", exc)
        self._own.clear()
        self._own_by_worker.clear()
        self._ok = False
        await r.aclose()

    def reachable(self) -> bool:
        return self._ok

    def _client(self) -> aioredis.Redis:
        if self._redis is None:
            raise RuntimeError("RedisStore is not started: call `await store.start()` first")
        return self._redis

    def _mark_down(self, exc: BaseException) -> None:
        if self._ok:
            self._ok = False
            log.warning(
                "Redis at %s unreachable (%s); falling back to local accounting until it answers again",
                _redact(self.url), exc,
            )

    async def _mark_up(self) -> None:
        """Redis answers again: re-add reservations made meanwhile, replay releases and registry writes."""
        self._ok = True
        log.warning("Redis at %s reachable again; shared state resumed", _redact(self.url))
        r = self._client()
        pipe = r.pipeline(transaction=False)
        for wid, rid, _tokens in self._pending_release:
            pipe.zrem(self._k(f"res:{wid}"), self._member(rid))
        for wid, rec in self._pending_registry.items():
            if rec is None:
                pipe.hdel(self._k("workers"), wid)
                pipe.hdel(self._k("metrics"), wid)
            else:
                pipe.hset(self._k("workers"), wid, orjson.dumps(dataclasses.asdict(rec)))
        await pipe.execute()
        self._pending_release, self._pending_registry = [], {}
        await self._heartbeat()  # re-adds reservations made while Redis was away, rewrites the load hash

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

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval_s if self._ok else max(self.refresh_interval_s, 0.5))
            try:
                if not self._ok:
                    await self._client().ping()
                    await self._mark_up()
                await self._refresh()
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
            except Exception:
                log.exception("in-flight refresh failed")

    async def _heartbeat(self) -> None:
        args: list[str | int] = [self.prefix, self.replica_id, self._ttl_ms, len(self._own)]
        for wid, rid in self._own:
            args += (wid, self._member(rid))
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
        for wid, rid, tokens in raced:  # released while the heartbeat may have re-added them: release again
            await self._release_script(
                keys=[self._k(f"res:{wid}"), self._k(f"load:{self.replica_id}")],
                args=[self._member(rid), wid, tokens],
            )

    async def _refresh(self) -> None:
        flat = await self._refresh_script(args=[self.prefix, self.replica_id])
        others: dict[str, Inflight] = {}
        for i in range(0, len(flat), 4):
            wid, total, other_tokens, own_then = flat[i], int(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3])
            others[wid] = Inflight(max(0, total - own_then), max(0, other_tokens))
        self._others = others
        view = dict(others)
        for wid, own in self._own_by_worker.items():
            o = view.get(wid)
            view[wid] = own if o is None else Inflight(o.requests + own.requests, o.tokens + own.tokens)
        self._view = view

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
        if self._ok:
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

    async def release(self, worker_id: str, request_id: str) -> None:
        r = self._client()
        tokens = self._own.pop((worker_id, request_id), None)
        if tokens is None:
            return  # unknown or already released
        self._remove_local(worker_id, tokens)
        if self._hb_running:
            self._released_during_hb.append((worker_id, request_id, tokens))
        if not self._ok:
            self._pending_release.append((worker_id, request_id, tokens))
            return
        try:
            await self._release_script(
                keys=[self._k(f"res:{worker_id}"), self._k(f"load:{self.replica_id}")],
                args=[self._member(request_id), worker_id, tokens],
                client=r,
            )
        except _DOWN_ERRORS as exc:
            self._mark_down(exc)
            self._pending_release.append((worker_id, request_id, tokens))

    def inflight(self) -> dict[str, Inflight]:
        return dict(self._view)

    # --- registry -------------------------------------------------------------------------------
    async def upsert_worker(self, rec: WorkerRecord) -> None:
        rec = dataclasses.replace(rec, models=list(rec.models), labels=dict(rec.labels))
        self._workers_cache[rec.id] = rec
        if self._ok:
            try:
                await self._client().hset(self._k("workers"), rec.id, orjson.dumps(dataclasses.asdict(rec)))
                return
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
        self._pending_registry[rec.id] = rec

    async def remove_worker(self, worker_id: str) -> None:
        self._workers_cache.pop(worker_id, None)
        self._metrics_cache.pop(worker_id, None)
        if self._ok:
            try:
                pipe = self._client().pipeline(transaction=False)
                pipe.hdel(self._k("workers"), worker_id)
                pipe.hdel(self._k("metrics"), worker_id)
                await pipe.execute()
                return
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
        self._pending_registry[worker_id] = None

    async def list_workers(self) -> list[WorkerRecord]:
        if self._ok:
            try:
                raw = await self._client().hgetall(self._k("workers"))
                self._workers_cache = {wid: _record_from(v) for wid, v in raw.items()}
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
        return [dataclasses.replace(r, models=list(r.models), labels=dict(r.labels))
                for r in self._workers_cache.values()]

    # --- scraped engine metrics ------------------------------------------------------------------
    async def put_metrics(self, worker_id: str, metrics: EngineMetrics) -> None:
        self._metrics_cache[worker_id] = dataclasses.replace(metrics)
        if self._ok:
            try:
                await self._client().hset(self._k("metrics"), worker_id, orjson.dumps(dataclasses.asdict(metrics)))
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)

    async def get_metrics(self) -> dict[str, EngineMetrics]:
        if self._ok:
            try:
                raw = await self._client().hgetall(self._k("metrics"))
                self._metrics_cache = {wid: _metrics_from(v) for wid, v in raw.items()}
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
        return {wid: dataclasses.replace(m) for wid, m in self._metrics_cache.items()}

    # --- shared documents (control loops; a write while Redis is down stays local until re-put) ---
    async def put_doc(self, key: str, doc: dict) -> None:
        raw = orjson.dumps(doc)
        self._docs_cache[key] = raw
        if self._ok:
            try:
                await self._client().hset(self._k("docs"), key, raw)
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)

    async def get_doc(self, key: str) -> dict | None:
        if self._ok:
            try:
                raw = await self._client().hget(self._k("docs"), key)
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
            else:
                if raw is None:
                    self._docs_cache.pop(key, None)
                else:
                    self._docs_cache[key] = raw
        raw = self._docs_cache.get(key)
        return orjson.loads(raw) if raw is not None else None

    async def get_docs(self, prefix: str) -> dict[str, dict]:
        if self._ok:
            try:
                found = {k: v async for k, v in self._client().hscan_iter(
                    self._k("docs"), match=_glob_escape(prefix) + "*", count=200)}
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)
            else:
                kept = {k: v for k, v in self._docs_cache.items() if not k.startswith(prefix)}
                self._docs_cache = {**kept, **found}
        return {k: orjson.loads(v) for k, v in self._docs_cache.items() if k.startswith(prefix)}

    async def delete_doc(self, key: str) -> None:
        self._docs_cache.pop(key, None)
        if self._ok:
            try:
                await self._client().hdel(self._k("docs"), key)
            except _DOWN_ERRORS as exc:
                self._mark_down(exc)


def _glob_escape(text: str) -> str:
    """Escape Redis glob metacharacters so a key prefix matches literally (HSCAN MATCH)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
