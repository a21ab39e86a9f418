"""Virtual-time cluster simulator: N EngineCores, one routing policy, a discrete-event loop (heapq).

    sim = ClusterSim("llama3-8b-h100", workers=8, policy="least_requests", slo_ttft_s=0.6, slo_tpot_s=0.03)
    result = sim.run(load_workload("azure_conv", duration=600))
    print(result.to_json())

The policy is called exactly as the live gateway calls it (policies/base.py): `choose` with the workers
that are active, not draining and under their cap; `on_dispatch` when the request is sent; `on_complete`
when it finished (any outcome). A Decision with worker_id None keeps the request in a FIFO admission queue
that is retried whenever a request completes or a worker is added.

Timing of one request (all model seconds): arrival -> dispatch (after any admission-queue wait) ->
engine `add` after profile.pre_engine_delay -> first token / finish from the engine's RequestRecord.
TTFT = first_token - arrival; TPOT = (finish - first_token) / (n_out - 1); the SLO is met iff
TTFT <= slo_ttft and TPOT <= slo_tpot (TPOT of a one-token answer counts as 0).

Policies see `WorkerView`s: inflight / inflight_tokens are the simulator's own reservations (exact);
running / waiting / kv_usage come from the engine, refreshed at most once per `scrape_interval_s` tick
(the first look after a tick reads the engine then), like the gateway's metric scraping. 0 disables the lag.
`predicted_output_tokens` defaults to the workload's true mean output length; pass a number or a
function of the WorkloadRequest (e.g. an oracle `lambda r: r.output_tokens`) to change it, or a
`policies.length_predictor.LengthPredictor` to predict online as the gateway does (the simulator feeds
it every completed request's output length, so early requests see its default).

Feedback to policies that want it (optional methods, looked up once): `report_progress(request_id,
generated_tokens, now)` at a request's first token (generated_tokens = 1) and `observe_completion(request,
output_tokens, now)` just before `on_complete` of a request that completed (stop/length), the counts a
gateway sees in the stream. `queue_poll_s` also retries the admission queue's head every that many
seconds while it is non-empty (the gateway's admission queue polls too), not only on completions;
`queue_lookahead` > 1 lets that many waiting requests behind a head that does not fit try too (a policy
that holds requests until their own deadline, like `aladdin`'s risk mode, must not block the rest).

Engines are macro-stepped (EngineCore.plan_step(max_iterations=...)) and cut at the next iteration
boundary when a request reaches them mid-step, so runs match per-iteration stepping (max_iterations=1);
the one visible difference: a kv_usage read mid-macro-step misses the blocks its decodes added so far.

Extension points for experiments (no core-loop edits needed):
- `add_worker(...)` / `remove_worker(id)` (drains: no new requests, removed when idle) at any time,
  e.g. from a timer: `sim.schedule(t, fn)` calls fn(sim, now) at model time t (fn may schedule again);
- hooks: `sim.on_arrival`, `sim.on_dispatch`, `sim.on_finish` are lists of callables
  (sim, request, now), (sim, request, worker_id, now), (sim, RequestResult) called in that order.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from policies.admission import DEFAULT_QUEUE_SIZE, DEFAULT_QUEUE_TIMEOUT_S, AdmissionQueue
from policies.base import Policy, make_policy
from policies.length_predictor import LengthPredictor
from policies.pd import PdPolicy, pd_policy_for_profiles
from policies.perf_model import PerfModel
from policies.placement import (
    TOO_LONG,
    ModelPlacement,
    context_limit,
    has_room,
    reserved_tokens,
    too_long_message,
)
from policies.shedding import WILL_MISS
from policies.slo_targets import check_slo
from policies.types import (
    NO_CACHED_PREFIX,
    ROLE_DECODE,
    ROLE_MIXED,
    ROLE_PREFILL,
    Decision,
    RequestFeatures,
    WorkerView,
)
from simulator.engine import BLOCK_SIZE, EngineConfig, EngineCore, SimRequest
from simulator.kv_sim import SimKvView
from simulator.profiles import Profile, load_profile
from simulator.rebalance_sim import SimRebalancer
from simulator.service_sim import ServicePriority, ServiceScheduler, service_summary
from simulator.workload import WorkloadRequest

REFUSED = "refused"                      # finish_reason: 429 from the admission queue (full, or out of budget)
REJECTED_TOO_LONG = "rejected_too_long"  # finish_reason: vLLM's 400 for a prompt its context cannot hold
PREFIX_HASHES_MAX = 64          # leading block keys passed to policies as RequestFeatures.prefix_hashes
_ADD, _STEP, _WAKE, _TIMER = 0, 1, 2, 3


@dataclass(slots=True)
class RequestResult:
    request_id: str
    arrival: float
    prompt_tokens: int
    worker_id: str | None = None
    dispatched: float | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    finish_reason: str | None = None        # stop | length | abort | refused | rejected_too_long | None
    status: int | None = None               # the HTTP error a rejected request got (400, 429)
    num_cached_tokens: int = 0
    preemptions: int = 0
    slo_ttft_s: float = math.inf
    slo_tpot_s: float = math.inf
    error: str | None = None
    # P/D (Decision.prefill_worker_id set): the prefill leg's worker, its first scheduling and finish.
    prefill_worker_id: str | None = None
    prefill_scheduled: float | None = None
    prefill_done: float | None = None
    pd_decision: str | None = None          # the policy's Decision.reason for P/D policies
    service: str = ""                       # its service (runs with a service priority)

    @property
    def normalized_latency(self) -> float | None:
        """End-to-end latency per output token (SeaLLM's normalized latency in its per-token form)."""
        return None if self.finished is None or not self.output_tokens else self.e2e / self.output_tokens

    @property
    def completed(self) -> bool:
        return self.finish_reason in ("stop", "length")

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finished is None or self.first_token is None:
            return None
        return (self.finished - self.first_token) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def queue_s(self) -> float | None:
        """Arrival to first scheduling (gateway queue + API overhead + engine WAITING)."""
        first = self.prefill_scheduled if self.prefill_scheduled is not None else self.first_scheduled
        return None if first is None else first - self.arrival

    @property
    def servable(self) -> bool:
        """Could any worker serve it? Not when vLLM refuses it for its length (it is then outside the SLO
        denominator; refusals for capacity stay in it as misses)."""
        return self.finish_reason != REJECTED_TOO_LONG

    @property
    def slo_met(self) -> bool:
        """Completed within its targets (policies/slo_targets.py `check_slo`, the gateway's test of a stream)."""
        return self.completed and check_slo(self.arrival, self.first_token, self.finished, self.output_tokens,
                                            self.slo_ttft_s, self.slo_tpot_s).met


@dataclass(slots=True)
class SimWorker:
    id: str
    profile: Profile
    engine: EngineCore
    added_at: float
    role: str = ROLE_MIXED
    cap: int | None = None
    labels: dict[str, str] = field(default_factory=dict)
    draining: bool = False
    removed_at: float | None = None
    inflight: int = 0
    inflight_tokens: int = 0
    step_start: float = 0.0
    step_end: float | None = None      # None: no step in flight
    token: int = 0                     # invalidates stale heap entries
    scrape_tick: float = -1.0
    m_running: int = 0
    m_waiting: int = 0
    m_kv: float = 0.0
    weight: float = 1.0                # WorkerView.weight (e.g. for weighted_round_robin)

    @property
    def gpus(self) -> int:
        return self.profile.gpus_per_worker

    def reserve(self, tokens: int, n: int = 1) -> None:
        """Count `n` requests of `tokens` (prompt + predicted output) in flight here (n = -1: one leaves)."""
        self.inflight += n
        self.inflight_tokens += n * tokens


@dataclass(slots=True)
class _PdLeg:
    """A disaggregated request in flight: its prefill leg's engine id and the two workers."""

    request_id: str
    prefill_id: str
    prefill: SimWorker
    decode: SimWorker


@dataclass
class SimResult:
    policy: str
    profile: str
    workers: int
    results: list[RequestResult]
    start: float
    end: float
    wall_s: float
    gpu_seconds: float
    preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    max_admission_queue: int

    def to_dict(self) -> dict[str, Any]:
        rs = self.results
        done = [r for r in rs if r.completed]
        span = max(self.end - self.start, 1e-9)
        met = sum(1 for r in rs if r.slo_met)
        servable = sum(1 for r in rs if r.servable)
        ttfts = sorted(r.ttft for r in done)
        tpots = sorted(r.tpot for r in done if r.output_tokens > 1)
        e2es = sorted(r.e2e for r in done)
        queues = sorted(r.queue_s for r in done)
        return {
            "requests": len(rs),
            "servable": servable,
            "rejected_too_long": len(rs) - servable,
            "completed": len(done),
            "refused": sum(1 for r in rs if r.finish_reason == REFUSED),
            "unfinished": sum(1 for r in rs if r.finish_reason is None),
            "slo_met": met,
            "slo_attainment": met / servable if servable else 0.0,
            "goodput_rps": met / span,
            "throughput_rps": len(done) / span,
            "output_tokens_per_s": sum(r.output_tokens for r in done) / span,
            "ttft_p50": _pct(ttfts, 50), "ttft_p99": _pct(ttfts, 99),
            "tpot_p50": _pct(tpots, 50), "tpot_p99": _pct(tpots, 99),
            "e2e_p50": _pct(e2es, 50), "e2e_p99": _pct(e2es, 99),
            "queue_p50": _pct(queues, 50), "queue_p99": _pct(queues, 99),
            "gpu_seconds": self.gpu_seconds,
            "preemptions": self.preemptions,
            "prefix_cache_hit_rate": self.prefix_cache_hits / self.prefix_cache_queries
            if self.prefix_cache_queries else 0.0,
            "max_admission_queue": self.max_admission_queue,
            "policy": self.policy,
            "workers": self.workers,
            "profile": self.profile,
            "duration_s": span,
            "wall_s": self.wall_s,
            **_pd_summary(rs),
            **service_summary(rs),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def _pd_summary(rs: list[RequestResult]) -> dict[str, Any]:
    """P/D runs only: decisions, and the split of TTFT into the prefill leg and the hand-off to the first
    decode token (API overhead + KV transfer + the decode worker's queue), over completed split requests."""
    decisions: dict[str, int] = {}
    for r in rs:
        if r.pd_decision is not None:
            decisions[r.pd_decision] = decisions.get(r.pd_decision, 0) + 1
    if not decisions:
        return {}
    split = [r for r in rs if r.completed and r.prefill_done is not None]
    prefill = sorted(r.prefill_done - r.arrival for r in split)
    handoff = sorted(r.first_token - r.prefill_done for r in split)
    return {"pd_decisions": decisions, "pd_prefill_p50": _pct(prefill, 50), "pd_prefill_p99": _pct(prefill, 99),
            "pd_handoff_p50": _pct(handoff, 50), "pd_handoff_p99": _pct(handoff, 99)}


def _pct(sorted_values: list[float], q: float) -> float | None:
    """Percentile with linear interpolation (numpy's default) of an already sorted list."""
    if not sorted_values:
        return None
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def sim_policy(name: str, params: dict[str, Any] | None, profiles: Sequence[Profile], slo_ttft_s: float,
               slo_tpot_s: float, predictor: LengthPredictor | None = None, seed: int | None = None) -> Policy:
    """A policy by name as the simulated fleet needs it: SLO-aware policies get each profile's own performance
    model (PerfModel.from_step_profile: never another GPU's) and the run's SLOs; aladdin shares the run's
    output-length predictor (the placement step feeds it); seeded policies get the seed."""
    kw = dict(params or {})
    if name in ("aladdin", "hetero"):
        kw.setdefault("perf_models", {p.name: PerfModel.from_step_profile(p) for p in profiles})
    if name == "aladdin":
        kw.setdefault("slo_ttft_s", slo_ttft_s)
        kw.setdefault("slo_atgt_s", slo_tpot_s)
        if predictor is not None:
            kw.setdefault("predictor", predictor)
            kw.setdefault("learn_lengths", False)
    if name in ("random", "power_of_two") and seed is not None:
        kw.setdefault("seed", seed)
    return make_policy(name, **kw)


class ClusterSim:
    def __init__(
        self,
        profiles: str | Profile | Sequence[str | Profile] = "llama3-8b-h100",
        workers: int = 1,
        policy: str | Policy = "least_requests",
        *,
        slo_ttft_s: float = 0.6,
        slo_tpot_s: float = 0.03,
        scrape_interval_s: float = 0.5,
        engine_config: EngineConfig | None = None,
        max_iterations: int = 1 << 30,
        predicted_output_tokens: float | Callable[[WorkloadRequest], float] | LengthPredictor | None = None,
        policy_params: dict[str, Any] | None = None,
        cap: int | None = None,
        queue_poll_s: float | None = None,
        queue_lookahead: int = 1,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S,
        prefill_workers: int = 0,
        seed: int | None = None,
        rebalance_s: float | None = None,
        service_priority: str | ServiceScheduler | None = None,
        service_preempt: bool = False,
        kv_events: bool = True,
        shed: bool = True,
    ) -> None:
        if workers < 0:
            raise ValueError("workers must be >= 0")
        if prefill_workers and not 0 < prefill_workers < workers:
            raise ValueError("prefill_workers must leave at least one of the workers for decode")
        if slo_ttft_s <= 0 or slo_tpot_s <= 0:
            raise ValueError("SLOs must be > 0")
        if scrape_interval_s < 0:
            raise ValueError("scrape_interval_s must be >= 0")
        if max_iterations < 1:
            raise ValueError("max_iterations must be >= 1")
        if queue_poll_s is not None and not queue_poll_s > 0:
            raise ValueError("queue_poll_s must be > 0 (or None)")
        if queue_lookahead < 1:
            raise ValueError("queue_lookahead must be >= 1")
        if rebalance_s is not None and not rebalance_s > 0:
            raise ValueError("rebalance_s must be > 0 (or None)")
        plist = [profiles] if isinstance(profiles, str | Profile) else list(profiles)
        if not plist:
            raise ValueError("at least one profile is needed")
        self.profiles = [load_profile(p) for p in plist]
        self.model = self.profiles[0].model
        # Output lengths: the online predictor the gateway uses (fed every completion), unless the caller gives
        # a number, a function of the request (an oracle) or a predictor of its own.
        p = predicted_output_tokens
        self.length_predictor = p if isinstance(p, LengthPredictor) else LengthPredictor() if p is None else None
        self.predicted_output_tokens = None if p is None or isinstance(p, LengthPredictor) else p
        if isinstance(policy, str):
            self.policy = sim_policy(policy, policy_params, self.profiles, slo_ttft_s, slo_tpot_s,
                                     self.length_predictor, seed)
            self.policy_name = policy
        else:
            self.policy, self.policy_name = policy, getattr(policy, "name", type(policy).__name__)
        pd_factory = None
        if isinstance(policy, str):
            def pd_factory() -> PdPolicy:
                params = dict(policy_params or {})
                if policy == "aladdin" and self.length_predictor is not None:
                    params.setdefault("predictor", self.length_predictor)
                    params.setdefault("learn_lengths", False)
                return pd_policy_for_profiles(policy, params, self.profiles, slo_ttft_s=slo_ttft_s,
                                              slo_tpot_s=slo_tpot_s, prefix_chunk_tokens=BLOCK_SIZE)
        observe = self.length_predictor.observe if self.length_predictor is not None else None
        self.placement = ModelPlacement(self.policy, pd_factory, observe, shed)
        shedder = self.placement.shedder
        if shedder is not None and shedder.own_tracker and self.length_predictor is not None:
            shedder.tracker.predictor = self.length_predictor     # the rule's ledger reads the run's lengths
            shedder.tracker.learn_lengths = False
        self.prefill_workers = prefill_workers
        if prefill_workers:
            self.policy_name = f"pd/{self.policy_name}"
        self._pd_legs: dict[str, _PdLeg] = {}
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.scrape_interval_s = scrape_interval_s
        self.engine_config = engine_config
        self.max_iterations = max_iterations
        self.queue_poll_s = queue_poll_s
        self.queue = AdmissionQueue(queue_size, queue_lookahead, queue_timeout_s)
        self.services = ServicePriority.build(service_priority, service_preempt) if service_priority else None
        if self.services is not None:
            if prefill_workers:
                raise ValueError("a service priority is not supported with P/D workers")
            self.engine_config = self.services.engine_config(engine_config)
        self.rebalance_s = rebalance_s     # the live rebalancer's look every this many seconds (None: off)
        self.rebalancer = SimRebalancer(self, rebalance_s) if rebalance_s is not None else None
        self.faults: Any = None            # simulator/worker_faults.py WorkerFaults, once a worker fails
        self.moves = 0
        self._last_arrival = 0.0
        self._wake_at = math.inf
        self._drained_tick = -1.0        # the scrape tick of the last queue drain (`_drain_queue`)
        self.cap = cap
        self.now = 0.0
        self.workers: dict[str, SimWorker] = {}
        self.retired: list[SimWorker] = []
        self.on_arrival: list[Callable[..., Any]] = []
        self.on_dispatch: list[Callable[..., Any]] = []
        self.on_finish: list[Callable[..., Any]] = []
        self.results: dict[str, RequestResult] = {}
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._pending: dict[str, tuple[WorkloadRequest, RequestFeatures]] = {}
        self._decisions: dict[str, Decision] = {}
        # KV-cache events of each engine step, as (sim, worker_id, events, now); simulator/kv_sim.py feeds
        # the exact prefix-cache view (`kv_view`) of policies that want one (needs_kv_blocks).
        self.on_kv_events: list[Callable[..., Any]] = []
        # the exact prefix-cache view, for policies that read it and for the shedding rule's ledger (any policy);
        # kv_events=False: a fleet whose engines publish none, so such policies fall back to their own estimate.
        wanted = SimKvView.wanted(self.policy) or SimKvView.wanted(shedder.tracker if shedder is not None else None)
        self.kv_view = SimKvView(self.profiles[0].block_size) if kv_events and wanted else None
        # Every block key of the prompt for policies that infer a conversation from it (needs_prefix_chain).
        self._chain = self.policy.needs_prefix_chain
        if self.kv_view is not None:
            self.engine_config = self.kv_view.engine_config(self.engine_config)
            self.on_kv_events.append(self.kv_view.on_events)
        for i in range(workers):
            role = ROLE_MIXED if not prefill_workers else ROLE_PREFILL if i < prefill_workers else ROLE_DECODE
            self.add_worker(self.profiles[i % len(self.profiles)], role=role, now=0.0)

    # ---- fleet ------------------------------------------------------------------------------------
    def add_worker(self, profile: str | Profile | None = None, worker_id: str | None = None, *,
                   role: str = ROLE_MIXED, cap: int | None = None, labels: dict[str, str] | None = None,
                   now: float | None = None, weight: float = 1.0) -> str:
        prof = load_profile(profile) if profile is not None else self.profiles[0]
        wid = worker_id or f"w{next(self._ids)}"
        if wid in self.workers:
            raise ValueError(f"worker {wid!r} exists")
        if not weight > 0:
            raise ValueError("weight must be > 0")
        t = self.now if now is None else now
        engine = EngineCore(prof, self.engine_config)
        shedder = self.placement.shedder
        if shedder is not None and shedder.own_tracker and prof.name not in shedder.tracker.ledger.models:
            shedder.tracker.set_perf_model(prof.name, PerfModel.from_step_profile(prof))   # a profile new to the run
        if self.services is not None:
            self.services.attach(engine)
        self.workers[wid] = SimWorker(wid, prof, engine, t, role,
                                      cap if cap is not None else self.cap, dict(labels or {}), weight=weight)
        if self.queue:
            self._drain_queue(t)
        return wid

    def remove_worker(self, worker_id: str, now: float | None = None) -> None:
        """Drain: no new requests; the worker leaves once its in-flight requests finish."""
        w = self.workers[worker_id]
        w.draining = True
        self._maybe_retire(w, self.now if now is None else now)

    def _maybe_retire(self, w: SimWorker, now: float) -> None:
        if w.draining and w.inflight == 0 and w.removed_at is None:
            w.removed_at = now
            del self.workers[w.id]
            self.retired.append(w)

    def schedule(self, t: float, fn: Callable[[ClusterSim, float], Any]) -> None:
        """Call fn(sim, now) at model time t (during run)."""
        heapq.heappush(self._heap, (t, next(self._seq), _TIMER, fn))

    # ---- the placement step (policies/placement.py) and the admission queue (policies/admission.py) ---------
    def _view(self, w: SimWorker, now: float) -> WorkerView:
        iv = self.scrape_interval_s
        tick = now // iv if iv > 0 else now
        if tick != w.scrape_tick:
            eng = w.engine
            w.scrape_tick, w.m_running, w.m_waiting, w.m_kv = tick, eng.num_running, eng.num_waiting, eng.kv_usage
        return WorkerView(w.id, w.role, w.inflight, w.inflight_tokens, w.cap, w.m_running, w.m_waiting, w.m_kv,
                          w.profile.name, w.weight, w.labels, w.profile.max_model_len)

    def _predict(self, r: WorkloadRequest) -> float:
        """The output length policies are told: a number or function given to the sim (an oracle, by name),
        else the online predictor's."""
        p = self.predicted_output_tokens
        if p is not None:
            return float(p(r)) if callable(p) else float(p)
        return self.length_predictor.predict(self.model, r.prompt_tokens, r.max_tokens)

    def features(self, r: WorkloadRequest) -> RequestFeatures:
        return RequestFeatures(
            request_id=r.request_id, model=self.model, prompt_tokens=r.prompt_tokens,
            max_tokens=r.max_tokens, predicted_output_tokens=self._predict(r),
            session_id=r.session_id, prefix_hashes=tuple(r.prefix_blocks[:PREFIX_HASHES_MAX]),
            prefix_chain=tuple(r.prefix_blocks) if self._chain else (),
            slo_ttft_s=r.slo_ttft_s or self.slo_ttft_s, slo_tpot_s=r.slo_tpot_s or self.slo_tpot_s,
            priority=r.priority, arrival=r.arrival,
            cached_prefix_tokens=self.kv_view.cached_prefix(r.prefix_blocks, r.prompt_tokens)
            if self.kv_view is not None else NO_CACHED_PREFIX,
        )

    def _try_dispatch(self, r: WorkloadRequest, feats: RequestFeatures, now: float,
                      exclude: Collection[str] = ()) -> Decision | None:
        """Place and send the request (on none of `exclude`); None when it was handled (sent, or refused as too
        long), else the Decision that found no worker (its retry_at tells the queue when to ask again)."""
        views = [self._view(w, now) for w in self.workers.values()
                 if not w.draining and has_room(w.inflight, w.cap) and w.id not in exclude]
        decision = self.placement.place(feats, views, now)
        wid = decision.worker_id
        if wid is None:
            if decision.reason == TOO_LONG:
                self._reject(r, REJECTED_TOO_LONG, 400, too_long_message(feats, context_limit(views)), now)
                return None
            if decision.reason == WILL_MISS and self.placement.last_shed is not None:
                self._reject(r, REFUSED, 429, self.placement.last_shed.message, now)   # policies/shedding.py
                return None
            return decision
        w = self.workers.get(wid)
        if w is None or w.draining:
            raise RuntimeError(f"policy {self.policy_name} chose {wid!r}, which is not a candidate")
        if decision.prefill_worker_id is not None or self.placement.pd is not None:
            self.results[r.request_id].pd_decision = decision.reason
        pd = self.placement.dispatched(feats, decision, now)
        self._decisions[r.request_id] = decision
        if decision.prefill_worker_id is not None:
            self._dispatch_pd(r, feats, w, decision.prefill_worker_id, now)
            return None
        w.reserve(reserved_tokens(feats))
        res = self.results[r.request_id]
        res.worker_id, res.dispatched = wid, now
        for hook in self.on_dispatch:
            hook(self, r, wid, now)
        self._pending[r.request_id] = (r, feats)
        if self.faults is not None and self.faults.fails(self, w, r, feats, now, pd):
            return None     # the worker answered 5xx at once: simulator/worker_faults.py placed it again
        self._send(w, r.request_id, now)
        return None

    def _send(self, w: SimWorker, rid: str, now: float) -> None:
        """The request (a plain one, or a P/D request prefilled by its decode worker) reaches w's engine after
        the API overhead."""
        heapq.heappush(self._heap, (now + w.profile.pre_engine_delay(w.engine.num_running), next(self._seq), _ADD,
                                     (w.id, rid)))

    def _reject(self, r: WorkloadRequest, reason: str, status: int, error: str, now: float) -> None:
        """The request is answered with an error and never reaches an engine (a 400 or a 429)."""
        res = self.results[r.request_id]
        res.finish_reason, res.status, res.error, res.finished = reason, status, error, now
        if self.services is not None:
            self.services.scheduler.forget(r.request_id)
        for hook in self.on_finish:
            hook(self, res)

    def _arrive(self, r: WorkloadRequest, now: float) -> None:
        if r.request_id in self.results:
            raise ValueError(f"duplicate request id {r.request_id!r}")
        self.results[r.request_id] = RequestResult(r.request_id, r.arrival, r.prompt_tokens,
                                                   slo_ttft_s=r.slo_ttft_s or self.slo_ttft_s,
                                                   slo_tpot_s=r.slo_tpot_s or self.slo_tpot_s)
        for hook in self.on_arrival:
            hook(self, r, now)
        if self.services is not None:
            self.services.arrived(r, now)
            self.results[r.request_id].service = r.service
        feats = self.features(r)
        q = self.queue
        retry_at = None
        tried = q.admits_directly()
        if tried:
            d = self._try_dispatch(r, feats, now)
            if d is None:
                return
            retry_at = d.retry_at
        if q.full():
            self._reject(r, REFUSED, 429, "admission queue full", now)
            return
        q.enter(feats, now, r, retry_at=retry_at, tried=tried, prefill_s=self._prefill_s(feats, now))
        self._arm(now)

    def _prefill_s(self, feats: RequestFeatures, now: float) -> float:
        """The request's predicted prefill: its queue budget ends that long before its TTFT target."""
        return self.placement.queue_prefill_s(feats, [self._view(w, now) for w in self.workers.values()
                                                      if not w.draining])

    def _drain_queue(self, now: float, changed: bool = True) -> None:
        """Try the waiting requests; `changed`: capacity may have been freed (policies/admission.py `changed`), as
        a new engine report (a scrape tick since the last drain) may say too."""
        q = self.queue
        iv = self.scrape_interval_s
        tick = now // iv if iv > 0 else now
        if changed or tick != self._drained_tick:
            q.changed()
        self._drained_tick = tick
        for w in q.expired(now):
            self._reject(w.handle, REFUSED, 429, w.reason, now)
        order = self.services.queue_order(now) if self.services is not None else None
        for w in q.candidates(order, now):
            d = self._try_dispatch(w.handle, w.features, now)
            q.tried(w, d is None, d.retry_at if d is not None else None)
        self._arm(now)

    def _arm(self, now: float) -> None:
        """Make sure a drain runs at the queue's next due time (a policy's retry_at or a deadline), and every
        `queue_poll_s` while requests wait when polling is on."""
        if not self.queue:
            return
        t = self.queue.due(now, self.queue_poll_s)
        if t < self._wake_at:
            self._wake_at = t
            self.schedule(t, _wake_queue)

    # ---- Aladdin's Algorithm 2: requests placed but not started move to cancel prediction errors ---------
    def _rebalance(self, now: float) -> None:
        """Every `rebalance_s`: the live rebalancer's look (simulator/rebalance_sim.py over policies/rebalance.py)."""
        self.rebalancer.look(now)
        if self._pending or self.queue or now < self._last_arrival:
            self.schedule(now + self.rebalance_s, lambda sim, t: sim._rebalance(t))

    def _requeue(self, r: WorkloadRequest, feats: RequestFeatures, now: float) -> None:
        """A moved request no worker takes now waits in the admission queue, as a new one would."""
        if self.queue.full():
            self._reject(r, REFUSED, 429, "admission queue full", now)
            return
        self.queue.enter(feats, now, r, tried=True, prefill_s=self._prefill_s(feats, now))  # woken by the next change
        self._arm(now)

    def _complete(self, w: SimWorker, r: WorkloadRequest, feats: RequestFeatures, now: float) -> None:
        w.reserve(reserved_tokens(feats), -1)
        res = self.results[r.request_id]
        self._decisions.pop(r.request_id, None)
        if self.services is not None:
            self.services.finished(r, res, now)
        self.placement.finished(feats, w.id, res.output_tokens if res.completed else 0, now,
                                slo_met=res.slo_met if res.completed else False)
        for hook in self.on_finish:
            hook(self, self.results[r.request_id])
        self._maybe_retire(w, now)

    # ---- engines ----------------------------------------------------------------------------------
    def _engine_add(self, wid: str, rid: str, now: float) -> None:
        r, feats = self._pending[rid]
        w = self.workers.get(wid)
        if w is None:   # cannot happen: a worker with inflight requests is never retired
            raise RuntimeError(f"worker {wid} vanished with requests in flight")
        max_tokens = r.max_tokens or max(1, w.engine.max_model_len - r.prompt_tokens)
        priority = r.priority if self.services is None else self.services.engine_priority(r, now)
        sreq = SimRequest(rid, r.prompt_tokens, list(r.prefix_blocks), max_tokens,
                          min(r.output_tokens, max_tokens), priority=priority, arrival=now)
        try:
            w.engine.add(sreq, now)
        except ValueError as exc:   # what vLLM answers with HTTP 400
            del self._pending[rid]
            res = self.results[rid]
            res.finish_reason, res.status, res.error, res.finished = "rejected_too_long", 400, str(exc), now
            self._complete(w, r, feats, now)
            return
        if w.step_end is None:
            self._plan(w, now)
        elif w.step_end > now and self.max_iterations > 1:
            end = w.step_start + w.engine.truncate_step(now)
            if end != w.step_end:
                w.step_end = end
                w.token += 1
                heapq.heappush(self._heap, (end, next(self._seq), _STEP, (w, w.token)))

    def _plan(self, w: SimWorker, now: float) -> None:
        dur = w.engine.plan_step(now, self.max_iterations)
        w.token += 1
        if dur is None:
            w.step_end = None
            wake = w.engine.next_event_time() if w.engine.has_work() else None
            if wake is not None:
                heapq.heappush(self._heap, (max(wake, now), next(self._seq), _WAKE, (w, w.token)))
            return
        w.step_start, w.step_end = now, now + dur
        heapq.heappush(self._heap, (now + dur, next(self._seq), _STEP, (w, w.token)))

    def _step_done(self, w: SimWorker, now: float) -> None:
        w.step_end = None
        finished = False
        step_events = w.engine.finish_step(now)
        if self.on_kv_events:
            kv = w.engine.take_kv_events()
            for hook in self.on_kv_events:
                hook(self, w.id, kv, now)
        for ev in step_events:
            if self._pd_legs and ev.request_id in self._pd_legs and self._pd_step_event(w, ev, now):
                continue
            if not ev.finished:
                if ev.first_token:
                    self.placement.progress(self._pending[ev.request_id][1], 1, now)
                continue
            rec = ev.record
            r, feats = self._pending.pop(ev.request_id)
            res = self.results[ev.request_id]
            res.first_scheduled, res.first_token, res.finished = rec.first_scheduled, rec.first_token, rec.finished
            res.output_tokens, res.finish_reason = rec.num_output, rec.finish_reason
            res.num_cached_tokens, res.preemptions = rec.num_cached_tokens, rec.num_preemptions
            self._complete(w, r, feats, now)
            finished = True
        if w.removed_at is None:
            self._plan(w, now)
        if finished and self.queue:
            self._drain_queue(now)

    # ---- P/D: prefill leg on one worker, KV transfer, decode leg on another (policies/pd.py) ---------
    # The legs follow the gateway's protocol (docs/reference/vllm-interface.md §4.2): the prefill leg is a max_tokens=1
    # `remote_decode` request whose blocks stay pinned; its finish starts the decode leg (after the API
    # overhead) as a `remote_prefill` request whose KV is ready after the profile's transfer time; the
    # decode leg's first token (the KV has been read) releases the producer's pins.
    def _dispatch_pd(self, r: WorkloadRequest, feats: RequestFeatures, wd: SimWorker, pid: str, now: float) -> bool:
        wp = self.workers.get(pid)
        if wp is None or wp.draining or wp is wd:
            raise RuntimeError(f"policy {self.policy_name} chose prefill worker {pid!r}, which is not a candidate")
        wd.reserve(reserved_tokens(feats))
        wp.reserve(r.prompt_tokens)                  # a prefill leg reserves its prompt only
        res = self.results[r.request_id]
        res.worker_id, res.prefill_worker_id, res.dispatched = wd.id, pid, now
        for hook in self.on_dispatch:
            hook(self, r, wd.id, now)
        self._pending[r.request_id] = (r, feats)
        if self.faults is not None:   # a failing prefill worker: another one, or the decode worker prefills
            wp = self.faults.prefill_leg(self, r, feats, wp, now)
            if wp is None:
                res.prefill_worker_id = None
                self._send(wd, r.request_id, now)
                return True
            res.prefill_worker_id = wp.id
        leg = _PdLeg(r.request_id, r.request_id + "#prefill", wp, wd)
        self._pd_legs[leg.prefill_id] = leg
        self._pd_legs[leg.request_id] = leg
        self.schedule(now + wp.profile.pre_engine_delay(wp.engine.num_running),
                      lambda sim, t: sim._pd_add_prefill(leg, t))
        return True

    def _pd_add_prefill(self, leg: _PdLeg, now: float) -> None:
        r, _ = self._pending[leg.request_id]
        sreq = SimRequest(leg.prefill_id, r.prompt_tokens, list(r.prefix_blocks), 1, 1, priority=r.priority,
                          arrival=now, remote_decode=True)
        try:
            leg.prefill.engine.add(sreq, now)
        except ValueError as exc:
            self._pd_release_prefill(leg, now)
            self._pd_reject(leg, str(exc), now)
            return
        self._poke(leg.prefill, now)

    def _pd_step_event(self, w: SimWorker, ev: Any, now: float) -> bool:
        """P/D bookkeeping for one StepEvent; True when the event was the prefill leg's (consumed)."""
        leg = self._pd_legs[ev.request_id]
        if ev.request_id == leg.prefill_id:
            if ev.finished:
                del self._pd_legs[leg.prefill_id]
                rec = ev.record
                res = self.results[leg.request_id]
                res.prefill_scheduled, res.prefill_done = rec.first_scheduled, rec.finished
                res.num_cached_tokens = rec.num_cached_tokens
                self._pd_release_prefill(leg, now)
                transfer = leg.prefill.profile.kv_transfer_s(rec.prompt_len)
                t_add = now + leg.decode.profile.pre_engine_delay(leg.decode.engine.num_running)
                self.schedule(t_add, lambda sim, t: sim._pd_add_decode(leg, t, t + transfer))
            return True
        if ev.first_token:   # the decode worker holds the KV now: the producer lets its blocks go
            del self._pd_legs[leg.request_id]
            wp = leg.prefill
            if wp.removed_at is None and wp.step_end is not None:
                self._truncate(wp, now)
            wp.engine.release_remote(leg.prefill_id, now)
            if wp.removed_at is None and wp.step_end is None:
                self._plan(wp, now)
        return False

    def _pd_add_decode(self, leg: _PdLeg, now: float, kv_ready_at: float) -> None:
        if self.faults is not None and self.faults.decode_leg_fails(self, leg, now):
            return      # its decode worker failed it: simulator/worker_faults.py placed the leg again
        r, _ = self._pending[leg.request_id]
        wd = leg.decode
        max_tokens = r.max_tokens or max(1, wd.engine.max_model_len - r.prompt_tokens)
        sreq = SimRequest(leg.request_id, r.prompt_tokens, list(r.prefix_blocks), max_tokens,
                          min(r.output_tokens, max_tokens), priority=r.priority, arrival=now,
                          remote_prefill=True, kv_ready_at=kv_ready_at)
        try:
            wd.engine.add(sreq, now)
        except ValueError as exc:
            self._pd_legs.pop(leg.request_id, None)
            self._pd_reject(leg, str(exc), now)
            return
        self._poke(wd, now)

    def _pd_release_prefill(self, leg: _PdLeg, now: float) -> None:
        r, _ = self._pending[leg.request_id]
        wp = leg.prefill
        wp.reserve(r.prompt_tokens, -1)
        self._maybe_retire(wp, now)
        if self.queue:
            self._drain_queue(now)

    def _pd_reject(self, leg: _PdLeg, error: str, now: float) -> None:
        """What vLLM answers with HTTP 400 on either leg: the request ends, the decode slot is freed."""
        self._pd_legs.pop(leg.request_id, None)
        r, feats = self._pending.pop(leg.request_id)
        res = self.results[leg.request_id]
        res.finish_reason, res.status, res.error, res.finished = REJECTED_TOO_LONG, 400, error, now
        self._complete(leg.decode, r, feats, now)

    def _poke(self, w: SimWorker, now: float) -> None:
        """A request reached w's engine: plan a step if it is idle, else cut a macro step at `now`."""
        if w.removed_at is not None:
            return
        if w.step_end is None:
            self._plan(w, now)
        elif w.step_end > now:
            self._truncate(w, now)

    def _truncate(self, w: SimWorker, now: float) -> None:
        if self.max_iterations > 1 and w.step_end is not None and w.step_end > now:
            end = w.step_start + w.engine.truncate_step(now)
            if end != w.step_end:
                w.step_end = end
                w.token += 1
                heapq.heappush(self._heap, (end, next(self._seq), _STEP, (w, w.token)))

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self, workload: Sequence[WorkloadRequest], until: float | None = None,
            progress: Callable[[int, int], None] | None = None) -> SimResult:
        """Run the workload to the end (or `until`). `progress(arrived, total)` is called every 1% of the
        arrivals (for long runs' progress bars)."""
        wall0 = time.perf_counter()
        arrivals = sorted(workload, key=lambda r: r.arrival)
        start = arrivals[0].arrival if arrivals else 0.0
        self._last_arrival = arrivals[-1].arrival if arrivals else 0.0
        if self.rebalance_s is not None:
            self.schedule(start + self.rebalance_s, lambda sim, t: sim._rebalance(t))
        for w in self.workers.values():   # the fleet present before the run counts from the first arrival
            w.added_at = max(w.added_at, start)
        heap = self._heap
        i, n = 0, len(arrivals)
        inf = math.inf
        tick = max(n // 100, 1) if progress is not None else n + 1
        while True:
            t_arr = arrivals[i].arrival if i < n else inf
            t_evt = heap[0][0] if heap else inf
            t = min(t_arr, t_evt)
            if t == inf or (until is not None and t > until):
                break
            self.now = t
            if t_arr <= t_evt:
                r = arrivals[i]
                i += 1
                self._arrive(r, t)
                if i % tick == 0:
                    progress(i, n)
                continue
            _, _, kind, payload = heapq.heappop(heap)
            if kind == _STEP:
                w, token = payload
                if token == w.token:
                    self._step_done(w, t)
            elif kind == _ADD:
                self._engine_add(payload[0], payload[1], t)
            elif kind == _WAKE:
                w, token = payload
                if token == w.token and w.step_end is None and w.removed_at is None:
                    self._plan(w, t)
            else:
                payload(self, t)
        end = self.now
        for r in arrivals[i:]:      # arrivals after `until` never happened
            self.results.pop(r.request_id, None)
        return self._result(start, end, time.perf_counter() - wall0)

    def _result(self, start: float, end: float, wall: float) -> SimResult:
        all_workers = list(self.workers.values()) + self.retired
        gpu_s = sum(w.gpus * max(0.0, (w.removed_at if w.removed_at is not None else end) - w.added_at)
                    for w in all_workers)
        names = sorted({w.profile.name for w in all_workers}) or [p.name for p in self.profiles]
        return SimResult(
            policy=self.policy_name, profile=",".join(names), workers=len(all_workers),
            results=list(self.results.values()), start=start, end=end, wall_s=wall, gpu_seconds=gpu_s,
            preemptions=sum(w.engine.stats.preemptions for w in all_workers),
            prefix_cache_queries=sum(w.engine.stats.prefix_cache_queries for w in all_workers),
            prefix_cache_hits=sum(w.engine.stats.prefix_cache_hits for w in all_workers),
            max_admission_queue=self.queue.peak,
        )


def _wake_queue(sim: ClusterSim, now: float) -> None:
    """Timer: the admission queue's next due time (`_arm`); a stale timer (an earlier one was set since) does
    nothing."""
    if now < sim._wake_at:
        return
    sim._wake_at = math.inf
    if sim.queue:
        sim._drain_queue(now, changed=False)
