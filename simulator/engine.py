"""vLLM-V1-like engine model: continuous batching over a paged KV cache, stepped by any clock.

INTERFACE CONTRACT (the HTTP server in simulator/vllm_api.py and the virtual-time cluster simulator in
simulator/cluster.py both drive this class; keep these names and meanings):

    core = EngineCore(profile, config, seed=0)
    core.add(req, now)                  # enqueue a SimRequest (WAITING)
    core.abort(request_id, now)         # client went away: free its blocks, finish with "abort"
    dur = core.plan_step(now)           # schedule one iteration; seconds it takes (model time), or None if idle
    events = core.finish_step(now)      # call at plan time + dur: apply the iteration, return StepEvents
    core.has_work() -> bool
    core.num_running, core.num_waiting, core.kv_usage  (0..1), core.stats (EngineStats counters)
    core.take_kv_events()               # KV-cache events since the last call (EngineConfig.kv_events)
    core.add_lora(lora_id, now)         # LoRA (EngineConfig.max_loras > 0): load an adapter into host memory
    core.lora_adapters()                # (running, waiting) adapter names, vllm:lora_requests_info's labels

Only one step is in flight at a time: plan_step, then finish_step, then plan_step again.
All times are model seconds; a real-time driver sleeps dur / time_scale between the two calls.

Details of this implementation (docs/reference/vllm-interface.md §5.2 and §8; vLLM V1 scheduler semantics):

- `profile` is a `simulator.profiles.Profile` (or a name / YAML path); `config` an `EngineConfig` or None.
- `add` raises ValueError for a request that can never run (empty prompt, prompt >= max_model_len, prompt
  larger than the whole KV cache, duplicate id). It does not add `profile.ttft_overhead_s`: the driver
  calls `add` that much after the request arrived (the HTTP server and simulator.cluster both do).
- `abort(request_id, now)` returns the request's final StepEvent (finish_reason "abort", with `record`)
  directly, or None if the id is unknown; aborted requests are NOT reported again by `finish_step`. A
  request aborted while its step is in flight simply gets no event from that step. Aborting a finished
  P/D producer whose blocks are still pinned releases them (and returns None).
- Every finishing StepEvent carries `record`: a `RequestRecord` with the model times of arrival (as given
  in SimRequest.arrival), first scheduling, first token, finish, the number of output tokens, the prefix
  cache hit of the first admission and the number of preemptions. Times are exact per iteration also
  under macro-stepping.
- `plan_step(now)` may return None although `has_work()` is True: nothing is schedulable yet (a P/D
  consumer waiting for `kv_ready_at`, or all blocks pinned by P/D producers). `next_event_time()` then
  says when to try again (a new `add` is also a reason to try again).
- Macro-stepping (virtual-time drivers only): `plan_step(now, max_iterations=k)` may plan up to k
  iterations at once when the batch is pure decode and its composition cannot change (no admission or
  preemption possible, no request finishes before the last of them, no waiting P/D consumer becomes ready
  and no pinned blocks expire in between). `truncate_step(t)` cuts such a plan at the first iteration
  boundary >= t and returns the new duration from the plan's start; call it before adding a request or
  releasing pinned blocks mid-step. `finish_step` applies the planned iterations; StepEvents then carry
  `new_tokens == k`. With max_iterations=1 (the default) every step is exactly one iteration.
- KV-cache events (EngineConfig.kv_events, policies/kv_index.py types), at vLLM's moments: BlockStored when a
  step completes full prompt blocks that enter the prefix cache (one event per request and step, chained to the
  request's previous block, with the blocks' token ids when SimRequest.token_ids is given; a block whose twin
  is already cached stays private and is not announced), BlockRemoved when a cached block is evicted (an
  eviction run is one event here; the wire publisher splits it one hash per event, as vLLM sends them),
  AllBlocksCleared when reset_prefix_cache succeeds. Only prompt blocks are cached (vLLM also caches the full
  blocks of generated tokens).
- LoRA (simulator/lora.py): a request with `lora_id` > 0 runs with that adapter. At most `max_loras` distinct
  adapters are scheduled in one step; a waiting request of another adapter is skipped and keeps its place
  (vLLM V1's scheduler). A step that needs an adapter outside the GPU slots pays `lora_activate_s` for it (plus
  `lora_disk_s` when it was evicted from the `max_cpu_loras` host cache, LRU), and every step with an adapter pays
  `lora_step_s`.
- P/D: a `remote_decode` request (producer) finishes with "length" after its first token and keeps its
  blocks pinned (not running, not freeable) until `release_remote(request_id, now)` or `config.kv_hold_s`
  elapses (`expire_remote(now)`, also called by `plan_step`). A `remote_prefill` request (consumer) is
  skipped in WAITING until `kv_ready_at`; then it gets blocks for its prompt without computing it (it only
  recomputes the last prompt token, as vLLM's NIXL connector does, and that token is not counted in
  `stats.prompt_tokens`) and decodes.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from policies.kv_index import AllBlocksCleared, BlockRemoved, BlockStored
from simulator.speed import SpeedDrift

if TYPE_CHECKING:
    from simulator.profiles import Profile

BLOCK_SIZE = 16


@dataclass(slots=True)
class SimRequest:
    request_id: str
    prompt_len: int
    # Chained hashes of the prompt's full 16-token blocks (len == prompt_len // BLOCK_SIZE); see
    # simulator.tokenizer.block_hashes. Empty disables prefix-cache lookups for this request.
    block_hashes: list[int]
    max_tokens: int
    # How many tokens this request will generate before "stop" (<= max_tokens; == max_tokens gives "length").
    target_output_tokens: int
    priority: int = 0
    arrival: float = 0.0
    # P/D consumer: KV arrives from a remote prefill; the prompt is not recomputed. The engine waits
    # until `kv_ready_at` (model time) before the request can be scheduled.
    remote_prefill: bool = False
    kv_ready_at: float = 0.0
    # P/D producer: after the prefill (and the single token), keep the blocks pinned for a remote decode.
    remote_decode: bool = False
    # The prompt's token ids, when known (the HTTP server): KV events' BlockStored carry them.
    token_ids: list[int] | None = None
    # LoRA adapter serving this request (vLLM's LoRARequest): its integer id (> 0) and its name; 0 = base model.
    lora_id: int = 0
    lora_name: str | None = None


@dataclass(slots=True)
class RequestRecord:
    """Per-request model times (seconds), for TTFT / TPOT / queue-time statistics."""

    request_id: str
    prompt_len: int
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_output: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None


@dataclass(slots=True)
class StepEvent:
    """What one iteration did for one request."""

    request_id: str
    new_tokens: int = 0            # tokens generated this step (0 or 1 in this model; k when macro-stepped)
    first_token: bool = False      # the first output token was produced in this step
    finished: bool = False
    finish_reason: str | None = None   # "stop" | "length" | "abort"
    num_cached_tokens: int = 0     # prefix-cache hit for this request (set on its first scheduled step)
    preempted: bool = False        # it was preempted (back to WAITING) in this step
    record: RequestRecord | None = None  # set when finished: the request's timings


@dataclass(slots=True)
class EngineStats:
    """Monotonic counters (vLLM metric semantics) read by /metrics."""

    prompt_tokens: int = 0         # prefill tokens computed
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # in tokens
    prefix_cache_hits: int = 0     # in tokens
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    iterations: int = 0
    lora_disk_loads: int = 0       # adapters read from disk into host memory (runtime loads and cache misses)
    lora_activations: int = 0      # adapters copied from host memory into a GPU slot


@dataclass(slots=True)
class EngineConfig:
    """Per-engine overrides of the profile and vLLM scheduler options."""

    num_gpu_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    scheduling_policy: str = "fcfs"        # fcfs | priority (vLLM --scheduling-policy)
    enable_prefix_caching: bool = True
    kv_hold_s: float = 120.0               # vLLM 0.11 VLLM_NIXL_ABORT_REQUEST_TIMEOUT
    kv_events: bool = False                # record KV-cache events (take_kv_events), as --kv-events-config
    # LoRA (simulator/lora.py): distinct adapters per step (vLLM --max-loras; 0 = LoRA off), adapters kept in host
    # memory (--max-cpu-loras, LRU), and the model seconds of a slot load, a disk load and a step with adapters.
    max_loras: int = 0
    max_cpu_loras: int = 0
    lora_activate_s: float = 0.0
    lora_disk_s: float = 0.0
    lora_step_s: float = 0.0


_WAITING, _RUNNING, _DONE = 0, 1, 2


class _Seq:
    """Engine-side state of one request (vLLM's Request): tokens = prompt + generated so far."""

    __slots__ = ("req", "rec", "num_computed", "num_tokens", "num_output", "limit", "hashes", "num_blocks",
                 "status", "seq_no", "promote", "no_count_below", "loaded", "reported_cache", "paused")

    def __init__(self, req: SimRequest, limit: int, seq_no: int) -> None:
        self.req = req
        self.rec = RequestRecord(req.request_id, req.prompt_len, req.arrival)
        self.num_computed = 0
        self.num_tokens = req.prompt_len
        self.num_output = 0
        self.limit = limit              # output tokens at which it finishes
        self.hashes: list[int] = []     # leading blocks held through the prefix cache (ref-counted)
        self.num_blocks = 0             # all blocks held (cached ones included)
        self.status = _WAITING
        self.seq_no = seq_no
        self.promote = True             # may still register its computed full blocks in the cache
        self.no_count_below = 0         # prompt positions below this are not counted as computed
        self.loaded = False             # P/D consumer: remote KV already placed
        self.reported_cache = False
        self.paused = False             # set aside for a better request with its KV kept (reprioritize only)


class _BlockPool:
    """Paged KV blocks: plain free blocks plus a prefix cache of hashed blocks (ref-counted, LRU)."""

    __slots__ = ("total", "free_plain", "ref", "evictable", "events")

    def __init__(self, total: int, events: list[Any] | None = None) -> None:
        self.total = total
        self.free_plain = total
        self.ref: dict[int, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()   # ref == 0, least recently freed first
        self.events = events                                     # KV events, when recorded

    @property
    def num_free(self) -> int:
        return self.free_plain + len(self.evictable)

    def take(self, n: int) -> None:
        """Allocate n blocks (caller checked n <= num_free): plain ones first, then evict LRU cached ones."""
        plain = min(n, self.free_plain)
        self.free_plain -= plain
        if n > plain and self.events is not None:
            # One event for the whole eviction; the wire publisher splits it one hash per event, as vLLM.
            evicted = []
            for _ in range(n - plain):
                h, _ = self.evictable.popitem(last=False)
                del self.ref[h]
                evicted.append(h)
            self.events.append(BlockRemoved(tuple(evicted)))
            return
        for _ in range(n - plain):
            h, _ = self.evictable.popitem(last=False)
            del self.ref[h]

    def lookup(self, hashes: list[int], max_blocks: int) -> tuple[int, int]:
        """Leading cached blocks of `hashes` (at most max_blocks) and how many of them are evictable."""
        n = evictable = 0
        ref = self.ref
        for h in hashes[:max_blocks]:
            r = ref.get(h)
            if r is None:
                break
            n += 1
            if r == 0:
                evictable += 1
        return n, evictable

    def touch(self, hashes: list[int]) -> None:
        for h in hashes:
            r = self.ref[h]
            if r == 0:
                del self.evictable[h]
            self.ref[h] = r + 1

    def insert(self, h: int) -> bool:
        """Register a just-computed private block under its hash (no free-count change)."""
        if h in self.ref:
            return False
        self.ref[h] = 1
        return True

    def release(self, hashes: list[int], num_private: int) -> None:
        # Tail blocks first, so they are evicted first (vLLM frees a request's blocks in reverse order).
        for h in reversed(hashes):
            r = self.ref[h] - 1
            self.ref[h] = r
            if r == 0:
                self.evictable[h] = None
        self.free_plain += num_private


@dataclass(slots=True)
class _Plan:
    start: float
    sched: list[tuple[_Seq, int]]
    preempted: list[_Seq]
    dur: float
    k: int = 1
    a: float = 0.0          # macro: duration of the first iteration
    d: float = 0.0          # macro: per-iteration growth (k_ctx * B)

    def end_of(self, m: int) -> float:
        """Model time at the end of iteration m (1-based) of this plan."""
        if self.a == 0.0:   # a single-iteration plan (never extended)
            return self.start + self.dur
        return self.start + m * self.a + self.d * (m * (m - 1) / 2)


class EngineCore:
    def __init__(self, profile: Profile | str, config: EngineConfig | None = None, seed: int = 0) -> None:
        from simulator.profiles import load_profile

        self.profile = load_profile(profile)
        self.config = config or EngineConfig()
        cfg, prof = self.config, self.profile
        if cfg.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {cfg.scheduling_policy!r}")
        self.seed = seed
        self.block_size = prof.block_size
        self.num_gpu_blocks = cfg.num_gpu_blocks or prof.num_gpu_blocks
        self.max_num_seqs = cfg.max_num_seqs or prof.max_num_seqs
        self.max_num_batched_tokens = cfg.max_num_batched_tokens or prof.max_num_batched_tokens
        self.max_model_len = cfg.max_model_len or prof.max_model_len
        self.priority = cfg.scheduling_policy == "priority"
        self.caching = cfg.enable_prefix_caching
        self.stats = EngineStats()
        # KV-cache events in publication order (simulator/kv_events.py publishes them after each step).
        self._kv_events: list[Any] | None = [] if cfg.kv_events and cfg.enable_prefix_caching else None
        self._pool = _BlockPool(self.num_gpu_blocks, self._kv_events)
        self._running: list[_Seq] = []
        self._fifo: deque[_Seq] = deque()                       # fcfs WAITING
        self._heap: list[tuple[int, float, int, _Seq]] = []     # priority WAITING
        self._seqs: dict[str, _Seq] = {}                        # every live (not finished) request
        self._held: dict[str, tuple[_Seq, float]] = {}          # P/D producers: pinned until expiry
        self._plan: _Plan | None = None
        self._seq_no = 0
        self._pending_consumers = 0                             # P/D consumers whose KV is not placed yet
        p = prof
        self._c_step, self._t_w, self._k_p = p.c_step_s, p.t_weights_s, p.k_prefill_s
        self._c_d, self._k_ctx, self._k_attn = p.c_decode_s, p.k_ctx_s, p.k_attn_s
        self._c_admit = p.c_admit_s
        self._speed = SpeedDrift(p.speed_quantiles, p.speed_tau_s, seed) if p.speed_quantiles else None
        # LoRA: adapter ids in the max_loras GPU slots and in the max_cpu_loras host cache, least recently used
        # first (vLLM's LRUCacheWorkerLoRAManager); every adapter name seen, in first-seen order (its stats dict).
        self.max_loras = cfg.max_loras
        self._lora_gpu: OrderedDict[int, None] = OrderedDict()
        self._lora_cpu: OrderedDict[int, None] = OrderedDict()
        self._lora_names: dict[str, None] = {}
        self._lora_busy_until = 0.0     # model time a runtime adapter load keeps the engine busy until
        self._f = 1.0                                           # speed factor of the step being planned
        # Simulator only (vLLM fixes a request's priority at arrival): `reprioritize(req, generated, now)` gives
        # every live request's current priority and whether it may be preempted for a better one, before each
        # step; see `_preempt_for_priority`.
        self.reprioritize: Callable[[SimRequest, int, float], tuple[float, bool]] | None = None

    # ---- queries ----------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._heap) if self.priority else len(self._fifo)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self._pool.num_free / self.num_gpu_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    @property
    def num_held(self) -> int:
        return len(self._held)

    def has_work(self) -> bool:
        return bool(self._running) or self.num_waiting > 0

    def holds(self, request_id: str) -> bool:
        """The request has reached this engine (waiting or running) and has not finished or been aborted."""
        return request_id in self._seqs

    def output_so_far(self, request_id: str) -> int:
        """Output tokens the request has produced here so far (0: none, or not here)."""
        seq = self._seqs.get(request_id)
        return seq.num_output if seq is not None else 0

    def not_started(self, request_id: str) -> bool:
        """The request waits in this engine's queue and has computed nothing yet (it can still move elsewhere
        at no cost but its time in the queue)."""
        seq = self._seqs.get(request_id)
        return seq is not None and seq.status == _WAITING and seq.num_computed == 0 and seq.rec.first_scheduled is None

    def step_in_flight(self) -> bool:
        return self._plan is not None

    def next_event_time(self) -> float | None:
        """When something not driven by steps can make work schedulable (consumer KV ready, pins expire)."""
        times = [s.req.kv_ready_at for s in self._waiting_seqs() if s.req.remote_prefill and not s.loaded]
        if self.num_waiting:
            times += [exp for _, exp in self._held.values()]
        return min(times) if times else None

    def _waiting_seqs(self) -> list[_Seq]:
        return [e[3] for e in self._heap] if self.priority else list(self._fifo)

    # ---- requests ---------------------------------------------------------------------------------
    def add(self, req: SimRequest, now: float) -> None:
        if req.request_id in self._seqs or req.request_id in self._held:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.prompt_len < 1:
            raise ValueError("prompt must have at least one token")
        if req.lora_id and not self.max_loras:
            raise ValueError("a LoRA request on an engine without LoRA (EngineConfig.max_loras = 0)")
        if req.prompt_len >= self.max_model_len:
            raise ValueError(f"prompt of {req.prompt_len} tokens does not fit max_model_len {self.max_model_len}")
        if -(-(req.prompt_len + 1) // self.block_size) > self.num_gpu_blocks:
            raise ValueError(f"prompt of {req.prompt_len} tokens exceeds the KV cache ({self.num_gpu_blocks} blocks)")
        if self.block_size != BLOCK_SIZE and req.block_hashes:
            # Hashes arrive per 16-token block and are chained, so an engine block of r x 16 tokens is named by
            # the hash of its last 16-token sub-block (vLLM hashes whole blocks of its own block_size: the CPU
            # backend's 128). Without this a 128-token block would hit on 16 matching tokens.
            r = self.block_size // BLOCK_SIZE
            req.block_hashes = req.block_hashes[r - 1::r] if self.block_size % BLOCK_SIZE == 0 else []
        max_tokens = max(1, req.max_tokens)
        limit = max(1, min(req.target_output_tokens, max_tokens, self.max_model_len - req.prompt_len))
        if req.remote_decode:
            limit = 1
        self._seq_no += 1
        seq = _Seq(req, limit, self._seq_no)
        self._seqs[req.request_id] = seq
        if req.remote_prefill:
            self._pending_consumers += 1
        if req.lora_name is not None:
            self._lora_names.setdefault(req.lora_name)
        self._push_waiting(seq, front=False)

    def _push_waiting(self, seq: _Seq, front: bool) -> None:
        seq.status = _WAITING
        if self.priority:
            heapq.heappush(self._heap, (seq.req.priority, seq.req.arrival, seq.seq_no, seq))
        elif front:
            self._fifo.appendleft(seq)
        else:
            self._fifo.append(seq)

    def _remove_waiting(self, seq: _Seq) -> None:
        if self.priority:
            self._heap = [e for e in self._heap if e[3] is not seq]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(seq)

    def abort(self, request_id: str, now: float) -> StepEvent | None:
        if request_id in self._held:
            self.release_remote(request_id, now)
            return None
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        if seq.status == _RUNNING:
            self._running.remove(seq)
        else:
            self._remove_waiting(seq)
            if seq.req.remote_prefill and not seq.loaded:
                self._pending_consumers -= 1
        self._free(seq)
        return self._finish(seq, "abort", now)

    def release_remote(self, request_id: str, now: float) -> bool:
        """The decode side read the pinned KV of a finished P/D producer: free its blocks."""
        item = self._held.pop(request_id, None)
        if item is None:
            return False
        self._free(item[0])
        return True

    def expire_remote(self, now: float) -> list[str]:
        """Free pinned producer blocks whose hold time (config.kv_hold_s) has passed."""
        expired = [rid for rid, (_, exp) in self._held.items() if exp <= now]
        for rid in expired:
            self.release_remote(rid, now)
        return expired

    # ---- LoRA adapters -----------------------------------------------------------------------------
    def add_lora(self, lora_id: int, now: float, at_start: bool = False) -> float:
        """Load an adapter from disk into host memory (vLLM's add_lora: a runtime load or a static module). The
        engine does it between steps, so it waits for the step in flight and delays the next one. Returns model
        seconds from `now` until the load is done (0 if the adapter is in host memory already, or `at_start`: a
        static module, loaded before the server serves)."""
        if lora_id in self._lora_cpu:
            self._lora_cpu.move_to_end(lora_id)
            return 0.0
        self._cache_lora(lora_id)
        if at_start:
            return 0.0
        start = max(now, self._lora_busy_until)
        if self._plan is not None:
            start = max(start, self._plan.start + self._plan.dur)
        self._lora_busy_until = start + self.config.lora_disk_s
        return self._lora_busy_until - now

    def has_lora(self, lora_id: int) -> tuple[bool, bool]:
        """Whether the adapter is in host memory and whether it is in a GPU slot."""
        return lora_id in self._lora_cpu, lora_id in self._lora_gpu

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """Adapter names with requests running (scheduled at least once) and waiting (never scheduled yet), in
        first-seen order: the labels of vLLM's vllm:lora_requests_info (vllm/v1/metrics/stats.py)."""
        running: set[str] = set()
        waiting: set[str] = set()
        for seq in self._seqs.values():
            name = seq.req.lora_name
            if name is not None:
                (running if seq.rec.first_scheduled is not None else waiting).add(name)
        order = self._lora_names
        return [n for n in order if n in running], [n for n in order if n in waiting]

    def _cache_lora(self, lora_id: int) -> None:
        cpu = self._lora_cpu
        cpu[lora_id] = None
        self.stats.lora_disk_loads += 1
        while len(cpu) > max(self.config.max_cpu_loras, self.max_loras):
            old, _ = cpu.popitem(last=False)    # evicted from host memory: out of its GPU slot too
            self._lora_gpu.pop(old, None)

    def _lora_step_cost(self, seqs: Any) -> tuple[float, bool]:
        """Model seconds a step with these requests spends on LoRA (slot loads, disk reads of evicted adapters,
        the batched LoRA kernels), and whether it loaded anything."""
        ids = {s.req.lora_id for s in seqs if s.req.lora_id}
        if not ids:
            return 0.0, False
        cfg = self.config
        cost = cfg.lora_step_s
        loaded = False
        gpu, cpu = self._lora_gpu, self._lora_cpu
        for lora_id in sorted(ids):
            if lora_id in gpu:
                gpu.move_to_end(lora_id)
                cpu.move_to_end(lora_id)
                continue
            if lora_id in cpu:
                cpu.move_to_end(lora_id)
            else:
                self._cache_lora(lora_id)
                cost += cfg.lora_disk_s
            gpu[lora_id] = None
            while len(gpu) > self.max_loras:
                gpu.popitem(last=False)
            self.stats.lora_activations += 1
            cost += cfg.lora_activate_s
            loaded = True
        return cost, loaded

    # ---- blocks -----------------------------------------------------------------------------------
    def _free(self, seq: _Seq) -> None:
        self._pool.release(seq.hashes, seq.num_blocks - len(seq.hashes))
        seq.hashes = []
        seq.num_blocks = 0

    def _preempt(self, seq: _Seq) -> None:
        """Recompute preemption: drop all KV, keep generated tokens, back to the front of WAITING."""
        self._running.remove(seq)
        self._free(seq)
        seq.num_computed = 0
        seq.no_count_below = 0
        seq.promote = True
        seq.rec.num_preemptions += 1
        self.stats.preemptions += 1
        self._push_waiting(seq, front=True)

    def _victim(self) -> _Seq:
        if self.priority:
            # Lowest priority = largest value; ties: newest arrival (vLLM's max(priority, arrival_time)).
            return max(self._running, key=lambda s: (s.req.priority, s.req.arrival, s.seq_no))
        return self._running[-1]

    # ---- stepping ---------------------------------------------------------------------------------
    def plan_step(self, now: float, max_iterations: int = 1) -> float | None:
        if self._plan is not None:
            raise RuntimeError("plan_step called while a step is in flight; call finish_step first")
        if self._held:
            self.expire_remote(now)
        if not self._running and not self.num_waiting:
            return None
        bs = self.block_size
        pool = self._pool
        budget = self.max_num_batched_tokens
        sched: dict[_Seq, int] = {}
        preempted: list[_Seq] = []
        swapped_out: list[_Seq] = []
        if self.reprioritize is not None and self.num_waiting:
            swapped_out = self._preempt_for_priority(now)
            max_iterations = 1          # budgets run out at iteration boundaries: look again after each one
        running = self._running
        # 1) running requests: decodes first, then partial prefills (vLLM V1 schedules RUNNING first).
        order = [s for s in running if s.num_tokens - s.num_computed == 1]
        if len(order) < len(running):
            order += [s for s in running if s.num_tokens - s.num_computed > 1]
        for seq in order:
            if seq.status != _RUNNING or budget <= 0:
                continue
            n_new = min(seq.num_tokens - seq.num_computed, budget)
            while True:
                need = -(-(seq.num_computed + n_new) // bs) - seq.num_blocks
                if need <= pool.num_free:
                    if need > 0:
                        pool.take(need)
                        seq.num_blocks += need
                    sched[seq] = n_new
                    budget -= n_new
                    break
                if self._drop_paused_kv():
                    continue            # a paused request's KV went first (it recomputes when it resumes)
                victim = self._victim()
                self._preempt(victim)
                preempted.append(victim)
                if victim in sched:
                    budget += sched.pop(victim)
                if victim is seq:
                    break
        # 2) admissions from WAITING (none in a step that preempted, as vLLM).
        admitted = 0
        if not preempted:
            admitted, budget = self._admit(now, budget, sched)
        if not sched:
            return None
        # 3) step time (profiles.Profile.step_time, inlined: hot path).
        P = B = C = 0
        A = 0.0
        for seq, n in sched.items():
            if n == 1 and seq.num_tokens - seq.num_computed == 1:
                B += 1
                C += seq.num_computed + 1
            else:
                P += n
                A += n * (seq.num_computed + n / 2)
        k_ctx = self._k_ctx
        dur = (self._c_step + max(self._t_w, self._k_p * P + self._c_d * B) + k_ctx * C + self._k_attn * A
               + self._c_admit * admitted)
        if self._speed is not None:
            self._f = self._speed.factor(now)
            dur *= self._f
        lora_loaded = False
        if self.max_loras:
            lora_s, lora_loaded = self._lora_step_cost(sched)
            dur += lora_s + max(0.0, self._lora_busy_until - now)
        plan = _Plan(now, list(sched.items()), swapped_out + preempted, dur)
        if max_iterations > 1 and P == 0 and not preempted and not admitted and len(sched) == len(running) \
                and not lora_loaded and self._lora_busy_until <= now:
            self._extend(plan, max_iterations, now)
        self._plan = plan
        return plan.dur

    def _preempt_for_priority(self, now: float) -> list[_Seq]:
        """Simulator only: re-prioritise every live request (`reprioritize`), then, while the best waiting request
        outranks the worst preemptible running one and cannot start beside it (the batch is at max_num_seqs or its
        prompt's blocks are not free), set that one aside with its KV kept (`_pause`). Returns them."""
        fn = self.reprioritize
        if fn is None or not self.priority:
            raise RuntimeError("re-prioritising needs scheduling_policy 'priority' and a reprioritize function")
        victims: list[_Seq] = []
        for seq in self._running:
            seq.req.priority, preemptible = fn(seq.req, seq.num_output, now)
            if preemptible:
                victims.append(seq)
        for seq in self._waiting_seqs():
            seq.req.priority = fn(seq.req, seq.num_output, now)[0]
        self._heap = [(s.req.priority, s.req.arrival, s.seq_no, s) for s in self._waiting_seqs()]
        heapq.heapify(self._heap)
        out: list[_Seq] = []
        bs = self.block_size
        while self._heap and victims:
            best = self._heap[0][3]
            worst = max(victims, key=lambda s: (s.req.priority, s.req.arrival, s.seq_no))
            if best.req.priority >= worst.req.priority:
                break
            need = -(-(best.num_tokens + 1) // bs)
            if len(self._running) < self.max_num_seqs and need <= self._pool.num_free:
                break
            self._pause(worst)
            victims.remove(worst)
            out.append(worst)
        return out

    def _pause(self, seq: _Seq) -> None:
        """Set a running request aside with its KV kept (SeaLLM's preemption over its unified KV cache): back to
        WAITING by its priority; it resumes where it was, unless its blocks are needed meanwhile (then it
        recomputes, as after vLLM's preemption)."""
        self._running.remove(seq)
        seq.paused = True
        seq.rec.num_preemptions += 1
        self.stats.preemptions += 1
        self._push_waiting(seq, front=True)

    def _drop_paused_kv(self) -> bool:
        """KV is short: free the blocks of the lowest-priority paused request, if any holds some."""
        held = [e[3] for e in self._heap if e[3].paused and e[3].num_blocks] if self.reprioritize else []
        if not held:
            return False
        seq = max(held, key=lambda s: (s.req.priority, s.req.arrival, s.seq_no))
        self._free(seq)
        seq.paused = False
        seq.num_computed = 0
        seq.no_count_below = 0
        seq.promote = True
        return True

    def _admit(self, now: float, budget: int, sched: dict[_Seq, int]) -> tuple[int, int]:
        bs = self.block_size
        pool = self._pool
        running = self._running
        skipped: list[_Seq] = []
        admitted = 0
        # vLLM's scheduler: adapters of the requests scheduled so far; a waiting request of another adapter is
        # skipped (it keeps its place) once max_loras distinct adapters are in the step.
        loras = {s.req.lora_id for s in sched if s.req.lora_id} if self.max_loras else None
        while budget > 0 and len(running) < self.max_num_seqs:
            seq = self._peek_waiting()
            if seq is None:
                break
            req = seq.req
            if loras is not None and req.lora_id and req.lora_id not in loras and len(loras) >= self.max_loras:
                skipped.append(self._pop_waiting())
                continue
            if seq.paused:          # resumes with its KV (reprioritize only)
                n_new = min(seq.num_tokens - seq.num_computed, budget)
                need = -(-(seq.num_computed + n_new) // bs) - seq.num_blocks
                if need > pool.num_free:
                    break
                if need > 0:
                    pool.take(need)
                    seq.num_blocks += need
                seq.paused = False
            elif req.remote_prefill and not seq.loaded:
                if req.kv_ready_at > now:
                    skipped.append(self._pop_waiting())   # vLLM skips requests waiting for remote KV
                    continue
                need = -(-req.prompt_len // bs)
                if need > pool.num_free:
                    break
                pool.take(need)
                seq.num_blocks = need
                seq.num_computed = req.prompt_len - 1     # NIXL: the last prompt token is recomputed locally
                seq.no_count_below = req.prompt_len
                seq.loaded = True
                self._pending_consumers -= 1
                n_new = 1
            else:
                hits = evictable = 0
                if self.caching and req.block_hashes:
                    hits, evictable = pool.lookup(req.block_hashes, (seq.num_tokens - 1) // bs)
                cached = hits * bs
                n_new = min(seq.num_tokens - cached, budget)
                need = -(-(cached + n_new) // bs) - hits
                if need + evictable > pool.num_free:
                    if self._drop_paused_kv():
                        continue    # a paused request's KV made room; look again
                    break
                if hits:
                    hit_hashes = req.block_hashes[:hits]
                    pool.touch(hit_hashes)
                    seq.hashes = list(hit_hashes)
                pool.take(need)
                seq.num_blocks = hits + need
                seq.num_computed = cached
                if self.caching:
                    self.stats.prefix_cache_queries += seq.num_tokens
                    self.stats.prefix_cache_hits += cached
                if seq.rec.first_scheduled is None:
                    seq.rec.num_cached_tokens = cached
            self._pop_waiting()
            if loras is not None and req.lora_id:
                loras.add(req.lora_id)
            seq.status = _RUNNING
            running.append(seq)
            if seq.rec.first_scheduled is None:
                seq.rec.first_scheduled = now
            sched[seq] = n_new
            budget -= n_new
            admitted += 1
        for seq in reversed(skipped):
            self._push_waiting(seq, front=True)
        return admitted, budget

    def _peek_waiting(self) -> _Seq | None:
        if self.priority:
            return self._heap[0][3] if self._heap else None
        return self._fifo[0] if self._fifo else None

    def _pop_waiting(self) -> _Seq:
        return heapq.heappop(self._heap)[3] if self.priority else self._fifo.popleft()

    def _extend(self, plan: _Plan, max_iterations: int, now: float) -> None:
        """Macro step: k identical-composition decode iterations; durations form an arithmetic series."""
        seqs = plan.sched
        k = max_iterations
        for seq, _ in seqs:
            k = min(k, seq.limit - seq.num_output)
        if k <= 1:
            return
        # Block boundaries: every extra block needed over k iterations must be free now (nothing else
        # allocates or frees during a pure-decode run), else shorten to the largest feasible k. While
        # requests wait, cached blocks must not be evicted either: losing a cached prefix can make a
        # waiting request admissible (it then touches fewer evictable blocks).
        free = self._pool.free_plain if self.caching and self.num_waiting else self._pool.num_free
        bs = self.block_size
        if self._extra_blocks(seqs, k, bs) > free:
            lo, hi = 1, k       # need(lo) <= free < need(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if self._extra_blocks(seqs, mid, bs) <= free:
                    lo = mid
                else:
                    hi = mid
            k = lo
            if k <= 1:
                return
        plan.k = k
        plan.a = plan.dur
        plan.d = self._k_ctx * len(seqs) * self._f   # one speed factor per macro step (tau >> its length)
        # Events that would change the composition at an iteration boundary: consumer KV ready, pin expiry.
        if self._pending_consumers or (self._held and self.num_waiting):
            limit = self.next_event_time()
            if limit is not None and limit > now:
                self._cut(plan, limit)
        plan.dur = plan.end_of(plan.k) - plan.start

    @staticmethod
    def _extra_blocks(seqs: list[tuple[_Seq, int]], m: int, bs: int) -> int:
        total = 0
        for seq, _ in seqs:
            extra = -(-(seq.num_computed + m) // bs) - seq.num_blocks
            if extra > 0:
                total += extra
        return total

    def _cut(self, plan: _Plan, t: float) -> None:
        """Shorten a macro plan to the first iteration boundary >= t (at least one iteration)."""
        if plan.k == 1 or plan.end_of(plan.k) <= t:
            return
        a, d, x = plan.a, plan.d, t - plan.start
        # Solve m*a + d*m*(m-1)/2 = x for m, then fix rounding by checking neighbours.
        if d > 0:
            b = a - d / 2
            m = math.ceil((-b + math.sqrt(b * b + 2 * d * x)) / d)
        else:
            m = math.ceil(x / a)
        m = max(1, min(plan.k, m))
        while m > 1 and plan.end_of(m - 1) >= t:
            m -= 1
        while m < plan.k and plan.end_of(m) < t:
            m += 1
        plan.k = m

    def truncate_step(self, t: float) -> float:
        """Cut the in-flight macro step at the first iteration boundary >= t; new duration from its start."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("no step in flight")
        if plan.k > 1:
            self._cut(plan, t)
            plan.dur = plan.end_of(plan.k) - plan.start
        return plan.dur

    def finish_step(self, now: float) -> list[StepEvent]:
        plan = self._plan
        if plan is None:
            raise RuntimeError("finish_step called without a planned step")
        self._plan = None
        k = plan.k
        stats = self.stats
        stats.iterations += k
        events = [StepEvent(s.req.request_id, preempted=True) for s in plan.preempted]
        end = plan.start + plan.dur
        first_end = plan.end_of(1)
        bs = self.block_size
        pool = self._pool
        any_finished = False
        for seq, n in plan.sched:
            if seq.status != _RUNNING:
                continue    # aborted (or preempted) after planning
            ev = StepEvent(seq.req.request_id)
            if not seq.reported_cache:
                seq.reported_cache = True
                ev.num_cached_tokens = seq.rec.num_cached_tokens
            if k > 1:
                extra = -(-(seq.num_computed + k) // bs) - seq.num_blocks
                if extra > 0:
                    pool.take(extra)
                    seq.num_blocks += extra
                n = k
                new = k
            else:
                prompt_len = seq.req.prompt_len
                lo = max(seq.num_computed, seq.no_count_below)
                hi = min(seq.num_computed + n, prompt_len)
                if hi > lo:
                    stats.prompt_tokens += hi - lo
                new = 1 if seq.num_computed + n == seq.num_tokens else 0
                if self.caching and seq.promote and seq.num_computed < prompt_len and seq.req.block_hashes:
                    self._promote(seq, seq.num_computed + n)
            seq.num_computed += n
            if new:
                if seq.num_output == 0:
                    ev.first_token = True
                    seq.rec.first_token = first_end
                seq.num_output += new
                seq.num_tokens += new
                seq.rec.num_output = seq.num_output
                stats.generation_tokens += new
                ev.new_tokens = new
                if seq.num_output >= seq.limit:
                    reason = "length" if seq.num_output >= seq.req.max_tokens or seq.req.remote_decode \
                        or seq.num_tokens >= self.max_model_len else "stop"
                    seq.status = _DONE
                    any_finished = True
                    if seq.req.remote_decode:
                        self._held[seq.req.request_id] = (seq, end + self.config.kv_hold_s)
                    else:
                        self._free(seq)
                    done = self._finish(seq, reason, end)
                    ev.finished, ev.finish_reason, ev.record = True, reason, done.record
            events.append(ev)
        if any_finished:
            self._running = [s for s in self._running if s.status == _RUNNING]
        return events

    def _promote(self, seq: _Seq, computed: int) -> None:
        """Register the request's newly computed full prompt blocks in the prefix cache."""
        hashes = seq.req.block_hashes
        upto = min(computed // self.block_size, len(hashes))
        pool = self._pool
        start = len(seq.hashes)
        while len(seq.hashes) < upto:
            h = hashes[len(seq.hashes)]
            if not pool.insert(h):
                seq.promote = False     # a twin block is cached already; keep ours private
                break
            seq.hashes.append(h)
        if self._kv_events is not None and len(seq.hashes) > start:
            self._kv_events.append(self._stored_event(seq.req, start, len(seq.hashes)))

    def _stored_event(self, req: SimRequest, start: int, end: int) -> BlockStored:
        """BlockStored for blocks start..end-1 of a request's prompt, as vLLM's cache_full_blocks emits it."""
        bs = self.block_size
        hashes = req.block_hashes
        tokens = tuple(req.token_ids[start * bs:end * bs]) if req.token_ids is not None else ()
        return BlockStored(tuple(hashes[start:end]), hashes[start - 1] if start else None, tokens, bs)

    def take_kv_events(self) -> list[Any]:
        """The KV-cache events recorded since the last call (vLLM publishes them once per engine step)."""
        events = self._kv_events
        if not events:
            return []
        out = list(events)
        events.clear()
        return out

    def _finish(self, seq: _Seq, reason: str, now: float) -> StepEvent:
        seq.status = _DONE
        self._seqs.pop(seq.req.request_id, None)
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        rec = seq.rec
        rec.finished = now
        rec.finish_reason = reason
        rec.num_output = seq.num_output
        return StepEvent(seq.req.request_id, finished=True, finish_reason=reason, record=rec)

    def drop_kv(self) -> int:
        """The KV cache is gone while requests stay (vLLM 0.33 sleep level >= 1 with mode=keep): every running
        request goes back to WAITING (front, in order) and recomputes its prompt and output so far when stepping
        resumes; the prefix cache is cleared. Call between steps. Returns how many requests lost their KV."""
        if self._plan is not None:
            raise RuntimeError("drop_kv called while a step is in flight")
        dropped = list(self._running)
        for seq in reversed(dropped):
            self._preempt(seq)
        self.reset_prefix_cache()
        return len(dropped)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached blocks (vLLM /reset_prefix_cache); refused (False) while blocks are in use."""
        pool = self._pool
        if pool.num_free != pool.total:
            return False
        pool.ref.clear()
        pool.evictable.clear()
        pool.free_plain = pool.total
        if self._kv_events is not None:
            self._kv_events.append(AllBlocksCleared())
        return True

    def snapshot(self) -> dict[str, Any]:
        """Debug view of the scheduler state."""
        return {
            "running": self.num_running, "waiting": self.num_waiting, "held": len(self._held),
            "free_blocks": self._pool.num_free, "cached_blocks": len(self._pool.ref),
            "kv_usage": self.kv_usage,
        }
