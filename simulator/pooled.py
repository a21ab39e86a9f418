"""Virtual-time simulation of many models sharing hosts (Aegaeon's setting and its baselines): `fleetgate simulate
--num-models M --pooling dedicated|request|multiplex|aegaeon`.

    res = simulate_pooled(PooledSpec(num_models=16, rate=1.6, workers=4, pooling="aegaeon"))
    res.to_dict()["slo_attainment"], res.to_dict()["swaps"]

A host is one GPU (one worker of the profile). It holds one EngineCore (simulator/engine.py) per model
engine (for Aegaeon's decode instances: per decode batch), each awake or asleep. Only awake engines step,
one step at a time per host (temporal sharing); bringing a model's weights in costs the swap time of
policies/pooling/costs.py (eq. 4 of Aegaeon appendix A.2 with `reinit=optimized`; a vLLM sleep-level-1
offload plus reload and the profile's wake overhead with `reinit=sleep`), the same in every mode. The
policies deciding what runs are the pure objects of policies/pooling:

- dedicated   one model per host, placed by popularity (`static_placement`, per_host 1); no swaps.
- multiplex   as many models awake per host as its memory holds (`resident_capacity`), each engine with its
              share of the KV cache, stepped in round robin (`RoundRobin`); no swaps.
- request     one model awake per host; the gateway's planner (policies/pooling/swapping.py `RequestLevelSwaps`):
              requests wait per model, the model waiting longest is woken on a host with no engine awake or
              an idle one, else the busy engine with the fewest requests drains at once (it takes no new
              request) and the host switches when it is idle; sleeping drops nothing (the engine was idle).
- aegaeon     prefill and decode partitions (section 4.1; `prefill_fraction` of the hosts prefill): grouped
              FCFS prefill, batch size one (`GroupedPrefill`); KV moves to a decode batch over the P/D link;
              decode rounds of time-quota turns (`DecodeWorkLists`). A batch's KV stays in host memory while
              other batches run and is copied back over the host link before its turn (section 5.3).
              Simulator only: stock vLLM drops the KV cache on sleep (docs/reference/vllm-interface.md §6.1),
              so keeping a preempted batch's KV across a switch is not something a gateway can drive today.
- aegaeon with `prefill_fraction` 0 (`--prefill-fraction 0`, bench label `aegaeon-coloc`): colocated turns, what
              the live gateway's `scheduling: turns` runs over stock vLLM. No P/D partition: each engine prefills
              and decodes its own requests (vLLM's mixed batches), one engine of a host steps at a time.
              Placement (`turns_placement`, what a `shared_hosts` config declares): `spread` (default) gives each
              host ceil(M / N) engines by `static_placement` (every model on at least one host, spare slots as
              extra copies of the busiest, the others asleep in CPU memory); `all` puts every model on every host
              (as `fleetgate demo --num-models` does). A request goes to an engine of its model by the gateway's
              placement step over the engines serving it (`_route`, simulator/pooled_routing.py: `ModelPlacement`,
              least_tokens, `has_room`; every mode routes so). What runs when is each host's `HostTurns`
              (policies/pooling/turns.py), the object the live gateway's turn driver asks, told the models with
              requests on the host: rounds
              of time-quota turns (eq. 2-3, tbt = the TPOT target, c = the host's swap costs); a turn ends when
              its quota is spent or its engine has nothing left; a model alone with work runs on without a quota
              or a switch (a second model's request cuts the step at its next iteration and starts a round). The
              engine leaving its turn sleeps: level 0 (a pause: no cost, KV kept) when all the host's models fit
              awake (`resident_capacity`; each engine then has its share of the KV cache), else its weights
              leave (`swap_cost`, no prefetch: vLLM has no call for it) and
              stock vLLM drops the paused requests' KV (`EngineCore.drop_kv`): they recompute prompt and output
              so far in their next turn. That recomputation is not in eq. 2-3: a quota shorter than it starves
              the batch (it loses its KV again before it decodes). `recompute_quota` (the gateway's rule, always
              on there and in `fleetgate simulate`; off is the bench's stock baseline) counts the estimated
              recomputation as switching (in c, and the turn's quota starts after it);
              `kv_kept` (simulator only) keeps the KV in host memory and copies it back before the turn
              (`kv_copy_time_s`, section 5.3 without the overlap). The simulator does the I/O the gateway's
              `TurnDriver` does (`_next_turns`, `_turn_switch`): switch, start the quota, step.

Every engine is built by `_engine` / `_setup_static` with an EngineConfig (FCFS today): the one place a
service-aware priority (SeaLLM, `--service-priority`) would set vLLM's `scheduling_policy` and each request's
`priority`.

Timing: a request reaches its host `profile.ttft_overhead_s` after arriving; TTFT, TPOT and the SLO test are
those of simulator/cluster.py (TTFT <= target and mean time per output token after the first <= target).
Arrivals stop at `duration`; the run then drains, at most `drain_s` more (requests still unfinished count as
misses). `token_slo_attainment` is Aegaeon's own measure beside it (section 2.1): the share of all output
tokens produced before their deadline, arrival + TTFT target + i x TBT target for the i-th token after the
first (tokens never produced count as late). The active-model count (models with a request in the system) is integrated over the arrival window
and reported beside Theorem 3.1's E[m] for the measured mean time in system.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from policies.pooling.aegaeon import (
    MAX_GPSIZE,
    Q_MAX_S,
    DecodeBatch,
    DecodeWorkLists,
    GroupedPrefill,
    PrefillJob,
    RoundPlan,
    Turn,
)
from policies.pooling.baselines import (
    RoundRobin,
    resident_capacity,
    shared_kv_capacity,
    static_placement,
)
from policies.pooling.costs import REINIT_OPTIMIZED, expected_active_models, kv_copy_time_s, swap_cost
from policies.pooling.swapping import EngineView, HostView, RequestLevelSwaps
from policies.pooling.turns import HostTurns
from policies.service_priority import SERVICE_PRIORITIES, ServiceScheduler, make_service_scheduler
from simulator.cluster import RequestResult, SimResult
from simulator.engine import EngineConfig, EngineCore, SimRequest
from simulator.pooled_routing import EngineRouter
from simulator.pooled_workload import (
    ModelMix,
    ModelRequest,
    MultiModelWorkload,
    multi_model_workload,
    parse_skew,
)
from simulator.profiles import Profile, load_profile

POOLING_MODES = ("dedicated", "multiplex", "request", "aegaeon")
AEGAEON_PREFILL_FRACTION = 6 / 16     # section 7.2: six prefill and ten decode instances of 16 GPUs
MACRO = 4096                          # most decode iterations planned at once (engine macro-stepping)
REFUSED = "refused"                   # a model no host serves (static modes with more models than slots)


@dataclass
class PooledSpec:
    """Everything that decides a pooled run's numbers (with `seed`, the run is reproducible)."""

    num_models: int = 8
    model_skew: str = "uniform"          # uniform | zipf:S
    rate: float = 0.8                    # total over all models (req/s)
    workers: int = 4
    pooling: str = "aegaeon"
    profile: str = "llama2-13b-a100"
    traces: str = "sharegpt"             # comma-separated, cycled over the models
    duration: float = 300.0
    drain_s: float = 600.0
    seed: int = 0
    slo_ttft_s: float = 10.0             # Aegaeon section 7.1
    slo_tpot_s: float = 0.1
    reinit: str = REINIT_OPTIMIZED       # optimized (eq. 4) | sleep (vLLM level 1 offload + reload + wake)
    prefill_fraction: float = AEGAEON_PREFILL_FRACTION
    q_max_s: float = Q_MAX_S
    max_group_size: int = MAX_GPSIZE
    prefetch: bool = True                # section 5.2: load the next model's weights during the current work
    kv_overlap: bool = True              # section 5.3: aegaeon's KV swap-in overlapped with the previous turn
    service_priority: str | None = None  # multiplex / request: which model (service) runs next (SeaLLM)
    shared_kv: bool = False              # multiplex: models share one KV pool (SeaLLM section 4.4)
    kv_kept: bool = False                # aegaeon colocated: KV kept in host memory across turns (simulator only)
    turns_placement: str = "spread"      # aegaeon colocated: spread (static_placement) | all (every model everywhere)
    recompute_quota: bool = False        # colocated, KV dropped: recomputation counts as switching (off: bench baseline)

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_MODES:
            raise ValueError(f"--pooling must be one of {', '.join(POOLING_MODES)}, got {self.pooling!r}")
        if self.num_models < 1:
            raise ValueError("--num-models must be >= 1")
        if self.workers < 1:
            raise ValueError("--workers must be >= 1")
        if self.pooling == "aegaeon" and self.workers < 2 and not self.colocated:
            raise ValueError("--pooling aegaeon needs at least 2 workers (one prefill, one decode) unless "
                             "--prefill-fraction 0 (colocated turns)")
        if self.service_priority is not None:
            if self.service_priority not in SERVICE_PRIORITIES:
                raise ValueError(f"--service-priority must be one of {', '.join(SERVICE_PRIORITIES)}, "
                                 f"got {self.service_priority!r}")
            if self.pooling not in ("multiplex", "request"):
                raise ValueError("--service-priority applies to --pooling multiplex or request")
        if not 0 <= self.prefill_fraction < 1:
            raise ValueError("prefill_fraction must be in [0, 1) (0: no partition, colocated turns)")
        if self.turns_placement not in ("spread", "all"):
            raise ValueError(f"turns_placement must be spread or all, got {self.turns_placement!r}")
        if (self.kv_kept or self.recompute_quota) and not self.colocated:
            raise ValueError("kv_kept and recompute_quota apply to --pooling aegaeon --prefill-fraction 0 "
                             "(colocated turns)")
        if self.rate <= 0 or self.duration <= 0 or self.drain_s < 0:
            raise ValueError("--rate and --duration must be > 0")
        parse_skew(self.model_skew)

    @property
    def colocated(self) -> bool:
        """Aegaeon's turns on colocated hosts (no prefill/decode partition): what the live gateway runs."""
        return self.pooling == "aegaeon" and self.prefill_fraction == 0

    @property
    def label(self) -> str:
        return "aegaeon-coloc" if self.colocated else self.pooling

    @property
    def mix(self) -> ModelMix:
        prof = load_profile(self.profile)
        return ModelMix(self.num_models, self.rate, parse_skew(self.model_skew),
                        tuple(t.strip() for t in self.traces.split(",") if t.strip()),
                        prof.max_model_len, self.slo_ttft_s, self.slo_tpot_s)

    def split(self) -> tuple[int, int]:
        """Aegaeon's (prefill, decode) hosts: at least one of each."""
        p = min(max(1, round(self.workers * self.prefill_fraction)), self.workers - 1)
        return p, self.workers - p


