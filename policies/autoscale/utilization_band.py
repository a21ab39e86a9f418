"""Baseline autoscalers: a utilization band (Llumnix-style) and static provisioning.

    ub = UtilizationBand(low=0.3, high=0.7, cooldown_s=60, min_workers=1, max_workers=16)
    desired, reason = ub.decide(utilization, current, now)      # +1 / -1 / hold

The band keeps the mean KV-cache utilisation of the fleet between two thresholds, adding or removing
one worker at a time with a cooldown, as the autoscalers Chiron compares against do (Chiron section 6:
"keeps average token utilization across all instances between a configurable threshold range by adding
and removing serving instances"; Llumnix adds and removes one instance at a time). Utilisation counts the
KV the queued requests will need as well ("virtual usage"), so a queue that the fleet cannot absorb reads
above 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def fleet_utilization(kv_usages: Sequence[float], kv_capacity_tokens: int, queued_tokens: float = 0.0) -> float:
    """Mean KV utilisation of the fleet plus queued demand: (sum used + queued) / (workers * capacity)."""
    if kv_capacity_tokens <= 0:
        raise ValueError("kv_capacity_tokens must be > 0")
    if not kv_usages:
        return math.inf if queued_tokens > 0 else 0.0
    return sum(kv_usages) / len(kv_usages) + queued_tokens / (len(kv_usages) * kv_capacity_tokens)


@dataclass(slots=True)
class UtilizationBand:
    low: float = 0.3
    high: float = 0.7
    cooldown_s: float = 60.0
    min_workers: int = 1
    max_workers: int = 64
    last_action: float = -math.inf

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError("need 0 <= low < high")
        if not 0 <= self.min_workers <= self.max_workers:
            raise ValueError("need 0 <= min_workers <= max_workers")

    def decide(self, utilization: float, current: int, now: float) -> tuple[int, str | None]:
        """Desired worker count and the reason for a change (None: hold)."""
        if current < self.min_workers:
            self.last_action = now
            return self.min_workers, "min"
        if current > self.max_workers:
            self.last_action = now
            return self.max_workers, "max"
        if now - self.last_action < self.cooldown_s:
            return current, None
        if utilization > self.high and current < self.max_workers:
            self.last_action = now
            return current + 1, "util_high"
        if utilization < self.low and current > self.min_workers:
            self.last_action = now
            return current - 1, "util_low"
        return current, None


@dataclass(frozen=True, slots=True)
class StaticProvisioning:
    """A fixed fleet: the desired count never changes."""

    workers: int

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise ValueError("workers must be >= 0")

    def decide(self, utilization: float, current: int, now: float) -> tuple[int, str | None]:
        return (self.workers, "static") if current != self.workers else (current, None)
