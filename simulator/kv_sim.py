"""The exact prefix-cache view in virtual time: simulated engines' KV events feed a KvIndex synchronously.

In the live gateway, engines publish KV events over ZMQ and gateway/fleet/kv_events.py folds them into a
`policies.kv_index.KvIndex`. In `ClusterSim` there are no sockets: after every engine step the cluster hands
the step's events to its `on_kv_events` hooks, and `SimKvView` (one of them) applies them to the same index
class, so a policy such as `precise_prefix` sees the same kind of view in both. The view is exact up to the
step boundary, like the live one up to its network lag. Block keys are the workload's (WorkloadRequest.
prefix_blocks), which the engines cache under, so no hashing is needed here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from policies.kv_index import KvIndex
from policies.types import NO_CACHED_PREFIX
from simulator.engine import EngineConfig


class SimKvView:
    def __init__(self, block_size: int, max_blocks: int = 10_000_000) -> None:
        self.block_size = block_size
        self.index = KvIndex(block_size, max_blocks)
        self.events = 0

    @staticmethod
    def wanted(policy: Any) -> bool:
        """Policies that read RequestFeatures.cached_prefix_tokens declare `needs_kv_blocks = True`."""
        return bool(getattr(policy, "needs_kv_blocks", False))

    def engine_config(self, config: EngineConfig | None) -> EngineConfig:
        """The engines must record KV events for the view to exist."""
        return replace(config or EngineConfig(), kv_events=True)

    def on_events(self, sim: Any, worker_id: str, events: list[Any], now: float) -> None:
        self.events += len(events)
        self.index.apply(worker_id, events)

    def cached_prefix(self, prefix_blocks: tuple[int, ...], prompt_tokens: int) -> Any:
        """RequestFeatures.cached_prefix_tokens for one request (vLLM never serves the last prompt token
        from cache, so at most (prompt_tokens - 1) // block_size blocks count)."""
        if not prefix_blocks:
            return NO_CACHED_PREFIX
        return self.index.view(prefix_blocks, (prompt_tokens - 1) // self.block_size)

    def cached_tokens(self, worker_id: str, block_hashes: tuple[int, ...]) -> int:
        return self.index.cached_tokens(worker_id, block_hashes)
