"""Virtual-time autoscaling experiments: Chiron-style, utilization-band and static fleets on simulator.cluster.

    sc = scenario_wb(seed=0)                        # interactive trace + a batch queue with a 1 h deadline
    res = run_arm(sc, Arm("chiron"))                # or Arm("utilization"), Arm("static", static_workers=8)
    res.gpu_seconds, res.interactive["slo_attainment"], res.batch["on_time"]

What the driver adds to `ClusterSim` (all in the `AutoscaleSim` subclass; cluster.py is unchanged):
- request classes: interactive requests go through the cluster's own path (its FIFO admission queue
  when no worker has room); batch requests wait in a deadline-ordered `BatchQueue` held by the gateway
  and are pumped into workers with room whenever a slot frees, after any waiting interactive request;
- pools as worker labels (`labels["pool"]`: interactive / mixed / batch): the gateway's placement step
  (policies/placement.py) filters by pool, then the arm's policy (`least_fill` by default) picks;
  in the Chiron arm an interactive request that finds no room evicts the newest batch request of a
  mixed worker, which goes back to the queue at its old place (Chiron section 3);
- per-worker caps that change at run time (`SimWorker.cap`), set by Chiron's local autoscaler from the
  worker's mean inter-token latency (every engine step's duration / iterations, token-weighted: what
  vLLM's time_per_output_token histogram records) and its output tokens/s;
- cold start: a scale-out provisions a worker that is billed at once and takes traffic only after
  a cold start drawn uniformly from `cold_start_s`; scale-in drains (no new requests, in-flight ones
  finish) or cancels a worker still starting;
- GPU-seconds from provisioning (cold start included) to release, over the same horizon for every arm;
- what happens to an evicted batch request (`Arm.evict_mode`): "restart" (what the live gateway does:
  vLLM aborts it, it goes back to the queue and runs again from scratch, its generated tokens lost) or
  "swap" (Chiron section 4's fast restart, simulator only: its KV goes to host memory and it keeps its
  generated tokens; placed again, it waits for the swap-in, KV bytes / `Profile.host_link_bytes_per_s`,
  instead of recomputing, and decodes on). Real vLLM has no API to move a request's KV out and back in.
  "continue" (what the live gateway does for requests the resume continuation can carry: it keeps the
  generated text, and its next run prefills the prompt plus that text and decodes only the rest).

Routing sees each engine's live state (`scrape_interval_s` 0) and the queues are retried after every
engine step that leaves a worker with room. `has_room` (nothing sent to a worker waits inside its engine)
compares the in-flight count with the engine's running count; against a count up to 0.5 s old (one
metrics scrape) a worker could take only about one new request per scrape, which starved workers that run
hundreds of requests (a small model). A gateway learns each admission from the request's first streamed
token; the simulator reads it from the engine.

Arms (the same code paths; only the controller differs): `chiron` (local + global autoscaler, pools,
eviction), `utilization` (mean KV utilisation band, +1/-1 with cooldown, one pool, one static per-worker
cap: `Arm.static_cap`, by default the engine's default batch limit max_num_seqs), `utilization_local`
(the band plus Chiron's local caps: Chiron's ablation "global replaced by a utilisation autoscaler"),
`static` (a fixed fleet).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from policies.autoscale.global_ import (
    POOL_BATCH,
    POOL_INTERACTIVE,
    POOL_MIXED,
    POOLS,
    FleetObservation,
    GlobalAutoscaler,
    GlobalConfig,
    arrival_spikes,
    theta_from_spikes,
)
from policies.autoscale.local import LocalAutoscaler, LocalConfig
from policies.autoscale.observation import FleetTick, ObservationBuilder, OutputStats, WorkerTick
from policies.autoscale.routing import eviction_victim
from policies.autoscale.utilization_band import StaticProvisioning, UtilizationBand, fleet_utilization
from policies.batch_queue import BatchQueue
from policies.placement import has_room, reserved_tokens
from policies.types import CLASS_BATCH, Decision, RequestFeatures
from simulator.cluster import _STEP, ClusterSim, RequestResult, SimWorker
from simulator.engine import EngineConfig, SimRequest
from simulator.profiles import load_profile
from simulator.workload import WorkloadRequest, load_workload

ARMS = ("chiron", "utilization", "utilization_local", "static")
EVICT_MODES = ("restart", "swap", "continue")


# ---- scenario and arm -----------------------------------------------------------------------------
@dataclass
class BatchJob:
    """One batch submission (e.g. an OpenAI Batch API file): every request arrives at `submit_at`."""

    submit_at: float
    requests: list[WorkloadRequest]
    deadline_s: float = 3600.0


@dataclass
class Scenario:
    name: str
    interactive: list[WorkloadRequest]
    batch: list[BatchJob] = field(default_factory=list)
    profile: str = "llama2-70b-tp2-a100"
    horizon_s: float = 3600.0
    slo_ttft_s: float = 10.0           # Chiron section 6: interactive TTFT 10 s, ITL 200 ms
    slo_tpot_s: float = 0.2
    batch_itl_slo_s: float = 2.0       # Chiron section 6: batch ITL 2 s (deadline = its TTFT SLO, 1 h)
    cold_start_s: tuple[float, float] = (30.0, 60.0)
    initial_workers: int = 2
    max_workers: int = 16
    theta: float = 0.5                 # Chiron's over-provisioning target (see theta_for)
    seed: int = 0
    description: str = ""


@dataclass
class Arm:
    kind: str = "chiron"               # one of ARMS
    static_workers: int | None = None  # static: fleet size (default: scenario.initial_workers)
    util_low: float = 0.3
    util_high: float = 0.7
    util_cooldown_s: float = 60.0
    tick_s: float = 15.0               # global decision period
    local_tick_s: float = 10.0         # local cap update period (one measurement window)
    rate_window_s: float = 60.0
    throughput_window_s: float = 120.0
    local: LocalConfig | None = None   # defaults from the scenario's ITL SLO
    global_config: GlobalConfig | None = None
    static_cap: int | None = None      # utilization / static: the per-worker cap (None: profile max_num_seqs)
    batch_max_cap: int = 4096          # chiron: local-autoscaler ceiling on batch-pool workers (sec. 6.2: 2048-4096)
    evict_mode: str = "restart"        # chiron: "restart", "continue" (live gateway) or "swap" (sec. 4, sim only)
    policy: str = "least_fill"         # the placement policy behind the pool filter (the gateway's config name)
    policy_params: dict[str, Any] = field(default_factory=dict)
    joint: bool = False                # feed the placement shortfall (aladdin) to the global autoscaler
    queue_lookahead: int = 1           # the gateway's limits.queue_lookahead
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or self.kind


@dataclass
class ArmResult:
    scenario: str
    arm: str
    gpu_seconds: float
    interactive: dict[str, Any]
    batch: dict[str, Any]
    evictions: int
    scale_actions: dict[str, int]
    timeline: list[dict[str, Any]]
    wall_s: float
    swap: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        ups = sum(n for k, n in self.scale_actions.items() if "/up/" in k)
        total = sum(self.scale_actions.values())
        return {
            "scenario": self.scenario, "arm": self.arm, "gpu_seconds": round(self.gpu_seconds),
            "interactive_slo": self.interactive.get("slo_attainment"),
            "ttft_p99": self.interactive.get("ttft_p99"), "tpot_p99": self.interactive.get("tpot_p99"),
            "batch_on_time": self.batch.get("on_time"), "batch_done_at": self.batch.get("last_finish"),
            "evictions": self.evictions, "scale_ups": ups,
            "evicted_tokens": self.swap.get("evicted_tokens", 0), "swap_ins": self.swap.get("swap_ins", 0),
            "peak_host_kv_gb": self.swap.get("peak_host_kv_bytes", 0) / 1e9,
            "hysteresis": (total / ups) if ups else None,     # Chiron section 2.3: all actions / scale-ups
            "peak_workers": max((s["workers"] for s in self.timeline), default=0),
            "max_running": max((s.get("max_running", 0) for s in self.timeline), default=0),   # largest engine batch
            "wall_s": round(self.wall_s, 2),
        }


@dataclass(slots=True)
class _Swapped:
    """An evicted batch request whose KV waits in host memory (evict_mode "swap")."""

    generated: int                 # output tokens produced before the eviction(s)
    first_token: float | None
    first_scheduled: float | None
    kv_tokens: int                 # context held in host memory: prompt + generated
    source: str                    # the worker whose host memory holds it
    host_ready: float              # when its swap-out to host memory completes
    attempt: int = 0               # bumped at every re-dispatch (matches the swap-in timer)


@dataclass(slots=True)
class _WState:
    """The driver's per-worker bookkeeping."""

    interactive: int = 0
    batch: dict[str, float] = field(default_factory=dict)    # batch request id -> dispatch time
    local: LocalAutoscaler | None = None
    itl_weighted: float = 0.0      # sum over steps of (step seconds / iterations) * tokens, this window
    itl_tokens: int = 0
    gen_mark: int = 0              # engine generation tokens at the window start (local)
    gen_mark_global: int = 0
    peak: int = 0                  # highest in-flight count this window
    tick_peak: int = 0             # highest in-flight count since the last global tick
    t_mark: float = 0.0            # time-weighted in-flight counts since the last global tick
    inter_area: float = 0.0
    total_area: float = 0.0

    def touch(self, now: float) -> None:
        """Integrate the in-flight counts up to `now` (call before they change)."""
        dt = now - self.t_mark
        if dt > 0:
            self.inter_area += self.interactive * dt
            self.total_area += (self.interactive + len(self.batch)) * dt
            self.t_mark = now


