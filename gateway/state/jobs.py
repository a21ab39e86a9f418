"""Durable batch work in the state store: uploaded files, batch objects, the deadline-ordered request queue,
and named leases (the autoscaler's leader lease).

`JobStore` is the interface (StateStore inherits it); `MemoryJobs` and `RedisJobs` are the two
implementations, mixed into MemoryStore and RedisStore. With Redis everything here survives a gateway
restart: a request a dead replica had claimed returns to the queue once its claim lease runs out.

Redis keys (after the store's prefix):
  file:<id>         hash  meta (JSON), data (the file's text)
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

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

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


class JobStore:
    """Interface. Defaults raise NotImplementedError so stores without batch support still construct."""

    # --- files ------------------------------------------------------------------------------------
    async def put_file(self, meta: dict, content: str) -> None:
        raise NotImplementedError

    async def get_file(self, file_id: str) -> dict | None:
        raise NotImplementedError

    async def get_file_content(self, file_id: str) -> str | None:
        raise NotImplementedError

    async def list_files(self) -> list[dict]:
        """Newest first."""
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
    async def enqueue_batch(self, batch_id: str, items: list[QueuedRequest]) -> None:
        """Queue every request of a new batch and set its pending count."""
        raise NotImplementedError

    async def claim_next(self, holder: str, lease_s: float) -> QueuedRequest | None:
        """Take the earliest-deadline request; it returns to the queue unless renewed within lease_s."""
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
@dataclass
class _MemJobs:
    files: dict[str, tuple[dict, str]] = field(default_factory=dict)
    batches: dict[str, dict] = field(default_factory=dict)
    stats: dict[str, BatchStats] = field(default_factory=dict)
    final: dict[str, str] = field(default_factory=dict)
    out: dict[str, dict[int, str]] = field(default_factory=dict)
    err: dict[str, dict[int, str]] = field(default_factory=dict)
    queue: BatchQueue = field(default_factory=BatchQueue)
    running: dict[str, tuple[QueuedItem, float]] = field(default_factory=dict)  # id -> (item, claim expiry)
    leases: dict[str, tuple[str, float]] = field(default_factory=dict)


class MemoryJobs(JobStore):
    """Plain dicts and a BatchQueue; one process, lost on exit."""

    @property
    def _jobs(self) -> _MemJobs:
        j = self.__dict__.get("_jobs_state")
        if j is None:
            j = self.__dict__["_jobs_state"] = _MemJobs()
        return j

    async def put_file(self, meta: dict, content: str) -> None:
        self._jobs.files[meta["id"]] = (dict(meta), content)

    async def get_file(self, file_id: str) -> dict | None:
        hit = self._jobs.files.get(file_id)
        return dict(hit[0]) if hit is not None else None

    async def get_file_content(self, file_id: str) -> str | None:
        hit = self._jobs.files.get(file_id)
        return hit[1] if hit is not None else None

    async def list_files(self) -> list[dict]:
        return sorted((dict(m) for m, _ in self._jobs.files.values()), key=lambda m: -m["created_at"])

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

    async def enqueue_batch(self, batch_id: str, items: list[QueuedRequest]) -> None:
        j = self._jobs
        j.stats[batch_id] = BatchStats(pending=len(items))
        for it in items:
            j.queue.push(it.request_id, it.deadline, it, it.prompt_tokens)

    async def claim_next(self, holder: str, lease_s: float) -> QueuedRequest | None:
        j = self._jobs
        if not j.queue:
            return None
        item = j.queue.pop()
        j.running[item.request_id] = (item, time.monotonic() + lease_s)
        return item.payload

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

# KEYS: bq, items, run, dl. ARGV: ttl_ms. Returns the claimed item's JSON or false.
_CLAIM = _NOW_MS + """
while true do
  local m = redis.call('ZRANGE', KEYS[1], 0, 0)
  if #m == 0 then return false end
  m = m[1]
  redis.call('ZREM', KEYS[1], m)
  local raw = redis.call('HGET', KEYS[2], m)
  if raw then
    local it = cjson.decode(raw)
    if redis.call('HINCRBY', KEYS[4], it.dl_key, -1) <= 0 then redis.call('HDEL', KEYS[4], it.dl_key) end
    redis.call('ZADD', KEYS[3], now + tonumber(ARGV[1]), m)
    return raw
  end
end
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


class RedisJobs(JobStore):
    """Uses the host RedisStore's client (`_client()`) and key prefix (`_k()`). Redis errors propagate:
    the Batch API answers 503 while Redis is away, and the runner retries on its next round."""

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
    async def put_file(self, meta: dict, content: str) -> None:
        k = self._k  # type: ignore[attr-defined]
        pipe = self._client().pipeline(transaction=True)  # type: ignore[attr-defined]
        pipe.hset(k(f"file:{meta['id']}"), mapping={"meta": orjson.dumps(meta), "data": content})
        pipe.zadd(k("files"), {meta["id"]: meta["created_at"]})
        await pipe.execute()

    async def get_file(self, file_id: str) -> dict | None:
        raw = await self._client().hget(self._k(f"file:{file_id}"), "meta")  # type: ignore[attr-defined]
        return orjson.loads(raw) if raw is not None else None

    async def get_file_content(self, file_id: str) -> str | None:
        return await self._client().hget(self._k(f"file:{file_id}"), "data")  # type: ignore[attr-defined]

    async def list_files(self) -> list[dict]:
        r, k = self._client(), self._k  # type: ignore[attr-defined]
        ids = await r.zrevrange(k("files"), 0, -1)
        if not ids:
            return []
        pipe = r.pipeline(transaction=False)
        for fid in ids:
            pipe.hget(k(f"file:{fid}"), "meta")
        return [orjson.loads(m) for m in await pipe.execute() if m is not None]

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
    async def enqueue_batch(self, batch_id: str, items: list[QueuedRequest]) -> None:
        r, k = self._client(), self._k  # type: ignore[attr-defined]
        bq, items_key, _, dl = self._qkeys()
        counts: dict[str, int] = {}
        for it in items:
            counts[it.dl_key] = counts.get(it.dl_key, 0) + 1
        pipe = r.pipeline(transaction=True)
        pipe.hset(k(f"bstat:{batch_id}"), mapping={"pending": len(items), "completed": 0, "failed": 0,
                                                   "in_tok": 0, "out_tok": 0})
        for i in range(0, len(items), _ENQUEUE_CHUNK):
            chunk = items[i:i + _ENQUEUE_CHUNK]
            pipe.hset(items_key, mapping={it.request_id: it.to_json() for it in chunk})
            pipe.zadd(bq, {it.request_id: it.deadline for it in chunk})
        for key, n in counts.items():
            pipe.hincrby(dl, key, n)
        await pipe.execute()

    async def claim_next(self, holder: str, lease_s: float) -> QueuedRequest | None:
        raw = await self._script("claim", _CLAIM)(keys=self._qkeys(), args=[max(1, int(lease_s * 1000))])
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
