"""The swap controller: several models' engines on shared hosts (config `shared_hosts:`), at most `max_awake`
of a host's engines awake at once, woken as requests arrive (request-level swapping).

A request for a model none of whose engines is awake waits in the model's admission queue as any request
without room does (gateway/pipeline/dispatch.py asks `demand` instead of answering 503). The decision of which engine to
put to sleep and which to wake is `policies/pooling/swapping.py` (pure, FCFS, an idle engine swapped out, or
after `drain_after_s` a busy one drained first); this module carries it out:

1. the engine swapped out leaves rotation first (`Registry.set_sleep`), then the controller waits until no
   request of any replica is in flight on it, then POST /sleep?level=L&mode=wait (vLLM 0.33: pause, let
   in-flight requests finish, then sleep; docs/reference/vllm-interface.md §6.1);
2. POST /wake_up on the engine swapped in; when it answers it rejoins rotation and the queue drains onto it.

A wake-up that fails (the engine died) marks the engine failed for a while; another host holding the model is
tried, and when none is left the waiting requests get the OpenAI-style 503 of a model without workers.
With Redis, a host's swaps are serialised across gateway replicas by a lease per host (`swap:<host>`, the
autoscaler's lease mechanism), so only one replica drives a host at a time; the replica swapping publishes
which engines it holds out of rotation (document `pool:host:<id>`, with a version), every replica applies that
every `HOLD_SYNC_S` and acknowledges it (document `pool:ack:<host>:<replica>`: the version it applied and the
held engines it still has requests on). The swapping replica puts an engine to sleep only once every live
replica has acknowledged its hold and has nothing left on it, so no replica routes a request to an engine about
to sleep however late its loops run on a loaded host. A replica that does not acknowledge within `ACK_WAIT_S`
(an older version, a replica dying) is waited for as before: two hold syncs and two refreshes of the shared
in-flight view, then until the engine drains.

A host with `scheduling: turns` is not swapped at request level: gateway/control/turns.py drives Aegaeon's decode
turns on it (one `TurnDriver` per such host, started and stopped here); this controller only tells the
registry to route to its engines whatever their sleep state, and handles their failed wake-ups as its own.

Swap costs (`swap_costs`) come from the engine's weights and the host's link (Aegaeon appendix A.2 eq. 4 with
vLLM's sleep-mode reload, policies/pooling/costs.py), unless the config overrides them; the controller uses them
for its timeouts and reports them in the status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import orjson

from engine_adapters.types import AWAKE
from gateway.config import GatewayConfig, SharedHostConfig
from gateway.control.turns import LEVEL_STATE, TurnDriver
from gateway.fleet.registry import Registry
from gateway.ops.metrics import GatewayMetrics
from gateway.state.base import Inflight, StateStore
from gateway.state.outage import stop_task
from gateway.wire.upstream import UpstreamPool
from policies.pooling.costs import REINIT_SLEEP, SwapCost, swap_cost
from policies.pooling.swapping import EngineView, HostView, RequestLevelSwaps, SwapStep

if TYPE_CHECKING:
    from gateway.pipeline.learning import Learner

log = logging.getLogger("fleetgate.pooling")
_NONE = Inflight()

GB = 1e9
PLAN_POLL_S = 0.02           # while demand waits: re-plan this often (engines go idle on any replica)
DRAIN_POLL_S = 0.01
HOLD_SYNC_S = 0.1            # with Redis: how often each replica reads the hosts' published holds
ACK_WAIT_S = 5.0             # with Redis: how long a swap waits for the other replicas to acknowledge a hold


def swap_costs(host: SharedHostConfig) -> dict[str, SwapCost]:
    """Each model's swap cost on the host: vLLM sleep level 1 (weights offloaded over the host link and copied
    back on wake, plus the engine's wake overhead: policies/pooling/costs.py `swap_cost`), or the configured
    `load_s` / `offload_s`. A model without `weight_gb` costs only the wake overhead unless overridden."""
    out = {}
    for model in host.engines:
        e = host.engine(model)
        base = (swap_cost(e.weight_gb * GB, host.link_gb_per_s * GB, REINIT_SLEEP, host.wake_overhead_s)
                if e.weight_gb is not None else SwapCost(host.wake_overhead_s, 0.0))
        out[model] = SwapCost(e.load_s if e.load_s is not None else base.load_s,
                              e.offload_s if e.offload_s is not None else base.offload_s)
    return out


class SwapController:
    def __init__(self, config: GatewayConfig, registry: Registry, store: StateStore, metrics: GatewayMetrics,
                 learner: Learner | None = None) -> None:
        self.config = config
        self.registry = registry
        self.store = store
        self.metrics = metrics
        self.costs = {h.id: swap_costs(h) for h in config.shared_hosts}
        self.hosts = {h.id: h for h in config.shared_hosts if h.scheduling == "request"}   # swapped per request
        self.learner = learner       # turns: the decode step estimate of an engine's profile
        self.turns = {h.id: TurnDriver(self, h, config.turn_tbt_s(h) or 0.0)
                      for h in config.shared_hosts if h.scheduling == "turns"}
        self._routable: frozenset[str] = frozenset()   # turns engines the registry routes to asleep (not failed)
        self.model_hosts: dict[str, list[str]] = {}
        for h in self.hosts.values():
            for m in h.engines:
                self.model_hosts.setdefault(m, []).append(h.id)
        self.planner = RequestLevelSwaps()
        self.upstream: UpstreamPool | None = None
        self.switching: set[str] = set()
        # worker ids a swap under way wakes (they count as awake) -> when it should be done (monotonic): the swap
        # started then plus its cost, what a request arriving meanwhile still has to wait (`wake_s`)
        self.waking: dict[str, float] = {}
        self.failed_until: dict[str, float] = {}    # worker id -> monotonic time its failed wake-up is forgotten
        self.last_busy: dict[str, float] = {}       # worker id -> when it was last seen with requests in flight
        self.swaps = 0
        self.waiting: Callable[[], Collection[str]] = frozenset   # models with requests queued (set by the dispatcher)
        self.on_unservable: Callable[[str], None] = lambda model: None
        self._loop_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._fail_hold_s = max(5.0, 3 * config.health.interval_s)
        self.shared = bool(config.redis_url)
        self.holds: dict[str, dict[str, bool]] = {h: {} for h in self.hosts}   # host -> worker -> held (ours)
        self._sync_task: asyncio.Task | None = None
        self.driving: set[str] = set()              # hosts whose swap lease this replica holds now
        self._acked: dict[str, dict] = {}           # host -> the acknowledgement this replica last wrote

    @property
    def enabled(self) -> bool:
        return bool(self.hosts or self.turns)

    def handles(self, model: str) -> bool:
        return model in self.model_hosts

    def worker_id(self, host: str, model: str) -> str:
        return self.hosts[host].worker_id(model)

    # --- lifecycle ---------------------------------------------------------------------------------
    async def start(self, upstream: UpstreamPool) -> None:
        """Learn which engines sleep (GET /is_sleeping) and put to sleep the awake ones beyond each host's
        `max_awake` (the first ones configured stay awake); turns hosts are settled by their drivers
        (`TurnDriver.settle`: one engine awake) before their loops start, so the gateway never serves a turns
        host with two engines awake."""
        self.upstream = upstream
        await asyncio.gather(*(self._settle(h) for h in self.hosts.values()))
        if self.shared and self.hosts:
            self._sync_task = asyncio.get_running_loop().create_task(self._sync_loop(), name="fg-swap-holds")
        self.refresh_routable(time.monotonic())
        await asyncio.gather(*(d.settle() for d in self.turns.values()))
        for driver in self.turns.values():
            driver.start()

    async def stop(self) -> None:
        """Stop the plan, hold-sync and swap tasks. `stop_task` repeats a cancellation the task runs on past: a
        Redis command can swallow one (the sync loop then reads the holds forever and the shutdown waits)."""
        await asyncio.gather(*(d.stop() for d in self.turns.values()))
        for t in [self._loop_task, self._sync_task, *self._tasks]:
            await stop_task(t)

    async def _settle(self, host: SharedHostConfig) -> None:
        asleep = await asyncio.gather(*(self.is_sleeping(host.engine(m).url) for m in host.engines))
        lease = f"swap:{host.id}"
        if not await self.store.acquire_lease(lease, self.store.replica_id, 2 * host.swap_timeout_s):
            lease = ""      # another replica swaps on it now: only learn what sleeps
        try:
            awake = 0
            for model, sleeping in zip(host.engines, asleep, strict=True):
                wid = host.worker_id(model)
                if sleeping is None:
                    continue     # unreachable: the health checks keep it out
                if sleeping:
                    self.registry.set_sleep(wid, True, LEVEL_STATE[host.sleep_level])
                    self.holds[host.id][wid] = True
                elif awake < host.max_awake or not lease:
                    awake += 1
                else:
                    await self._sleep(host, model)
            if lease:
                await self._publish(host.id)
        finally:
            if lease:
                await self.store.release_lease(lease, self.store.replica_id)

    # --- holds shared between replicas (Redis) ------------------------------------------------------
    async def _publish(self, host: str) -> int:
        """Publish this replica's holds on `host`; their version (0 without Redis)."""
        if not self.shared:
            return 0
        version = time.time_ns()
        await self.store.put_doc(f"pool:host:{host}", {"holds": self.holds[host], "v": version})
        return version

    async def _acknowledged(self, host: str, version: int, wid: str) -> bool:
        """Every other live replica applied holds of `version` or later on `host` and has no request left on
        the held engine `wid`."""
        me = self.store.replica_id
        acks = await self.store.get_docs(f"pool:ack:{host}:")
        for replica in await self.store.live_replicas():
            ack = acks.get(f"pool:ack:{host}:{replica}")
            if replica != me and (ack is None or ack.get("v", 0) < version or wid in ack.get("busy", ())):
                return False
        return True

    async def _hold_everywhere(self, host: SharedHostConfig, wid: str) -> None:
        """Publish the hold on `wid` and wait until every live replica has acknowledged it with nothing left on
        the engine; one that does not within ACK_WAIT_S gets the timed wait instead (two hold syncs and two
        refreshes of the shared in-flight view)."""
        version = await self._publish(host.id)
        ack_by = time.monotonic() + min(ACK_WAIT_S, host.swap_timeout_s)
        while not await self._acknowledged(host.id, version, wid):
            if time.monotonic() > ack_by:
                log.info("engine %s: not every replica acknowledged its hold; waiting for the in-flight view", wid)
                await asyncio.sleep(2 * HOLD_SYNC_S + 2 * getattr(self.store, "refresh_interval_s", HOLD_SYNC_S))
                return
            await asyncio.sleep(DRAIN_POLL_S)

    async def _sync_loop(self) -> None:
        while True:
            try:
                await self.sync_holds()
            except Exception:  # noqa: BLE001 - Redis down: the scrapes still tell sleeping engines
                log.debug("reading shared-host holds failed", exc_info=True)
            await asyncio.sleep(HOLD_SYNC_S)

    async def sync_holds(self) -> None:
        """Apply the holds another replica published for hosts this replica is not swapping on."""
        for hid in self.hosts:
            if hid not in self.driving:     # where this replica swaps now, its own holds are the truth
                await self._apply_holds(hid)
        if self._stranded():
            self._ensure_planning()

    async def _apply_holds(self, hid: str) -> None:
        """The holds last published for host `hid`: True held out (asleep or on its way), False awake."""
        doc = await self.store.get_doc(f"pool:host:{hid}")
        holds = doc.get("holds") if isinstance(doc, dict) else None
        if not isinstance(holds, dict):
            return
        for wid, held in holds.items():
            ws = self.registry.workers.get(wid)
            if ws is None or not isinstance(held, bool):
                continue
            if held and not ws.held:
                self.registry.set_sleep(wid, True)
            elif not held and (ws.held or ws.metrics.sleep_state != AWAKE):
                self.registry.set_sleep(wid, False, AWAKE)   # woken by the publisher (its scrape here may lag)
            self.holds[hid][wid] = held
        version = doc.get("v") if isinstance(doc, dict) else None
        if isinstance(version, int):
            # Held engines are out of rotation here from now on: say so, and which of them still have our
            # requests in flight (the swapping replica waits for those to end).
            busy = sorted(w for w, held in holds.items() if held is True and self.store.own_inflight(w) > 0)
            ack = {"v": version, "busy": busy}
            if ack != self._acked.get(hid):
                await self.store.put_doc(f"pool:ack:{hid}:{self.store.replica_id}", ack)
                self._acked[hid] = ack

    def _stranded(self) -> list[str]:
        """Models with a request in flight on an engine its scrape says sleeps, no swap under way on its host:
        another replica placed it just before it saw the hold (the race the hold sync narrows but cannot close
        without a Redis call per request). Waking the model serves it rather than strand it."""
        inflight = self.store.inflight()
        out = []
        for hid, host in self.hosts.items():
            if hid in self.switching:
                continue
            for model in host.engines:
                ws = self.registry.workers.get(host.worker_id(model))
                f = inflight.get(ws.id) if ws is not None else None
                if f is not None and f.requests and ws.metrics.sleep_state != AWAKE:
                    out.append(model)
        return out

    # --- what the dispatcher asks (no I/O) -----------------------------------------------------------
    def servable(self, model: str) -> bool:
        """Some engine of the model could be woken: healthy, and its last wake-up did not fail lately."""
        now = time.monotonic()
        for h in self.model_hosts.get(model, ()):
            ws = self.registry.workers.get(self.worker_id(h, model))
            if ws is not None and ws.healthy and ws.active and self.failed_until.get(ws.id, 0.0) <= now:
                return True
        return False

    def wake_s(self, model: str) -> float:
        """How long before an engine of `model` can run: 0 when one is awake (or the model is not on a
        request-level shared host); what is left of the swap when one is waking it; else the quickest swap over
        the hosts that could wake it: the model's `load_s`, plus the largest `offload_s` of the host's other awake
        engines when it has no room (one of them sleeps first), after what is left of a swap already under way on
        that host (its swaps run one at a time). What a waiting request adds to its TTFT target
        (policies/admission.py `queue_budget`): a request that waits for its model to wake waits, it is not
        refused for the swap's time."""
        if not self.handles(model):
            return 0.0
        now = time.monotonic()
        busy_until = {h: max(self.waking.get(self.worker_id(h, m), now) for m in host.engines)
                      for h, host in self.hosts.items()}
        best = None
        for hid, view in self.views().items():
            e = view.engines.get(model)
            if e is None:
                continue
            if e.awake:
                ready = self.waking.get(self.worker_id(hid, model))
                if ready is None:
                    return 0.0
                s = max(0.0, ready - now)
            elif not e.usable:
                continue
            else:
                costs = self.costs[hid]
                out = [costs[m].offload_s for m, o in view.engines.items() if o.awake and m != model]
                s = (busy_until[hid] - now + costs[model].load_s
                     + (max(out) if out and view.awake_count() >= view.max_awake else 0.0))
            best = s if best is None else min(best, s)
        return best or 0.0

    def _step_s(self, step: SwapStep) -> float:
        """The expected time of a swap: the victims' offload, then the wanted engine's load."""
        costs = self.costs[step.host]
        return sum(costs[m].offload_s for m in step.sleep) + costs[step.wake].load_s

    def demand(self, model: str) -> None:
        """Requests for `model` wait with none of its engines awake: plan a swap (now and until it is met)."""
        self.planner.want(model, time.monotonic())
        self._ensure_planning()

    def _ensure_planning(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._plan_loop(), name="fg-swaps")

    # --- planning ----------------------------------------------------------------------------------
    async def _plan_loop(self) -> None:
        try:
            while True:
                self.plan_once()
                if not (self.planner.demand or self.switching):
                    return
                await asyncio.sleep(PLAN_POLL_S)
        except Exception:  # noqa: BLE001 - a bug here must not kill the gateway; waiting requests time out
            log.exception("swap planning failed")

    def plan_once(self) -> list[SwapStep]:
        now = time.monotonic()
        for model in self._stranded():
            self.planner.want(model, now)
        steps = self.planner.plan(self.views(), self.waiting(), now)
        for step in steps:
            self.switching.add(step.host)
            # the model counts as awake there from now: its demand is met, no other host swaps for it meanwhile
            self.waking[self.worker_id(step.host, step.wake)] = now + self._step_s(step)
            t = asyncio.get_running_loop().create_task(self._swap(step), name=f"fg-swap-{step.host}")
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        return steps

    def views(self) -> dict[str, HostView]:
        now = time.monotonic()
        inflight = self.store.inflight()
        out = {}
        for hid, host in self.hosts.items():
            engines = {}
            for model in host.engines:
                wid = host.worker_id(model)
                ws = self.registry.workers.get(wid)
                f = inflight.get(wid)
                busy = f.requests if f is not None else 0
                if busy:
                    self.last_busy[wid] = now
                usable = ws is not None and ws.healthy and ws.active and self.failed_until.get(wid, 0.0) <= now
                awake = ws is not None and (ws.awake or wid in self.waking)
                engines[model] = EngineView(awake, busy, self.last_busy.get(wid, 0.0), usable)
            out[hid] = HostView(host.max_awake, engines, hid in self.switching, host.drain_after_s)
        return out

    # --- carrying a swap out -------------------------------------------------------------------------
    async def _swap(self, step: SwapStep) -> None:
        host = self.hosts[step.host]
        lease = f"swap:{host.id}"
        t0 = time.perf_counter()
        held = False
        try:
            held = await self.store.acquire_lease(lease, self.store.replica_id, 2 * host.swap_timeout_s)
            if not held:
                return      # another replica swaps on this host now; the plan loop asks again
            if self.shared:     # the plan may predate what the last lease holder did: re-read it, re-check
                await self._apply_holds(host.id)
                others = [self.registry.workers.get(host.worker_id(m)) for m in host.engines
                          if m != step.wake and m not in step.sleep]
                awake = [ws for ws in others if ws is not None and ws.awake]
                if len(awake) >= host.max_awake:
                    return
            self.driving.add(host.id)
            for victim in step.sleep:
                if not await self._sleep(host, victim):
                    return
            await self._wake(host, step.wake)
            self.metrics.swap_seconds.labels(host.id).observe(time.perf_counter() - t0)
        except Exception:  # noqa: BLE001
            log.exception("swap on %s failed", host.id)
        finally:
            self.waking.pop(host.worker_id(step.wake), None)
            self.driving.discard(host.id)
            if held:
                with contextlib.suppress(Exception):
                    await self.store.release_lease(lease, self.store.replica_id)
            self.switching.discard(host.id)

    async def _sleep(self, host: SharedHostConfig, model: str) -> bool:
        """Out of rotation, wait until nothing is in flight on it, then sleep; False (and back in rotation)
        when it does not drain or the engine refuses."""
        wid = host.worker_id(model)
        self.registry.set_sleep(wid, True)
        self.holds[host.id][wid] = True
        deadline = time.monotonic() + host.swap_timeout_s
        if self.shared:     # every replica stops placing on it, and its last placements end
            await self._hold_everywhere(host, wid)
        while True:
            f = self.store.inflight().get(wid)
            if f is None or f.requests == 0:
                break
            if time.monotonic() > deadline:
                log.warning("engine %s did not go idle within %gs; not swapped out", wid, host.swap_timeout_s)
                await self._unhold(host.id, wid)
                return False
            await asyncio.sleep(DRAIN_POLL_S)
        url = f"{host.engine(model).url}/sleep?level={host.sleep_level}&mode=wait"
        if not await self.post(url, host.swap_timeout_s):
            log.warning("engine %s refused to sleep; left awake", wid)
            await self._unhold(host.id, wid)
            return False
        self.registry.set_sleep(wid, True, LEVEL_STATE[host.sleep_level])
        self.metrics.model_swaps.labels(model, "out").inc()
        log.info("engine %s (%s on %s) asleep", wid, model, host.id)
        return True

    async def _wake(self, host: SharedHostConfig, model: str) -> bool:
        wid = host.worker_id(model)
        ok = await self.post(f"{host.engine(model).url}/wake_up", host.swap_timeout_s)
        if not ok:
            self.failed_until[wid] = time.monotonic() + self._fail_hold_s
            self.registry.report_failure(wid)
            log.warning("engine %s (%s on %s) did not wake up", wid, model, host.id)
            if not self.servable(model):
                self.planner.served(model)       # nothing left to wake: its waiting requests get a 503
            self.on_unservable(model)
            return False
        self.last_busy[wid] = time.monotonic()
        self.registry.set_sleep(wid, False, AWAKE)
        self.holds[host.id][wid] = False
        await self._publish(host.id)
        self.planner.served(model)
        self.swaps += 1
        self.metrics.model_swaps.labels(model, "in").inc()
        log.info("engine %s (%s on %s) awake", wid, model, host.id)
        return True

    # --- turns hosts (gateway/control/turns.py) ----------------------------------------------------------------
    def refresh_routable(self, now: float) -> None:
        """The registry routes to every turns engine whatever its sleep state, except one whose wake-up failed
        lately."""
        wids = frozenset(d.host.worker_id(m) for d in self.turns.values() for m in d.host.engines
                         if self.failed_until.get(d.host.worker_id(m), 0.0) <= now)
        if wids != self._routable:
            self._routable = wids
            self.registry.route_while_asleep(wids)

    def wake_failed(self, model: str, wid: str) -> None:
        """A turns engine did not wake: out of rotation for a while (its waiting requests may get a 503)."""
        now = time.monotonic()
        self.failed_until[wid] = now + self._fail_hold_s
        self.registry.report_failure(wid)
        self.refresh_routable(now)
        self.on_unservable(model)

    def engine_lost(self, model: str, wid: str) -> None:
        """A turns engine did not answer its pause (dead or hung): suspected (out of rotation at once, its
        exchanges in flight given up, so its requests resume or retry on the model's other engines; back after
        the health checks pass, not before `resume.suspect_hold_s`) and failed as `wake_failed`."""
        self.registry.suspect(wid, "it did not answer its pause between turns")
        self.wake_failed(model, wid)

    async def _unhold(self, host: str, wid: str) -> None:
        self.registry.set_sleep(wid, False)
        self.holds[host][wid] = False
        await self._publish(host)

    async def post(self, url: str, timeout_s: float) -> bool:
        return await self.post_status(url, timeout_s) == 200

    async def post_status(self, url: str, timeout_s: float) -> int | None:
        """The status of an empty POST, None when the engine did not answer."""
        assert self.upstream is not None
        try:
            r = await self.upstream.fetch(url, timeout_s, b"POST")
        except (TimeoutError, OSError):
            return None
        return r.status

    async def is_sleeping(self, url: str) -> bool | None:
        assert self.upstream is not None
        try:
            r = await self.upstream.fetch(url + "/is_sleeping", self.config.health.timeout_s)
            return bool(orjson.loads(r.body).get("is_sleeping")) if r.status == 200 else None
        except (TimeoutError, OSError, ValueError, AttributeError):
            return None

    # --- reporting -----------------------------------------------------------------------------------
    def _awake(self, wid: str) -> bool:
        ws = self.registry.workers.get(wid)
        return ws is not None and ws.awake
    def describe(self) -> list[dict[str, Any]]:
        views = self.views()
        turns = [{"id": hid, "scheduling": "turns", "max_awake": d.host.max_awake, "q_max_s": d.host.q_max_s,
                  "tbt_s": d.keeper.tbt_s, **d.describe(),
                  "engines": {m: {"worker": d.host.worker_id(m), "awake": self._awake(d.host.worker_id(m)),
                                  "busy": (self.store.inflight().get(d.host.worker_id(m)) or _NONE).requests,
                                  "load_s": self.costs[hid][m].load_s, "offload_s": self.costs[hid][m].offload_s}
                              for m in d.host.engines}} for hid, d in self.turns.items()]
        return turns + [{"id": hid, "scheduling": "request", "max_awake": h.max_awake, "switching": hid in self.switching,
                 "engines": {m: {"worker": h.worker_id(m), "awake": views[hid].engines[m].awake,
                                 "busy": views[hid].engines[m].busy,
                                 "load_s": self.costs[hid][m].load_s, "offload_s": self.costs[hid][m].offload_s}
                             for m in h.engines}} for hid, h in self.hosts.items()]
