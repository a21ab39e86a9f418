"""Batch work in Redis (`RedisJobs`, mixed into RedisStore): the Lua scripts that claim, renew, requeue, reap
and finish queued requests atomically, and streamed uploads. The interface and the key layout are in
gateway/state/jobs.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Collection
from typing import Any

import orjson
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.state.jobs import (
    CLAIM_SCAN,
    FILE_CHUNK,
    BatchStats,
    JobStore,
    QueuedRequest,
    QueueSnapshot,
    StoreUnavailableError,
    Upload,
    expired,
)

# ---- Redis implementation -------------------------------------------------------------------------
_NOW_MS = """
if redis.replicate_commands then pcall(redis.replicate_commands) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: bq, items, run, dl. ARGV: ttl_ms, scan depth, then models to skip. Returns the claimed item's JSON or
# false. Members without an item (left by a cancel) are dropped on the way.
_CLAIM = _NOW_MS + """
local skip = {}
for i = 3, #ARGV do skip[ARGV[i]] = true end
local depth, start, stale = tonumber(ARGV[2]), 0, {}
local found = nil
while start < depth and not found do
  local ms = redis.call('ZRANGE', KEYS[1], start, start + 99)
  if #ms == 0 then break end
  for _, m in ipairs(ms) do
    local raw = redis.call('HGET', KEYS[2], m)
    if not raw then
      stale[#stale + 1] = m
    else
      local it = cjson.decode(raw)
      if not skip[it.model] then found = {m, raw, it}; break end
    end
  end
  start = start + 100
end
for _, m in ipairs(stale) do redis.call('ZREM', KEYS[1], m) end
if not found then return false end
local m, raw, it = found[1], found[2], found[3]
redis.call('ZREM', KEYS[1], m)
if redis.call('HINCRBY', KEYS[4], it.dl_key, -1) <= 0 then redis.call('HDEL', KEYS[4], it.dl_key) end
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[1]), m)
return raw
"""

# KEYS: run. ARGV: ttl_ms, ids...
_RENEW = _NOW_MS + """
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[i]) end
return 1
"""

# KEYS: bq, items, run, dl. ARGV: id. Only a claimed request goes back (a reap may have raced us).
_REQUEUE = """
if redis.call('ZREM', KEYS[3], ARGV[1]) == 0 then return 0 end
local raw = redis.call('HGET', KEYS[2], ARGV[1])
if not raw then return 0 end
local it = cjson.decode(raw)
redis.call('ZADD', KEYS[1], it.score, ARGV[1])
redis.call('HINCRBY', KEYS[4], it.dl_key, 1)
return 1
"""

# KEYS: bq, items, run, dl. Claims whose lease ran out go back to the queue.
_REAP = _NOW_MS + """
local late = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
local n = 0
for _, m in ipairs(late) do
  redis.call('ZREM', KEYS[3], m)
  local raw = redis.call('HGET', KEYS[2], m)
  if raw then
    local it = cjson.decode(raw)
    redis.call('ZADD', KEYS[1], it.score, m)
    redis.call('HINCRBY', KEYS[4], it.dl_key, 1)
    n = n + 1
  end
end
return n
"""

# KEYS: bq, items, run, dl, bstat, bout, berr. ARGV: id, index, line, ok, in_tok, out_tok
_FINISH = """
local raw = redis.call('HGET', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
if raw and redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  local it = cjson.decode(raw)
  if redis.call('HINCRBY', KEYS[4], it.dl_key, -1) <= 0 then redis.call('HDEL', KEYS[4], it.dl_key) end
end
redis.call('HDEL', KEYS[2], ARGV[1])
if redis.call('HEXISTS', KEYS[6], ARGV[2]) == 1 or redis.call('HEXISTS', KEYS[7], ARGV[2]) == 1 then return -1 end
if ARGV[4] == '1' then
  redis.call('HSET', KEYS[6], ARGV[2], ARGV[3])
  redis.call('HINCRBY', KEYS[5], 'completed', 1)
else
  redis.call('HSET', KEYS[7], ARGV[2], ARGV[3])
  redis.call('HINCRBY', KEYS[5], 'failed', 1)
end
redis.call('HINCRBY', KEYS[5], 'in_tok', ARGV[5])
redis.call('HINCRBY', KEYS[5], 'out_tok', ARGV[6])
return redis.call('HINCRBY', KEYS[5], 'pending', -1)
"""

