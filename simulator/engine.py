"""vLLM-V1-like engine model: continuous batching over a paged KV cache, stepped by any clock.

INTERFACE CONTRACT (the HTTP server in simulator/server.py and the virtual-time cluster simulator in
simulator/cluster.py both drive this class; keep these names and meanings):

    core = EngineCore(profile, config, seed=0)
    core.add(req, now)                  # enqueue a SimRequest (WAITING)
    core.abort(request_id, now)         # client went away: free its blocks, finish with "abort"
    dur = core.plan_step(now)           # schedule one iteration; seconds it takes (model time), or None if idle
    events = core.finish_step(now)      # call at plan time + dur: apply the iteration, return StepEvents
    core.has_work() -> bool
    core.num_running, core.num_waiting, core.kv_usage  (0..1), core.stats (EngineStats counters)

Only one step is in flight at a time: plan_step, then finish_step, then plan_step again.
All times are model seconds; a real-time driver sleeps dur / time_scale between the two calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(slots=True)
class StepEvent:
    """What one iteration did for one request."""

    request_id: str
    new_tokens: int = 0            # tokens generated this step (0 or 1 in this model)
    first_token: bool = False      # the first output token was produced in this step
    finished: bool = False
    finish_reason: str | None = None   # "stop" | "length" | "abort"
    num_cached_tokens: int = 0     # prefix-cache hit for this request (set on its first scheduled step)
    preempted: bool = False        # it was preempted (back to WAITING) in this step


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
