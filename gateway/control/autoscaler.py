"""The gateway's autoscaling loop: Chiron's local caps and global pool sizes, acted on by one leader.

Every replica, every `autoscale.sample_s`: samples its own interactive / batch requests in flight per
worker (gateway/batch/runner.py ClassRouter) and the shared reservations; every `interval_s` it
publishes those time averages and its cumulative counts (interactive dispatches, batch output tokens,
batch output lengths) as `autoscale:load:<replica>` in the state store.

The replica holding the lease `autoscaler` (state store, TTL `lease_ttl_s`, renewed every TTL/3) also:
- every `local_interval_s`, per worker (Chiron Algorithm 1, policies/autoscale/local.py): LBP = window
  ITL / ITL SLO from the engine's inter-token-latency histogram (scraped `_sum` / `_count` deltas, engine
  seconds), TBP from the engine's generated-token counter; the cap binds when the sampled peak in flight
  reached it while the engine queued nothing. The new cap is written to the worker record (every
  replica enforces it; `fleetgate_worker_batch_cap{worker}`). ITL SLO: `itl_slo_ms` (default: slo.tpot_ms,
  else 200 ms) for interactive and mixed workers, `batch_itl_slo_ms` for batch workers (section 4.2);
- every `interval_s`, builds a FleetObservation from all replicas' load documents, the registry, the
  batch queue and the scraped engine counters (through policies/autoscale/observation.py, the builder the
  simulator uses too; the arrivals it counts are interactive dispatches: the request pipeline has no arrival
  hook for the autoscaler yet, so a request refused at admission is not counted), runs GlobalAutoscaler (policies/autoscale/global_.py:
  interactive band, Aladdin's rate fit, batch deadline groups, hysteresis, cooldowns, bounds, scale to
  zero), hands the desired counts to the actuator (gateway/control/actuators.py), keeps `desired[interactive]` of
  the interactive+mixed workers labelled interactive (labels are free, Chiron section 3), and publishes the
  result as `autoscale:state`.
Every other replica exports the leader's `autoscale:state`, so all replicas show the same numbers.
With `replan.enabled` the leader re-plans the fleet from observed traffic instead of acting on the pool sizes
(gateway/control/replanner.py; the pool sizes are still computed and exported).

Gateway-level rule beyond the policy: when batch work is queued and no worker may run it (no mixed or
batch worker, none starting), the batch pool gets one worker ("bootstrap"): the policy needs a measured
per-worker batch throughput before it sizes the pool, and there is none to measure yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.control.actuator_kinds import make_actuator
from gateway.control.actuators import Actuator, ActuatorContext, pool_label
from gateway.control.replanner import Replanner
from gateway.state.base import EngineMetrics
from gateway.state.outage import LoopErrors, stop_task
from policies.autoscale.global_ import (
    POOL_BATCH,
    POOL_INTERACTIVE,
    POOL_MIXED,
    POOLS,
    FleetObservation,
    GlobalAutoscaler,
    GlobalConfig,
    ScaleAction,
)
from policies.autoscale.local import LocalAutoscaler, LocalConfig
from policies.autoscale.observation import FleetTick, ObservationBuilder, WorkerTick
from policies.batch_queue import estimate_wait
from policies.length_predictor import DEFAULT_OUTPUT_TOKENS
from policies.types import ROLE_MIXED

if TYPE_CHECKING:
    from gateway.batch.runner import BatchRunner
    from gateway.config import GatewayConfig
    from gateway.fleet.registry import Registry, WorkerState
    from gateway.ops.metrics import GatewayMetrics
    from gateway.pipeline.dispatch import Dispatcher
    from gateway.state.base import StateStore

log = logging.getLogger("fleetgate.autoscaler")

LEASE = "autoscaler"
DOC_LOAD = "autoscale:load:"
DOC_STATE = "autoscale:state"
MIN_ITL_TOKENS = 16          # fewer inter-token samples in a window say little about the ITL
DEFAULT_ITL_SLO_S = 0.2      # Chiron section 6: interactive ITL SLO 200 ms
BP_KINDS = ("lbp", "tbp", "ibp", "bbp")
RECENT_ACTIONS = 50          # scale actions kept for the status page (gateway/api/status_page.py)


@dataclass(slots=True)
class _LocalState:
    """The leader's Algorithm 1 state for one worker."""

    la: LocalAutoscaler
    pool: str
    prev: EngineMetrics
    peak: int = 0