# KEYS: bq, items, dl, bstat, berr. ARGV: batch id, count, expire message ('' = cancel: no lines)
_DROP = """
local removed = 0
for i = 0, tonumber(ARGV[2]) - 1 do
  local m = ARGV[1] .. '-' .. string.format('%06d', i)
  if redis.call('ZREM', KEYS[1], m) == 1 then
    removed = removed + 1
    local raw = redis.call('HGET', KEYS[2], m)
    redis.call('HDEL', KEYS[2], m)
    redis.call('HINCRBY', KEYS[4], 'pending', -1)
    if raw then
      local it = cjson.decode(raw)
      if redis.call('HINCRBY', KEYS[3], it.dl_key, -1) <= 0 then redis.call('HDEL', KEYS[3], it.dl_key) end
      if ARGV[3] ~= '' and redis.call('HEXISTS', KEYS[5], tostring(i)) == 0 then
        local line = '{"id":"batch_req_' .. m .. '","custom_id":' .. cjson.encode(it.custom_id) ..
          ',"response":null,"error":{"code":"batch_expired","message":' .. cjson.encode(ARGV[3]) .. '}}'
        redis.call('HSET', KEYS[5], tostring(i), line)
        redis.call('HINCRBY', KEYS[4], 'failed', 1)
      end
    end
  end
end
return removed
"""

