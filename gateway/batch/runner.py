"""Runs queued batch requests on spare capacity through the normal dispatch path; writes the result files.

The runner (one per gateway replica) claims the earliest-deadline request from the durable queue
(gateway/state/jobs.py) whenever a worker that may take batch work has a free slot and no interactive
request is waiting for that model, and replays it through `Dispatcher.handle` as a local, non-streaming
request with `X-Request-Class: batch`: same validation, placement policy, caps, reservations, retries,
metrics and learning as any other request. Its claim is renewed every lease_s / 3; a replica that dies
stops renewing, and any replica's reaper returns the request to the queue after lease_s.

`ClassRouter` is the dispatcher's hook for request classes and worker types (Chiron section 3):
- candidates (the placement step's pool filter, policies/autoscale/routing.py, the same in the simulator): a
  request goes to workers of its own type (label `pool`: interactive | batch) with room and spills to `mixed`
  (unlabelled) workers with room; no room: it waits;
- an interactive request that finds no room evicts a batch request of this replica from the mixed worker
  running the most batch work (policies.autoscale.routing.eviction_victim): the runner "disconnects"
  (the relay closes the upstream request, vLLM aborts it) and the request returns to its place in the queue;
- a runner request that finds no room is not queued in the interactive admission queue: it gets a 429
  at once and goes back to the batch queue;
- it counts interactive and batch requests in flight per worker (the autoscaler's busy measure).

Streaming inside, one answer outside: a request the resume continuation can carry (gateway/wire/resume.py
`resumable`, and no tools) goes to the worker as a stream with usage on every chunk, and the runner folds the
events into the non-streaming body an uninterrupted answer has (the text, finish_reason, the original prompt's
tokens and every completion token, the first leg's id/created/model). When such a request is evicted after
producing tokens, what it produced stays with this replica and its next run is the continuation (the prompt
plus that text, `max_tokens` less its tokens), placed like any batch request by its pool's router: it goes on
where it stopped instead of starting again. Other requests run non-streaming and restart as before, and so
does a continued request claimed by another replica (the produced text is held in this replica's memory).

Results: a 2xx answer is an output-file line, anything else an error-file line (OpenAI's format); the
gateway's own "no capacity" answers (429 capacity_exceeded, 503 no_healthy_worker) and evictions requeue.
When a batch's last request resolves, exactly one replica (claim in the store) writes the output and error
files and moves the batch to completed / cancelled / expired.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from gateway.batch.progress import BatchProgressLog
from gateway.request.hooks import RequestHook
from gateway.request.parse import CHAT, ROUTES
from gateway.state.jobs import (
    BatchStats,
    QueuedRequest,
    QueueSnapshot,
    StoreUnavailableError,
    expired_line,
    new_id,
)
from gateway.state.outage import LoopErrors, stop_task
from gateway.tenancy.auth import SCOPE_TENANT, Tenant
from gateway.wire import errors
from gateway.wire.resume import Delivered, continuation_body, read_delivered, resumable, sse_objects
from policies.autoscale.global_ import POOL_INTERACTIVE, POOL_MIXED
from policies.autoscale.observation import OutputStats
from policies.autoscale.routing import eviction_victim
from policies.types import CLASS_BATCH, RequestFeatures

if TYPE_CHECKING:
    from gateway.config import GatewayConfig
    from gateway.fleet.registry import Registry, WorkerState
    from gateway.ops.metrics import GatewayMetrics
    from gateway.pipeline.dispatch import Dispatcher
    from gateway.request.context import ModelRuntime, RequestContext
    from gateway.state.base import StateStore

log = logging.getLogger("fleetgate.batch")

_ACTIVE_STATUSES = ("validating", "in_progress", "cancelling", "finalizing")
_REQUEUE_CODES = ("capacity_exceeded", "slo_unattainable", "no_healthy_worker")
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
EVICT_WAIT_S = 5.0
SWEEP_S = 1.0
PURGE_S = 60.0


def worker_pool(labels: dict[str, str]) -> str:
    return labels.get("pool", POOL_MIXED)


@dataclass(slots=True)
class _Run:
    item: QueuedRequest
    started: float
    task: asyncio.Task | None = None
    worker: str | None = None
    evicted: bool = False
    evict: asyncio.Event = field(default_factory=asyncio.Event)
    chunks: list[bytes] = field(default_factory=list)   # the answer's bytes as they arrive


@dataclass(slots=True)
class Produced:
    """What a streamed batch request has produced over its runs so far (its continuation goes on from here)."""

    text: str = ""
    tokens: int = 0
    id: str | None = None
    created: int | None = None
    model: str | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: Any = None          # an error event that ended the stream
    deadline: float = 0.0      # the request's deadline: a held continuation is dropped after it


class ClassRouter(RequestHook):
    """The dispatcher's request hook for request classes (see the module docstring; gateway/request/hooks.py: `placed`,
    `released`) and its `no_room` step. All methods are O(workers) at most and do no I/O, except `no_room`,
    which may wait for an evicted request to leave its worker."""

    def __init__(self, registry: Registry, runner: BatchRunner) -> None:
        self.registry = registry
        self.runner = runner
        self.pools_in_use = False
        self.counts: dict[str, list[int]] = {}       # worker -> [interactive, batch] in flight (this replica)
        self.interactive_arrived = 0                   # cumulative, for the arrival rate (demand, not dispatches)
        registry.on_change(self.refresh)

    def refresh(self) -> None:
        """Whether the fleet has pools (labelled workers) now."""
        self.pools_in_use = any(worker_pool(ws.rec.labels) != POOL_MIXED for ws in self.registry.workers.values())

    def arrived(self, ctx: RequestContext) -> None:
        """Request hook: a request arrived for a model (counted once, before any placement, retry or fallback):
        the autoscaler's arrival rate counts interactive ones (policies/autoscale/observation.py: demand, as the
        simulator counts)."""
        if ctx.feats.request_class != CLASS_BATCH:
            self.interactive_arrived += 1

    def placed(self, ctx: RequestContext, worker: WorkerState) -> None:
        feats, worker_id = ctx.feats, worker.id
        c = self.counts.get(worker_id)
        if c is None:
            c = self.counts[worker_id] = [0, 0]
        if feats.request_class == CLASS_BATCH:
            c[1] += 1
        else:
            c[0] += 1
        run = self.runner.active.get(feats.request_id)
        if run is not None:
            run.worker = worker_id

    def released(self, ctx: RequestContext, worker: WorkerState) -> None:
        feats, worker_id = ctx.feats, worker.id
        c = self.counts.get(worker_id)
        if c is not None:
            c[1 if feats.request_class == CLASS_BATCH else 0] -= 1
            if c == [0, 0]:
                del self.counts[worker_id]
        run = self.runner.active.get(feats.request_id)
        if run is not None and run.worker == worker_id:
            run.worker = None

    async def no_room(self, rt: ModelRuntime, feats: RequestFeatures) -> None:
        """Called before a request would wait in the admission queue."""
        if feats.request_id in self.runner.active:
            raise errors.overloaded(rt.model, 1.0, "no spare capacity for batch work right now")
        if feats.request_class != CLASS_BATCH:
            await self.runner.evict_for(rt.model)


class BatchRunner:
    def __init__(self, config: GatewayConfig, store: StateStore, registry: Registry, metrics: GatewayMetrics) -> None:
        self.config = config
        self.cfg = config.batch
        self.store = store
        self.registry = registry
        self.metrics = metrics
        self.router = ClassRouter(registry, self)
        self.active: dict[str, _Run] = {}
        self.dispatcher: Dispatcher | None = None
        self.outputs = OutputStats()
        self.batch_tokens = 0              # output tokens of finished batch requests (this replica, cumulative)
        self.evictions = 0
        self.continued = 0                 # evictions whose request keeps its tokens (its next run continues)
        self.restarted = 0                 # evictions whose request starts again from scratch
        self.produced: dict[str, Produced] = {}   # request id -> tokens kept from its evicted runs
        self.snapshot = QueueSnapshot()    # last read of the shared queue
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._backoff_until = 0.0
        self._evicting = 0                 # interactive requests freeing a slot: no new batch work meanwhile
        self.progress_log = BatchProgressLog()  # progress lines and stall warnings (gateway/batch/progress.py)

    # --- lifecycle --------------------------------------------------------------------------------
    async def start(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self.router.refresh()
        if self.cfg.enabled and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="fg-batch-runner")

    async def stop(self) -> None:
        """Stop claiming; hand running requests back to the queue (a successor replica runs them)."""
        task, self._task = self._task, None
        await stop_task(task)
        runs = list(self.active.values())
        for run in runs:
            run.evicted = True
            run.evict.set()
        tasks = [r.task for r in runs if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=EVICT_WAIT_S)

    def wake(self) -> None:
        self._wake.set()

    # --- submission and lifecycle of batch objects (called by gateway/api/batch.py) ---------------------
    async def submit(self, doc: dict[str, Any], items: list[QueuedRequest],
                     failed: dict[int, str] | None = None) -> dict[str, Any]:
        """Queue a checked batch; `failed`: error lines of input lines that cannot run (already failed)."""
        doc.update(status="in_progress", in_progress_at=int(time.time()),
                   request_counts={"total": len(items) + len(failed or {}), "completed": 0,
                                   "failed": len(failed or {})})
        await self.store.put_batch(doc)
        await self.store.enqueue_batch(doc["id"], items, failed)
        if not items:  # nothing to run: done now
            await self.finalize(doc["id"])
            return await self.store.get_batch(doc["id"]) or doc
        self.wake()
        return doc

    async def cancel(self, doc: dict[str, Any]) -> dict[str, Any]:
        if doc["status"] not in ("cancelling", "cancelled"):
            doc.update(status="cancelling", cancelling_at=int(time.time()))
            await self.store.put_batch(doc)
            await self.store.drop_queued(doc["id"], doc["request_counts"]["total"])
            if (await self.store.batch_stats(doc["id"])).pending <= 0:
                await self.finalize(doc["id"])
        return await self.with_counts(await self.store.get_batch(doc["id"]) or doc)

    async def with_counts(self, doc: dict[str, Any]) -> dict[str, Any]:
        """The stored object with live request counts and usage while the batch runs."""
        if doc["status"] in _ACTIVE_STATUSES:
            _set_counts(doc, await self.store.batch_stats(doc["id"]))
        return doc

    async def finalize(self, batch_id: str) -> None:
        """Write the output and error files and close the batch (one replica wins the claim)."""
        for rid in [rid for rid in self.produced if rid.startswith(batch_id + "-")]:
            del self.produced[rid]   # cancelled or expired while it waited to continue
        if not await self.store.claim_final(batch_id, self.store.replica_id):
            return
        doc = await self.store.get_batch(batch_id)
        if doc is None:
            return
        final = ("cancelled" if doc["status"] == "cancelling"
                 else "expired" if doc.get("_fg_expiring") else "completed")
        doc.update(status="finalizing", finalizing_at=int(time.time()))
        await self.store.put_batch(doc)
        out, err = await self.store.batch_results(batch_id)
        ttl = doc.get("_fg_output_ttl_s") or self.cfg.file_ttl_s
        for lines, key, purpose in ((out, "output_file_id", "batch_output"), (err, "error_file_id", "batch_output")):
            if lines:
                text = "".join(lines[i] + "\n" for i in sorted(lines))
                fid = new_id("file-")
                now = int(time.time())
                await self.store.put_file({"id": fid, "object": "file", "bytes": len(text.encode()),
                                           "created_at": now, "filename": f"{batch_id}_{key[:-8]}.jsonl",
                                           "purpose": purpose, "status": "processed", "expires_at": now + int(ttl),
                                           "status_details": None, "_fg_owner": doc.get("_fg_owner", "")}, text)
                doc[key] = fid
        _set_counts(doc, await self.store.batch_stats(batch_id))
        doc["status"] = final
        doc[f"{final}_at"] = int(time.time())
        await self.store.put_batch(doc)
        log.info("batch %s %s: %s", batch_id, final, doc["request_counts"])

    # --- the loop ---------------------------------------------------------------------------------
    async def _loop(self) -> None:
        lease = self.cfg.lease_s
        next_renew = next_reap = next_sweep = next_purge = 0.0
        failures = LoopErrors(log, "batch runner round")
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.cfg.poll_s):
                    await self._wake.wait()
            self._wake.clear()
            with failures.round():  # a control loop must survive anything (Redis away: the next round)
                now = time.monotonic()
                if now >= next_renew and self.active:
                    await self.store.renew_claims(list(self.active), lease)
                    next_renew = now + lease / 3
                if now >= next_reap:
                    if await self.store.reap_claims():
                        log.info("returned claims of a stopped replica to the batch queue")
                    next_reap = now + max(0.2, lease / 2)
                if now >= next_sweep:
                    await self._sweep()
                    next_sweep = now + SWEEP_S
                if now >= next_purge:
                    if n := await self.store.purge_expired_files():
                        log.info("deleted %d expired file(s)", n)
                    next_purge = now + PURGE_S
                if now >= self._backoff_until:
                    await self._fill()


    async def _sweep(self) -> None:
        """Expire batches past their window; refresh the queue snapshot and its depth gauges."""
        now = time.time()
        for doc in await self.store.list_batches():
            if doc["status"] == "in_progress" and doc["expires_at"] <= now and not doc.get("_fg_expiring"):
                doc["_fg_expiring"] = True
                await self.store.put_batch(doc)
                await self.store.drop_queued(doc["id"], doc["request_counts"]["total"], EXPIRED_MESSAGE)
                if (await self.store.batch_stats(doc["id"])).pending <= 0:
                    await self.finalize(doc["id"])
        for rid in [rid for rid, p in self.produced.items() if p.deadline <= now]:
            del self.produced[rid]   # run elsewhere or expired: nobody continues it here
        self.snapshot = await self.store.queue_snapshot()
        self.metrics.set_batch_queue_depth(self.snapshot.depth)
        await self.progress_log.sweep(self.store, self.snapshot)

    async def _fill(self) -> None:
        """Start queued requests while there is room. A request whose model has no room now goes back to its
        place and later claims pass over that model: no request blocks the ones behind it."""
        assert self.dispatcher is not None
        full: set[str] = set()
        while len(self.active) < self.cfg.max_inflight and self.room(None) > 0:
            item = await self.store.claim_next(self.store.replica_id, self.cfg.lease_s, full)
            if item is None:
                return
            if item.deadline <= time.time():
                pending = await self.store.finish_request(item, False, expired_line(item, EXPIRED_MESSAGE))
                if pending == 0:
                    await self.finalize(item.batch_id)
                continue
            if self.room(item.model) <= 0:
                await self.store.requeue(item)
                full.add(item.model)
                continue
            run = _Run(item, time.monotonic())
            self.active[item.request_id] = run
            run.task = asyncio.create_task(self._execute(run), name=f"fg-batch-{item.request_id}")

    def room(self, model: str | None) -> int:
        """Free batch slots for `model` (None: any model): workers of the batch and mixed pools under their
        cap (or slots_per_worker when uncapped), minus runs not placed yet; 0 while interactive work waits."""
        assert self.dispatcher is not None
        if self._evicting:
            return 0
        if model is None or not model:
            models = self.registry.served_models() if model is None else self._default_model()
        else:
            models = [model]
        inflight = self.dispatcher.store.inflight()
        unplaced: dict[str, int] = {}
        for run in self.active.values():
            if run.worker is None:
                unplaced[run.item.model] = unplaced.get(run.item.model, 0) + 1
        best = 0
        for m in models:
            rt = self.dispatcher.runtimes.get(m)
            if rt is not None and len(rt.queue):
                continue
            free = 0
            for ws in self.registry.rotation(m):
                if self.router.pools_in_use and worker_pool(ws.rec.labels) == POOL_INTERACTIVE:
                    continue
                f = inflight.get(ws.id)
                free += max(0, (ws.rec.cap or self.cfg.slots_per_worker) - (f.requests if f is not None else 0))
            free -= unplaced.get(m, 0) + (unplaced.get("", 0) if len(models) == 1 else 0)
            best = max(best, free)
        return best

    def _default_model(self) -> list[str]:
        served = self.registry.served_models()
        return served[:1] if len(served) == 1 else []

    # --- one request ------------------------------------------------------------------------------
    async def _execute(self, run: _Run) -> None:
        item = run.item
        status, chunks = 0, run.chunks
        chat = ROUTES.get(item.url) is CHAT
        before = self.produced.pop(item.request_id, None)
        streamed = _streamable(item.body, chat)

        async def send(msg: dict[str, Any]) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            elif msg.get("body"):
                chunks.append(msg["body"])

        try:
            if not streamed:
                body = {k: v for k, v in item.body.items() if k not in ("stream", "stream_options")}
            else:
                body = {**item.body, "stream": True,
                        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
                if before is not None:
                    body = continuation_body(body, chat, before.text, before.tokens)
            if body is None:   # it had produced everything but the end: answered from what it has
                streamed, status = False, 200
                chunks.append(_folded(before, None, chat))
            else:
                await self._dispatch(run, body, send)
        except Exception:
            log.exception("batch request %s crashed in the runner", item.request_id)
            status = 0
        finally:
            self.active.pop(item.request_id, None)
            self.wake()
        await self._record(run, before, streamed, chat, status, b"".join(chunks))

    async def _dispatch(self, run: _Run, body: dict[str, Any], send: Any) -> None:
        """Replay the request through the dispatcher as a local batch-class request; an eviction disconnects it."""
        item = run.item
        raw = orjson.dumps(body)
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await run.evict.wait()
            return {"type": "http.disconnect"}

        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                   (b"x-request-id", item.request_id.encode()), (b"x-request-class", b"batch")]
        # The batch's owner was authenticated by the Batch API; its key's rate limits are for interactive
        # traffic (batch work runs on spare capacity), so the request carries the owner without limits.
        owner = Tenant(item.owner, f"batch owner {item.owner[:8]}", source="batch")
        scope = {"type": "http", "method": "POST", "path": item.url, "query_string": b"", "headers": headers,
                 SCOPE_TENANT: owner}
        assert self.dispatcher is not None
        await self.dispatcher.handle(scope, receive, send, ROUTES[item.url])

    async def _record(self, run: _Run, before: Produced | None, streamed: bool, chat: bool, status: int,
                      payload: bytes) -> None:
        item = run.item
        try:
            if streamed and status == 200:
                leg = _leg(payload)
                if run.evicted and leg.finish_reason is None and leg.error is None:
                    self._keep(run, before, leg)
                    status, payload = 0, b""   # back to the queue (as any eviction); its next run continues
                else:
                    run.evicted = False         # it finished before the eviction took hold
                    status, payload = (200, _folded(before, leg, chat)) if leg.finish_reason is not None \
                        else (502, orjson.dumps({"error": leg.error or {
                            "message": "the stream ended without finishing", "type": "upstream_error"}}))
            elif streamed and before is not None:
                self.produced[item.request_id] = before   # not run (no room, or evicted before its first byte)
            await self._settle(run, status, payload)
        except StoreUnavailableError:  # the store logs its outage; the claim lease returns the request to the queue
            log.debug("batch request %s not recorded: the store is unreachable", item.request_id)
        except Exception:  # the claim lease returns it to the queue
            log.exception("could not record batch request %s", item.request_id)

    async def _settle(self, run: _Run, status: int, payload: bytes) -> None:
        item = run.item
        try:
            body: Any = orjson.loads(payload) if payload else None
        except orjson.JSONDecodeError:
            body = {"error": {"message": payload[:2000].decode("utf-8", "replace"), "type": "upstream_error"}}
        code = body.get("error", {}).get("code") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None
        if run.evicted or status in (0, 499) or (status in (429, 503) and code in _REQUEUE_CODES):
            if status in (429, 503):
                self._backoff_until = time.monotonic() + self.cfg.poll_s
            if run.evicted:
                self.evictions += 1
                if item.request_id in self.produced:
                    self.continued += 1
                else:
                    self.restarted += 1
            await self.store.requeue(item)
            return
        ok = 200 <= status < 300
        line = orjson.dumps({"id": f"batch_req_{item.request_id}", "custom_id": item.custom_id,
                             "response": {"status_code": status, "request_id": item.request_id, "body": body},
                             "error": None}).decode()
        usage = body.get("usage") if ok and isinstance(body, dict) else None
        n_in = int(usage.get("prompt_tokens") or 0) if isinstance(usage, dict) else 0
        n_out = int(usage.get("completion_tokens") or 0) if isinstance(usage, dict) else 0
        if ok:
            self.outputs.add(n_out)
            self.batch_tokens += n_out
        pending = await self.store.finish_request(item, ok, line, n_in, n_out)
        if pending == 0:
            await self.finalize(item.batch_id)

    def _keep(self, run: _Run, before: Produced | None, leg: Produced) -> None:
        """An evicted stream: keep what it produced, so its next run continues (nothing produced: a restart)."""
        item = run.item
        p = before if before is not None else Produced(deadline=item.deadline)
        if leg.tokens == 0 and not leg.text:
            if before is not None:
                self.produced[item.request_id] = before
            return
        if p.id is None:
            p.id, p.created, p.model = leg.id, leg.created, leg.model
        if p.prompt_tokens is None and leg.prompt_tokens is not None:
            p.prompt_tokens = leg.prompt_tokens - p.tokens   # a continuation's prompt holds the earlier text
        p.text += leg.text
        p.tokens += leg.tokens
        self.produced[item.request_id] = p
        log.info("batch request %s evicted after %d tokens: it continues from them on its next run",
                 item.request_id, p.tokens)

    # --- eviction ---------------------------------------------------------------------------------
    async def evict_for(self, model: str) -> bool:
        """Free a slot for an interactive request: evict this replica's newest batch request on the mixed
        worker running the most batch work (Chiron section 3). True if one was evicted."""
        assert self.dispatcher is not None
        per_worker: dict[str, int] = {}
        for run in self.active.values():
            if run.worker is not None and not run.evicted:
                per_worker[run.worker] = per_worker.get(run.worker, 0) + 1
        if not per_worker:
            return False
        inflight = self.dispatcher.store.inflight()
        views = []
        for ws in self.registry.rotation(model):
            f = inflight.get(ws.id)
            views.append(ws.view(f.requests if f else 0, f.tokens if f else 0))
        wid = eviction_victim(views, per_worker)
        if wid is None:
            return False
        self._evicting += 1
        try:  # the caller enters the admission queue right after, before the runner looks for room again
            return await self.evict_on(wid, 1) > 0
        finally:
            self._evicting -= 1

    async def evict_on(self, worker_id: str, n: int | None = None) -> int:
        """Send up to n (None: all) of this replica's batch requests on a worker back to the queue and wait
        until they left it. Returns how many."""
        runs = sorted((r for r in self.active.values() if r.worker == worker_id and not r.evicted),
                      key=lambda r: -r.started)[:n]
        for run in runs:
            run.evicted = True
            run.evict.set()
        tasks = [r.task for r in runs if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=EVICT_WAIT_S)
        return len(runs)

    # --- measurements for the autoscaler ------------------------------------------------------------
    def class_counts(self) -> dict[str, tuple[int, int]]:
        return {w: (c[0], c[1]) for w, c in self.router.counts.items()}

    def running_on(self, workers: Sequence[str]) -> int:
        ids = set(workers)
        return sum(1 for r in self.active.values() if r.worker in ids)


def _set_counts(doc: dict[str, Any], s: BatchStats) -> None:
    total = doc.get("request_counts", {}).get("total", 0)
    doc["request_counts"] = {"total": total, "completed": s.completed, "failed": s.failed}
    doc["usage"] = {"input_tokens": s.input_tokens, "output_tokens": s.output_tokens,
                    "total_tokens": s.input_tokens + s.output_tokens,
                    "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}


def _streamable(body: dict[str, Any], chat: bool) -> bool:
    """Whether a batch request runs as a stream that an eviction can continue (module docstring)."""
    try:
        return resumable(body, chat) and not (chat and body.get("tools"))
    except (KeyError, IndexError, TypeError, AttributeError):   # a malformed body: the gateway's 400 as before
        return False


def _leg(payload: bytes) -> Produced:
    """One run's stream (its events, complete ones only) read into what it produced."""
    d: Delivered = read_delivered(payload)
    out = Produced(text=d.text, id=d.id, created=d.created, model=d.model, finish_reason=d.finish_reason)
    events = 0
    usage: dict[str, Any] | None = None
    for obj in sse_objects(payload):
        if "error" in obj:
            out.error = obj["error"]
            continue
        if isinstance(obj.get("usage"), dict):
            usage = obj["usage"]
        events += any(isinstance(c, dict) and ((c.get("delta") or {}).get("content") or c.get("text"))
                      for c in obj.get("choices") or ())
    if usage is not None:
        out.tokens = int(usage.get("completion_tokens") or 0)
        out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    else:   # no usage: the events bound the tokens from below
        out.tokens = events
    return out


