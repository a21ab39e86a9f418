"""Hung-worker detection: how long a worker may stay silent, judged against its own recent pace.

A worker is suspect when its first token, or its next token, is later than `factor` times what it has recently
needed (the p99 over a window of recent requests), never less than a floor; not after fixed 60-300 s timeouts.
Two paces per worker:

- first token: the wait from sending a request to its first output token (queueing and prefill included);
- gap: per request, its longest wait between two output tokens (so one sample per request, not per token:
  the relay only keeps a running maximum on the hot path).

Until `min_samples` requests have been seen on a worker, its limits are the `cold_*` values (a new worker
has no pace yet), unless its first token can be predicted:

- a request that has not started (no first token, or a P/D prefill leg with no answer yet) is judged against
  its predicted time to first token on that worker, the prefill of its prompt behind the prompts still
  waiting there, from the worker profile's performance model (`first_token_limit`): max(floor, k x
  predicted), and never less than the worker's own recent pace allows. Only workers whose profile the caller
  knows get a prediction; the others keep the cold limit.

A stalled or failing worker is ejected with Envoy's outlier-ejection backoff (`ejection_s`): the base ejection
time times the number of times it has been ejected, capped (envoyproxy.io docs, "Outlier detection",
base_ejection_time / max_ejection_time), and at most `max_ejected` workers of a pool out at once
(max_ejection_percent). Pure: the caller measures durations on its own clock and passes them in; the
gateway's relay (gateway/relay.py) turns the limits into read timeouts.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PaceSettings:
    factor: float = 4.0             # k: a wait longer than k x the recent p99 is a stall
    gap_floor_s: float = 2.0        # never suspect a gap shorter than this
    first_floor_s: float = 5.0      # never suspect a first-token wait shorter than this
    cold_gap_s: float = 30.0        # limits while the worker has too few samples
    cold_first_s: float = 60.0
    window: int = 256               # recent requests remembered per worker
    min_samples: int = 8
    quantile: float = 0.99


class WorkerPace:
    """The recent pace of one worker and the waits it may take before it is suspect."""

    __slots__ = ("settings", "_first", "_gaps", "_limits", "_stale")

    def __init__(self, settings: PaceSettings) -> None:
        self.settings = settings
        self._first: deque[float] = deque(maxlen=settings.window)
        self._gaps: deque[float] = deque(maxlen=settings.window)
        self._limits = (settings.cold_first_s, settings.cold_gap_s)
        self._stale = 0  # samples since the limits were computed

    def observe(self, first_token_s: float | None, max_gap_s: float | None) -> None:
        """One finished request: its wait for the first token and its longest gap between tokens (None: no
        such measure, e.g. fewer than two tokens)."""
        if first_token_s is not None and first_token_s >= 0:
            self._first.append(first_token_s)
        if max_gap_s is not None and max_gap_s >= 0:
            self._gaps.append(max_gap_s)
        self._stale += 1
        # a p99 over <= 256 samples costs ~20 us: recompute every 16 requests, not on every one
        if self._stale >= 16 or len(self._first) <= self.settings.min_samples:
            self._limits = self._compute()
            self._stale = 0

    def limits(self) -> tuple[float, float]:
        """(first-token limit, gap limit) in seconds."""
        return self._limits

    @property
    def paced(self) -> bool:
        """Enough samples for a pace of its own (else the limits are the cold ones)."""
        return len(self._first) >= self.settings.min_samples

    def _compute(self) -> tuple[float, float]:
        s = self.settings
        first = _limit(self._first, s, s.first_floor_s, s.cold_first_s)
        gap = _limit(self._gaps, s, s.gap_floor_s, s.cold_gap_s)
        return first, gap


def _limit(samples: deque[float], s: PaceSettings, floor: float, cold: float) -> float:
    if len(samples) < s.min_samples:
        return cold
    return max(floor, s.factor * quantile(samples, s.quantile))


def quantile(samples: deque[float], q: float) -> float:
    """numpy.quantile's default (linear interpolation between the closest ranks) from the top of the sample only:
    a p99 over 256 samples needs the 4 largest, ~6x cheaper than building an array for numpy (~120 us)."""
    n = len(samples)
    pos = q * (n - 1)
    lo = math.floor(pos)
    top = heapq.nlargest(n - lo, samples)   # descending: top[-1] is rank lo, top[-2] rank lo + 1
    a = top[-1]
    b = top[-2] if len(top) > 1 else a
    return a + (b - a) * (pos - lo)


class FleetPace:
    """WorkerPace per worker id. `unpaced`: workers whose silences are planned, not hangs (engines of shared hosts
    running Aegaeon's turns, gateway/turns.py: a stream waits a whole round of other models' turns); they have no
    pace limit, only the gateway's fixed timeouts."""

    def __init__(self, settings: PaceSettings, unpaced: Iterable[str] = ()) -> None:
        self.settings = settings
        self._workers: dict[str, WorkerPace] = {}
        self.unpaced = frozenset(unpaced)

    def of(self, worker_id: str) -> WorkerPace:
        p = self._workers.get(worker_id)
        if p is None:
            p = self._workers[worker_id] = WorkerPace(self.settings)
        return p

    def limits(self, worker_id: str) -> tuple[float, float]:
        if worker_id in self.unpaced:
            return math.inf, math.inf
        p = self._workers.get(worker_id)
        return p.limits() if p is not None else (self.settings.cold_first_s, self.settings.cold_gap_s)

    def first_limit(self, worker_id: str, predicted_s: float | None) -> float:
        """How long a request that has not started may wait on `worker_id` for its first token (or a prefill
        leg for its answer), given its predicted time to first token there (None: no prediction)."""
        if worker_id in self.unpaced:
            return math.inf
        p = self._workers.get(worker_id)
        paced = p.limits()[0] if p is not None and p.paced else None
        return first_token_limit(predicted_s, paced, self.settings)

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)