@dataclass(slots=True)
class _ReplicaMark:
    t: float
    arrived: float
    batch_tokens: float


class Autoscaler:
    def __init__(self, config: GatewayConfig, store: StateStore, registry: Registry, metrics: GatewayMetrics,
                 batch: BatchRunner) -> None:
        self.config = config
        self.cfg = cfg = config.autoscale
        self.store = store
        self.registry = registry
        self.metrics = metrics
        self.batch = batch
        self.dispatcher: Dispatcher | None = None
        self.itl_slo_s = (cfg.itl_slo_ms or config.slo.tpot_ms or DEFAULT_ITL_SLO_S * 1000) / 1000
        self.batch_itl_slo_s = cfg.batch_itl_slo_ms / 1000
        self.ctx = ActuatorContext(registry, store, batch, cfg.drain_timeout_s, store.replica_id)
        self.actuator: Actuator = make_actuator(cfg, self.ctx)
        params = dict(cfg.scaler)
        if cfg.actuator.kind == "sim":
            params.setdefault("cold_start_s", cfg.actuator.sim.cold_start_s)
        self.scaler = GlobalAutoscaler(GlobalConfig(**params))
        # Re-planning (config `replan:`): the leader moves the fleet to plans; pool sizes are then exported only.
        self.replanner = Replanner(config, store, metrics, self.actuator) if config.replan.enabled else None
        self.leader = False
        self.state: dict[str, Any] = {}
        self.actions: Counter[str] = Counter()           # "pool|direction|reason" -> workers (leader, cumulative)
        self.recent_actions: deque[dict[str, Any]] = deque(maxlen=RECENT_ACTIONS)  # for the status page
        self._fleet_shape: tuple = ()
        self._local: dict[str, _LocalState] = {}
        self._peak: dict[str, int] = {}
        self._area: dict[str, list[float]] = {}         # worker -> [interactive, batch] x seconds (this replica)
        self._wait_area = 0.0                            # interactive requests waiting for room x seconds
        self._area_t0 = self._t_sample = time.monotonic()
        self._marks: dict[str, _ReplicaMark] = {}
        self._gen: dict[str, tuple[float, float]] = {}   # worker -> (scraped_at, generation tokens)
        self._t_gather = self._since = time.time()      # _since: when this replica's cumulative counts started
        self.observations = ObservationBuilder(cfg.rate_window_s, cfg.throughput_window_s, cfg.busy_cap, self._t_gather)
        self._tick_peak: dict[str, int] = {}             # worker -> highest in-flight count since the last global tick
        self._exported_actions: Counter[str] = Counter()
        self._task: asyncio.Task | None = None

    # --- lifecycle --------------------------------------------------------------------------------
    async def start(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        if self.cfg.enabled:
            await self.actuator.start()
        if self.replanner is not None:
            await self.replanner.start(dispatcher)
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="fg-autoscaler")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)
        with contextlib.suppress(Exception):
            await self.actuator.stop()
        if self.leader:
            with contextlib.suppress(Exception):
                await self.store.release_lease(LEASE, self.store.replica_id)
            self.leader = False

    async def _loop(self) -> None:
        cfg = self.cfg
        now = time.monotonic()
        next_lease, next_local, next_global = now, now + cfg.local_interval_s, now + cfg.interval_s
        errors = LoopErrors(log, "autoscaler round")
        while True:
            await asyncio.sleep(cfg.sample_s)
            with errors.round():
                now = time.monotonic()
                self._sample(now)
                if cfg.enabled and now >= next_lease:
                    await self._renew_lease()
                    next_lease = now + min(cfg.lease_ttl_s / 3, cfg.interval_s)
                if now >= next_local:
                    next_local = now + cfg.local_interval_s
                    if cfg.enabled and cfg.local_caps and self.leader:
                        await self.local_tick(time.time())
                if now >= next_global:
                    next_global = now + cfg.interval_s
                    await self.global_tick(time.time())

    async def _renew_lease(self) -> None:
        was = self.leader
        self.leader = await self.store.acquire_lease(LEASE, self.store.replica_id, self.cfg.lease_ttl_s)
        if self.leader != was:
            log.info("replica %s %s the autoscaler lease", self.store.replica_id, "holds" if self.leader else "lost")
            self._local.clear()
        self.metrics.autoscaler_leader.set(1 if self.leader else 0)

    # --- sampling (every replica) -------------------------------------------------------------------
    def _sample(self, now: float) -> None:
        dt = now - self._t_sample
        self._t_sample = now
        for wid, (inter, batch) in self.batch.class_counts().items():
            a = self._area.get(wid)
            if a is None:
                a = self._area[wid] = [0.0, 0.0]
            a[0] += inter * dt
            a[1] += batch * dt
        if self.dispatcher is not None:
            self._wait_area += sum(len(rt.queue) for rt in self.dispatcher.runtimes.values()) * dt
        for wid, f in self.store.inflight().items():
            if f.requests > self._peak.get(wid, 0):
                self._peak[wid] = f.requests
            if f.requests > self._tick_peak.get(wid, 0):
                self._tick_peak[wid] = f.requests

    def _load_doc(self, now_wall: float) -> dict[str, Any]:
        mono = time.monotonic()
        self._sample(mono)     # the areas up to now: the averages below cover their whole span
        span = max(mono - self._area_t0, 1e-9)
        workers = {wid: [a[0] / span, a[1] / span] for wid, a in self._area.items() if a[0] or a[1]}
        waiting = self._wait_area / span   # time-averaged, like the in-flight counts: one snapshot of a queue
        self._area = {}                    # that a burst fills and the next dispatch empties is noise
        self._wait_area = 0.0
        self._area_t0 = mono
        out = self.batch.outputs
        shortfall = 0
        if self.dispatcher is not None:
            shortfall = self.dispatcher.learner.shortfall_total()
        doc = {"t": now_wall, "since": self._since, "workers": workers, "arrived": self.batch.router.interactive_arrived,
               "batch_tokens": self.batch.batch_tokens, "out": [out.n, out.total, out.total_sq], "waiting": waiting,
               "shortfall": shortfall}
        if self.replanner is not None:
            doc["replan"] = self.replanner.traffic_doc()
        return doc

    # --- Chiron Algorithm 1 (leader) ------------------------------------------------------------------
    def _slo_for(self, pool: str) -> float:
        return self.batch_itl_slo_s if pool == POOL_BATCH else self.itl_slo_s

    async def local_tick(self, now: float) -> None:
        inflight = self.store.inflight()
        seen = set()
        for ws in list(self.registry.workers.values()):
            if not (ws.healthy and ws.active and ws.rec.role == ROLE_MIXED):
                continue
            seen.add(ws.id)
            pool = pool_label(ws)
            st = self._local.get(ws.id)
            if st is None or st.pool != pool:
                la = LocalAutoscaler(LocalConfig(itl_slo_s=self._slo_for(pool), **self.cfg.local),
                                     initial_cap=ws.rec.cap or self._peer_cap(pool))
                self._local[ws.id] = _LocalState(la, pool, dataclasses.replace(ws.metrics))
                self._peak[ws.id] = 0
                if ws.rec.cap != la.cap:
                    await self.registry.update_worker(ws.id, cap=la.cap)
                continue
            m, prev = ws.metrics, st.prev
            if m.scraped_at <= prev.scraped_at:
                continue  # no new scrape since the last window
            d_count, d_sum = m.itl_count - prev.itl_count, m.itl_sum - prev.itl_sum
            d_gen, dt = m.generation_tokens - prev.generation_tokens, m.scraped_at - prev.scraped_at
            st.prev = dataclasses.replace(m)
            f = inflight.get(ws.id)
            n_now = f.requests if f is not None else 0
            peak, self._peak[ws.id] = max(self._peak.get(ws.id, 0), n_now), n_now
            if d_count < 0 or d_gen < 0 or dt <= 0:
                continue  # the engine restarted: counters went back
            cap = ws.rec.cap or st.la.cap
            st.la.observe(itl_s=d_sum / d_count if d_count >= MIN_ITL_TOKENS else None, tokens_per_s=d_gen / dt,
                          saturated=peak >= cap and m.waiting == 0)
            new = st.la.update(now)
            if new != ws.rec.cap:
                await self.registry.update_worker(ws.id, cap=new)
                self.metrics.worker_batch_cap.labels(ws.id).set(new)
        for wid in [w for w in self._local if w not in seen]:
            del self._local[wid]

    def _peer_cap(self, pool: str) -> int | None:
        """A new worker starts from the median cap its peers learned (same ITL SLO), else the default."""
        is_batch = pool == POOL_BATCH
        caps = sorted(st.la.cap for st in self._local.values() if (st.pool == POOL_BATCH) == is_batch)
        return caps[len(caps) // 2] if caps else None

    # --- Chiron section 5 (leader) / export (all) -----------------------------------------------------
    async def global_tick(self, now: float) -> None:
        await self.store.put_doc(DOC_LOAD + self.store.replica_id, self._load_doc(now))
        if self.cfg.enabled and self.leader:
            self.state = await self._plan(now)
            await self.store.put_doc(DOC_STATE, self.state)
        elif self.cfg.enabled:
            self.state = await self.store.get_doc(DOC_STATE) or {}
            if self.replanner is not None:
                await self.replanner.export_shared()
        else:
            self.state = await self._observe_only(now)
        self._export(self.state)

    async def _gather(self, now: float) -> tuple[FleetObservation, dict[str, Any]]:
        """The FleetObservation (policies/autoscale/observation.py builds it, as for the simulator) from every
        replica's load document, the registry, the queue and the engines."""
        cfg = self.cfg
        stale = 3 * cfg.interval_s + cfg.lease_ttl_s
        docs = await self.store.get_docs(DOC_LOAD)
        per_worker: dict[str, list[float]] = {}
        new_arrivals = new_tokens = 0.0
        out_n = out_sum = out_sq = 0.0
        waiting = 0.0
        shortfall = 0
        for key, d in docs.items():
            if now - d.get("t", 0.0) > stale:
                if now - d.get("t", 0.0) > 100 * stale:
                    await self.store.delete_doc(key)  # a replica long gone
                continue
            for wid, (inter, batch) in d.get("workers", {}).items():
                acc = per_worker.setdefault(wid, [0.0, 0.0])
                acc[0] += inter
                acc[1] += batch
            mark = self._marks.get(key)
            if mark is None and d.get("since", math.inf) >= self.observations.t0:
                # a replica whose counts started after this builder did (this one included): all of them are new,
                # as the simulator counts every arrival from its start; an older replica's first document is the
                # baseline (its counts before this builder started are not this builder's window)
                mark = _ReplicaMark(-math.inf, 0.0, 0.0)
            if mark is not None and d["t"] > mark.t:
                new_arrivals += max(0.0, d.get("arrived", 0.0) - mark.arrived)
                new_tokens += max(0.0, d["batch_tokens"] - mark.batch_tokens)
            if mark is None or d["t"] > mark.t:
                self._marks[key] = _ReplicaMark(d["t"], d.get("arrived", 0.0), d["batch_tokens"])
            n, s, sq = d.get("out", (0, 0.0, 0.0))
            out_n, out_sum, out_sq = out_n + n, out_sum + s, out_sq + sq
            waiting += float(d.get("waiting", 0.0))
            shortfall += int(d.get("shortfall", 0))   # each replica's unplaceable requests are its own

        active = self.ctx.active_by_pool()
        snap = await self.store.queue_snapshot()
        self.metrics.set_batch_queue_depth(snap.depth)
        rates = self._worker_rates(active)
        workers = [WorkerTick(ws.id, p, per_worker.get(ws.id, (0.0, 0.0))[0], ws.rec.cap, rates.get(ws.id),
                              bool(ws.rec.cap) and self._tick_peak.get(ws.id, 0) >= (ws.rec.cap or 0))
                   for p in POOLS for ws in active[p]]
        self._tick_peak = {}
        dt, self._t_gather = now - self._t_gather, now
        tick = FleetTick(workers, self.actuator.pending(), waiting, new_arrivals, snap.deadlines, snap.running,
                         new_tokens / dt if dt > 0 else 0.0, (out_n, out_sum, out_sq), self._predicted_output(),
                         float(shortfall))
        obs = self.observations.build(tick, now)
        extra = {"queue": snap.queued, "waiting": waiting, "lbp": self._pool_bp("lbp"), "tbp": self._pool_bp("tbp")}
        return obs, extra

    def _predicted_output(self) -> float:
        """The length predictor's mean output length over the served models (the builder's fallback)."""
        if self.dispatcher is None or not self.dispatcher.runtimes:
            return DEFAULT_OUTPUT_TOKENS
        predictor = self.dispatcher.learner.predictor
        return statistics.fmean(predictor.model_mean(m) for m in self.dispatcher.runtimes)

    def _worker_rates(self, active: dict[str, list[WorkerState]]) -> dict[str, float]:
        """Output tokens/s of each active worker since its previous scrape seen here (engine counters)."""
        out: dict[str, float] = {}
        for p in POOLS:
            for ws in active[p]:
                m = ws.metrics
                prev = self._gen.get(ws.id)
                self._gen[ws.id] = (m.scraped_at, m.generation_tokens)
                if prev is None or m.scraped_at <= prev[0] or m.generation_tokens < prev[1]:
                    continue
                out[ws.id] = (m.generation_tokens - prev[1]) / (m.scraped_at - prev[0])
        return out

    def _pool_bp(self, kind: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for st in self._local.values():
            v = getattr(st.la, kind)
            if v is not None and math.isfinite(v):
                out[st.pool] = max(out.get(st.pool, 0.0), v)
        return out

    async def _plan(self, now: float) -> dict[str, Any]:
        obs, extra = await self._gather(now)
        plan = self.scaler.update(obs, now)
        desired, actions = dict(plan.desired), list(plan.actions)
        can_batch = obs.workers.get(POOL_MIXED, 0) + obs.workers.get(POOL_BATCH, 0) + obs.pending.get(POOL_MIXED, 0)
        if (extra["queue"] and not can_batch and desired[POOL_MIXED] == 0 and desired[POOL_BATCH] == 0
                and not obs.pending.get(POOL_BATCH, 0) and self.scaler.config.max_batch > 0):
            desired[POOL_BATCH] = 1
            actions.append(ScaleAction(POOL_BATCH, "up", 1, "bootstrap"))
        for a in actions:
            self.actions[f"{a.pool}|{a.direction}|{a.reason}"] += a.count
            self.recent_actions.append({"t": now, "pool": a.pool, "direction": a.direction, "count": a.count,
                                        "reason": a.reason, "busy": round(obs.interactive_busy, 3)})
            log.info("scale %s %s %+d (%s)", a.pool, a.direction, a.count if a.direction == "up" else -a.count, a.reason)
        if self.replanner is not None:
            stale = 3 * self.cfg.interval_s + self.cfg.lease_ttl_s
            docs = await self.store.get_docs(DOC_LOAD)
            await self.replanner.tick(now, {k: d for k, d in docs.items() if now - d.get("t", 0.0) <= stale})
        elif self.actuator.kind != "none":
            await self.actuator.apply(desired)
            await self._relabel(desired[POOL_INTERACTIVE])
        active = self.ctx.active_by_pool()
        pending = self.actuator.pending()
        self._log_fleet(active, pending, desired)
        bp = plan.backpressure
        wait_i = extra["waiting"] / obs.interactive_rate if obs.interactive_rate > 0 else 0.0
        return {
            "t": now, "leader": self.store.replica_id, "desired": desired,
            "current": {p: len(active[p]) + pending.get(p, 0) for p in POOLS}, "pending": pending,
            "backpressure": {"ibp": {POOL_INTERACTIVE: bp["ibp"]}, "bbp": {POOL_BATCH: bp["bbp"]},
                             "lbp": extra["lbp"], "tbp": extra["tbp"]},
            "wait": {"batch": bp["batch_wait_s"] if math.isfinite(bp["batch_wait_s"]) else 1e9,
                     "interactive": wait_i},
            "actions": dict(self.actions), "recent_actions": list(self.recent_actions),
            "rate": obs.interactive_rate, "busy": obs.interactive_busy,
            "forecast": bp.get("forecast_busy"),
        }

    def _log_fleet(self, active: dict[str, list[WorkerState]], pending: dict[str, int],
                   desired: dict[str, int]) -> None:
        """One `fleet:` line whenever the fleet's make-up (workers, pools, starting, draining, desired) changes."""
        draining = self.actuator.draining()
        shape = (tuple((p, tuple(sorted(w.id for w in active[p]))) for p in POOLS), tuple(sorted(pending.items())),
                 tuple(draining), tuple(sorted(desired.items())))
        if shape == self._fleet_shape:
            return
        self._fleet_shape = shape
        inflight = self.store.inflight()
        parts = []
        for p in POOLS:
            for ws in sorted(active[p], key=lambda w: w.id):
                f = inflight.get(ws.id)
                parts.append(f"{ws.id}[{p} {f.requests if f else 0}/{ws.rec.cap or '-'}]")
        log.info("fleet: %d active (%s), %d starting, %d draining; desired %s", sum(len(v) for v in active.values()),
                 " ".join(parts) or "none", sum(pending.values()), len(draining),
                 " ".join(f"{p}={n}" for p, n in desired.items()), extra={"unlimited": True})

    async def _observe_only(self, now: float) -> dict[str, Any]:
        """Autoscaling off: still export what the queues look like (depth, wait estimates, pool sizes)."""
        obs, extra = await self._gather(now)
        q = sum(n for _, n in obs.queue) + obs.batch_inflight
        w = estimate_wait(q, obs.output_mean, obs.output_std, obs.batch_tokens_per_s)
        active = self.ctx.active_by_pool()
        return {"t": now, "current": {p: len(active[p]) for p in POOLS},
                "wait": {"batch": w if math.isfinite(w) else 1e9,
                         "interactive": extra["waiting"] / obs.interactive_rate if obs.interactive_rate > 0 else 0.0}}

    async def _relabel(self, want_interactive: int) -> None:
        """Keep `want_interactive` of the active interactive+mixed workers labelled interactive."""
        active = self.ctx.active_by_pool()
        inter, mixed = active[POOL_INTERACTIVE], active[POOL_MIXED]
        want = min(want_interactive, len(inter) + len(mixed))
        counts = self.batch.class_counts()
        if len(inter) > want:
            for ws in sorted(inter, key=lambda w: sum(counts.get(w.id, (0, 0))))[: len(inter) - want]:
                await self.registry.update_worker(ws.id, labels={**ws.rec.labels, "pool": POOL_MIXED})
        elif len(inter) < want:
            for ws in sorted(mixed, key=lambda w: counts.get(w.id, (0, 0))[1])[: want - len(inter)]:
                await self.registry.update_worker(ws.id, labels={**ws.rec.labels, "pool": POOL_INTERACTIVE})

    # --- metrics ----------------------------------------------------------------------------------
    def _export(self, state: dict[str, Any]) -> None:
        m = self.metrics
        for pool, n in state.get("desired", {}).items():
            m.desired_workers.labels(pool).set(n)
        for pool, n in state.get("current", {}).items():
            m.current_workers.labels(pool).set(n)
        for kind, by_pool in state.get("backpressure", {}).items():
            for pool, v in by_pool.items():
                m.backpressure.labels(kind, pool).set(v)
        for cls, w in state.get("wait", {}).items():
            m.queue_wait_estimate.labels(cls).set(w)
        for key, total in state.get("actions", {}).items():  # mirror the leader's cumulative counts
            grow = total - self._exported_actions[key]
            if grow > 0:
                m.scale_actions.labels(*key.split("|")).inc(grow)
                self._exported_actions[key] = total
        for ws in self.registry.workers.values():
            if ws.rec.cap is not None:
                m.worker_batch_cap.labels(ws.id).set(ws.rec.cap)