def _folded(before: Produced | None, leg: Produced | None, chat: bool) -> bytes:
    """The non-streaming answer of all runs: the text, the last finish_reason, the original prompt's tokens and
    every completion token, the first run's id, created and model (the shape of vLLM's non-streaming body)."""
    first = before if before is not None else leg
    assert first is not None
    text = (before.text if before is not None else "") + (leg.text if leg is not None else "")
    tokens = (before.tokens if before is not None else 0) + (leg.tokens if leg is not None else 0)
    prompt = first.prompt_tokens if first.prompt_tokens is not None else 0
    finish = leg.finish_reason if leg is not None else "length"
    usage = {"prompt_tokens": prompt, "total_tokens": prompt + tokens, "completion_tokens": tokens,
             "prompt_tokens_details": None}
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                                          "audio": None, "function_call": None, "tool_calls": [],
                                          "reasoning_content": None},
                  "logprobs": None, "finish_reason": finish, "stop_reason": None, "token_ids": None}
        return orjson.dumps({"id": first.id, "object": "chat.completion", "created": first.created,
                             "model": first.model, "choices": [choice], "service_tier": None,
                             "system_fingerprint": None, "usage": usage, "prompt_logprobs": None,
                             "prompt_token_ids": None, "kv_transfer_params": None})
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
              "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None}
    return orjson.dumps({"id": first.id, "object": "text_completion", "created": first.created,
                         "model": first.model, "choices": [choice], "service_tier": None,
                         "system_fingerprint": None, "usage": usage, "kv_transfer_params": None})
