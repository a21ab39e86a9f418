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

import secrets
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson


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
    owner: str = ""          # the tenant id of the key that made the batch (gateway/tenancy/auth.py)

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
