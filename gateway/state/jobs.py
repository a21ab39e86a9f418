"""Durable batch work in the state store: uploaded files, batch objects, the deadline-ordered request queue,
and named leases (the autoscaler's leader lease).

`JobStore` is the interface (StateStore inherits it); `MemoryJobs` and `RedisJobs` are the two
implementations, mixed into MemoryStore and RedisStore. With Redis everything here survives a gateway
restart: a request a dead replica had claimed returns to the queue once its claim lease runs out.

Uploads are streamed into the store a piece at a time (`open_upload`): in Redis a string APPENDed to, in
memory a file in a private temporary directory, never the whole file in the gateway's memory. A file
expires at its `expires_at` (Redis expires its keys; the runner's sweep deletes expired files from both).

Redis keys (after the store's prefix):
  file:<id>         hash  meta (JSON)
  fdata:<id>        str   the file's bytes
  files             zset  file id scored by created_at
  batch:<id>        str   the batch object (JSON, OpenAI's shape)
  batches           zset  batch id scored by created_at
  bstat:<id>        hash  pending, completed, failed, in_tok, out_tok, final (the finalizing replica)
  bout:<id>         hash  line index -> output line; berr:<id> the same for the error file
  bq                zset  queued request id scored by its deadline (unix s); ties: request id order
  bq:items          hash  request id -> QueuedRequest JSON (queued and claimed ones)
  bq:run            zset  claimed request id scored by claim expiry (ms, Redis TIME)
  bq:dl             hash  "<deadline>|<model>" -> queued requests (queue depth and deadline groups)
  lease:<name>      str   holder, with a PX expiry
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from policies.batch_queue import BatchQueue, QueuedItem


@dataclass(slots=True)
class QueuedRequest:
    """One line of a batch input file, waiting for (or claimed by) a batch runner."""

    request_id: str          # "<batch id>-<index, 6 digits>": queue member, X-Request-Id upstream
    batch_id: str
    index: int               # line number in the input file (0-based)
    custom_id: str
    url: str                 # /v1/chat/completions | /v1/completions
    body: dict[str, Any]
    deadline: float          # unix seconds (batch created_at + completion_window)
    model: str = ""
    prompt_tokens: int = 0
    owner: str = ""          # the tenant id of the key that made the batch (gateway/auth.py)

    @property
    def dl_key(self) -> str:
        return f"{self.deadline!r}|{self.model}"

    def to_json(self) -> bytes:
        d = asdict(self)
        d["dl_key"] = self.dl_key
        d["score"] = repr(self.deadline)  # exact zset score for Lua (its number formatting keeps 14 digits)
        return orjson.dumps(d)

    @classmethod
    def from_json(cls, raw: str | bytes) -> QueuedRequest:
        d = orjson.loads(raw)
        d.pop("dl_key", None)
        d.pop("score", None)
        return cls(**d)


class StoreUnavailableError(ConnectionError):
    """The shared store cannot be reached right now (Redis down or frozen); callers retry later. The store
    logs the outage itself (one line when it starts, reminders, one when it ends)."""


def new_id(prefix: str) -> str:
    """A fresh file or batch id: `prefix` and 24 random hex digits."""
    return prefix + secrets.token_hex(12)


def request_id_for(batch_id: str, index: int) -> str:
    return f"{batch_id}-{index:06d}"


@dataclass(slots=True)
class BatchStats:
    pending: int = 0         # queued or running
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


@dataclass(slots=True)
class QueueSnapshot:
    """The batch queue as the autoscaler and the metrics see it (all replicas)."""

    depth: dict[str, int] = field(default_factory=dict)          # model -> queued requests
    deadlines: list[tuple[float, int]] = field(default_factory=list)   # (deadline, queued), earliest first
    running: int = 0                                             # claimed by a runner

    @property
    def queued(self) -> int:
        return sum(self.depth.values())


def expired_line(req: QueuedRequest, message: str) -> str:
    """An error-file line for a request the batch could not run in its window (OpenAI's batch_expired)."""
    return orjson.dumps({"id": f"batch_req_{req.request_id}", "custom_id": req.custom_id, "response": None,
                         "error": {"code": "batch_expired", "message": message}}).decode()


FILE_CHUNK = 1 << 20  # bytes per store write and read of a file's content
CLAIM_SCAN = 1000     # queued requests a claim looks through for one whose model has room


class Upload:
    """A file being written: `write` its bytes in order, then `commit(meta)`, or `abort()`."""

    async def write(self, data: bytes) -> None:
        raise NotImplementedError

    async def commit(self, meta: dict) -> None:
        raise NotImplementedError

    async def abort(self) -> None:
        raise NotImplementedError


def expired(meta: dict, now: float | None = None) -> bool:
    at = meta.get("expires_at")
    return at is not None and at <= (time.time() if now is None else now)


class JobStore:
    """Interface. Defaults raise NotImplementedError so stores without batch support still construct."""

    # --- files ------------------------------------------------------------------------------------
    async def put_file(self, meta: dict, content: str) -> None:
        """A whole (gateway-made) file at once: batch outputs."""
        up = await self.open_upload(meta["id"])
        data = content.encode("utf-8")
        for i in range(0, len(data), FILE_CHUNK):
            await up.write(data[i:i + FILE_CHUNK])
        await up.commit(meta)

    async def open_upload(self, file_id: str) -> Upload:
        raise NotImplementedError

    async def get_file(self, file_id: str) -> dict | None:
        """The file's meta; None when unknown or expired."""
        raise NotImplementedError

    def read_file(self, file_id: str) -> AsyncIterator[bytes]:
        """The file's bytes, FILE_CHUNK at a time (nothing for an unknown file)."""
        raise NotImplementedError

    async def get_file_content(self, file_id: str) -> str | None:
        if await self.get_file(file_id) is None:
            return None
        return b"".join([c async for c in self.read_file(file_id)]).decode("utf-8")

    async def delete_file(self, file_id: str) -> bool:
        raise NotImplementedError

    async def list_files(self) -> list[dict]:
        """Newest first, expired ones left out."""
        raise NotImplementedError

    async def purge_expired_files(self) -> int:
        """Delete files past their expires_at; returns how many."""
        n = 0
        for meta in await self.list_files_all():
            if expired(meta):
                n += await self.delete_file(meta["id"])
        return n

    async def list_files_all(self) -> list[dict]:
        """Every stored file's meta, expired ones too."""
        raise NotImplementedError

    # --- batch objects and results -------------------------------------------------------------------
    async def put_batch(self, doc: dict) -> None:
        raise NotImplementedError

    async def get_batch(self, batch_id: str) -> dict | None:
        raise NotImplementedError

    async def list_batches(self) -> list[dict]:
        """Newest first."""
        raise NotImplementedError

    async def batch_stats(self, batch_id: str) -> BatchStats:
        raise NotImplementedError

    async def batch_results(self, batch_id: str) -> tuple[dict[int, str], dict[int, str]]:
        """(output lines, error lines) by input line index."""
        raise NotImplementedError

    async def claim_final(self, batch_id: str, holder: str) -> bool:
        """True for exactly one caller: that one writes the output files."""
        raise NotImplementedError

    # --- the queue ---------------------------------------------------------------------------------
    async def enqueue_batch(self, batch_id: str, items: list[QueuedRequest],
                            failed: dict[int, str] | None = None) -> None:
        """Queue every request of a new batch and set its pending count; `failed`: error-file lines of input
        lines that could not run (by line index), recorded as failed at once."""
        raise NotImplementedError

    async def claim_next(self, holder: str, lease_s: float, skip_models: Collection[str] = ()
                         ) -> QueuedRequest | None:
        """Take the earliest-deadline request whose model is not in `skip_models` (those have no room now and
        stay queued, looking at most CLAIM_SCAN requests deep); it returns to the queue unless renewed within
        lease_s."""
        raise NotImplementedError

    async def renew_claims(self, request_ids: list[str], lease_s: float) -> None:
        raise NotImplementedError

    async def requeue(self, req: QueuedRequest) -> None:
        """A claimed request goes back to its place in the queue (evicted, or no room after all)."""
        raise NotImplementedError

    async def finish_request(self, req: QueuedRequest, ok: bool, line: str, input_tokens: int = 0,
                             output_tokens: int = 0) -> int:
        """Record a claimed request's result line; returns the batch's pending count, or -1 if the request
        already had a result (a re-run after a lost claim: the first result stands)."""
        raise NotImplementedError

    async def drop_queued(self, batch_id: str, count: int, expire_message: str | None = None) -> int:
        """Remove the batch's still-queued requests (cancel; with expire_message: expiry, which writes a
        batch_expired error line for each). Returns how many were removed."""
        raise NotImplementedError

    async def reap_claims(self) -> int:
        """Return requests whose claim lease ran out to the queue; returns how many."""
        raise NotImplementedError

    async def queue_snapshot(self) -> QueueSnapshot:
        raise NotImplementedError

    # --- leases ------------------------------------------------------------------------------------
    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        """Take or renew the named lease; True while `holder` has it."""
        raise NotImplementedError

    async def release_lease(self, name: str, holder: str) -> None:
        raise NotImplementedError


# ---- in-process implementation -------------------------------------------------------------------
class _DiskUpload(Upload):
    def __init__(self, jobs: _MemJobs, file_id: str) -> None:
        self.jobs, self.file_id = jobs, file_id
        self.path = os.path.join(jobs.directory(), file_id)
        self.f = open(self.path, "wb")  # noqa: SIM115 - closed in commit/abort

    async def write(self, data: bytes) -> None:
        self.f.write(data)

    async def commit(self, meta: dict) -> None:
        self.f.close()
        self.jobs.files[self.file_id] = dict(meta)

    async def abort(self) -> None:
        self.f.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


@dataclass
class _MemJobs:
    files: dict[str, dict] = field(default_factory=dict)   # id -> meta; the bytes are on disk
    dir: str | None = None
    batches: dict[str, dict] = field(default_factory=dict)
    stats: dict[str, BatchStats] = field(default_factory=dict)
    final: dict[str, str] = field(default_factory=dict)
    out: dict[str, dict[int, str]] = field(default_factory=dict)
    err: dict[str, dict[int, str]] = field(default_factory=dict)
    queue: BatchQueue = field(default_factory=BatchQueue)
    running: dict[str, tuple[QueuedItem, float]] = field(default_factory=dict)  # id -> (item, claim expiry)
    leases: dict[str, tuple[str, float]] = field(default_factory=dict)

    def directory(self) -> str:
        if self.dir is None:
            self.dir = tempfile.mkdtemp(prefix="fleetgate-files-")
        return self.dir


class MemoryJobs(JobStore):
    """Plain dicts and a BatchQueue; one process, lost on exit."""

    @property
    def _jobs(self) -> _MemJobs:
        j = self.__dict__.get("_jobs_state")
        if j is None:
            j = self.__dict__["_jobs_state"] = _MemJobs()
        return j

    def close_files(self) -> None:
        """Remove the files' directory (the store is closing; its state goes with the process)."""
        j = self._jobs
        if j.dir is not None:
            shutil.rmtree(j.dir, ignore_errors=True)
            j.dir = None
        j.files.clear()

    async def open_upload(self, file_id: str) -> Upload:
        return _DiskUpload(self._jobs, file_id)

    async def get_file(self, file_id: str) -> dict | None:
        meta = self._jobs.files.get(file_id)
        return dict(meta) if meta is not None and not expired(meta) else None

    async def read_file(self, file_id: str) -> AsyncIterator[bytes]:
        if file_id not in self._jobs.files:
            return
        try:
            f = open(os.path.join(self._jobs.directory(), file_id), "rb")  # noqa: SIM115
        except OSError:
            return
        with f:
            while chunk := f.read(FILE_CHUNK):
                yield chunk
                await asyncio.sleep(0)

    async def delete_file(self, file_id: str) -> bool:
        if self._jobs.files.pop(file_id, None) is None:
            return False
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self._jobs.directory(), file_id))
        return True

    async def list_files(self) -> list[dict]:
        now = time.time()
        return sorted((dict(m) for m in self._jobs.files.values() if not expired(m, now)),
                      key=lambda m: -m["created_at"])

    async def list_files_all(self) -> list[dict]:
        return [dict(m) for m in self._jobs.files.values()]

    async def put_batch(self, doc: dict) -> None:
        self._jobs.batches[doc["id"]] = orjson.loads(orjson.dumps(doc))

    async def get_batch(self, batch_id: str) -> dict | None:
        doc = self._jobs.batches.get(batch_id)
        return orjson.loads(orjson.dumps(doc)) if doc is not None else None

    async def list_batches(self) -> list[dict]:
        docs = [orjson.loads(orjson.dumps(d)) for d in self._jobs.batches.values()]
        return sorted(docs, key=lambda d: (-d["created_at"], d["id"]))

    async def batch_stats(self, batch_id: str) -> BatchStats:
        s = self._jobs.stats.get(batch_id)
        return BatchStats(**asdict(s)) if s is not None else BatchStats()

    async def batch_results(self, batch_id: str) -> tuple[dict[int, str], dict[int, str]]:
        j = self._jobs
        return dict(j.out.get(batch_id, {})), dict(j.err.get(batch_id, {}))

    async def claim_final(self, batch_id: str, holder: str) -> bool:
        return self._jobs.final.setdefault(batch_id, holder) == holder

    async def enqueue_batch(self, batch_id: str, items: list[QueuedRequest],
                            failed: dict[int, str] | None = None) -> None:
        j = self._jobs
        j.stats[batch_id] = BatchStats(pending=len(items), failed=len(failed or {}))
        if failed:
            j.err.setdefault(batch_id, {}).update(failed)
        for it in items:
            j.queue.push(it.request_id, it.deadline, it, it.prompt_tokens)

    async def claim_next(self, holder: str, lease_s: float, skip_models: Collection[str] = ()
                         ) -> QueuedRequest | None:
        j = self._jobs
        passed: list[QueuedItem] = []
        found = None
        while j.queue and len(passed) < CLAIM_SCAN:
            item = j.queue.pop()
            if item.payload.model in skip_models:
                passed.append(item)
                continue
            found = item
            break
        for item in passed:
            j.queue.requeue(item)
        if found is None:
            return None
        j.running[found.request_id] = (found, time.monotonic() + lease_s)
        return found.payload

    async def renew_claims(self, request_ids: list[str], lease_s: float) -> None:
        until = time.monotonic() + lease_s
        for rid in request_ids:
            hit = self._jobs.running.get(rid)
            if hit is not None:
                self._jobs.running[rid] = (hit[0], until)

    async def requeue(self, req: QueuedRequest) -> None:
        hit = self._jobs.running.pop(req.request_id, None)
        if hit is not None:
            self._jobs.queue.requeue(hit[0])

    async def finish_request(self, req: QueuedRequest, ok: bool, line: str, input_tokens: int = 0,
                             output_tokens: int = 0) -> int:
        j = self._jobs
        j.running.pop(req.request_id, None)
        j.queue.remove(req.request_id)
        out, err = j.out.setdefault(req.batch_id, {}), j.err.setdefault(req.batch_id, {})
        if req.index in out or req.index in err:
            return -1
        (out if ok else err)[req.index] = line
        s = j.stats.setdefault(req.batch_id, BatchStats())
        if ok:
            s.completed += 1
        else:
            s.failed += 1
        s.input_tokens += input_tokens
        s.output_tokens += output_tokens
        s.pending -= 1
        return s.pending

    async def drop_queued(self, batch_id: str, count: int, expire_message: str | None = None) -> int:
        j = self._jobs
        s = j.stats.setdefault(batch_id, BatchStats())
        err = j.err.setdefault(batch_id, {})
        removed = 0
        for i in range(count):
            item = j.queue.remove(request_id_for(batch_id, i))
            if item is None:
                continue
            removed += 1
            s.pending -= 1
            if expire_message is not None and i not in err:
                err[i] = expired_line(item.payload, expire_message)
                s.failed += 1
        return removed

    async def reap_claims(self) -> int:
        j = self._jobs
        now = time.monotonic()
        late = [rid for rid, (_, until) in j.running.items() if until < now]
        for rid in late:
            item, _ = j.running.pop(rid)
            j.queue.requeue(item)
        return len(late)

    async def queue_snapshot(self) -> QueueSnapshot:
        j = self._jobs
        depth: dict[str, int] = {}
        for item in j.queue._live.values():  # noqa: SLF001 - same package, read-only
            depth[item.payload.model] = depth.get(item.payload.model, 0) + 1
        return QueueSnapshot(depth, j.queue.deadline_counts(), len(j.running))

    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        now = time.monotonic()
        cur = self._jobs.leases.get(name)
        if cur is None or cur[0] == holder or cur[1] <= now:
            self._jobs.leases[name] = (holder, now + ttl_s)
            return True
        return False

    async def release_lease(self, name: str, holder: str) -> None:
        cur = self._jobs.leases.get(name)
        if cur is not None and cur[0] == holder:
            del self._jobs.leases[name]


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