@dataclass
class PooledResult:
    """A `SimResult` (the usual fields) plus what pooling adds."""

    sim: SimResult
    spec: PooledSpec
    swaps: int
    swap_seconds: float
    active_models_mean: float
    expected_active_models: float
    unserved_models: int
    token_slo_attainment: float = 0.0
    per_model_attainment: dict[str, float] = field(default_factory=dict)
    hidden_swaps: int = 0                # swaps whose weight load a prefetch hid completely
    decode_rounds: list[RoundPlan] = field(default_factory=list)   # aegaeon: every round planned
    kv_dropped: int = 0                  # colocated turns: requests whose KV a sleep dropped (they recompute)
    prompt_tokens_computed: int = 0      # prefill tokens the engines computed (recomputation included)

    def to_dict(self) -> dict[str, Any]:
        out = self.sim.to_dict()
        out.update({
            "pooling": self.spec.pooling, "num_models": self.spec.num_models, "model_skew": self.spec.model_skew,
            "rate": self.spec.rate, "models_per_worker": self.spec.num_models / self.spec.workers,
            "swaps": self.swaps, "swap_seconds": self.swap_seconds,
            "active_models_mean": self.active_models_mean, "expected_active_models": self.expected_active_models,
            "unserved_models": self.unserved_models, "reinit": self.spec.reinit,
            "token_slo_attainment": self.token_slo_attainment,
            "prefetch": self.spec.prefetch, "kv_overlap": self.spec.kv_overlap, "hidden_swaps": self.hidden_swaps,
        })
        if self.spec.service_priority is not None:
            out["service_priority"] = self.spec.service_priority
        if self.decode_rounds:
            out["decode_round_s_mean"] = sum(r.round_s for r in self.decode_rounds) / len(self.decode_rounds)
            out["decode_alpha_mean"] = sum(r.alpha for r in self.decode_rounds) / len(self.decode_rounds)
        if self.spec.colocated:
            out.update({"mode": self.spec.label, "kv_kept": self.spec.kv_kept, "kv_dropped": self.kv_dropped,
                        "recompute_quota": self.spec.recompute_quota,
                        "prompt_tokens_computed": self.prompt_tokens_computed})
        elif self.spec.pooling == "aegaeon":
            p, d = self.spec.split()
            out["prefill_workers"], out["decode_workers"] = p, d
        return out