def first_token_limit(predicted_s: float | None, paced_s: float | None, s: PaceSettings) -> float:
    """The stall limit of a request that has not started: max(first_floor_s, factor x predicted_s), and at
    least `paced_s` (the worker's own pace limit, None while it has none); without a prediction the pace limit,
    else `cold_first_s`."""
    if predicted_s is not None and predicted_s >= 0 and math.isfinite(predicted_s):
        limit = max(s.first_floor_s, s.factor * predicted_s)
        return limit if paced_s is None else max(limit, paced_s)
    return paced_s if paced_s is not None else s.cold_first_s


@dataclass(frozen=True, slots=True)
class EjectionSettings:
    """Envoy's outlier-ejection backoff (envoyproxy.io docs, "Outlier detection")."""

    base_s: float = 10.0        # base_ejection_time: the first ejection's length
    max_s: float = 300.0        # max_ejection_time: no ejection longer than this
    max_fraction: float = 0.75  # max_ejection_percent / 100: of a pool, at least one worker may be out


def ejection_s(times_ejected: int, s: EjectionSettings) -> float:
    """How long the `times_ejected`-th ejection (1: the first) keeps a worker out: base x n, capped."""
    return min(s.max_s, s.base_s * max(1, times_ejected))


def times_ejected(previous: int, healthy_for_s: float, s: EjectionSettings) -> int:
    """The ejection count of a worker ejected again after `healthy_for_s` back in rotation: Envoy lowers the
    multiplier by one for every base ejection time the worker stayed healthy, then counts this ejection."""
    if s.base_s <= 0 or healthy_for_s == math.inf:
        return previous + 1 if healthy_for_s != math.inf else 1
    return max(0, previous - int(healthy_for_s // s.base_s)) + 1


def may_eject(ejected: int, pool: int, s: EjectionSettings) -> bool:
    """Whether one more of a pool of `pool` workers may be ejected while `ejected` of them are out: at most
    `max_fraction` of the pool, but one always may (Envoy ejects at least one host whatever the percentage)."""
    return ejected == 0 or ejected + 1 <= s.max_fraction * pool


__all__ = ["EjectionSettings", "FleetPace", "PaceSettings", "WorkerPace", "ejection_s", "first_token_limit",
           "may_eject", "times_ejected"]
