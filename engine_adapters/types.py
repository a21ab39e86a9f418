"""Plain data the engine adapters produce, shared with the gateway (which re-exports it where it stores it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineMetrics:
    """The engine-neutral numbers scraped from a worker's /metrics (parsed by an engine adapter)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0               # 0..1
    prefix_cache_queries: float = 0.0   # counters, tokens
    prefix_cache_hits: float = 0.0
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    generation_tokens: float = 0.0      # counter: output tokens generated (local autoscaler throughput)
    itl_sum: float = 0.0                # inter-token latency histogram _sum / _count (seconds, engine time)
    itl_count: float = 0.0
    scraped_at: float = 0.0             # unix time of the scrape
    # vLLM 0.33 vllm:engine_sleep_state (docs/reference/vllm-interface.md §6.1): awake, or paused /
    # weights_offloaded / discard_all; an engine without the series counts as awake
    sleep_state: str = "awake"
    # vllm:lora_requests_info, its newest series: the adapters in the running batch and waiting, and max_lora
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    max_lora: int | None = None


AWAKE = "awake"
PAUSED = "paused"   # level 0: our name; vLLM 0.32 exports no series for it (awake 0, every other state 0)
SLEEP_STATES = (AWAKE, PAUSED, "weights_offloaded", "discard_all")

__all__ = ["AWAKE", "PAUSED", "SLEEP_STATES", "EngineMetrics"]