@dataclass(slots=True, eq=False)
class _Host:
    id: str
    role: str                                   # mixed | prefill | decode | turns (colocated)
    engines: dict[str, EngineCore] = field(default_factory=dict)   # engine key -> engine (awake or asleep)
    resident_model: str | None = None           # the model whose weights are on the GPU
    resident_key: str | None = None             # decode: the batch whose KV is on the GPU
    step_key: str | None = None                 # the engine whose step is in flight
    step_start: float = 0.0
    step_end: float | None = None
    swap_end: float | None = None               # a swap in flight until then
    token: int = 0                              # invalidates stale timers
    rr: RoundRobin | None = None
    turns: deque[Turn] = field(default_factory=deque)
    turn: Turn | None = None
    turn_end: float | None = None
    ran_this_round: bool = False
    round_batches: int = 0                      # batches in the current decode round
    after_swap: list[str] = field(default_factory=list)   # request ids to add once the swap is done
    pf_model: str | None = None                 # a prefetch of this model's weights (section 5.2) ...
    pf_done: float = 0.0                        # ... is on the GPU from then on
    pf_batch: str | None = None                 # a decode batch's KV swapped in ahead of its turn (section 5.3) ...
    pf_kv_done: float = 0.0                     # ... in from then on
    live: dict[str, set[str]] = field(default_factory=dict)   # with a service priority: engine -> its requests
    keeper: HostTurns | None = None             # colocated turns: the host's turn keeper (the gateway's)
    reqs: dict[str, set[str]] = field(default_factory=dict)   # colocated turns: model -> its requests on the host
    turn_pending: bool = False                  # colocated turns: a new turn's quota starts once its engine runs
    rounds_seen: int = 0                        # colocated turns: the keeper's rounds already reported
    level: int = 1                              # colocated turns: the sleep level of an engine leaving its turn
    blocks: int | None = None                   # colocated turns at level 0: each engine's share of the KV cache
    grace: float = 0.0                          # colocated turns, recompute_quota: the next turn's recompute estimate
    inflight: int = 0                           # request-level swapping: requests on the resident engine
    idle_since: float = 0.0                     # request-level swapping: when its last request ended
    target: str | None = None                   # request-level swapping: the model a planned swap brings in; the
                                                # resident engine takes no new request until it is idle (drains)

    @property
    def busy(self) -> bool:
        return self.step_end is not None or self.swap_end is not None


