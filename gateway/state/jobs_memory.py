"""Batch work kept in this process (`MemoryJobs`, mixed into MemoryStore): uploads in a private temporary
directory, the queue and batches in dicts. The interface is gateway/state/jobs.py's `JobStore`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import asdict, dataclass, field

import orjson

from gateway.state.jobs import (
    CLAIM_SCAN,
    FILE_CHUNK,
    BatchStats,
    JobStore,
    QueuedRequest,
    QueueSnapshot,
    Upload,
    expired,
    expired_line,
    request_id_for,
)
from policies.batch_queue import BatchQueue, QueuedItem


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
