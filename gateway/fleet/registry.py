"""The worker registry: who the workers are, which are healthy, what they serve, how loaded they are.

The state store holds the shared record of each worker (so gateway replicas agree on the fleet);
this module keeps a local, synchronously readable copy for the hot path and runs the control loops:

- health: GET /health every `health.interval_s`; out of rotation after `failures_to_eject` failures
  in a row, back after `successes_to_restore` successes (a worker starts out of rotation and joins
  on its first success);
- outlier ejection: a worker that stalls against its pace (`suspect`) or fails request after request
  (`note_outcome`) leaves rotation for Envoy's backoff (policies/pace.py `ejection_s`: base x times ejected,
  capped; at most `resume.max_ejected_fraction` of its pool), and comes back only once a probe *generation*
  (a max_tokens=1 completion) succeeds: a zombie engine answers /health while it never generates;
- discovery: a worker without configured models gets them from its /v1/models;
- scrape: every `scrape_interval_s` the engine's /metrics via the engine adapter, into the store;
- sync: picks up workers added, drained or removed through another replica.

None of the loops is awaited by a request. They talk to workers through the gateway's one upstream client
(gateway/wire/upstream.py), with the same TLS, DNS and connection settings as the relay.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from engine_adapters.base import EngineAdapter
from engine_adapters.types import AWAKE
from gateway.config import GatewayConfig, WorkerConfig
from gateway.ops.metrics import GatewayMetrics
from gateway.state.base import WORKER_ACTIVE, WORKER_DRAINING, EngineMetrics, StateStore, WorkerRecord
from gateway.state.outage import quiet_loop, stop_task
from gateway.wire.upstream import UpstreamPool
from policies.pace import ejection_s, error_streak, may_eject, times_ejected
from policies.types import ROLE_MIXED, WorkerView

log = logging.getLogger("fleetgate.registry")


@dataclass(slots=True)
class WorkerState:
    """The local picture of one worker."""

    rec: WorkerRecord
    healthy: bool = False
    checked: bool = False  # at least one health check ran
    fails: int = 0  # consecutive failed checks
    oks: int = 0  # consecutive good checks
    models: tuple[str, ...] = ()  # configured, else discovered
    cards: list[dict[str, Any]] = field(default_factory=list)
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    discovered_at: float = 0.0
    weight: float = 1.0
    reported: bool | None = None  # the health last logged (None: nothing yet), so each change is logged once
    held_until: float = 0.0  # ejected: no health check restores it before this (time.monotonic())
    errors_in_row: int = 0  # requests that failed on it since its last success (outlier ejection)
    ejected: bool = False  # out as an outlier: back only after a probe generation succeeds
    ejections: int = 0  # Envoy's ejection multiplier (policies/pace.py times_ejected)
    restored_at: float = 0.0  # time.monotonic() it last came back from an ejection
    probing: bool = False  # a probe generation is under way
    held: bool = False  # the swap controller keeps it out: asleep or on its way there (gateway/control/pooling.py)
    sleep_told_at: float = 0.0  # time.monotonic() the swap controller last said what its engine is (set_sleep)
    # url prefixes, computed once
    chat_url: str = ""
    completions_url: str = ""

    @property
    def id(self) -> str:
        return self.rec.id

    @property
    def active(self) -> bool:
        return self.rec.state == WORKER_ACTIVE

    @property
    def awake(self) -> bool:
        """The engine is not asleep or paused (its last scraped vllm:engine_sleep_state) nor held by the swap
        controller: a sleeping engine takes no requests (docs/reference/vllm-interface.md §6.1)."""
        return not self.held and self.metrics.sleep_state == AWAKE

    def view(self, inflight: int, inflight_tokens: int) -> WorkerView:
        """What the policies see. `running` is the engine's scraped count, up to one scrape old: the requests
        sent since count as running unless that scrape said the engine queues (`waiting`). Taken as it was
        scraped, a burst onto idle workers found room (policies/autoscale/routing.py `has_room`: in flight <=
        running) for about one request per worker per scrape, and the rest waited at the gateway past their TTFT
        target (`fleetgate demo --autoscale`: 25 of 615 requests of its burst refused on warm workers). The
        simulator reads the engine's live count instead."""
        m = self.metrics
        r = self.rec
        running = max(int(m.running), inflight - int(m.waiting))
        return WorkerView(r.id, r.role, inflight, inflight_tokens, r.cap, running, int(m.waiting),
                          m.kv_usage, r.profile, self.weight, r.labels)