class PooledSim:
    """The event loop (module docstring). Build with a spec and its workload, then `run()`."""

    def __init__(self, spec: PooledSpec, workload: MultiModelWorkload) -> None:
        self.spec = spec
        self.wl = workload
        self.profile: Profile = load_profile(spec.profile)
        prof = self.profile
        cost = swap_cost(prof.weight_bytes, prof.host_link_bytes_per_s, spec.reinit, prof.wake_up_s)
        self.swap = cost
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()
        self.results: dict[str, RequestResult] = {}
        self.requests: dict[str, ModelRequest] = {}
        self.swaps = 0
        self.swap_seconds = 0.0
        self.preemptions = 0
        self._in_system: dict[str, int] = dict.fromkeys(workload.rates, 0)
        self._active = 0
        self._active_area = 0.0
        self._active_since = 0.0
        self._host_of: dict[str, _Host] = {}           # request -> host running it now
        self._emitted: dict[str, int] = {}             # request -> output tokens so far
        self.tokens_met = 0                             # output tokens before their per-token deadline
        self.hosts: list[_Host] = []
        self.placement: dict[str, list[str]] = {}
        self.hidden_swaps = 0
        self.rounds: list[RoundPlan] = []
        self.sched: ServiceScheduler | None = (make_service_scheduler(spec.service_priority)
                                               if spec.service_priority is not None else None)
        self._prefetching = spec.prefetch and spec.reinit == REINIT_OPTIMIZED and not spec.colocated
        self.kv_dropped = 0
        self.router = EngineRouter()                    # the gateway's placement step per model
        mode = spec.pooling
        if mode in ("dedicated", "multiplex"):
            self._setup_static(mode)
        elif mode == "request":
            self.hosts = [_Host(f"w{i}", "mixed") for i in range(spec.workers)]
            self.swapping = RequestLevelSwaps()     # the gateway's planner (gateway/control/pooling.py)
            self._waiting: dict[str, deque[str]] = {}   # model -> its requests waiting for an awake engine
        elif spec.colocated:
            self._setup_turns()
        else:
            self._setup_aegaeon()
        self._by_id = {h.id: h for h in self.hosts}

    # ---- set-up -------------------------------------------------------------------------------------
    def _memory_bytes(self) -> float:
        """GPU memory for weights and KV: the profile's weights plus its KV cache (its activation room aside)."""
        prof = self.profile
        return prof.weight_bytes + prof.kv_capacity_tokens * prof.kv_bytes_per_token

    def _setup_static(self, mode: str) -> None:
        prof = self.profile
        fit = shared_kv_capacity if self.spec.shared_kv else resident_capacity
        per_host = 1 if mode == "dedicated" else max(1, fit(
            self._memory_bytes(), prof.weight_bytes, prof.kv_bytes_per_token, prof.max_model_len))
        self.hosts = [_Host(f"w{i}", "mixed") for i in range(self.spec.workers)]
        self.placement = static_placement(self.wl.rates, [h.id for h in self.hosts], per_host)
        blocks = int((self._memory_bytes() - per_host * prof.weight_bytes)
                     / per_host / (prof.kv_bytes_per_token * prof.block_size))
        by_id = {h.id: h for h in self.hosts}
        policy = "priority" if self.spec.service_priority == "seallm" else "fcfs"
        for model, hosts in self.placement.items():
            for hid in hosts:
                by_id[hid].engines[model] = EngineCore(prof, EngineConfig(num_gpu_blocks=blocks,
                                                                          scheduling_policy=policy))
        for h in self.hosts:
            h.rr = RoundRobin(sorted(h.engines))

    def _setup_turns(self) -> None:
        """Colocated turns: every model on every host; level 0 (pause only) when they all fit awake, each engine
        then with its share of the KV cache; else each engine owns the whole KV cache while its turn runs."""
        prof = self.profile
        fit = resident_capacity(self._memory_bytes(), prof.weight_bytes, prof.kv_bytes_per_token, prof.max_model_len)
        self.hosts = [_Host(f"w{i}", "turns") for i in range(self.spec.workers)]
        ids = [h.id for h in self.hosts]
        if self.spec.turns_placement == "all":
            self.placement = {m: list(ids) for m in self.wl.rates}
        else:
            self.placement = static_placement(self.wl.rates, ids, -(-len(self.wl.rates) // len(ids)))
        for h in self.hosts:
            h.keeper = HostTurns(h.id, self.spec.slo_tpot_s, self.spec.q_max_s)
            held = sum(1 for hosts in self.placement.values() if h.id in hosts)
            h.level = 0 if held <= fit else 1
            h.blocks = (int((self._memory_bytes() - held * prof.weight_bytes) / max(1, held)
                            / (prof.kv_bytes_per_token * prof.block_size)) if h.level == 0 else None)

    def _setup_aegaeon(self) -> None:
        p, d = self.spec.split()
        prefill = [_Host(f"p{i}", "prefill") for i in range(p)]
        decode = [_Host(f"d{i}", "decode") for i in range(d)]
        self.hosts = prefill + decode
        prof = self.profile
        self.grouped = GroupedPrefill([h.id for h in prefill], self._prefill_time, lambda m: self.swap.total_s,
                                      self.spec.max_group_size)
        self.worklists = DecodeWorkLists([h.id for h in decode], lambda m: prof.kv_capacity_tokens,
                                         self.spec.q_max_s)

    # ---- estimates (appendix A.2: the profile's step-time model stands in for eq. 5-6) ------------------
    def _prefill_time(self, job: PrefillJob) -> float:
        prof = self.profile
        chunks = max(1, -(-job.prompt_tokens // prof.max_num_batched_tokens))
        return prof.step_time(job.prompt_tokens, 0, 0, job.prompt_tokens * job.prompt_tokens / 2) \
            + (chunks - 1) * prof.c_step_s

    def _decode_step_time(self, b: DecodeBatch) -> float:
        eng = self.hosts_by_id(b.instance).engines.get(b.batch_id)
        seqs = max(1, len(b.requests))
        ctx = (eng.num_gpu_blocks - eng.num_free_blocks) * eng.block_size if eng is not None else 0
        return self.profile.step_time(0, seqs, max(ctx, seqs), 0.0)

    @staticmethod
    def _kv_tokens(eng: EngineCore | None) -> int:
        return 0 if eng is None else (eng.num_gpu_blocks - eng.num_free_blocks) * eng.block_size

    def _kv_reload_s(self, eng: EngineCore | None) -> float:
        return kv_copy_time_s(self._kv_tokens(eng), self.profile.kv_bytes_per_token, self.profile.host_link_bytes_per_s)

    def _free_bytes(self, h: _Host, key: str | None) -> float:
        """GPU memory beside the resident weights and the KV of engine `key` (the one running now)."""
        prof = self.profile
        return self._memory_bytes() - prof.weight_bytes - self._kv_tokens(
            h.engines.get(key) if key is not None else None) * prof.kv_bytes_per_token

    def _switch_cost(self, prev: DecodeBatch, nxt: DecodeBatch) -> float:
        weights = self.swap.total_s if prev.model != nxt.model else 0.0
        if prev.batch_id == nxt.batch_id:
            return weights
        return weights + self._kv_reload_s(self.hosts_by_id(nxt.instance).engines.get(nxt.batch_id))

    def hosts_by_id(self, host_id: str) -> _Host:
        return self._by_id[host_id]

    # ---- the event loop ---------------------------------------------------------------------------------
    def _at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def run(self, progress: Callable[[int, int], None] | None = None) -> PooledResult:
        wall0 = time.perf_counter()
        reqs = self.wl.requests
        for r in reqs:
            self.requests[r.request_id] = r
            self.results[r.request_id] = RequestResult(r.request_id, r.arrival, r.prompt_tokens,
                                                       slo_ttft_s=r.slo_ttft_s or math.inf,
                                                       slo_tpot_s=r.slo_tpot_s or math.inf)
            self._at(r.arrival, self._arrive, r)
        until = self.spec.duration + self.spec.drain_s
        n, done = len(reqs), 0
        tick = max(n // 100, 1)
        while self._heap:
            t, _, fn, args = heapq.heappop(self._heap)
            if t > until:
                break
            self.now = t
            fn(t, *args)
            if progress is not None and fn == self._arrive:
                done += 1
                if done % tick == 0:
                    progress(done, n)
        self._count_active(min(self.now, self.spec.duration))
        end = max([r.finished for r in self.results.values() if r.finished is not None] or [self.spec.duration])
        for h in self.hosts:
            self.preemptions += sum(e.stats.preemptions for e in h.engines.values())
        prompt_computed = sum(e.stats.prompt_tokens for h in self.hosts for e in h.engines.values())
        sim = SimResult(policy=self.spec.label, profile=self.profile.name, workers=self.spec.workers,
                        results=list(self.results.values()), start=0.0, end=end, wall_s=time.perf_counter() - wall0,
                        gpu_seconds=self.spec.workers * self.profile.gpus_per_worker * end,
                        preemptions=self.preemptions, prefix_cache_queries=0, prefix_cache_hits=0,
                        max_admission_queue=0)
        done_rs = [r for r in self.results.values() if r.completed]
        mean_t = sum(r.e2e for r in done_rs) / len(done_rs) if done_rs else 0.0
        per_model: dict[str, list[int]] = {m: [0, 0] for m in self.wl.rates}
        for rid, r in self.results.items():
            tally = per_model[self.requests[rid].model]
            tally[0] += r.slo_met
            tally[1] += 1
        return PooledResult(
            sim, self.spec, self.swaps, self.swap_seconds,
            self._active_area / self.spec.duration, expected_active_models(list(self.wl.rates.values()), mean_t),
            unserved_models=sum(1 for m in self.wl.rates if (self.spec.pooling in ("dedicated", "multiplex")
                                                             or self.spec.colocated) and m not in self.placement),
            per_model_attainment={m: met / n for m, (met, n) in per_model.items() if n},
            hidden_swaps=self.hidden_swaps, decode_rounds=self.rounds, kv_dropped=self.kv_dropped,
            prompt_tokens_computed=prompt_computed,
            token_slo_attainment=self.tokens_met / max(1, sum(r.output_tokens for r in self.wl.requests)))

    # ---- active models (Theorem 3.1's m) ----------------------------------------------------------------
    def _count_active(self, now: float) -> None:
        t = min(now, self.spec.duration)
        if t > self._active_since:
            self._active_area += self._active * (t - self._active_since)
            self._active_since = t

    def _enter(self, model: str, now: float) -> None:
        self._count_active(now)
        self._in_system[model] += 1
        if self._in_system[model] == 1:
            self._active += 1

    def _leave(self, model: str, now: float) -> None:
        self._count_active(now)
        self._in_system[model] -= 1
        if self._in_system[model] == 0:
            self._active -= 1

    # ---- arrivals ---------------------------------------------------------------------------------------
    def _arrive(self, now: float, r: ModelRequest) -> None:
        self._enter(r.model, now)
        self._at(now + self.profile.ttft_overhead_s, self._reach, r)

    def _reach(self, now: float, r: ModelRequest) -> None:
        """The request reaches the hosts' scheduler (after the API server's overhead)."""
        mode = self.spec.pooling
        res = self.results[r.request_id]
        res.dispatched = now
        if self.sched is not None:
            res.service = r.model
            self.sched.arrived(r.request_id, r.model, now)
        if mode in ("dedicated", "multiplex"):
            hosts = [self._by_id[h] for h in self.placement.get(r.model, ())]
            if not hosts:
                res.finish_reason, res.status, res.finished = REFUSED, 429, None
                res.error = f"no host serves {r.model}"
                self._leave(r.model, now)
                return
            h = self._by_id[self._route(r, [x.id for x in hosts], now)]
            self._add(h, r.model, self._sim_request(r, now), now)
        elif self.spec.colocated:
            self._reach_turns(r, now)
        elif mode == "request":
            self._reach_request(r, now)
        else:
            h = self._by_id[self.grouped.place(PrefillJob(r.request_id, r.model, r.prompt_tokens))]
            self._next(h, now)
            if h.busy:
                self._prefetch(h, self.grouped.peek_model(h.id), now)

    def _sim_request(self, r: ModelRequest, now: float) -> SimRequest:
        prio = self.sched.engine_priority(r.request_id, now) if self.sched is not None else 0
        return SimRequest(r.request_id, r.prompt_tokens, [], r.output_tokens, r.output_tokens, arrival=now,
                          priority=prio)

    # ---- request-level swapping: the gateway's planner (policies/pooling/swapping.py) over one engine per host --
    def _reach_request(self, r: ModelRequest, now: float) -> None:
        """To an awake engine of the model taking requests (`_route` among them), else wait for a swap: the
        model's demand joins the planner's book, FCFS, as the gateway's swap controller reports it."""
        waiting = self._waiting.get(r.model)
        hosts = [h for h in self.hosts if h.resident_model == r.model and h.target is None and h.swap_end is None]
        if hosts and not waiting:
            h = self._by_id[self._route(r, [x.id for x in hosts], now)]
            h.inflight += 1
            self._add(h, r.model, self._sim_request(r, now), now)
            return
        self._waiting.setdefault(r.model, deque()).append(r.request_id)
        self.swapping.want(r.model, now)
        self._plan_swaps(now)

    def _swap_views(self) -> dict[str, HostView]:
        """What the planner sees: per host one engine per model (any can be loaded), at most one awake (the
        resident, or the model a planned swap brings in), drained at once (`drain_after_s` 0: a host switches
        only once its engine is idle, Aegaeon section 3.1's head-of-line blocking)."""
        out = {}
        for h in self.hosts:
            awake = h.target or h.resident_model
            engines = {m: EngineView(m == awake, h.inflight if m == h.resident_model else 0,
                                     h.idle_since if m == h.resident_model else 0.0) for m in self.wl.rates}
            out[h.id] = HostView(1, engines, h.target is not None or h.swap_end is not None, 0.0)
        return out

    def _plan_swaps(self, now: float) -> None:
        if not self.swapping.demand:
            return
        waiting = {m for m, q in self._waiting.items() if q}
        for step in self.swapping.plan(self._swap_views(), waiting, now, self._order(now)):
            h = self._by_id[step.host]
            h.target = step.wake
            if h.busy or h.inflight:
                self._prefetch(h, step.wake, now)
            self._switch_if_idle(h, now)

    def _order(self, now: float) -> Callable[[str], Any] | None:
        """With a service priority: a waiting model ranks as the first of its waiting requests in the order
        (SeaLLM section 4.2); None: FCFS."""
        if self.sched is None:
            return None
        key = self.sched.key
        return lambda m: min((key(rid, now) for rid in self._waiting.get(m, ())), default=(math.inf,))

    def _switch_if_idle(self, h: _Host, now: float) -> None:
        """A planned swap starts once the host's engine has drained (no request in flight, no step)."""
        if h.target is not None and h.inflight == 0 and not h.busy:
            model, h.target = h.target, None
            self._swap_in(h, model, now)

    def _prefetch(self, h: _Host, model: str | None, now: float) -> None:
        """Start copying `model`'s weights onto host h beside the running model (Aegaeon section 5.2, quick
        model loading: prefetched into the self-managed buffer right after the running model when VRAM allows),
        so the coming switch waits only for what is not copied yet. The same mechanism in every swapping mode
        (request-level swapping knows its next model from its queue as well). A prefetch of another model in
        flight is dropped for this one."""
        if (not self._prefetching or model is None or model in (h.resident_model, h.pf_model)
                or self._free_bytes(h, h.resident_model) < self.profile.weight_bytes):
            return
        h.pf_model, h.pf_done = model, now + self.swap.load_s

    def _engine(self, h: _Host, key: str) -> EngineCore:
        eng = h.engines.get(key)
        if eng is None:
            eng = h.engines[key] = EngineCore(self.profile)
        return eng

    def _add(self, h: _Host, key: str, sreq: SimRequest, now: float) -> None:
        """A request enters engine `key` of host h; the host plans at once if idle, else the step in flight is
        cut at its next iteration boundary."""
        self._engine(h, key).add(sreq, now)
        self._host_of[sreq.request_id] = h
        if self.sched is not None:
            h.live.setdefault(key, set()).add(sreq.request_id)
        if not h.busy:
            self._next(h, now)
        elif h.step_end is not None and h.step_end > now:
            # Cut whatever macro step runs, so the host decides again at the next iteration (the request joins
            # its engine's batch, or another engine of the host gets its round-robin turn).
            end = h.step_start + h.engines[h.step_key].truncate_step(now)
            if end != h.step_end:
                h.step_end = end
                h.token += 1
                self._at(end, self._step_done, h, h.token)

    def _tokens(self, rid: str, k: int, start: float, end: float) -> None:
        """k tokens of the request came out of a step over [start, end] (a macro step's iterations taken as
        evenly spaced): count those before their deadline, arrival + TTFT target + i x TBT target for the i-th
        token after the first (Aegaeon section 2.1, Figure 3: a late token can hide behind buffered ones)."""
        r = self.requests[rid]
        first = self._emitted.get(rid, 0)
        base = r.arrival + (r.slo_ttft_s or math.inf)
        tbt = r.slo_tpot_s or math.inf
        gap = (end - start) / k
        met = sum(1 for m in range(k) if start + (m + 1) * gap <= base + (first + m) * tbt)
        self._emitted[rid] = first + k
        self.tokens_met += met

    # ---- steps and swaps --------------------------------------------------------------------------------
    def _step(self, h: _Host, key: str, now: float, macro: bool, limit: float | None = None) -> bool:
        eng = h.engines[key]
        dur = eng.plan_step(now, MACRO if macro else 1)
        if dur is None:
            return False
        if limit is not None and now + dur > limit:
            dur = eng.truncate_step(limit)
        h.step_key, h.step_start, h.step_end = key, now, now + dur
        h.token += 1
        self._at(now + dur, self._step_done, h, h.token)
        return True

    def _step_done(self, now: float, h: _Host, token: int) -> None:
        if token != h.token or h.step_end is None:
            return
        key = h.step_key
        eng = h.engines[key]
        start = h.step_start
        h.step_end = h.step_key = None
        if h.pf_model is not None or h.pf_batch is not None:
            self._keep_room(h, key)
        for ev in eng.finish_step(now):
            if ev.new_tokens:
                self._tokens(ev.request_id, ev.new_tokens, start, now)
                if self.sched is not None:
                    self.sched.progressed(ev.request_id, self.requests[ev.request_id].prompt_tokens,
                                          self._emitted[ev.request_id], now)
            if ev.finished:
                self._finished(h, key, ev.record, now)
        self._next(h, now)

    def _swap_in(self, h: _Host, model: str, now: float, extra_s: float = 0.0) -> None:
        """Bring `model` onto host h (the current model goes to sleep); the host is busy meanwhile."""
        cost = extra_s
        if model != h.resident_model:
            load = self.swap.load_s
            if h.pf_model == model:           # prefetched: wait only for what is not on the GPU yet
                load = max(0.0, h.pf_done - now)
                self.hidden_swaps += load == 0.0
            cost += load + (self.swap.offload_s if h.resident_model is not None else 0.0)
            self.swaps += 1
        h.pf_model = None
        h.resident_model = model
        self.swap_seconds += cost
        h.swap_end = now + cost
        h.token += 1
        self._at(now + cost, self._swap_done, h, h.token)

    def _swap_done(self, now: float, h: _Host, token: int) -> None:
        if token != h.token:
            return
        h.swap_end = None
        if self.spec.pooling == "request":     # the model's waiting requests drain onto its engine, in order
            h.after_swap = list(self._waiting.pop(h.resident_model, ()))
            h.inflight += len(h.after_swap)
            for rid in h.after_swap:
                self.router.hold(h.resident_model, h.id, self.requests[rid], now)
        pending, h.after_swap = h.after_swap, []
        for rid in pending:
            self._engine(h, h.resident_model).add(self._sim_request(self.requests[rid], now), now)
            self._host_of[rid] = h
        self._next(h, now)
        if self.spec.pooling == "request":     # the host takes part in the plan again
            self._plan_swaps(now)

    def _wake(self, now: float, h: _Host, token: int) -> None:
        if token == h.token and not h.busy:
            self._next(h, now)

    # ---- what a free host does next (per pooling mode) -----------------------------------------------------
    def _next(self, h: _Host, now: float) -> None:
        if h.busy:
            return
        if h.role == "prefill":
            self._next_prefill(h, now)
        elif h.role == "decode":
            self._next_decode(h, now)
        elif h.role == "turns":
            self._next_turns(h, now)
        elif self.spec.pooling == "request":
            self._next_request(h, now)
        else:
            with_work = [k for k, e in h.engines.items() if e.has_work()]
            if self.sched is not None and self.spec.service_priority != "round_robin" and len(with_work) > 1:
                # One service per step, the one holding the request the order ranks first (SeaLLM section 4.2:
                # requests of one service batched together, the highest priority first; FCFS: the oldest).
                key_of = self.sched.key
                key = min(with_work, key=lambda k: min((key_of(rid, now) for rid in h.live.get(k, ())),
                                                       default=(math.inf,)))
            else:
                key = h.rr.next(with_work) if h.rr is not None else None
            if key is not None:
                self._step(h, key, now, macro=len(with_work) == 1)

    def _step_resident(self, h: _Host, now: float, macro: bool) -> bool:
        """Step the engine of the model the host holds, if it has work (True: a step is in flight)."""
        eng = h.engines.get(h.resident_model) if h.resident_model is not None else None
        return eng is not None and eng.has_work() and self._step(h, h.resident_model, now, macro)

    def _next_request(self, h: _Host, now: float) -> None:
        if self._step_resident(h, now, macro=True):
            if h.target is not None:
                self._prefetch(h, h.target, now)
            return
        self._switch_if_idle(h, now)
        self._plan_swaps(now)

    def _next_prefill(self, h: _Host, now: float) -> None:
        if self._step_resident(h, now, macro=False):
            return
        job = self.grouped.next_job(h.id)
        if job is None:
            return
        r = self.requests[job.request_id]
        prefill = SimRequest(r.request_id, r.prompt_tokens, [], 1, 1, arrival=now)
        if job.model != h.resident_model:
            self.grouped.loaded(h.id, job.model)
            h.after_swap = []
            self._swap_in(h, job.model, now)
            self._engine(h, job.model).add(prefill, now)     # runs once the weights are in
            self._host_of[r.request_id] = h
        else:
            self._add(h, job.model, prefill, now)
        self._prefetch(h, self.grouped.peek_model(h.id), now)

    def _next_decode(self, h: _Host, now: float) -> None:
        wl = self.worklists
        rounds = 0
        while True:
            t = h.turn
            if t is not None and wl.batches.get(t.batch_id) is not None:
                if h.turn_end is None:
                    h.turn_end = now + t.quota_s
                    self._prefetch_decode(h, t, now)
                if now < h.turn_end and self._step(h, t.batch_id, now, macro=True, limit=h.turn_end):
                    h.ran_this_round = True
                    return
            h.turn = h.turn_end = None
            if not h.turns:
                if not h.ran_this_round and (self._idle_decode(h, now) or rounds):
                    return      # a fresh round ran nothing either: wait for KV or a new request
                rounds += 1
                h.ran_this_round = False
                turns = wl.round(h.id, self._decode_step_time, self.spec.slo_tpot_s, self._switch_cost,
                                 h.resident_key)
                if not turns:
                    return
                if wl.last_round is not None:
                    self.rounds.append(wl.last_round)
                h.round_batches = len(turns)
                h.turns = deque(turns)
            t = h.turns.popleft()
            b = wl.batches.get(t.batch_id)
            eng = h.engines.get(t.batch_id)
            if b is None or eng is None or not _schedulable(eng, now):
                continue
            h.turn = t
            reload = self._kv_reload_s(eng) if h.resident_key not in (None, t.batch_id) else 0.0
            if reload and h.pf_batch == t.batch_id:     # swapped in during the previous turn (section 5.3)
                reload = min(reload, max(0.0, h.pf_kv_done - now))
            h.pf_batch = None
            h.resident_key = t.batch_id
            if b.model != h.resident_model or reload > 0:
                self._swap_in(h, b.model, now, reload)
                return

    # ---- colocated turns (module docstring; the gateway's `scheduling: turns`) ------------------------------
    def _route(self, r: ModelRequest, hosts: list[str], now: float) -> str:
        """The gateway's placement step over the engines of the request's model on `hosts` (simulator/pooled_routing.py;
        no cap, so one is always chosen)."""
        host = self.router.place(r.model, r, hosts, now)
        assert host is not None, "an engine without a cap always has room"
        return host

    def _reach_turns(self, r: ModelRequest, now: float) -> None:
        """The gateway's routing (`_route`) over the engines of the request's model, asleep or not. A step in
        flight is cut at its next iteration (`_add`), so the keeper decides again: a model that ran alone starts
        a round when a second one gets work."""
        h = self._by_id[self._route(r, self.placement[r.model], now)]
        h.reqs.setdefault(r.model, set()).add(r.request_id)
        if r.model not in h.engines:
            h.engines[r.model] = EngineCore(self.profile, EngineConfig(num_gpu_blocks=h.blocks))
        self._add(h, r.model, self._sim_request(r, now), now)

    def _turn_step_time(self, h: _Host, model: str, n: int) -> float:
        """Eq. 2's t_k for a model's batch on host h: one decode iteration of its n requests over their context
        so far (the gateway gives the keeper the learner's estimate of the same)."""
        rids = h.reqs.get(model, ())
        seqs = max(1, n)
        ctx = sum(self.requests[rid].prompt_tokens + self._emitted.get(rid, 0) for rid in rids)
        return self.profile.step_time(0, seqs, max(ctx, seqs), 0.0)

    def _turn_switch_cost(self, h: _Host, a: str, b: str) -> float:
        """Eq. 3's c, per switch from model a's engine to b's: nothing at sleep level 0; else the weights, with
        `kv_kept` b's KV copied back, with `recompute_quota` b's estimated recomputation (the gateway's
        `TurnDriver._switch_cost`, from the same profile)."""
        if a == b or h.level == 0:
            return 0.0
        kv = self._kv_reload_s(h.engines.get(b)) if self.spec.kv_kept else 0.0
        return self.swap.total_s + kv + (self._recompute_s(h, b) if self.spec.recompute_quota else 0.0)

    def _recompute_s(self, h: _Host, model: str) -> float:
        """`recompute_quota`: seconds to recompute, at the start of `model`'s next turn, the KV a sleep drops (the
        prompt and output so far of each of its started requests), chunked by the step's token budget (an
        estimate from the profile's step-time model, as eq. 5-6 of appendix A.2 are estimates)."""
        eng = h.engines.get(model)
        if eng is None:
            return 0.0
        lens = [self.requests[rid].prompt_tokens + self._emitted.get(rid, 0) for rid in h.reqs.get(model, ())
                if not eng.not_started(rid)]
        total = sum(lens)
        if not total:
            return 0.0
        prof = self.profile
        chunks = -(-total // prof.max_num_batched_tokens)
        return (chunks * (prof.c_step_s + prof.t_weights_s) + prof.k_prefill_s * total
                + prof.k_attn_s * sum(n * n / 2 for n in lens))

    def _next_turns(self, h: _Host, now: float) -> None:
        """Ask the host's keeper (`HostTurns`, the object the gateway's TurnDriver asks) which engine runs now,
        switch to it if needed, start its quota once it runs, and step it up to the turn's end."""
        keeper = h.keeper
        if h.turn_pending:                          # the switch that started a turn is done
            keeper.switched(now + h.grace)          # (its quota counts once the recomputation is done)
            h.turn_pending, h.grace = False, 0.0
        work = {m: len(rids) for m, rids in h.reqs.items() if rids}
        d = keeper.decide(now, work, lambda m, n: self._turn_step_time(h, m, n),
                          lambda a, b: self._turn_switch_cost(h, a, b))
        if keeper.rounds != h.rounds_seen and keeper.last_round is not None:
            h.rounds_seen = keeper.rounds
            self.rounds.append(keeper.last_round)
        if d.model is None or d.model not in work:
            return
        if d.model != h.resident_model and self._turn_switch(h, d.model, now):
            h.turn_pending = d.new_turn             # the weights move; the keeper hears of it when they are in
            return
        if d.new_turn:
            keeper.switched(now + h.grace)
            h.grace = 0.0
        self._step(h, d.model, now, macro=True, limit=keeper.turn_end)

    def _turn_switch(self, h: _Host, model: str, now: float) -> bool:
        """The resident engine leaves its turn (/sleep?level=L&mode=keep) and `model`'s takes the host. Level 0:
        a pause, free. Else the weights go (`swap_cost`) and, unless `kv_kept`, the sleeping engine's requests
        lose their KV; with `kv_kept` the incoming engine's KV is copied back. True: a swap is in flight."""
        prev = h.engines.get(h.resident_model) if h.resident_model is not None else None
        if h.level == 0:
            h.resident_model = model
            return False
        if prev is not None and not self.spec.kv_kept:
            self.kv_dropped += prev.drop_kv()
        if self.spec.recompute_quota:
            h.grace = self._recompute_s(h, model)
        kv = self._kv_reload_s(h.engines.get(model)) if self.spec.kv_kept else 0.0
        self._swap_in(h, model, now, kv)
        return True

    def _keep_room(self, h: _Host, key: str) -> None:
        """The running batch's KV grew: what was prefetched beside it and no longer fits is dropped (the KV of
        running requests comes first), the KV before the weights."""
        prof = self.profile
        free = self._free_bytes(h, key)
        weights = prof.weight_bytes if h.pf_model is not None else 0.0
        if h.pf_batch is not None and free < weights + self._kv_tokens(h.engines.get(h.pf_batch)) \
                * prof.kv_bytes_per_token:
            h.pf_batch = None
        if free < weights:
            h.pf_model = None

    def _prefetch_decode(self, h: _Host, t: Turn, now: float) -> None:
        """A turn starts: bring what the next turn needs while this one decodes. Its model's weights (section 5.2,
        as `_prefetch`), then over the same host link its batch's KV (section 5.3: swap-in overlapped with
        compute; swap-out is never charged, it is overlapped in every configuration), each only if the GPU has
        room beside the running batch. Without room, or with the options off, the switch pays in full."""
        nb = self.worklists.batches.get(h.turns[0].batch_id) if h.turns else \
            self.worklists.following(h.id, t.batch_id)
        if nb is None or nb.batch_id == t.batch_id:
            return
        prof = self.profile
        free = self._free_bytes(h, t.batch_id)
        start = now
        if nb.model != h.resident_model and self._prefetching and free >= prof.weight_bytes:
            if h.pf_model != nb.model:          # (a copy of this model already under way goes on)
                h.pf_model, h.pf_done = nb.model, now + self.swap.load_s
            free -= prof.weight_bytes
            start = h.pf_done
        tokens = self._kv_tokens(h.engines.get(nb.batch_id))
        if self.spec.kv_overlap and tokens and free >= tokens * prof.kv_bytes_per_token:
            h.pf_batch = nb.batch_id
            h.pf_kv_done = start + kv_copy_time_s(tokens, prof.kv_bytes_per_token, prof.host_link_bytes_per_s)

    def _idle_decode(self, h: _Host, now: float) -> bool:
        """A whole round ran nothing: unless some batch can run now, wait for the earliest KV arrival on this host
        (True: it waits)."""
        if any(_schedulable(e, now) for e in h.engines.values()):
            return False
        wakes = [w for w in (e.next_event_time() for e in h.engines.values() if e.has_work()) if w is not None]
        if wakes:
            h.token += 1
            self._at(max(min(wakes), now), self._wake, h, h.token)
        return True

    # ---- request completion -----------------------------------------------------------------------------
    def _finished(self, h: _Host, key: str, rec: Any, now: float) -> None:
        rid = rec.request_id
        r = self.requests[rid]
        res = self.results[rid]
        if h.role == "prefill":
            res.prefill_worker_id = h.id
            res.prefill_scheduled, res.prefill_done = rec.first_scheduled, rec.finished
            res.first_scheduled, res.first_token = rec.first_scheduled, rec.first_token
            if r.output_tokens <= 1:
                self._done(r, res, rec.finished, 1, rec.finish_reason, now)
                return
            self._to_decode(r, now)
            return
        if h.role == "decode":
            res.output_tokens = rec.num_output + 1
            self._done(r, res, rec.finished, rec.num_output + 1, rec.finish_reason, now)
            b = self.worklists.remove(rid)
            if b is not None and b.batch_id not in self.worklists.batches:
                gone = h.engines.pop(b.batch_id)
                self.preemptions += gone.stats.preemptions
            return
        res.first_scheduled, res.first_token = rec.first_scheduled, rec.first_token
        self._done(r, res, rec.finished, rec.num_output, rec.finish_reason, now)
        if self.spec.pooling == "request":
            h.inflight -= 1
            if not h.inflight:
                h.idle_since = now
        elif h.role == "turns":
            h.reqs[r.model].discard(rid)

    def _done(self, r: ModelRequest, res: RequestResult, finished: float, n_out: int, reason: str, now: float) -> None:
        res.finished, res.output_tokens, res.finish_reason = finished, n_out, reason
        h = self._host_of.pop(r.request_id)
        res.worker_id = h.id
        self.router.finished(r.model, h.id, r.request_id, n_out if res.completed else 0, now)
        if self.sched is not None:
            self.sched.finished(r.request_id, r.prompt_tokens, n_out, now, completed=res.completed)
            for rids in h.live.values():
                rids.discard(r.request_id)
        self._leave(r.model, now)

    def _to_decode(self, r: ModelRequest, now: float) -> None:
        """Hand a prefilled request to a decode batch (Algorithm 2 line 2); its KV arrives over the P/D link."""
        prof = self.profile
        need = r.prompt_tokens + 1 + round(self.wl.mean_output.get(r.model, prof.output_mean_tokens))
        b = self.worklists.place(r.request_id, r.model, need)
        h = self._by_id[b.instance]
        if h.round_batches == 1 and len(self.worklists.work[h.id]) > 1 and h.turn is not None:
            # A round of one batch switches nothing (eq. 2's c = 0: we give it Q_MAX); a second batch makes
            # the round stale, so the turn ends at the next iteration and a new round gives both quotas.
            h.turn_end = now
        ready = now + prof.kv_transfer_s(r.prompt_tokens + 1)
        rest = r.output_tokens - 1
        self._add(h, b.batch_id, SimRequest(r.request_id, r.prompt_tokens + 1, [], rest, rest, arrival=now,
                                            remote_prefill=True, kv_ready_at=ready), now)


def _schedulable(eng: EngineCore, now: float) -> bool:
    if eng.num_running:
        return True
    if not eng.num_waiting:
        return False
    t = eng.next_event_time()
    return t is None or t <= now


def simulate_pooled(spec: PooledSpec, progress: Callable[[int, int], None] | None = None) -> PooledResult:
    wl = multi_model_workload(spec.mix, spec.duration, spec.seed)
    if not wl.requests:
        raise ValueError("the workload is empty (check --duration / --rate)")
    return PooledSim(spec, wl).run(progress)


def run_pooled_cli(spec: PooledSpec, as_json: bool) -> None:
    """`fleetgate simulate --pooling ...`: one run, printed as JSON or a table (the single-model command's)."""
    from simulator.simulate import run_cli

    run_cli(f"simulate pooling={spec.pooling} M={spec.num_models}",
            lambda progress: simulate_pooled(spec, progress=progress), {"seed": spec.seed}, as_json)