# KEYS: lease. ARGV: holder, ttl_ms
_LEASE = """
local cur = redis.call('GET', KEYS[1])
if cur == false or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

_UNLEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""

_ENQUEUE_CHUNK = 1000


# Redis unreachable, slow or still loading: a StoreUnavailableError for the caller (a script error is a bug and
# propagates as itself).
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, OSError, asyncio.TimeoutError)
_UPLOAD_TTL_MS = 3_600_000  # a half-written upload (its writer died) disappears after an hour


def _guard(fn: Any) -> Any:
    """Redis away -> StoreUnavailableError, at once while the store knows it is away (no call, no wait)."""

    @functools.wraps(fn)
    async def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._ok:
            raise StoreUnavailableError("the state store (Redis) is unreachable")
        try:
            return await fn(self, *args, **kwargs)
        except UNREACHABLE as exc:
            self._mark_down(exc)
            raise StoreUnavailableError(f"the state store (Redis) is unreachable ({type(exc).__name__})") from None
    return wrapper


class _RedisUpload(Upload):
    def __init__(self, store: RedisJobs, file_id: str) -> None:
        self.store, self.file_id = store, file_id
        self.key = store._k(f"fdata:{file_id}")  # type: ignore[attr-defined]
        self.started = False

    async def write(self, data: bytes) -> None:
        await self.store._upload_write(self.key, data, not self.started)
        self.started = True

    async def commit(self, meta: dict) -> None:
        await self.store._upload_commit(self.key, meta, self.started)

    async def abort(self) -> None:
        with contextlib.suppress(StoreUnavailableError):
            await self.store._upload_abort(self.key)


class RedisJobs(JobStore):
    """Uses the host RedisStore's client (`_client()`), key prefix (`_k()`) and outage state (`_ok`,
    `_mark_down`). While Redis is away every call raises StoreUnavailableError: the Batch API answers 503,
    and the runner retries on its next round."""

    def _script(self, name: str, source: str) -> Any:
        cache = self.__dict__.setdefault("_job_scripts", {})
        client = self._client()  # type: ignore[attr-defined]
        hit = cache.get(name)
        if hit is None or hit[0] is not client:
            hit = cache[name] = (client, client.register_script(source))
        return hit[1]

    def _qkeys(self) -> list[str]:
        k = self._k  # type: ignore[attr-defined]
        return [k("bq"), k("bq:items"), k("bq:run"), k("bq:dl")]

    # --- files ------------------------------------------------------------------------------------
    async def open_upload(self, file_id: str) -> Upload:
        return _RedisUpload(self, file_id)

    async def _upload_write(self, key: str, data: bytes, first: bool) -> None:
        pipe = self._binary().pipeline(transaction=False)  # type: ignore[attr-defined]
        if first:
            pipe.delete(key)
        pipe.append(key, data)
        pipe.pexpire(key, _UPLOAD_TTL_MS)
        await pipe.execute()

    async def _upload_commit(self, key: str, meta: dict, has_data: bool) -> None:
        k = self._k  # type: ignore[attr-defined]
        pipe = self._client().pipeline(transaction=True)  # type: ignore[attr-defined]
        if not has_data:
            pipe.set(key, "")
        pipe.hset(k(f"file:{meta['id']}"), "meta", orjson.dumps(meta))
        pipe.zadd(k("files"), {meta["id"]: meta["created_at"]})
        if meta.get("expires_at") is not None:
            pipe.pexpireat(k(f"file:{meta['id']}"), int(meta["expires_at"] * 1000))
            pipe.pexpireat(key, int(meta["expires_at"] * 1000))
        else:
            pipe.persist(key)
        await pipe.execute()

    async def _upload_abort(self, key: str) -> None:
        await self._client().delete(key)  # type: ignore[attr-defined]

    async def get_file(self, file_id: str) -> dict | None:
        raw = await self._client().hget(self._k(f"file:{file_id}"), "meta")  # type: ignore[attr-defined]
        meta = orjson.loads(raw) if raw is not None else None
        return meta if meta is not None and not expired(meta) else None

    async def read_file(self, file_id: str) -> AsyncIterator[bytes]:
        key = self._k(f"fdata:{file_id}")  # type: ignore[attr-defined]
        start = 0
        while True:
            chunk = await self._read_range(key, start)
            if chunk:
                yield chunk
            if len(chunk) < FILE_CHUNK:
                return
            start += len(chunk)

    async def _read_range(self, key: str, start: int) -> bytes:
        return await self._binary().getrange(key, start, start + FILE_CHUNK - 1)  # type: ignore[attr-defined]

    async def delete_file(self, file_id: str) -> bool:
        k = self._k  # type: ignore[attr-defined]
        pipe = self._client().pipeline(transaction=True)  # type: ignore[attr-defined]
        pipe.delete(k(f"file:{file_id}"))
        pipe.delete(k(f"fdata:{file_id}"))
        pipe.zrem(k("files"), file_id)
        existed, _, _ = await pipe.execute()
        return bool(existed)

    async def list_files(self) -> list[dict]:
        now = time.time()
        return [m for m in await self.list_files_all() if not expired(m, now)]

    async def list_files_all(self) -> list[dict]:
        r, k = self._client(), self._k  # type: ignore[attr-defined]
        ids = await r.zrevrange(k("files"), 0, -1)
        if not ids:
            return []
        pipe = r.pipeline(transaction=False)
        for fid in ids:
            pipe.hget(k(f"file:{fid}"), "meta")
        metas, gone = [], []
        for fid, m in zip(ids, await pipe.execute(), strict=True):
            if m is None:
                gone.append(fid)  # expired by Redis
            else:
                metas.append(orjson.loads(m))
        if gone:
            await r.zrem(k("files"), *gone)
        return metas

    # --- batches ----------------------------------------------------------------------------------
    async def put_batch(self, doc: dict) -> None:
        k = self._k  # type: ignore[attr-defined]
        pipe = self._client().pipeline(transaction=True)  # type: ignore[attr-defined]
        pipe.set(k(f"batch:{doc['id']}"), orjson.dumps(doc))
        pipe.zadd(k("batches"), {doc["id"]: doc["created_at"]})
        await pipe.execute()

    async def get_batch(self, batch_id: str) -> dict | None:
        raw = await self._client().get(self._k(f"batch:{batch_id}"))  # type: ignore[attr-defined]
        return orjson.loads(raw) if raw is not None else None

    async def list_batches(self) -> list[dict]:
        r, k = self._client(), self._k  # type: ignore[attr-defined]
        ids = await r.zrevrange(k("batches"), 0, -1)
        if not ids:
            return []
        raws = await r.mget([k(f"batch:{i}") for i in ids])
        return [orjson.loads(x) for x in raws if x is not None]

    async def batch_stats(self, batch_id: str) -> BatchStats:
        h = await self._client().hgetall(self._k(f"bstat:{batch_id}"))  # type: ignore[attr-defined]
        return BatchStats(int(h.get("pending", 0)), int(h.get("completed", 0)), int(h.get("failed", 0)),
                          int(h.get("in_tok", 0)), int(h.get("out_tok", 0)))

    async def batch_results(self, batch_id: str) -> tuple[dict[int, str], dict[int, str]]:
        r, k = self._client(), self._k  # type: ignore[attr-defined]
        out = await r.hgetall(k(f"bout:{batch_id}"))
        err = await r.hgetall(k(f"berr:{batch_id}"))
        return {int(i): v for i, v in out.items()}, {int(i): v for i, v in err.items()}

    async def claim_final(self, batch_id: str, holder: str) -> bool:
        return bool(await self._client().hsetnx(self._k(f"bstat:{batch_id}"), "final", holder))  # type: ignore[attr-defined]

    # --- queue ------------------------------------------------------------------------------------
    async def enqueue_batch(self, batch_id: str, items: list[QueuedRequest],
                            failed: dict[int, str] | None = None) -> None:
        r, k = self._client(), self._k  # type: ignore[attr-defined]
        bq, items_key, _, dl = self._qkeys()
        counts: dict[str, int] = {}
        for it in items:
            counts[it.dl_key] = counts.get(it.dl_key, 0) + 1
        pipe = r.pipeline(transaction=True)
        pipe.hset(k(f"bstat:{batch_id}"), mapping={"pending": len(items), "completed": 0, "failed": len(failed or {}),
                                                   "in_tok": 0, "out_tok": 0})
        if failed:
            pipe.hset(k(f"berr:{batch_id}"), mapping={str(i): line for i, line in failed.items()})
        for i in range(0, len(items), _ENQUEUE_CHUNK):
            chunk = items[i:i + _ENQUEUE_CHUNK]
            pipe.hset(items_key, mapping={it.request_id: it.to_json() for it in chunk})
            pipe.zadd(bq, {it.request_id: it.deadline for it in chunk})
        for key, n in counts.items():
            pipe.hincrby(dl, key, n)
        await pipe.execute()

    async def claim_next(self, holder: str, lease_s: float, skip_models: Collection[str] = ()
                         ) -> QueuedRequest | None:
        raw = await self._script("claim", _CLAIM)(keys=self._qkeys(),
                                                  args=[max(1, int(lease_s * 1000)), CLAIM_SCAN, *skip_models])
        return QueuedRequest.from_json(raw) if raw else None

    async def renew_claims(self, request_ids: list[str], lease_s: float) -> None:
        if request_ids:
            await self._script("renew", _RENEW)(keys=[self._qkeys()[2]],
                                                args=[max(1, int(lease_s * 1000)), *request_ids])

    async def requeue(self, req: QueuedRequest) -> None:
        await self._script("requeue", _REQUEUE)(keys=self._qkeys(), args=[req.request_id])

    async def finish_request(self, req: QueuedRequest, ok: bool, line: str, input_tokens: int = 0,
                             output_tokens: int = 0) -> int:
        k = self._k  # type: ignore[attr-defined]
        keys = [*self._qkeys(), k(f"bstat:{req.batch_id}"), k(f"bout:{req.batch_id}"), k(f"berr:{req.batch_id}")]
        return int(await self._script("finish", _FINISH)(
            keys=keys, args=[req.request_id, req.index, line, "1" if ok else "0", int(input_tokens),
                             int(output_tokens)]))

    async def drop_queued(self, batch_id: str, count: int, expire_message: str | None = None) -> int:
        k = self._k  # type: ignore[attr-defined]
        bq, items_key, _, dl = self._qkeys()
        keys = [bq, items_key, dl, k(f"bstat:{batch_id}"), k(f"berr:{batch_id}")]
        return int(await self._script("drop", _DROP)(keys=keys, args=[batch_id, count, expire_message or ""]))

    async def reap_claims(self) -> int:
        return int(await self._script("reap", _REAP)(keys=self._qkeys()))

    async def queue_snapshot(self) -> QueueSnapshot:
        r = self._client()  # type: ignore[attr-defined]
        _, _, run, dl = self._qkeys()
        pipe = r.pipeline(transaction=False)
        pipe.hgetall(dl)
        pipe.zcard(run)
        counts, running = await pipe.execute()
        depth: dict[str, int] = {}
        by_deadline: dict[float, int] = {}
        for key, n in counts.items():
            n = int(n)
            if n <= 0:
                continue
            deadline, _, model = key.partition("|")
            depth[model] = depth.get(model, 0) + n
            d = float(deadline)
            by_deadline[d] = by_deadline.get(d, 0) + n
        return QueueSnapshot(depth, sorted(by_deadline.items()), int(running))

    # --- leases -----------------------------------------------------------------------------------
    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        return bool(await self._script("lease", _LEASE)(keys=[self._k(f"lease:{name}")],  # type: ignore[attr-defined]
                                                        args=[holder, max(1, int(ttl_s * 1000))]))

    async def release_lease(self, name: str, holder: str) -> None:
        await self._script("unlease", _UNLEASE)(keys=[self._k(f"lease:{name}")], args=[holder])  # type: ignore[attr-defined]


for _name, _fn in list(vars(RedisJobs).items()):
    if asyncio.iscoroutinefunction(_fn) and _name != "open_upload":
        setattr(RedisJobs, _name, _guard(_fn))
del _name, _fn
