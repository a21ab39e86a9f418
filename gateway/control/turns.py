"""Aegaeon's decode turns enforced live on a shared host (config `shared_hosts[].scheduling: turns`;
Aegaeon SOSP 2025 section 4.3).

On a turns host every engine takes its model's requests at any time: the gateway keeps routing to an engine
while it is paused or asleep between turns (vLLM queues them and runs them after the wake-up, as does the
simulated engine; `Registry.route_while_asleep`). At most one engine of the host runs at a time. A loop per
host (`TurnDriver`) only does I/O; what runs when is `policies/pooling/turns.py` `HostTurns` (pure), whose rounds
and quotas are `aegaeon.DecodeWorkLists.round` / `decode_quotas` (eq. 2-3), the code the simulator's aegaeon mode
uses:

- the work list: the models with requests in flight on the host (the state store's in-flight view, every
  replica's), one batch per model; the TBT target d is the host's `tbt_ms` (default the models' slo.tpot_ms),
  a batch's step time the learner's decode estimate for its size (Aladdin eq. 3 of the engine's profile) or,
  without one, d itself (every quota is then Q_MAX); the switch cost from a to b is a's `offload_s` plus b's
  `load_s` (`pooling.swap_costs`; at level 0 nothing moves: 0) or the host's measured switch time if larger;
- a switch: POST /sleep?level=L&mode=keep on the engine whose turn ended (its in-flight requests stay,
  paused), then POST /wake_up on the next. L = 0 (pause the scheduler only; weights and KV stay) when every
  engine of the host fits in its memory (`max_awake` >= engines), else the host's `sleep_level` (weights out).
  An engine answering level 0 with 400 (a vLLM without it) is paused at level 1 from then on
  (`EngineAdapter.sleep_fallback`).

Simulator only: with L >= 1 stock vLLM drops the paused requests' KV cache, so they recompute their context
after the wake-up (the simulated engine does the same), whereas Aegaeon keeps the KV in host memory and copies
it back (its section 5); the live gateway cannot move KV, only the simulator models Aegaeon's KV swap.
Hence `recompute_quota` (always on; false is refused: its turns starve): at L >= 1 a turn's quota starts after
the learner's prefill estimate for the tokens in flight on its engine, and that estimate counts in c (the
simulator's `recompute_quota`; with the stock rule a quota shorter than the recomputation decodes nothing:
bench/results/pooling_seeds.md, bench/results/pooling.md 2026-12-07).

A wake-up that fails marks the engine failed for a while (out of rotation, its model left out of the work
list); waiting requests for a model with no engine left get the OpenAI-style 503, as on request-level hosts.
Two engines of the host are never woken at once (on a host sized for one they would run out of GPU memory): the
next engine wakes only once the old one paused (`policies/pooling/turns.py` `pause_outcome`). A pause unanswered
within `pause_timeout_s` (the connection fails, or a live engine answers late on a loaded machine) is followed
by a GET /is_sleeping: asleep, the pause went through and the switch goes on; awake, the engine still runs, so
its turn goes on and the switch is retried; no answer to that either (it died or hangs), it is taken for not
running: it loses its turn, is suspected (out of rotation, its exchanges given up: its model's requests resume
or retry on the model's engines on other hosts) and marked failed, and the switch goes on to wake the next
engine. A dead engine is never waited on; an engine that answers with a refusal still runs, so its turn goes on.
The gateway settles each turns host before it serves (`TurnDriver.settle`): the lease holder learns which
engines are awake and pauses all but one, so no request ever finds two engines awake.
With Redis only the replica holding the host's lease (`swap:<host>`) drives its turns; the others just route
(their requests reach the engines whatever their state). The lease is short so that another replica takes over
within seconds of the driver dying: its TTL is `lease_ttl_s` = max(LEASE_MIN_S, LEASE_SWITCHES x the host's
longest switch), the longest switch being the largest offload_s plus the largest load_s of its engines (0 at
level 0) or the measured switch time if larger. It is renewed every tick and again before each step of a switch
(the /sleep and the /wake_up), and while a step's request is out it is renewed every TTL / 3; a driver that
finds the lease taken (it was stopped or slow past its TTL) abandons the switch and stops driving, so a switch
never runs on without the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from engine_adapters.types import AWAKE
from gateway.config import SharedHostConfig
from gateway.state.outage import stop_task
from policies.pooling.turns import LOST, PAUSED, REFUSED, HostTurns, pause_outcome

if TYPE_CHECKING:
    from gateway.fleet.registry import Registry
    from gateway.ops.metrics import GatewayMetrics
    from gateway.pipeline.learning import Learner
    from gateway.state.base import StateStore
    from policies.pooling.costs import SwapCost

log = logging.getLogger("fleetgate.turns")

TURN_POLL_S = 0.01       # how often a turn's end (quota spent, nothing in flight) is checked
LEASE_POLL_S = 0.5       # a replica without the host's lease asks for it this often
LEVEL_STATE = {0: "paused", 1: "weights_offloaded", 2: "discard_all"}   # vllm:engine_sleep_state per /sleep level
SWITCH_RETRY_S = 0.5     # after a switch that failed, the next attempt waits this long
SWITCH_EWMA = 0.3        # weight of the latest switch in the host's measured switch time
LEASE_MIN_S = 3.0        # the host lease's shortest TTL (module docstring)
LEASE_SWITCHES = 2.0     # the TTL covers this many of the host's longest switches
PAUSE_FLOOR_S = 2.0      # a pause unanswered this long (or PAUSE_SLACK x its expected time if longer) has failed
PAUSE_SLACK = 3.0


class TurnHost(Protocol):
    """What a turn driver uses of the swap controller that owns it (gateway/control/pooling.py `SwapController`)."""

    store: StateStore
    registry: Registry
    metrics: GatewayMetrics
    learner: Learner | None
    costs: dict[str, dict[str, SwapCost]]      # host -> model -> its swap cost
    failed_until: dict[str, float]            # worker id -> monotonic time its failed wake-up is forgotten
    driving: set[str]                         # hosts whose swap lease this replica holds

    def refresh_routable(self, now: float) -> None: ...
    def wake_failed(self, model: str, wid: str) -> None: ...
    def engine_lost(self, model: str, wid: str) -> None: ...
    async def post(self, url: str, timeout_s: float) -> bool: ...
    async def post_status(self, url: str, timeout_s: float) -> int | None: ...
    async def is_sleeping(self, url: str) -> bool | None: ...


class TurnDriver:
    """The turn loop of one host (module docstring)."""

    def __init__(self, ctl: TurnHost, host: SharedHostConfig, tbt_s: float) -> None:
        self.ctl = ctl
        self.host = host
        self.keeper = HostTurns(host.id, tbt_s, host.q_max_s)
        self.level = 0 if host.max_awake >= len(host.engines) else host.sleep_level
        self.levels: dict[str, int] = {}          # model -> level its engine is paused at (after a fallback)
        self.running: str | None = None           # the model whose engine is awake (this replica's knowledge)
        self.known = False                        # `running` learnt since the lease was taken
        self.lost: set[str] = set()               # models whose engine did not answer its pause (out a while)
        self.holding = False
        self.switches = 0
        self.switch_s = 0.0                       # measured switch time (EWMA)
        self._lease_at = 0.0
        self._task: asyncio.Task | None = None

    @property
    def lease(self) -> str:
        return f"swap:{self.host.id}"

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"fg-turns-{self.host.id}")

    async def stop(self) -> None:
        await stop_task(self._task)
        if self.holding:
            with contextlib.suppress(Exception):
                await self.ctl.store.release_lease(self.lease, self.ctl.store.replica_id)

    async def settle(self) -> None:
        """Before the gateway serves (`SwapController.start`): with the host's lease, learn which engine is awake
        and pause the others, so that the host never runs two engines once requests come (the engines may all
        start awake). Without the lease another replica drives the host and settles it. A failure here is left
        to the loop, which learns anew."""
        try:
            if await self._hold_lease():
                await self._learn()
        except Exception:  # noqa: BLE001 - the gateway must start; the loop retries the learning
            log.exception("turns on %s could not settle", self.host.id)
            self.known = False

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a bug here must not kill the gateway; the engines keep their requests
                log.exception("turns on %s failed", self.host.id)
                self.known = False
                await asyncio.sleep(LEASE_POLL_S)
            await asyncio.sleep(TURN_POLL_S)

    async def tick(self) -> None:
        self.ctl.refresh_routable(time.monotonic())     # an engine whose failed wake-up is forgotten routes again
        if not await self._hold_lease():
            return
        now = time.monotonic()
        back = {m for m in self.lost if self.usable(m, now)}
        if back:                        # an engine taken for dead answers again: learn anew what is awake
            self.lost -= back
            self.known = False
        if not self.known:
            await self._learn()
        work = self._work(now)
        d = self.keeper.decide(now, work, self._step_time, self._switch_cost)
        if d.model is None or d.model not in work:
            return                      # nothing to run, or the one to run failed meanwhile
        if d.new_turn:
            self.ctl.metrics.turns.labels(self.host.id, d.model).inc()
        grace = 0.0
        if d.model != self.running:
            if not await self._switch(self.running, d.model):
                await asyncio.sleep(SWITCH_RETRY_S)     # an engine refused: do not hammer it every tick
            else:
                grace = self._recompute_s(d.model)
        if d.new_turn:
            self.keeper.switched(time.monotonic() + grace)

    # --- what the keeper is told ---------------------------------------------------------------------
    def usable(self, model: str, now: float) -> bool:
        ws = self.ctl.registry.workers.get(self.host.worker_id(model))
        return ws is not None and ws.healthy and ws.active and self.ctl.failed_until.get(ws.id, 0.0) <= now

    def _work(self, now: float) -> dict[str, int]:
        """Requests in flight per usable engine (every replica's)."""
        inflight = self.ctl.store.inflight()
        out = {}
        for m in self.host.engines:
            if self.usable(m, now):
                f = inflight.get(self.host.worker_id(m))
                out[m] = f.requests if f is not None else 0
        return out

    def _step_time(self, model: str, n: int) -> float:
        """One decode step of `n` requests of `model`: the learner's estimate for the engine's profile, else the
        TBT target (the batch is taken to use all its slack)."""
        pm = self._perf_model(model)
        if pm is None:
            return self.keeper.tbt_s
        f = self.ctl.store.inflight().get(self.host.worker_id(model))
        ctx = f.tokens / f.requests if f is not None and f.requests else 0.0
        return max(pm.decode_step(max(n, 1), ctx), 1e-6)

    def _perf_model(self, model: str) -> Any:
        """The learner's performance model of the engine's profile (None without a profile or a learner)."""
        profile = self.host.engine(model).profile
        learner = self.ctl.learner
        return learner.model_for(profile) if learner is not None and profile else None

    def _switch_cost(self, a: str, b: str) -> float:
        costs = self.ctl.costs[self.host.id]
        moved = costs[a].offload_s + costs[b].load_s if self._level(a) >= 1 else 0.0
        return max(moved, self.switch_s) + self._recompute_s(b)

    def _recompute_s(self, model: str) -> float:
        """At level >= 1 (`recompute_quota`, always on): the learner's prefill estimate for the tokens in flight
        on the model's engine (prompts and outputs so far, as the gateway accounts them: an upper estimate), the KV
        its requests recompute after the wake-up. 0 at level 0, or without a profile to estimate from."""
        if self._level(model) == 0:
            return 0.0
        pm = self._perf_model(model)
        f = self.ctl.store.inflight().get(self.host.worker_id(model))
        if pm is None or f is None or not f.tokens:
            return 0.0
        return max(pm.prefill_time(f.tokens, f.tokens * f.tokens / max(f.requests, 1)), 0.0)   # equal prompts

    def _level(self, model: str) -> int:
        return self.levels.get(model, self.level)

    # --- I/O -----------------------------------------------------------------------------------------
    def lease_ttl_s(self) -> float:
        """max(LEASE_MIN_S, LEASE_SWITCHES x the longest switch): module docstring."""
        costs = self.ctl.costs[self.host.id].values()
        moved = max(c.offload_s for c in costs) + max(c.load_s for c in costs) if self.level >= 1 or self.levels \
            else 0.0
        return max(LEASE_MIN_S, LEASE_SWITCHES * max(moved, self.switch_s))

    async def _renew(self) -> bool:
        """Renew the lease now (before a switch step); False, and this replica stops driving, if it is lost."""
        self._lease_at = 0.0
        return await self._hold_lease()

    async def _leased(self, step: Any) -> Any:
        """Await one switch step with the lease renewed every TTL / 3 while it is out; None if the lease is lost
        (the step is cancelled: another replica drives the host now)."""
        if not await self._renew():
            return None
        task = asyncio.ensure_future(step)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.lease_ttl_s() / 3)
                if done:
                    return task.result()
                if not await self._renew():
                    return None
        finally:
            if not task.done():
                with contextlib.suppress(Exception):
                    await stop_task(task)

    async def _hold_lease(self) -> bool:
        now = time.monotonic()
        if now < self._lease_at:
            return self.holding
        store = self.ctl.store
        held = await store.acquire_lease(self.lease, store.replica_id, self.lease_ttl_s())
        self._lease_at = now + (TURN_POLL_S * 10 if held else LEASE_POLL_S)
        if held != self.holding:
            log.info("turns on %s %s", self.host.id, "driven here" if held else "driven by another replica")
            self.known = self.known and held
        self.holding = held
        (self.ctl.driving.add if held else self.ctl.driving.discard)(self.host.id)
        return held

    async def _learn(self) -> None:
        """Which engine is awake: keep one (the keeper's current, else the first), pause the others."""
        asleep = await asyncio.gather(*(self.ctl.is_sleeping(self.host.engine(m).url) for m in self.host.engines))
        awake = [m for m, s in zip(self.host.engines, asleep, strict=True) if s is False]
        keep = self.keeper.current if self.keeper.current in awake else (awake[0] if awake else None)
        for m, s in zip(self.host.engines, asleep, strict=True):
            wid = self.host.worker_id(m)
            if m == keep:
                self.ctl.registry.set_sleep(wid, False, AWAKE)
            elif s is False:
                await self._pause(m)
            elif s:
                self.ctl.registry.set_sleep(wid, False, LEVEL_STATE[self._level(m)])
        self.running = keep
        self.known = True

    async def _switch(self, old: str | None, new: str) -> bool:
        t0 = time.perf_counter()
        if old is not None:
            outcome = await self._leased(self._pause(old))
            if outcome is None or outcome == REFUSED:
                return False        # the lease is lost (another replica drives the host), or the engine runs on
        self.running = None
        if not await self._leased(self._wake(new)):
            return False
        self.running = new
        took = time.perf_counter() - t0
        self.switches += 1
        self.switch_s = took if self.switches == 1 else (1 - SWITCH_EWMA) * self.switch_s + SWITCH_EWMA * took
        self.ctl.metrics.swap_seconds.labels(self.host.id).observe(took)
        return True

    def pause_timeout_s(self, model: str) -> float:
        """How long a pause of `model`'s engine may take before the engine is taken for dead or hung:
        PAUSE_SLACK x what it should take (its offload at level >= 1, else nothing moves; or the measured switch
        time if longer), at least PAUSE_FLOOR_S, at most the host's `swap_timeout_s`."""
        moved = self.ctl.costs[self.host.id][model].offload_s if self._level(model) >= 1 else 0.0
        return min(self.host.swap_timeout_s, max(PAUSE_FLOOR_S, PAUSE_SLACK * max(moved, self.switch_s)))

    async def _pause(self, model: str) -> str:
        """/sleep?level=L&mode=keep: its requests stay, paused; a 400 at level 0 retries at the fallback level.
        Unanswered, the engine's /is_sleeping decides (`pause_outcome`). PAUSED; LOST when the engine answers
        neither (dead or hung: it lost its turn and is out of rotation a while, module docstring); REFUSED when it
        answered no or is still awake (it runs on)."""
        level = self._level(model)
        url = self.host.engine(model).url
        adapter = self.ctl.registry.adapter
        wid = self.host.worker_id(model)
        while True:
            status = await self.ctl.post_status(url + adapter.sleep_path(level, "keep"), self.pause_timeout_s(model))
            fallback = adapter.sleep_fallback(level, status) if status not in (200, None) else None
            if fallback is None:
                break
            log.info("engine %s refused level %d; paused at level %d from now on", wid, level, fallback)
            level = self.levels[model] = fallback
        asleep = await self.ctl.is_sleeping(url) if status is None else None
        outcome = pause_outcome(status, asleep)
        if outcome == LOST:
            log.warning("engine %s (%s on %s) answered neither its pause nor /is_sleeping: taken for dead, it loses "
                        "its turn", wid, model, self.host.id)
            self.ctl.engine_lost(model, wid)
            self.lost.add(model)
            return LOST
        if outcome == REFUSED:
            log.warning("engine %s did not pause (%s); its turn goes on", wid,
                        status if status is not None else "no answer in time, still awake")
            return REFUSED
        if status is None:
            log.info("engine %s answered its pause late but is asleep: the switch goes on", wid)
        self.ctl.registry.set_sleep(wid, False, LEVEL_STATE[level])
        self.ctl.metrics.model_swaps.labels(model, "out").inc()
        return PAUSED

    async def _wake(self, model: str) -> bool:
        wid = self.host.worker_id(model)
        if not await self.ctl.post(f"{self.host.engine(model).url}/wake_up", self.host.swap_timeout_s):
            self.ctl.wake_failed(model, wid)
            log.warning("engine %s (%s on %s) did not wake up for its turn", wid, model, self.host.id)
            return False
        self.ctl.registry.set_sleep(wid, False, AWAKE)
        self.ctl.metrics.model_swaps.labels(model, "in").inc()
        return True

    # --- reporting -----------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        k = self.keeper
        plan = k.last_round
        left = max(0.0, k.turn_end - time.monotonic()) if k.turn_end is not None else None
        return {"driving": self.holding, "lease_ttl_s": round(self.lease_ttl_s(), 3), "level": self.level,
                "running": self.running, "switches": self.switches,
                "switch_s": round(self.switch_s, 4),
                "turn": {"model": k.current, "quota_s": k.quota_s, "left_s": left},
                "round": None if plan is None else {"models": k.order, "quotas_s": list(plan.quotas),
                                                    "step_s": list(plan.step_times), "switch_s": plan.switch_s,
                                                    "alpha": plan.alpha}}
