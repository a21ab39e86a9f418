"""Actuators: turn the autoscaler's desired worker counts per pool into workers (`autoscale.actuator.kind`).

- `none`: nothing; the numbers are exported (`fleetgate_desired_workers{pool}`) and KEDA scales the
  Deployments from Prometheus (deploy/kubernetes/base/keda-scaledobject.yaml).
- `sim`: simulated vLLM servers started in this process (simulator/fleet.py, one server per worker,
  on a free port), taking traffic after `cold_start_s`. For `fleetgate demo --autoscale` and tests; the
  workers live in the leader's process, so run one gateway replica with it.
  With re-planning (gateway/control/replanner.py) it starts a plan's instance groups instead (`apply_groups`: each
  group's derived profile and model, label `group`), and drains the instances a new plan drops.
- `webhook`: every tick, POST to `url`
      {"replica", "desired": {pool: n}, "current": {pool: n}, "draining": [ids], "release": [ids]}
  and read back the fleet {"workers": [{"id", "url", "pool", "state": "ready" | "starting", "cap"?}]}. Ready
  workers join the registry (label pool); starting ones count as pending; a worker the gateway registered
  from the webhook that is no longer listed leaves the registry. The provider creates workers to reach
  `desired` and terminates only the ids in `release`: the gateway picks scale-in victims itself and
  releases them after a graceful drain. The POST goes through the gateway's one upstream client
  (gateway/wire/upstream.py: its TLS, DNS and connection settings), bounded by `timeout_s`.
- `docker`: containers of a compose service, created and removed through the Docker Engine API
  (gateway/control/docker_actuator.py).

Graceful drain (every managed kind): the victim is marked draining (no new requests, on every replica
through the state store); once nothing is in flight on it, or after `drain_timeout_s` (when this
replica's batch requests on it go back to the queue, then one more timeout for the rest), it leaves the
registry and is released. A worker still starting is simply cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from gateway.state.base import WorkerRecord
from gateway.state.outage import stop_task
from gateway.wire.upstream import encode_headers
from policies.autoscale.global_ import POOL_BATCH, POOL_INTERACTIVE, POOL_MIXED, POOLS
from policies.planning import InstanceGroup
from policies.replan import group_key
from policies.types import ROLE_MIXED

if TYPE_CHECKING:
    from gateway.batch.runner import BatchRunner
    from gateway.fleet.registry import Registry, WorkerState
    from gateway.state.base import StateStore

log = logging.getLogger("fleetgate.actuators")

DRAIN_POLL_S = 0.05
GROUPS = (((POOL_INTERACTIVE, POOL_MIXED), POOL_MIXED), ((POOL_BATCH,), POOL_BATCH))  # (pools, new workers' pool)


def pool_label(ws: WorkerState) -> str:
    return ws.rec.labels.get("pool", POOL_MIXED)


@dataclass
class ActuatorContext:
    registry: Registry
    store: StateStore
    batch: BatchRunner | None
    drain_timeout_s: float
    replica_id: str = ""

    def active_by_pool(self) -> dict[str, list[WorkerState]]:
        """Mixed-role workers taking traffic (healthy, not draining), by pool label."""
        out: dict[str, list[WorkerState]] = {p: [] for p in POOLS}
        for ws in self.registry.workers.values():
            if ws.healthy and ws.active and ws.rec.role == ROLE_MIXED:  # P/D workers are not Chiron's types
                out.setdefault(pool_label(ws), []).append(ws)
        return out

    def inflight(self, worker_id: str) -> int:
        f = self.store.inflight().get(worker_id)
        return f.requests if f is not None else 0


class Actuator:
    """`none`: export only."""

    kind = "none"

    def __init__(self, ctx: ActuatorContext) -> None:
        self.ctx = ctx

    async def start(self) -> None:  # noqa: B027 - optional
        pass

    async def stop(self) -> None:  # noqa: B027 - optional
        pass

    def pending(self) -> dict[str, int]:
        """Workers still starting, per pool."""
        return {}

    def draining(self) -> list[str]:
        return []

    async def apply(self, desired: dict[str, int]) -> None:  # noqa: B027 - optional
        """Move the fleet towards `desired` (called by the autoscaler's leader only)."""


class ManagedActuator(Actuator):
    """Scale-out / scale-in with drain; subclasses say how a worker is provisioned and released."""

    def __init__(self, ctx: ActuatorContext) -> None:
        super().__init__(ctx)
        self._draining: dict[str, asyncio.Task] = {}

    # --- what subclasses provide ------------------------------------------------------------------
    def pending_ids(self) -> dict[str, list[str]]:
        """Starting workers per pool, latest-started last."""
        return {}

    def owns(self, ws: WorkerState) -> bool:
        raise NotImplementedError

    async def provision(self, pool: str) -> None:
        raise NotImplementedError

    async def cancel(self, worker_id: str) -> bool:
        """Cancel a worker still starting; False if it cannot be cancelled."""
        return False

    async def release(self, worker_id: str) -> None:
        """The worker is drained and out of the registry: let it go."""

    # --- the common part --------------------------------------------------------------------------
    def pending(self) -> dict[str, int]:
        return {p: len(ids) for p, ids in self.pending_ids().items() if ids}

    def draining(self) -> list[str]:
        return sorted(self._draining)

    async def apply(self, desired: dict[str, int]) -> None:
        active = self.ctx.active_by_pool()
        pending = self.pending_ids()
        for pools, new_pool in GROUPS:
            want = sum(desired.get(p, 0) for p in pools)
            have = sum(len(active.get(p, ())) + len(pending.get(p, ())) for p in pools)
            for _ in range(want - have):
                await self.provision(new_pool)
            if want < have:
                await self._shrink(pools, have - want, active, pending)

    async def _shrink(self, pools: Iterable[str], n: int, active: dict[str, list[WorkerState]],
                      pending: dict[str, list[str]]) -> None:
        pools = tuple(pools)
        for pool in pools:       # workers still starting go first, the latest-started first
            for wid in reversed(pending.get(pool, [])):
                if n and await self.cancel(wid):
                    n -= 1
        # Mixed before interactive workers (the relabel keeps the interactive count), the least loaded first.
        live = sorted((ws for p in pools for ws in active.get(p, ()) if self.owns(ws)),
                      key=lambda ws: (pool_label(ws) == POOL_INTERACTIVE, self.ctx.inflight(ws.id)))
        for ws in live[:n]:
            await self.drain(ws.id)

    async def drain(self, worker_id: str) -> None:
        """Stop new requests now (all replicas); release the worker in the background once it is idle."""
        if worker_id in self._draining:
            return
        await self.ctx.registry.drain(worker_id)
        self._draining[worker_id] = asyncio.create_task(self._finish_drain(worker_id), name=f"fg-drain-{worker_id}")

    async def _finish_drain(self, worker_id: str) -> None:
        ctx = self.ctx
        try:
            if not await self._wait_idle(worker_id, ctx.drain_timeout_s):
                if ctx.batch is not None:  # batch work goes back to the queue; interactive work gets more time
                    await ctx.batch.evict_on(worker_id)
                if not await self._wait_idle(worker_id, ctx.drain_timeout_s):
                    log.warning("worker %s still has %d request(s) in flight after draining %.0f s; releasing it",
                                worker_id, ctx.inflight(worker_id), 2 * ctx.drain_timeout_s)
            await self._wait_engine_idle(worker_id, ctx.drain_timeout_s)
            await ctx.registry.remove(worker_id)
            await self.release(worker_id)
            log.info("worker %s drained and released", worker_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("draining worker %s failed", worker_id)
        finally:
            self._draining.pop(worker_id, None)

    async def _wait_idle(self, worker_id: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.ctx.inflight(worker_id) > 0:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(DRAIN_POLL_S)
        return True

    async def _wait_engine_idle(self, worker_id: str, timeout: float) -> None:
        """Until a scrape taken after the gateway's count reached zero shows the engine with nothing running or
        waiting. A request placed on the worker just before it was marked draining is not counted until it has
        reserved its slot, and one the gateway gave up on may still run in the engine: neither may be cut off."""
        since = time.time()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ws = self.ctx.registry.workers.get(worker_id)
            if ws is None or not ws.healthy:
                return                  # nothing scrapes it: it is gone or failing anyway
            m = ws.metrics
            if m.scraped_at == 0.0 and self.ctx.inflight(worker_id) == 0:
                return                  # its /metrics never answered: the gateway's own count is all there is
            if m.scraped_at > since and m.running + m.waiting == 0 and self.ctx.inflight(worker_id) == 0:
                return
            await asyncio.sleep(DRAIN_POLL_S)
        log.warning("worker %s: its engine still reports requests after draining; releasing it", worker_id)

    async def stop(self) -> None:
        await asyncio.gather(*(stop_task(t) for t in list(self._draining.values())))


# --- sim ----------------------------------------------------------------------------------------------
@dataclass
class _SimWorker:
    pool: str
    started: float
    fleet: Any = None                  # simulator.fleet.SimFleet
    task: asyncio.Task | None = None   # boot (start + cold start + register)
    ready: bool = False
    group: InstanceGroup | None = None  # the plan group it is an instance of (re-planning), else cfg's profile


class SimActuator(ManagedActuator):
    kind = "sim"

    def __init__(self, ctx: ActuatorContext, cfg: Any) -> None:
        super().__init__(ctx)
        self.cfg = cfg
        self.workers: dict[str, _SimWorker] = {}
        self._profile_dir: Path | None = None    # derived profiles of plan groups (YAML files the servers load)
        self._pending_drains: set[asyncio.Task] = set()   # drains waiting for a new plan's instances

    def owns(self, ws: WorkerState) -> bool:
        return ws.id in self.workers

    def pending_ids(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for wid, w in sorted(self.workers.items(), key=lambda kv: kv[1].started):
            if not w.ready:
                out.setdefault(w.pool, []).append(wid)
        return out

    async def start(self) -> None:
        boots = []
        for pool, n in self.cfg.initial.items():
            for _ in range(n):
                boots.append(self._spawn(pool, cold_start_s=0.0))
        for t in boots:
            await t

    async def provision(self, pool: str) -> None:
        self._spawn(pool, self.cfg.cold_start_s)

    def _spawn(self, pool: str, cold_start_s: float, group: InstanceGroup | None = None) -> asyncio.Task:
        # sim-<n>, the lowest n free: stable names and ports (base_port + n). No pool in the name: the
        # autoscaler relabels workers between the interactive and mixed pools as it goes.
        n = next(i for i in itertools.count() if f"sim-{i}" not in self.workers)
        wid = f"sim-{n}"
        w = self.workers[wid] = _SimWorker(pool, time.monotonic(), group=group)
        w.task = asyncio.create_task(self._boot(wid, w, n, cold_start_s), name=f"fg-sim-boot-{wid}")
        log.info("starting simulated worker %s (pool %s, cold start %.1f s)", wid, pool, cold_start_s)
        return w.task

    async def _boot(self, wid: str, w: _SimWorker, n: int, cold_start_s: float) -> None:
        from simulator.fleet import SimFleet, specs_from_options

        cfg = self.cfg
        port = cfg.base_port + n if cfg.base_port else 0
        profile, model, labels = cfg.profile, cfg.model, {"pool": w.pool}
        if w.group is not None:
            profile, model = self._group_profile(w.group)
            labels["group"] = group_key(w.group)
        w.fleet = SimFleet(specs_from_options(1, port, profile, model, cfg.time_scale, cfg.seed + n))
        try:
            await asyncio.to_thread(w.fleet.start)
            await asyncio.sleep(cold_start_s)  # a real worker loads weights meanwhile; it is billed already
            await self.ctx.registry.add(WorkerRecord(
                id=wid, url=w.fleet.urls[0], labels=labels, cap=cfg.cap, source="autoscaler",
                profile=profile if w.group is not None else w.fleet.servers[0].profile.name,
                models=[model] if w.group is not None and model else []))
            w.ready = True
            log.info("simulated worker %s ready at %s (pool %s)", wid, w.fleet.urls[0], w.pool)
        except BaseException:
            self.workers.pop(wid, None)
            await asyncio.to_thread(w.fleet.stop)
            raise

    def _group_profile(self, g: InstanceGroup) -> tuple[str, str]:
        """(profile YAML path, served model name) of a plan group's instances (policies/hardware.py derives it)."""
        import tempfile

        import yaml

        from policies.hardware import derive_profile

        if self._profile_dir is None:
            self._profile_dir = Path(tempfile.mkdtemp(prefix="fleetgate-replan-"))
        prof = derive_profile(g.model, g.gpu, g.tp)
        path = self._profile_dir / f"{prof['name']}.yaml"
        if not path.exists():
            path.write_text(yaml.safe_dump(prof))
        return str(path), str(prof["model"])

    async def apply_groups(self, groups: Iterable[InstanceGroup], cold_start_s: float | None = None,
                           wait: bool = False) -> None:
        """Move the fleet to a plan (re-planning, gateway/control/replanner.py): start the missing instances of each group
        (its derived profile and model), and for a group with too many, cancel those still starting and drain the
        least loaded of the rest, exactly as a scale-in (a group the plan no longer has goes to 0). `wait`: return
        once the new instances are registered."""
        want = {group_key(g): g for g in groups}
        cold = self.cfg.cold_start_s if cold_start_s is None else cold_start_s
        have: dict[str, list[str]] = {}
        for wid, w in sorted(self.workers.items(), key=lambda kv: kv[1].started):
            if w.group is not None and wid not in self._draining:
                have.setdefault(group_key(w.group), []).append(wid)
        boots = [self._spawn(POOL_MIXED, cold, g) for key, g in want.items()
                 for _ in range(g.count - len(have.get(key, ())))]
        if wait:                                  # `wait`: until the new instances are in the registry
            for t in boots:
                await t
        drains: list[str] = []
        for key, wids in have.items():
            extra = len(wids) - (want[key].count if key in want else 0)
            for wid in reversed(wids):           # still starting: cancel, the latest first
                if extra > 0 and not self.workers[wid].ready and await self.cancel(wid):
                    extra -= 1
            ready = sorted((wid for wid in wids if wid in self.workers and self.workers[wid].ready),
                           key=self.ctx.inflight)
            drains += ready[:max(extra, 0)]
        if boots and drains:
            # Make before break: a plan that reshapes a model (TP1 -> TP2) drains the old instances only once the
            # new ones take traffic, else the model would have no worker meanwhile (503s).
            task = asyncio.create_task(self._drain_after(boots, drains), name="fg-replan-drain")
            self._pending_drains.add(task)
            task.add_done_callback(self._pending_drains.discard)
        else:
            for wid in drains:
                await self.drain(wid)

    async def _drain_after(self, boots: list[asyncio.Task], drains: list[str]) -> None:
        failed = [r for r in await asyncio.gather(*boots, return_exceptions=True) if isinstance(r, BaseException)]
        if failed:   # keep the old instances serving; the next apply starts the missing ones again
            log.warning("%d new instance(s) failed to start (%s); not draining %s", len(failed), failed[0], drains)
            return
        for wid in drains:
            if wid in self.workers:
                await self.drain(wid)

    async def cancel(self, worker_id: str) -> bool:
        w = self.workers.get(worker_id)
        if w is None or w.ready or w.task is None:
            return False
        with contextlib.suppress(Exception):
            await stop_task(w.task)
        self.workers.pop(worker_id, None)
        return True

    async def release(self, worker_id: str) -> None:
        w = self.workers.pop(worker_id, None)
        if w is not None and w.fleet is not None:
            core = w.fleet.servers[0].driver.core     # the engine's own count, not the gateway's
            if core.num_running or core.num_waiting:
                log.warning("simulated worker %s stopped with %d request(s) still running in its engine", worker_id,
                            core.num_running + core.num_waiting)
            await asyncio.to_thread(w.fleet.stop)

    async def stop(self) -> None:
        for t in list(self._pending_drains):
            t.cancel()
        await super().stop()
        for wid, w in list(self.workers.items()):
            if w.task is not None and not w.task.done():
                with contextlib.suppress(Exception):
                    await stop_task(w.task)
            if w.fleet is not None:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(w.fleet.stop)
            self.workers.pop(wid, None)
        if self._profile_dir is not None:
            shutil.rmtree(self._profile_dir, ignore_errors=True)
            self._profile_dir = None


# --- webhook ------------------------------------------------------------------------------------------
@dataclass
class _Listed:
    url: str
    pool: str
    state: str
    cap: int | None = None


class WebhookActuator(ManagedActuator):
    kind = "webhook"

    def __init__(self, ctx: ActuatorContext, cfg: Any) -> None:
        super().__init__(ctx)
        self.cfg = cfg
        self.fleet: dict[str, _Listed] = {}
        self.released: set[str] = set()       # drained by us; the provider may terminate them
        self.errors = 0
        self._order: dict[str, float] = {}    # first seen (monotonic): cancel the latest starting first
        self._headers = encode_headers([("Content-Type", "application/json"), *self.cfg.headers.items()])

    def owns(self, ws: WorkerState) -> bool:
        return ws.rec.source == "webhook"

    def pending_ids(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for wid, w in sorted(self.fleet.items(), key=lambda kv: self._order.get(kv[0], 0.0)):
            if w.state == "starting" and wid not in self.released:
                out.setdefault(w.pool, []).append(wid)
        return out

    async def provision(self, pool: str) -> None:
        """Nothing to do here: the provider sees `desired` in the next POST and creates the worker."""

    async def release(self, worker_id: str) -> None:
        self.released.add(worker_id)

    async def apply(self, desired: dict[str, int]) -> None:
        await self._exchange(desired)
        await self._reconcile()
        await super().apply(desired)

    async def _exchange(self, desired: dict[str, int]) -> None:
        upstream = self.ctx.registry.upstream
        assert upstream is not None, "the registry is not started"
        active = self.ctx.active_by_pool()
        payload = {"replica": self.ctx.replica_id, "time": time.time(), "desired": desired,
                   "current": {p: len(active.get(p, ())) for p in POOLS}, "draining": self.draining(),
                   "release": sorted(self.released)}
        try:
            r = await upstream.fetch(self.cfg.url, self.cfg.timeout_s, b"POST", orjson.dumps(payload), self._headers)
            if r.status != 200:
                raise ValueError(f"status {r.status}")
            fleet = _parse_fleet(orjson.loads(r.body))
        except (OSError, TimeoutError, ValueError, TypeError, KeyError) as e:
            self.errors += 1
            log.warning("autoscaler webhook %s failed: %s", self.cfg.url, e)
            return
        now = time.monotonic()
        for wid in fleet:
            self._order.setdefault(wid, now)
        self.fleet = fleet
        self.released &= set(fleet)  # the provider let them go: forget them

    async def _reconcile(self) -> None:
        reg = self.ctx.registry
        for wid, w in self.fleet.items():
            if w.state == "ready" and wid not in reg.workers and wid not in self.released and wid not in self._draining:
                await reg.add(WorkerRecord(id=wid, url=w.url, labels={"pool": w.pool}, cap=w.cap, source="webhook"))
        for wid, ws in list(reg.workers.items()):
            if ws.rec.source == "webhook" and wid not in self.fleet and wid not in self._draining:
                await reg.remove(wid)


def _parse_fleet(data: Any) -> dict[str, _Listed]:
    if not isinstance(data, dict) or not isinstance(data.get("workers"), list):
        raise ValueError("expected {\"workers\": [...]}")
    out: dict[str, _Listed] = {}
    for w in data["workers"]:
        if not isinstance(w, dict) or not isinstance(w.get("id"), str) or not isinstance(w.get("url"), str):
            raise ValueError(f"bad worker entry {w!r}")
        pool = w.get("pool", POOL_MIXED)
        if pool not in POOLS:
            raise ValueError(f"worker {w['id']}: unknown pool {pool!r}")
        cap = w.get("cap")
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError(f"worker {w['id']}: cap must be a positive integer")
        out[w["id"]] = _Listed(w["url"].rstrip("/"), pool, "starting" if w.get("state") == "starting" else "ready", cap)
    return out