def record_from_config(w: WorkerConfig, source: str = "config") -> WorkerRecord:
    return WorkerRecord(id=w.id, url=w.url, role=w.role, models=list(w.models), labels=dict(w.labels),
                        profile=w.profile, cap=w.cap, source=source)


class Registry:
    def __init__(self, config: GatewayConfig, store: StateStore, adapter: EngineAdapter,
                 metrics: GatewayMetrics) -> None:
        self.config = config
        self.store = store
        self.adapter = adapter
        self.metrics = metrics
        self.workers: dict[str, WorkerState] = {}
        # model -> workers that may take a request for it (active, healthy, role mixed); rebuilt on change
        self._rotation: dict[str, tuple[WorkerState, ...]] = {}
        self._candidates: dict[str, tuple[WorkerState, ...]] = {}
        self._pools: dict[tuple[str, str], tuple[WorkerState, ...]] = {}  # (model, role) -> workers
        self._known_models: dict[str, dict[str, Any]] = {}
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()  # one-off probes of workers adopted by sync
        self.upstream: UpstreamPool | None = None  # the gateway's one client to workers (set by start)
        self._listeners: list[Callable[[], None]] = []
        self._route_asleep: set[str] = set()   # engines on turns hosts: they queue requests while paused/asleep
        self._eject_listeners: list[Callable[[str, bool], object]] = []
        self._scrape_listeners: list[Callable[[], None]] = []
        self._probe_timeout = config.health.timeout_s
        self.ejection = config.resume.ejection()
        self._scrape_timeout = max(0.2, min(2.0, config.scrape_interval_s * 2))
        store.on_restore(self.republish)

    # --- lifecycle --------------------------------------------------------------------------------
    async def start(self, upstream: UpstreamPool) -> None:
        self.upstream = upstream
        for w in self.config.all_workers():
            await self.store.upsert_worker(record_from_config(w))
        await self.sync()
        await self.probe_all()
        self._tasks = [
            asyncio.create_task(self._every(self.config.health.interval_s, self.probe_all), name="fg-health"),
            asyncio.create_task(self._every(self.config.scrape_interval_s, self.scrape_all), name="fg-scrape"),
            asyncio.create_task(self._every(max(1.0, self.config.scrape_interval_s), self.sync), name="fg-sync"),
        ]

    async def stop(self) -> None:
        """Stop the health, scrape and sync loops and the probes under way; each cancellation is repeated while
        its task runs on (`stop_task`: a Redis command in the loop can swallow one)."""
        for t in [*self._tasks, *self._background]:
            await stop_task(t)
        self._tasks = []

    def on_change(self, fn: Callable[[], None]) -> None:
        """Call `fn` whenever the rotation changes (a worker joined, left, recovered...)."""
        self._listeners.append(fn)

    def on_scraped(self, fn: Callable[[], None]) -> None:
        """Call `fn` after every round of engine scrapes: the engines' load may have fallen (the admission queue's
        waiting requests are worth a try again, policies/admission.py)."""
        self._scrape_listeners.append(fn)

    async def _every(self, interval: float, fn: Callable[[], Any]) -> None:
        await quiet_loop(interval, fn, log, f"registry loop {getattr(fn, '__name__', fn)}")

    async def republish(self) -> None:
        """The shared store lost its data: write back every worker this gateway knows (config, admin
        additions, discovered models), as they are now."""
        for ws in list(self.workers.values()):
            await self.store.upsert_worker(self._shared_record(ws))

    # --- hot-path reads (no I/O) ----------------------------------------------------------------
    def rotation(self, model: str) -> tuple[WorkerState, ...]:
        """Active, healthy mixed workers serving `model`."""
        return self._rotation.get(model, ())

    def candidates(self, model: str) -> tuple[WorkerState, ...]:
        """Active, healthy workers of any role serving `model`: what the placement step chooses from."""
        return self._candidates.get(model, ())

    def pool(self, model: str, role: str) -> tuple[WorkerState, ...]:
        """Active, healthy workers of one role (mixed | prefill | decode) serving `model` (P/D: gateway/pd.py)."""
        return self._pools.get((model, role), ())

    def served_models(self) -> list[str]:
        return sorted(self._known_models)

    def model_cards(self) -> list[dict[str, Any]]:
        return [self._known_models[m] for m in sorted(self._known_models)]

    def knows_model(self, model: str) -> bool:
        return model in self._known_models

    def any_healthy(self) -> bool:
        return any(ws.healthy and ws.active for ws in self.workers.values())

    # --- changes --------------------------------------------------------------------------------
    async def add(self, rec: WorkerRecord) -> WorkerState:
        await self.store.upsert_worker(rec)
        ws = self._adopt(rec)
        await self.probe(ws)
        return ws

    async def remove(self, worker_id: str) -> bool:
        if worker_id not in self.workers:
            return False
        await self.store.remove_worker(worker_id)
        self._drop(worker_id)
        return True

    async def set_state(self, worker_id: str, state: str) -> WorkerState | None:
        ws = self.workers.get(worker_id)
        if ws is None:
            return None
        ws.rec.state = state
        await self.store.upsert_worker(self._shared_record(ws))
        self._rebuild()
        return ws

    async def drain(self, worker_id: str) -> WorkerState | None:
        return await self.set_state(worker_id, WORKER_DRAINING)

    async def update_worker(self, worker_id: str, *, cap: int | None = None,
                            labels: dict[str, str] | None = None) -> WorkerState | None:
        """Set a worker's cap and/or labels (the autoscaler's caps and pools), shared with every replica."""
        ws = self.workers.get(worker_id)
        if ws is None:
            return None
        if cap is not None:
            ws.rec.cap = cap
        if labels is not None:
            ws.rec.labels = dict(labels)
        await self.store.upsert_worker(self._shared_record(ws))
        self._rebuild()  # listeners wake waiting requests: a cap may have grown
        return ws

    def set_sleep(self, worker_id: str, held: bool, sleep_state: str | None = None) -> None:
        """The swap controller (gateway/control/pooling.py) holds a worker out of rotation (before and while it sleeps) or
        lets it back; `sleep_state` is what its engine now is, until the next scrape says again."""
        ws = self.workers.get(worker_id)
        if ws is None:
            return
        was = ws.awake
        ws.held = held
        if sleep_state is not None:
            ws.metrics.sleep_state = sleep_state
            ws.sleep_told_at = time.monotonic()
            self.metrics.set_engine_state(ws.id, ws.models, sleep_state)
        if ws.awake != was:
            self._rebuild()

    def route_while_asleep(self, worker_ids: Collection[str]) -> None:
        """These workers' engines take requests while paused or asleep and run them after the wake-up (shared
        hosts with `scheduling: turns`, gateway/control/turns.py): they stay in rotation whatever their sleep state."""
        self._route_asleep = set(worker_ids)
        self._rebuild()

    def on_eject(self, fn: Callable[[str, bool], object]) -> None:
        """Call `fn(worker_id, suspected)` whenever a worker leaves rotation for failing (its exchanges can be
        given up): `suspected` when its own pace said it hung (suspect), not when health checks failed."""
        self._eject_listeners.append(fn)

    def suspect(self, worker_id: str, why: str) -> None:
        """A worker stalled against its own pace (policies/pace.py): ejected at once (module docstring), its
        exchanges in flight given up; a probe generation brings it back after its ejection time."""
        self._hold_out(worker_id, why, True)

    def note_outcome(self, worker_id: str, ok: bool) -> None:
        """Outlier ejection (Envoy's consecutive_5xx): a worker whose last `resume.eject_after_errors` requests
        all failed (refused, 5xx, cut short) leaves rotation as a suspect does, its exchanges left to time out."""
        ws = self.workers.get(worker_id)
        if ws is None:
            return
        limit = self.config.resume.eject_after_errors
        ws.errors_in_row, eject = error_streak(ws.errors_in_row, ok, limit)
        if eject:
            self._hold_out(worker_id, f"{limit} requests in a row failed", False)

    def _hold_out(self, worker_id: str, why: str, suspected: bool) -> None:
        ws = self.workers.get(worker_id)
        if ws is None or not ws.healthy:
            return
        pool = [w for w in self.workers.values() if w.rec.role == ws.rec.role and set(w.models) & set(ws.models)]
        if not may_eject(sum(w.ejected for w in pool), len(pool), self.ejection):
            log.warning("worker %s not ejected (%s): %d of its %d-worker pool are out already", worker_id, why,
                        sum(w.ejected for w in pool), len(pool))
            return
        now = time.monotonic()
        ws.ejections = times_ejected(ws.ejections, now - ws.restored_at if ws.restored_at else float("inf"),
                                     self.ejection)
        ws.ejected = True
        ws.healthy = False
        ws.oks = 0
        ws.fails = max(ws.fails, self.config.health.failures_to_eject)
        ws.checked = True
        hold = ejection_s(ws.ejections, self.ejection)
        ws.held_until = now + hold
        self._rebuild()
        log_health_change(ws, f"{why}; ejected for {hold:g}s")
        self._ejected(worker_id, suspected)

    def _ejected(self, worker_id: str, suspected: bool) -> None:
        for fn in self._eject_listeners:
            fn(worker_id, suspected)

    def report_failure(self, worker_id: str) -> None:
        """Passive health: a refused connection on the data path counts like a failed check."""
        ws = self.workers.get(worker_id)
        if ws is not None:
            self._note_health(ws, False, "connection refused on a request")

    def _adopt(self, rec: WorkerRecord) -> WorkerState:
        ws = self.workers.get(rec.id)
        if ws is None:
            ws = WorkerState(rec=rec)
            self.workers[rec.id] = ws
        else:
            ws.rec = rec
        ws.weight = _weight(rec.labels)
        ws.chat_url = rec.url + "/v1/chat/completions"
        ws.completions_url = rec.url + "/v1/completions"
        if rec.models:
            ws.models = tuple(rec.models)
        self._rebuild()
        return ws

    def _drop(self, worker_id: str) -> None:
        if self.workers.pop(worker_id, None) is not None:
            self.metrics.forget_worker(worker_id)
            self._rebuild()

    def _rebuild(self) -> None:
        rotation: dict[str, list[WorkerState]] = {}
        candidates: dict[str, list[WorkerState]] = {}
        pools: dict[tuple[str, str], list[WorkerState]] = {}
        known: dict[str, dict[str, Any]] = {}
        for ws in sorted(self.workers.values(), key=lambda w: w.id):
            cards = {c["id"]: c for c in ws.cards}
            for m in ws.models:
                known.setdefault(m, cards.get(m) or _card(m))
                if ws.healthy and ws.active and (ws.awake or ws.id in self._route_asleep):
                    pools.setdefault((m, ws.rec.role), []).append(ws)
                    candidates.setdefault(m, []).append(ws)
                    if ws.rec.role == ROLE_MIXED:
                        rotation.setdefault(m, []).append(ws)
        self._rotation = {m: tuple(v) for m, v in rotation.items()}
        self._candidates = {m: tuple(v) for m, v in candidates.items()}
        self._pools = {k: tuple(v) for k, v in pools.items()}
        self._known_models = known
        for fn in self._listeners:
            fn()

    def _shared_record(self, ws: WorkerState) -> WorkerRecord:
        r = ws.rec
        return WorkerRecord(id=r.id, url=r.url, role=r.role, models=list(ws.models), labels=dict(r.labels),
                            profile=r.profile, cap=r.cap, state=r.state, healthy=ws.healthy, source=r.source)

    # --- control loops ----------------------------------------------------------------------------
    async def sync(self) -> None:
        """Adopt the store's view of the fleet (workers added/removed/drained by any replica)."""
        records = await self.store.list_workers()
        seen = set()
        for rec in records:
            seen.add(rec.id)
            ws = self.workers.get(rec.id)
            if ws is None:
                ws = self._adopt(rec)
                if self._tasks:  # running: probe it now rather than at the next health round
                    t = asyncio.get_running_loop().create_task(self.probe(ws))
                    self._background.add(t)
                    t.add_done_callback(self._background.discard)
            elif ((rec.url, rec.state, rec.cap, rec.role, rec.labels)
                  != (ws.rec.url, ws.rec.state, ws.rec.cap, ws.rec.role, ws.rec.labels)):
                rec.models = list(ws.models) if not rec.models else rec.models
                self._adopt(rec)
        for wid in [w for w in self.workers if w not in seen]:
            self._drop(wid)

    async def probe_all(self) -> None:
        if self.workers:
            await asyncio.gather(*(self.probe(ws) for ws in list(self.workers.values())))

    async def probe(self, ws: WorkerState) -> None:
        """One health check, plus model discovery when the worker's models are not configured."""
        why = await self._check(ws.rec.url + self.adapter.health_path)
        ok = why is None
        if ok and not ws.rec.models and (
            not ws.models or time.monotonic() - ws.discovered_at > self.config.discovery_interval_s
        ):
            await self._discover(ws)
        if ok and not ws.models:
            why = f"no models listed at {self.adapter.models_path}"
        if ws.id in self.workers:
            self._note_health(ws, why is None, why)
            if ok and ws.ejected and not ws.probing and time.monotonic() >= ws.held_until \
                    and ws.id not in self._route_asleep:  # a turns engine may sleep: its /health decides
                ws.probing = True  # in the background: a hung engine must not hold up the health round
                t = asyncio.get_running_loop().create_task(self._probe_generation(ws))
                self._background.add(t)
                t.add_done_callback(self._background.discard)

    async def _probe_generation(self, ws: WorkerState) -> None:
        """An ejected worker whose ejection time is over: one max_tokens=1 completion decides its return (back
        in rotation), or another, longer ejection."""
        try:
            why = await self._generate(ws)
        finally:
            ws.probing = False
        if ws.id not in self.workers or not ws.ejected:
            return
        now = time.monotonic()
        if why is None:
            ws.ejected = False
            ws.restored_at = now
            self._note_health(ws, True, None)
            return
        ws.ejections += 1
        hold = ejection_s(ws.ejections, self.ejection)
        ws.held_until = now + hold
        log.info("worker %s: probe generation failed (%s); ejected for another %gs", ws.id, why, hold)

    async def _generate(self, ws: WorkerState) -> str | None:
        """None when the worker generates one token within the probe timeout, else why not."""
        assert self.upstream is not None
        if not ws.models:
            return "no models"
        body = orjson.dumps({"model": ws.models[0], "prompt": "ping", "max_tokens": 1})
        timeout = self.config.resume.probe_timeout_s
        try:
            r = await self.upstream.fetch(ws.completions_url, timeout, method=b"POST", body=body,
                                          headers=b"Content-Type: application/json\r\n")
        except TimeoutError:
            return f"no answer within {timeout:g}s"
        except OSError as e:
            return f"{type(e).__name__}: {e}"
        return None if r.status == 200 else f"answered {r.status}"

    def _note_health(self, ws: WorkerState, ok: bool, why: str | None = None) -> None:
        h = self.config.health
        before = ws.healthy
        if ok:
            ws.oks += 1
            ws.fails = 0
            if not ws.healthy and (not ws.checked or ws.oks >= h.successes_to_restore) \
                    and time.monotonic() >= ws.held_until \
                    and (not ws.ejected or ws.id in self._route_asleep):
                ws.ejected = False
                ws.healthy = True
        else:
            ws.fails += 1
            ws.oks = 0
            if ws.healthy and ws.fails >= h.failures_to_eject:
                ws.healthy = False
        ws.checked = True
        if ws.healthy != before:
            self._rebuild()
        log_health_change(ws, why)
        if before and not ws.healthy:
            self._ejected(ws.id, False)

    async def _check(self, url: str) -> str | None:
        """None when `url` answers 200, else why not (for the state-change log)."""
        assert self.upstream is not None
        try:
            r = await self.upstream.fetch(url, self._probe_timeout)
        except TimeoutError:
            return f"health check timed out after {self.config.health.timeout_s:g}s"
        except OSError as e:
            return f"unreachable: {type(e).__name__}: {e}"
        return None if r.status == 200 else f"health check answered {r.status}"

    async def _discover(self, ws: WorkerState) -> None:
        assert self.upstream is not None
        try:
            r = await self.upstream.fetch(ws.rec.url + self.adapter.models_path, self._probe_timeout)
        except (TimeoutError, OSError):
            return
        if r.status != 200:
            return
        cards = self.adapter.parse_models(r.body)
        ws.discovered_at = time.monotonic()
        models = tuple(c["id"] for c in cards)
        if models != ws.models or cards != ws.cards:
            ws.models, ws.cards = models, cards
            self._rebuild()
            if ws.id in self.workers:
                await self.store.upsert_worker(self._shared_record(ws))

    async def scrape_all(self) -> None:
        targets = [ws for ws in self.workers.values() if ws.healthy]
        if targets:
            await asyncio.gather(*(self.scrape(ws) for ws in targets))
            for fn in self._scrape_listeners:
                fn()

    async def scrape(self, ws: WorkerState) -> None:
        assert self.upstream is not None
        sent_at = time.monotonic()
        try:
            r = await self.upstream.fetch(ws.rec.url + self.adapter.metrics_path, self._scrape_timeout)
            text = r.body.decode("utf-8") if r.status == 200 else None
        except (TimeoutError, OSError, UnicodeDecodeError):
            text = None
        if text is None:
            self.metrics.upstream_error(ws.id, "scrape")
            return
        m = self.adapter.parse_metrics(text, time.time())
        if sent_at < ws.sleep_told_at:
            # Sent before the swap controller's last /sleep or /wake_up came back, the answer may predate what
            # the controller knows (a stale "asleep" would plan a second wake-up): the controller's word stands.
            m.sleep_state = ws.metrics.sleep_state
        was_awake = ws.awake
        ws.metrics = m
        self.metrics.set_engine_state(ws.id, ws.models, m.sleep_state)
        if ws.awake != was_awake:
            log.info("worker %s is %s", ws.id, m.sleep_state)
            self._rebuild()
        await self.store.put_metrics(ws.id, m)

    # --- reporting --------------------------------------------------------------------------------
    def refresh_gauges(self) -> None:
        inflight = self.store.inflight()
        for ws in self.workers.values():
            f = inflight.get(ws.id)
            self.metrics.set_worker(ws.id, ws.healthy, f.requests if f else 0)

    def describe(self, ws: WorkerState) -> dict[str, Any]:
        f = self.store.inflight().get(ws.id)
        m = ws.metrics
        r = ws.rec
        return {
            "id": r.id, "url": r.url, "role": r.role, "models": list(ws.models), "labels": r.labels,
            "profile": r.profile, "cap": r.cap, "state": r.state, "healthy": ws.healthy, "source": r.source,
            "inflight": f.requests if f else 0,
            "engine": {"running": m.running, "waiting": m.waiting, "kv_usage": m.kv_usage,
                       "sleep_state": m.sleep_state, "scraped_at": m.scraped_at},
        }

    def describe_all(self, ids: Iterable[str] | None = None) -> list[dict[str, Any]]:
        return [self.describe(self.workers[i]) for i in sorted(ids or self.workers) if i in self.workers]


def log_health_change(ws: WorkerState, why: str | None) -> None:
    """One line per change of a worker's health as logged last: joined, left (with why), or never came up."""
    if ws.reported == ws.healthy or (ws.healthy is False and not ws.checked):
        return
    first = ws.reported is None
    ws.reported = ws.healthy
    if ws.healthy:
        log.info("worker %s in rotation (%s)", ws.id, ws.rec.url, extra={"fields": {"worker": ws.id}})
    elif first:
        log.warning("worker %s not in rotation yet: %s (%s); retrying every health check quietly", ws.id,
                    why or "failed its health check", ws.rec.url, extra={"fields": {"worker": ws.id}})
    else:
        log.warning("worker %s out of rotation: %s (%s)", ws.id, why or "failed its health checks", ws.rec.url,
                    extra={"fields": {"worker": ws.id}})


def _card(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "fleetgate"}


def _weight(labels: dict[str, str]) -> float:
    try:
        w = float(labels.get("weight", 1.0))
    except (TypeError, ValueError):
        return 1.0
    return w if w > 0 else 1.0