# ---- the simulator --------------------------------------------------------------------------------
class AutoscaleSim(ClusterSim):
    def __init__(self, scenario: Scenario, arm: Arm) -> None:
        if arm.kind not in ARMS:
            raise ValueError(f"unknown arm {arm.kind!r}; use one of {', '.join(ARMS)}")
        if arm.evict_mode not in EVICT_MODES:
            raise ValueError(f"unknown evict_mode {arm.evict_mode!r}; use one of {', '.join(EVICT_MODES)}")
        if arm.static_cap is not None and arm.static_cap < 1:
            raise ValueError("static_cap must be >= 1")
        prof = load_profile(scenario.profile)
        self.scenario, self.arm = scenario, arm
        self.local_config = arm.local or LocalConfig(itl_slo_s=scenario.slo_tpot_s, max_cap=prof.max_num_seqs * 4)
        self.static_cap = arm.static_cap or prof.max_num_seqs     # default: vLLM's batch limit (max_num_seqs)
        # The engines accept what the gateway sends; the gateway cap is the batch-size limit of every arm.
        engine = EngineConfig(max_num_seqs=max(prof.max_num_seqs, self.local_config.max_cap, self.static_cap,
                                               arm.batch_max_cap if arm.kind == "chiron" else 0),
                              scheduling_policy="priority")
        super().__init__(prof, 0, arm.policy, slo_ttft_s=scenario.slo_ttft_s, slo_tpot_s=scenario.slo_tpot_s,
                         engine_config=engine, cap=self.static_cap, scrape_interval_s=0.0,
                         policy_params=arm.policy_params or None, seed=scenario.seed,
                         queue_lookahead=arm.queue_lookahead,
                         # the gateway of such a fleet lets interactive requests wait out their TTFT target
                         # (limits.queue_timeout_s >= the target) while new workers start
                         queue_timeout_s=max(scenario.slo_ttft_s, 5.0))
        self.use_local = arm.kind in ("chiron", "utilization_local")
        self.evict = arm.kind == "chiron"
        self.swap = self.evict and arm.evict_mode == "swap"
        self.keep = self.evict and arm.evict_mode != "restart"     # evicted requests keep their tokens
        self.swapped: dict[str, _Swapped] = {}
        self._host_held: dict[str, int] = {}                   # request id -> KV bytes in host memory
        self.swap_stats = {"evicted_tokens": 0, "swap_ins": 0, "swap_in_s": 0.0, "host_kv_bytes": 0,
                           "peak_host_kv_bytes": 0, "continued": 0}
        self.rng = random.Random(scenario.seed * 7919 + 17)
        self.batch_queue = BatchQueue()
        self.deadline: dict[str, float] = {}
        self.state: dict[str, _WState] = {}
        self.pending: dict[str, tuple[str, float]] = {}        # worker id -> (pool, ready at)
        self.provisioned_at: dict[str, float] = {}
        self.cancelled: list[tuple[float, float, int]] = []    # (start, end, gpus) of workers cancelled while starting
        self.gpus = prof.gpus_per_worker
        self.kv_tokens = prof.kv_capacity_tokens
        self.evictions = 0
        self.actions: Counter[str] = Counter()
        self.timeline: list[dict[str, Any]] = []
        self.cap_log: list[tuple[float, str, int, float | None]] = []    # (t, worker, new cap, window ITL)
        self._wids = itertools.count()
        self._pump_due: float | None = None
        self.observations = ObservationBuilder(arm.rate_window_s, arm.throughput_window_s)
        self._arrivals = 0                                       # interactive arrivals since the last global tick
        self._wait_area, self._wait_t = 0.0, 0.0                 # interactive requests waiting x seconds, since when
        self._batch_out = OutputStats()
        self._last_global = 0.0
        self.on_arrival.append(_on_arrival)
        self.on_dispatch.append(_on_dispatch)
        self.on_finish.append(_on_finish)
        if arm.kind == "chiron":
            self.controller: Callable[[AutoscaleSim, float], None] = _chiron_tick
            gcfg = arm.global_config or GlobalConfig(
                theta=scenario.theta, delta=min(0.1, scenario.theta / 4), max_interactive=scenario.max_workers, max_batch=scenario.max_workers,
                max_total=scenario.max_workers, cold_start_s=scenario.cold_start_s[1])
            self.global_scaler = GlobalAutoscaler(gcfg)
        elif arm.kind == "static":
            self.controller = _baseline_tick
            self.band: UtilizationBand | StaticProvisioning = StaticProvisioning(
                arm.static_workers if arm.static_workers is not None else scenario.initial_workers)
        else:
            self.controller = _baseline_tick
            self.band = UtilizationBand(arm.util_low, arm.util_high, arm.util_cooldown_s, 1, scenario.max_workers)
        n0 = arm.static_workers if arm.kind == "static" and arm.static_workers is not None else scenario.initial_workers
        for i in range(n0):
            pool = POOL_MIXED
            if arm.kind == "chiron":
                pool = POOL_INTERACTIVE if i < max(1, math.floor(scenario.theta * n0)) else POOL_MIXED
            self._activate_now(self._new_id(), pool, 0.0)

    # ---- fleet: provisioning with cold start, drain, GPU ledger ----------------------------------
    def _new_id(self) -> str:
        return f"w{next(self._wids)}"

    def provision(self, pool: str, now: float) -> str:
        wid = self._new_id()
        lo, hi = self.scenario.cold_start_s
        ready = now + self.rng.uniform(lo, hi)
        self.provisioned_at[wid] = now
        self.pending[wid] = (pool, ready)
        self.schedule(ready, lambda sim, t, wid=wid: sim._activate(wid, t))
        return wid

    def _activate(self, wid: str, now: float) -> None:
        item = self.pending.pop(wid, None)
        if item is not None:            # else: cancelled while starting
            self._activate_now(wid, item[0], now)

    def _activate_now(self, wid: str, pool: str, now: float) -> None:
        self.provisioned_at.setdefault(wid, now)
        st = _WState()
        cap = self.static_cap
        if self.use_local:
            la = LocalAutoscaler(self._local_config(pool), initial_cap=self._pool_cap(pool))
            st.local, cap = la, la.cap
        self.state[wid] = st
        self.add_worker(None, wid, cap=cap, labels={"pool": pool}, now=now)
        self.kick(now)

    def _local_config(self, pool: str) -> LocalConfig:
        if pool == POOL_BATCH:   # relaxed ITL SLO, and room to grow the batch (Chiron section 6.2)
            return dataclasses.replace(self.local_config, itl_slo_s=self.scenario.batch_itl_slo_s,
                                       max_cap=max(self.local_config.max_cap, self.arm.batch_max_cap))
        return self.local_config

    def _pool_cap(self, pool: str) -> int | None:
        """A new worker starts from the median cap its peers learned (same ITL SLO), else the default."""
        is_batch = pool == POOL_BATCH
        caps = sorted(w.cap for w in self.workers.values()
                      if not w.draining and w.cap and (w.labels.get("pool") == POOL_BATCH) == is_batch)
        return caps[len(caps) // 2] if caps else None

    def release(self, wid: str, now: float) -> None:
        """Scale in one worker: cancel it if still starting, else drain it (in-flight requests finish)."""
        if wid in self.pending:
            del self.pending[wid]
            self.cancelled.append((self.provisioned_at[wid], now, self.gpus))
            return
        self.remove_worker(wid, now)

    def gpu_seconds(self, horizon: float) -> float:
        total = sum(g * (min(e, horizon) - min(s, horizon)) for s, e, g in self.cancelled)
        for w in list(self.workers.values()) + self.retired:
            end = w.removed_at if w.removed_at is not None else horizon
            total += w.gpus * (min(end, horizon) - min(self.provisioned_at.get(w.id, 0.0), horizon))
        for wid in self.pending:
            total += self.gpus * (horizon - min(self.provisioned_at[wid], horizon))
        return total

    def pool_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(active and not draining, starting) workers per pool."""
        active = dict.fromkeys(POOLS, 0)
        for w in self.workers.values():
            if not w.draining:
                active[w.labels.get("pool", POOL_MIXED)] += 1
        pending = dict.fromkeys(POOLS, 0)
        for pool, _ in self.pending.values():
            pending[pool] += 1
        return active, pending

    # ---- requests: classes, batch queue, eviction ------------------------------------------------
    def features(self, r: WorkloadRequest) -> RequestFeatures:
        f = super().features(r)
        if r.request_id in self.deadline:
            return dataclasses.replace(f, request_class=CLASS_BATCH)
        return f

    def _arrive(self, r: WorkloadRequest, now: float) -> None:
        deadline = self.deadline.get(r.request_id)
        if deadline is None:
            super()._arrive(r, now)
            return
        if r.request_id in self.results:
            raise ValueError(f"duplicate request id {r.request_id!r}")
        self.results[r.request_id] = RequestResult(r.request_id, r.arrival, r.prompt_tokens,
                                                   slo_ttft_s=deadline - r.arrival,
                                                   slo_tpot_s=self.scenario.batch_itl_slo_s)
        for hook in self.on_arrival:
            hook(self, r, now)
        self.batch_queue.push(r.request_id, deadline, (r, self.features(r)), r.prompt_tokens)
        self._request_pump(now)

    def _request_pump(self, now: float) -> None:
        if self._pump_due is None or self._pump_due > now:
            self._pump_due = now
            self.schedule(now, _pump)

    def kick(self, now: float) -> None:
        """Capacity may have appeared (a cap grew, a worker joined): serve waiting interactive, then batch."""
        if self.queue:
            self._drain_queue(now)
        self._request_pump(now)

    def _pump(self, now: float) -> None:
        if self._pump_due != now:       # superseded by an earlier pump
            return
        self._pump_due = None
        q = self.batch_queue
        if self.queue:                  # interactive requests wait: they go first
            self._drain_queue(now)
        while q and not self.queue:
            item = q.peek()
            r, feats = item.payload
            if super()._try_dispatch(r, feats, now) is not None:
                break
            q.pop()
        if self.queue or q:             # a finish or an engine step retries sooner; this is the fallback
            retry = now + (self.scrape_interval_s or 0.5)
            self._pump_due = retry
            self.schedule(retry, _pump)

    def _try_dispatch(self, r: WorkloadRequest, feats: RequestFeatures, now: float) -> Decision | None:
        d = super()._try_dispatch(r, feats, now)
        if d is None or not self.evict or feats.request_class == CLASS_BATCH or not self._evict_one(now):
            return d
        return super()._try_dispatch(r, feats, now)

    def _evict_one(self, now: float) -> bool:
        """Send the newest batch request of the busiest mixed worker back to the queue (Chiron section 3)."""
        views = [self._view(w, now) for w in self.workers.values()
                 if not w.draining and (w.cap is None or w.inflight <= w.cap)]
        # Freeing one slot lets the request run only where the engine queues nothing.
        wid = eviction_victim([v for v in views if v.waiting == 0],
                              {wid: len(st.batch) for wid, st in self.state.items()})
        if wid is None:
            return False
        best = self.workers[wid]
        st = self.state[best.id]
        victim = next((rid for rid in reversed(st.batch) if best.engine.holds(rid)), None)
        if victim is None:              # none has reached the engine yet (still in the host path)
            return False
        if best.step_end is not None and best.step_end > now and self.max_iterations > 1:
            end = best.step_start + best.engine.truncate_step(now)      # as ClusterSim._engine_add does
            if end != best.step_end:
                best.step_end = end
                best.token += 1
                self.schedule_step(best, end)
        ev = best.engine.abort(victim, now)
        r, feats = self._pending.pop(victim)
        self._evicted(victim, r, ev.record if ev is not None else None, best, now)
        best.reserve(reserved_tokens(feats), -1)
        self.placement.finished(feats, best.id, 0, now)
        st.touch(now)
        del st.batch[victim]
        res = self.results[victim]
        res.worker_id = res.dispatched = None
        self.batch_queue.push(victim, self.deadline[victim], (r, feats), r.prompt_tokens)
        self.evictions += 1
        return True

    def _evicted(self, rid: str, r: WorkloadRequest, rec: Any, w: SimWorker, now: float) -> None:
        """Account an eviction; in swap mode keep the generated tokens and put the KV in host memory."""
        out = rec.num_output if rec is not None else 0
        self.swap_stats["evicted_tokens"] += out
        if not self.keep:
            return
        prev = self.swapped.get(rid)
        if out == 0:        # nothing new on the GPU (not admitted yet, or still waiting for its swap-in)
            return          # a previous host copy stays valid; without one the prefill simply restarts
        generated = out + (prev.generated if prev is not None else 0)
        kv_tokens = r.prompt_tokens + generated
        first = prev if prev is not None else rec
        if not self.swap:   # continue: the text is kept, the KV is not
            self.swapped[rid] = _Swapped(generated, first.first_token, first.first_scheduled, kv_tokens, w.id, now)
            return
        self._host_kv(rid, kv_tokens * w.profile.kv_bytes_per_token)
        self.swapped[rid] = _Swapped(generated, first.first_token, first.first_scheduled, kv_tokens, w.id,
                                     now + w.profile.kv_swap_s(kv_tokens))    # GPU -> host copy (PCIe)

    def _host_kv(self, rid: str, nbytes: int) -> None:
        """Set the host-memory KV held for `rid` (0 frees it) and track the fleet's peak."""
        st = self.swap_stats
        held = self._host_held
        st["host_kv_bytes"] += nbytes - held.pop(rid, 0)
        if nbytes:
            held[rid] = nbytes
        st["peak_host_kv_bytes"] = max(st["peak_host_kv_bytes"], st["host_kv_bytes"])

    def _engine_add(self, wid: str, rid: str, now: float) -> None:
        """A swapped-out request resumes: its context arrives from host memory, no prefill (Chiron section 4)."""
        sw = self.swapped.get(rid) if self.keep else None
        if sw is None:
            super()._engine_add(wid, rid, now)
            return
        r, _ = self._pending[rid]
        w = self.workers[wid]
        prof = w.profile
        max_tokens = r.max_tokens or max(1, w.engine.max_model_len - r.prompt_tokens)
        target = min(r.output_tokens, max_tokens)
        if not self.swap:   # continue: prefill the prompt plus the kept text, decode the rest
            w.engine.add(SimRequest(rid, sw.kv_tokens, [], max_tokens - sw.generated, target - sw.generated,
                                    priority=r.priority, arrival=now), now)
            sw.attempt += 1
            self.swap_stats["continued"] += 1
            self._poke(w, now)
            return
        # Same worker: host -> GPU over its PCIe link; another worker: the KV also crosses the network.
        link = None if wid == sw.source else min(prof.host_link_bytes_per_s, prof.pd_link_bytes_per_s)
        swap_in = prof.kv_swap_s(sw.kv_tokens, link)
        ready = max(now, sw.host_ready) + swap_in
        w.engine.add(SimRequest(rid, sw.kv_tokens, [], max_tokens - sw.generated, target - sw.generated,
                                priority=r.priority, arrival=now, remote_prefill=True, kv_ready_at=ready), now)
        sw.attempt += 1
        self.swap_stats["swap_ins"] += 1
        self.swap_stats["swap_in_s"] += ready - now
        self.schedule(ready, lambda sim, t, rid=rid, a=sw.attempt: sim._swapped_in(rid, a))
        self._poke(w, now)

    def _swapped_in(self, rid: str, attempt: int) -> None:
        sw = self.swapped.get(rid)
        if sw is not None and sw.attempt == attempt and rid in self._pending:   # the copy landed on the GPU
            self._host_kv(rid, 0)

    def schedule_step(self, w: SimWorker, end: float) -> None:
        heapq.heappush(self._heap, (end, next(self._seq), _STEP, (w, w.token)))

    def _step_done(self, w: SimWorker, now: float) -> None:
        """Record the step's inter-token latency (duration / iterations, per generated token), then step."""
        st = self.state.get(w.id)
        stats = w.engine.stats
        it0, gen0, dur = stats.iterations, stats.generation_tokens, now - w.step_start
        super()._step_done(w, now)
        if st is not None:
            k = stats.iterations - it0
            tokens = stats.generation_tokens - gen0
            if k > 0 and tokens > 0:
                st.itl_weighted += dur / k * tokens
                st.itl_tokens += tokens
        # The engine admitted what it was sent and the cap allows more: look at the queues now.
        if ((self.queue or (self.batch_queue and w.labels.get("pool") != POOL_INTERACTIVE))
                and not w.draining and w.removed_at is None and has_room(w.inflight, w.cap)
                and w.engine.num_waiting == 0 and w.inflight <= w.engine.num_running):
            self._request_pump(now)

    # ---- the run --------------------------------------------------------------------------------
    def run_scenario(self) -> ArmResult:
        sc = self.scenario
        workload = [r for r in sc.interactive]
        for j, job in enumerate(sc.batch):
            for r in job.requests:
                r.arrival = job.submit_at
                r.priority = 1
                self.deadline[r.request_id] = job.submit_at + job.deadline_s
            if not job.requests:
                raise ValueError(f"batch job {j} is empty")
            workload.extend(job.requests)
        self.record(0.0)
        self.schedule(self.arm.tick_s, _global_timer)
        if self.use_local:
            self.schedule(self.arm.local_tick_s, _local_timer)
        wall0 = time.perf_counter()
        self.run(workload, until=sc.horizon_s)
        wall = time.perf_counter() - wall0
        engines = [w.engine.stats for w in list(self.workers.values()) + self.retired]
        self.swap_stats["engine_prompt_tokens"] = sum(e.prompt_tokens for e in engines)      # prefill work
        self.swap_stats["engine_generation_tokens"] = sum(e.generation_tokens for e in engines)
        return ArmResult(sc.name, self.arm.name, self.gpu_seconds(sc.horizon_s), self._interactive_stats(),
                         self._batch_stats(), self.evictions, dict(self.actions), self.timeline, wall,
                         dict(self.swap_stats))

    def _interactive_stats(self) -> dict[str, Any]:
        rs = [r for rid, r in self.results.items() if rid not in self.deadline]
        done = [r for r in rs if r.completed]
        ttft = sorted(r.ttft for r in done)
        tpot = sorted(r.tpot for r in done if r.output_tokens > 1)
        return {
            "requests": len(rs), "completed": len(done),
            "slo_attainment": sum(r.slo_met for r in rs) / len(rs) if rs else None,
            "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99),
            "tpot_p50": _pct(tpot, 50), "tpot_p99": _pct(tpot, 99),
            "per_minute": _per_minute(rs),
        }

    def _batch_stats(self) -> dict[str, Any]:
        rs = [(r, self.deadline[rid]) for rid, r in self.results.items() if rid in self.deadline]
        if not rs:
            return {"requests": 0, "on_time": None, "last_finish": None}
        done = [r for r, _ in rs if r.completed]
        on_time = sum(1 for r, d in rs if r.completed and r.finished <= d)
        return {"requests": len(rs), "completed": len(done), "on_time": on_time / len(rs),
                "last_finish": max((r.finished for r in done), default=None)}

    # ---- measurements for the controllers ----------------------------------------------------------
    def observe_fleet(self, now: float) -> FleetObservation:
        """The global autoscaler's inputs over the time since the last global tick, built by the gateway's builder
        (policies/autoscale/observation.py) from this simulator's exact in-flight integrals and engine counters."""
        _, pending = self.pool_counts()
        workers: list[WorkerTick] = []
        batch_inflight = 0
        batch_thr = 0.0                 # batch output tokens/s, all workers
        window = max(now - self._last_global, 1e-9)
        for w in self.workers.values():
            st = self.state[w.id]
            st.touch(now)
            avg_inter, avg_total = st.inter_area / window, st.total_area / window
            st.inter_area = st.total_area = 0.0
            gen = w.engine.stats.generation_tokens
            produced, st.gen_mark_global = gen - st.gen_mark_global, gen
            peak, st.tick_peak = st.tick_peak, w.inflight
            batch_inflight += len(st.batch)
            if avg_total > 0:           # split the worker's output between the classes by their share
                batch_thr += produced / window * (1.0 - avg_inter / avg_total)
            if not w.draining:
                workers.append(WorkerTick(w.id, w.labels.get("pool", POOL_MIXED), avg_inter, w.cap,
                                          produced / window, bool(w.cap) and peak >= w.cap))
        out = self._batch_out
        self.touch_wait(now)
        waiting, self._wait_area = self._wait_area / window, 0.0
        tick = FleetTick(workers, pending, waiting, float(self._arrivals), self.batch_queue.deadline_counts(),
                         batch_inflight, batch_thr, (out.n, out.total, out.total_sq), self.predicted_output_tokens_value(),
                         float(getattr(self.policy, "shortfall", 0)) if self.arm.joint else 0.0)
        self._arrivals = 0
        return self.observations.build(tick, now)

    def touch_wait(self, now: float) -> None:
        """Integrate the admission queue's length up to `now` (the hooks call it before the queue changes)."""
        self._wait_area += len(self.queue) * max(0.0, now - self._wait_t)
        self._wait_t = now

    def predicted_output_tokens_value(self) -> float:
        """The mean output length the run's predictor has seen (the gateway's view, not the trace's)."""
        if self.length_predictor is not None:
            return self.length_predictor.model_mean(self.model)
        p = self.predicted_output_tokens
        return float(p) if isinstance(p, int | float) else 128.0

    def record(self, now: float, desired: dict[str, int] | None = None, extra: dict[str, float] | None = None) -> None:
        active, pending = self.pool_counts()
        row: dict[str, Any] = {"t": now, "workers": sum(active.values()) + sum(pending.values()),
                               "active": dict(active), "pending": dict(pending), "queue": len(self.batch_queue),
                               "interactive_waiting": len(self.queue)}
        caps = [w.cap for w in self.workers.values() if w.cap]
        row["mean_cap"] = statistics.fmean(caps) if caps else None
        row["max_running"] = max((w.engine.num_running for w in self.workers.values()), default=0)
        if desired is not None:
            row["desired"] = desired
        if extra:
            row.update(extra)
        self.timeline.append(row)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    pos = (len(values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def _per_minute(rs: list[RequestResult]) -> list[tuple[int, int, int]]:
    """(minute, requests arrived, met their SLO) per minute of arrival."""
    arrived: Counter[int] = Counter()
    met: Counter[int] = Counter()
    for r in rs:
        m = int(r.arrival // 60)
        arrived[m] += 1
        met[m] += r.slo_met
    return [(m, arrived[m], met[m]) for m in sorted(arrived)]


# ---- hooks and timers -------------------------------------------------------------------------------
def _on_arrival(sim: AutoscaleSim, r: WorkloadRequest, now: float) -> None:
    sim.touch_wait(now)
    if r.request_id not in sim.deadline:
        sim._arrivals += 1


def _on_dispatch(sim: AutoscaleSim, r: WorkloadRequest, wid: str, now: float) -> None:
    sim.touch_wait(now)
    st = sim.state[wid]
    st.touch(now)
    if r.request_id in sim.deadline:
        st.batch[r.request_id] = now
    else:
        st.interactive += 1
    st.peak = max(st.peak, sim.workers[wid].inflight)
    st.tick_peak = max(st.tick_peak, sim.workers[wid].inflight)


def _on_finish(sim: AutoscaleSim, res: RequestResult) -> None:
    sw = sim.swapped.pop(res.request_id, None)
    if sw is not None:              # a resumed request: its answer includes what it generated before
        sim._host_kv(res.request_id, 0)
    if sw is not None and res.completed:
        res.output_tokens += sw.generated
        res.first_token, res.first_scheduled = sw.first_token, sw.first_scheduled
    sim.touch_wait(sim.now)
    st = sim.state.get(res.worker_id or "")
    if st is not None:
        st.touch(sim.now)
    if res.request_id in sim.deadline:
        if st is not None:
            st.batch.pop(res.request_id, None)
        if res.completed:
            sim._batch_out.add(res.output_tokens)
        if sim.batch_queue:
            sim._request_pump(sim.now)
    elif st is not None:
        st.interactive -= 1
        if sim.batch_queue:
            sim._request_pump(sim.now)


def _pump(sim: AutoscaleSim, now: float) -> None:
    sim._pump(now)


def _local_timer(sim: AutoscaleSim, now: float) -> None:
    """Chiron Algorithm 1 on every worker: window ITL and throughput -> a new cap."""
    dt = sim.arm.local_tick_s
    for w in sim.workers.values():
        st = sim.state[w.id]
        la = st.local
        gen = w.engine.stats.generation_tokens
        if la is not None and not w.draining:
            itl = st.itl_weighted / st.itl_tokens if st.itl_tokens >= 16 else None
            # The cap binds when it was reached and the engine still admitted everything (no requests
            # waiting inside it: then the KV cache, not the cap, limits the batch and growth is moot).
            binding = st.peak >= (w.cap or 0) and w.engine.num_waiting == 0
            la.observe(itl_s=itl, tokens_per_s=(gen - st.gen_mark) / dt, saturated=binding)
            w.cap = la.update(now)
            sim.cap_log.append((now, w.id, w.cap, itl))
        st.itl_weighted, st.itl_tokens, st.gen_mark, st.peak = 0.0, 0, gen, w.inflight
    sim.kick(now)
    sim.schedule(now + dt, _local_timer)


def _global_timer(sim: AutoscaleSim, now: float) -> None:
    sim.controller(sim, now)
    sim._last_global = now
    sim.schedule(now + sim.arm.tick_s, _global_timer)


def _chiron_tick(sim: AutoscaleSim, now: float) -> None:
    obs = sim.observe_fleet(now)
    plan = sim.global_scaler.update(obs, now)
    for a in plan.actions:
        sim.actions[f"{a.pool}/{a.direction}/{a.reason}"] += a.count
    _apply_chiron(sim, plan.desired, now)
    sim.record(now, plan.desired, {"ibp": plan.backpressure["ibp"], "bbp": plan.backpressure["bbp"],
                                   "rate": obs.interactive_rate})


def _apply_chiron(sim: AutoscaleSim, desired: dict[str, int], now: float) -> None:
    active, pending = sim.pool_counts()
    # interactive + mixed: new ones join as mixed; scale-in cancels starting ones, then drains the idlest mixed.
    want_im = desired[POOL_INTERACTIVE] + desired[POOL_MIXED]
    have_im = active[POOL_INTERACTIVE] + active[POOL_MIXED] + pending[POOL_INTERACTIVE] + pending[POOL_MIXED]
    for _ in range(want_im - have_im):
        sim.provision(POOL_MIXED, now)
    if want_im < have_im:
        _shrink(sim, (POOL_MIXED, POOL_INTERACTIVE), have_im - want_im, now)
    want_b, have_b = desired[POOL_BATCH], active[POOL_BATCH] + pending[POOL_BATCH]
    for _ in range(want_b - have_b):
        sim.provision(POOL_BATCH, now)
    if want_b < have_b:
        _shrink(sim, (POOL_BATCH,), have_b - want_b, now)
    _relabel(sim, desired[POOL_INTERACTIVE])


def _shrink(sim: AutoscaleSim, pools: tuple[str, ...], n: int, now: float) -> None:
    for wid, (pool, _) in sorted(sim.pending.items(), key=lambda kv: -kv[1][1]):   # latest-ready first
        if n and pool in pools:
            sim.release(wid, now)
            n -= 1
    for pool in pools:
        live = sorted((w for w in sim.workers.values() if not w.draining and w.labels.get("pool") == pool),
                      key=lambda w: w.inflight)
        for w in live[:n]:
            sim.release(w.id, now)
            n -= 1


def _relabel(sim: AutoscaleSim, want_interactive: int) -> None:
    """Keep `want_interactive` of the active interactive+mixed workers labelled interactive (labels are free)."""
    im = [w for w in sim.workers.values() if not w.draining and w.labels.get("pool") in (POOL_INTERACTIVE, POOL_MIXED)]
    inter = [w for w in im if w.labels["pool"] == POOL_INTERACTIVE]
    mixed = [w for w in im if w.labels["pool"] == POOL_MIXED]
    want = min(want_interactive, len(im))
    if len(inter) > want:
        for w in sorted(inter, key=lambda w: w.inflight)[: len(inter) - want]:
            w.labels["pool"] = POOL_MIXED
    elif len(inter) < want:
        for w in sorted(mixed, key=lambda w: len(sim.state[w.id].batch))[: want - len(inter)]:
            w.labels["pool"] = POOL_INTERACTIVE


def _baseline_tick(sim: AutoscaleSim, now: float) -> None:
    active, pending = sim.pool_counts()
    current = sum(active.values()) + sum(pending.values())
    live = [w for w in sim.workers.values() if not w.draining]
    mean_out = sim.predicted_output_tokens_value()
    queued = sim.batch_queue.prompt_tokens + mean_out * len(sim.batch_queue)
    queued += sum(w.features.prompt_tokens + mean_out for w in sim.queue)
    util = fleet_utilization([w.engine.kv_usage for w in live], sim.kv_tokens, queued)
    desired, reason = sim.band.decide(util, current, now)
    if desired > current:
        for _ in range(desired - current):
            sim.provision(POOL_MIXED, now)
        sim.actions[f"mixed/up/{reason}"] += desired - current
    elif desired < current:
        _shrink(sim, (POOL_MIXED,), current - desired, now)
        sim.actions[f"mixed/down/{reason}"] += current - desired
    sim.record(now, {POOL_MIXED: desired}, {"util": util if math.isfinite(util) else None})


# ---- entry points -----------------------------------------------------------------------------------
def run_arm(scenario: Scenario, arm: Arm) -> ArmResult:
    """Run one arm on a private copy of the scenario's requests (arms never share mutable state)."""
    sc = dataclasses.replace(
        scenario,
        interactive=[dataclasses.replace(r) for r in scenario.interactive],
        batch=[dataclasses.replace(j, requests=[dataclasses.replace(r) for r in j.requests]) for j in scenario.batch],
    )
    return AutoscaleSim(sc, arm).run_scenario()


def fit_to_context(reqs: list[WorkloadRequest], max_model_len: int) -> list[WorkloadRequest]:
    """Drop requests whose prompt plus output does not fit the model's context (a client would not send them)."""
    return [r for r in reqs if r.prompt_tokens + r.output_tokens < max_model_len]


def tag_requests(reqs: list[WorkloadRequest], prefix: str) -> list[WorkloadRequest]:
    for i, r in enumerate(reqs):
        r.request_id = f"{prefix}{i}"
    return reqs


def stepped_arrivals(trace: str, segments: list[tuple[float, float]], *, arrival: str = "poisson", cv: float = 1.0,
                     seed: int = 0) -> list[WorkloadRequest]:
    """Interactive requests with lengths from `trace` and a piecewise-constant rate: [(seconds, req/s), ...]."""
    out: list[WorkloadRequest] = []
    t0 = 0.0
    for k, (dur, rate) in enumerate(segments):
        part = load_workload(trace, rate=rate, arrival=arrival, cv=cv, duration=dur, seed=seed * 1000 + k)
        for r in part:
            r.arrival += t0
        out.extend(part)
        t0 += dur
    return out


def theta_for(history: list[float], cold_start_s: float, quantile: float = 0.99) -> float:
    """Chiron section 5.2: theta from the tail arrival spike of a history, windows of the model load time.

    Bounded below by 1/3, Chiron's default over-provisioning (section 6.3: "3, sufficient for a
    burstiness of 8"); spikes beyond that are left to scale-out.
    """
    return theta_from_spikes(arrival_spikes(history, cold_start_s), quantile, lo=1 / 3, hi=0.9)


def scenario_wa(arrival: str = "poisson", seed: int = 0, *, profile: str = "llama2-70b-tp2-a100",
                trace: str = "azure_conv", low: float = 1.0, high: float = 3.0, minutes: float = 10.0) -> Scenario:
    """Chiron W_A: interactive only; the rate steps low -> high -> low (Poisson, or Gamma bursts with CV 4)."""
    prof = load_profile(profile)
    cv = 4.0 if arrival == "gamma" else 1.0
    seg = [(minutes * 60, low), (minutes * 60, high), (minutes * 60, low)]
    reqs = tag_requests(fit_to_context(stepped_arrivals(trace, seg, arrival=arrival, cv=cv, seed=seed), prof.max_model_len), "i")
    history = stepped_arrivals(trace, seg, arrival=arrival, cv=cv, seed=seed + 101)   # "historic" pattern
    theta = theta_for([r.arrival for r in history], 45.0)
    name = f"W_A-{arrival}" + (f"-s{seed}" if seed else "")
    return Scenario(name, reqs, [], profile, horizon_s=3 * minutes * 60 + 120, initial_workers=2,
                    theta=theta, seed=seed,
                    description=f"interactive only, {trace} lengths, {arrival} arrivals (cv {cv:g}) at "
                                f"{low:g} -> {high:g} -> {low:g} req/s, {minutes:g} min each")


def scenario_wb(seed: int = 0, *, profile: str = "llama2-70b-tp2-a100", interactive_scale: float = 0.5,
                batch_trace: str = "sharegpt", batch_requests: int = 6000, submit_at: float = 300.0,
                deadline_s: float = 3600.0, tail_s: float = 600.0) -> Scenario:
    """Chiron W_B: the Azure conversation trace (rate-scaled) plus a large batch queue with a 1 h deadline."""
    prof = load_profile(profile)
    horizon = submit_at + deadline_s + tail_s
    inter = load_workload("azure_conv", rate_scale=interactive_scale, duration=horizon, seed=seed)
    inter = tag_requests(fit_to_context(inter, prof.max_model_len), "i")
    pool = fit_to_context(load_workload(batch_trace, rate=100.0, limit=batch_requests * 3, seed=seed + 1),
                          prof.max_model_len)
    rng = random.Random(seed)
    rng.shuffle(pool)
    batch = tag_requests(pool[:batch_requests], "b")
    theta = theta_for([r.arrival for r in inter], 45.0)
    return Scenario(f"W_B-{batch_trace}-s{seed}", inter, [BatchJob(submit_at, batch, deadline_s)], profile,
                    horizon_s=horizon, initial_workers=2, theta=theta, seed=seed,
                    description=f"azure_conv x{interactive_scale:g} interactive + {len(batch)} {batch_trace} batch "
                                f"requests at t={submit_at:g}s, deadline {deadline_s:g}s")


__all__ = ["ARMS", "Arm", "ArmResult", "AutoscaleSim", "BatchJob", "Scenario", "fit_to_context", "run_arm", "scenario_wa",
           "scenario_wb", "stepped_arrivals", "tag_requests", "theta_for"]
