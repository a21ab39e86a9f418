"""The global autoscaler's FleetObservation, built in one place for the gateway (gateway/control/autoscaler.py `_gather`)
and the simulator (simulator/autoscale_sim.py `observe_fleet`). Pure; the clock is passed in.

Each caller measures its raw inputs its own way (the gateway samples its in-flight counts every `sample_s` and
merges every replica's load document; the simulator integrates exactly, event by event) and hands one `FleetTick`
per global tick to `ObservationBuilder.build`. Where the two used to define a quantity differently, the one kept:

- busy (interactive backpressure's numerator, workers' worth): the sum over active interactive + mixed workers of
  min(1, interactive requests in flight / cap), plus the interactive requests waiting for room divided by the
  median cap of the active workers. Both counts are time averages over the tick: a snapshot of a closed-loop
  burst's queue (full just before a dispatch, empty just after) moved the target by several workers from one
  tick to the next. A worker without a cap counts with `busy_cap`.
- arrival rate: interactive requests that arrived in the last `rate_window_s`, over that window (or the time since
  the start when shorter): demand, which Aladdin's rate fit (appendix E.2) relates to workers, rather than
  dispatches, which the fleet's own capacity limits.
- batch tokens/s: the mean of the per-tick rates while batch work exists (reset when there is none): a mean of
  rates needs no start time after a reset, where a sum over the window divided by the window would
  under-read the first ticks of a new batch.
- one worker's batch tokens/s: the batch pool's per-worker mean; else that of mixed workers whose in-flight count
  reached their cap during the tick (over the tick rather than at its last instant); else, as a last resort, the
  best single worker's rate in the window, so that the batch pool can be sized before any worker is full.
- batch output length: the mean and the sample standard deviation of finished batch requests once
  MIN_OUTPUT_SAMPLES have finished; before that, the length predictor's mean output length (every finished
  request teaches it) rather than a constant.
- placement shortfall: as the caller's placement step reports it (policies/aladdin.py `shortfall`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from policies.autoscale.global_ import POOL_BATCH, POOL_INTERACTIVE, POOL_MIXED, POOLS, FleetObservation

MIN_OUTPUT_SAMPLES = 20      # batch output length statistics from this many finished requests on
DEFAULT_BUSY_CAP = 16        # "busy" denominator of a worker without a cap (gateway config autoscale.busy_cap)


class WindowSum:
    """Sum of (time, value) samples over the last `window_s` seconds."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._q: deque[tuple[float, float]] = deque()
        self._sum = 0.0

    def add(self, t: float, v: float = 1.0) -> None:
        self._q.append((t, v))
        self._sum += v

    def total(self, now: float) -> float:
        q = self._q
        while q and q[0][0] <= now - self.window_s:
            self._sum -= q.popleft()[1]
        return self._sum if q else 0.0

    def mean(self, now: float) -> float | None:
        """Mean of the samples in the window (None if there are none)."""
        total = self.total(now)
        return total / len(self._q) if self._q else None

    def max(self, now: float) -> float | None:
        """Largest sample in the window (None if there are none)."""
        self.total(now)
        return max(v for _, v in self._q) if self._q else None


@dataclass(slots=True)
class OutputStats:
    """Output lengths of finished batch requests (cumulative): Chiron's O_i, as count, sum and sum of squares (they
    add up over gateway replicas)."""

    n: int = 0
    total: float = 0.0
    total_sq: float = 0.0

    def add(self, tokens: int) -> None:
        self.n += 1
        self.total += tokens
        self.total_sq += tokens * tokens


@dataclass(frozen=True, slots=True)
class WorkerTick:
    """One active worker (taking traffic, not draining) over one global tick."""

    id: str
    pool: str
    interactive: float                  # interactive requests in flight, time-averaged over the tick
    cap: int | None = None              # its per-worker cap now (None: `busy_cap`)
    tokens_per_s: float | None = None   # output tokens/s over the tick (engine counter); None: not measured
    full: bool = False                  # its in-flight count reached its cap during the tick


@dataclass(frozen=True, slots=True)
class FleetTick:
    """Everything the builder needs from one global tick, measured by the caller."""

    workers: Sequence[WorkerTick]
    pending: Mapping[str, int] = field(default_factory=dict)    # starting (cold start) per pool
    waiting: float = 0.0                   # interactive requests waiting for room, time-averaged over the tick
    arrivals: float = 0.0                  # interactive requests that arrived since the last tick
    queue: Sequence[tuple[float, int]] = ()    # batch queue: (deadline, requests)
    batch_inflight: int = 0                # batch requests running anywhere
    batch_tokens_per_s: float = 0.0        # batch output tokens/s the fleet made over the tick
    outputs: tuple[float, float, float] = (0.0, 0.0, 0.0)   # finished batch requests: count, sum, sum of squares
    predicted_output: float = 128.0        # the length predictor's mean output length (tokens)
    shortfall: float = 0.0                 # more workers the unplaceable requests need


def output_length(outputs: tuple[float, float, float], fallback: float) -> tuple[float, float]:
    """(mean, sample standard deviation) of finished batch requests' output tokens; (`fallback`, 0) before
    MIN_OUTPUT_SAMPLES of them."""
    n, total, total_sq = outputs
    if n < MIN_OUTPUT_SAMPLES:
        return fallback, 0.0
    mean = total / n
    return mean, math.sqrt(max(0.0, (total_sq - n * mean * mean) / (n - 1)))


def interactive_busy(workers: Sequence[WorkerTick], waiting: float, busy_cap: int = DEFAULT_BUSY_CAP) -> float:
    """Workers' worth of interactive + mixed workers busy with interactive work, waiting requests included."""
    busy = sum(min(1.0, w.interactive / (w.cap or busy_cap)) for w in workers
               if w.pool in (POOL_INTERACTIVE, POOL_MIXED))
    if waiting > 0:
        caps = [w.cap or busy_cap for w in workers]
        busy += waiting / (statistics.median(caps) if caps else busy_cap)
    return busy


class ObservationBuilder:
    """The windows behind a FleetObservation (arrival rate, batch throughput, per-worker throughput); `build` once
    per global tick."""

    def __init__(self, rate_window_s: float, throughput_window_s: float, busy_cap: int = DEFAULT_BUSY_CAP,
                 t0: float = 0.0) -> None:
        self.rate_window_s, self.throughput_window_s = rate_window_s, throughput_window_s
        self.busy_cap = busy_cap
        self.t0 = t0
        self._rate = WindowSum(rate_window_s)
        self._batch_tokens = WindowSum(throughput_window_s)      # per-tick fleet batch tokens/s
        self._batch_pool = WindowSum(throughput_window_s)        # per batch worker, tokens/s
        self._full_mixed = WindowSum(throughput_window_s)        # per full mixed worker, tokens/s
        self._best = WindowSum(throughput_window_s)              # the best single worker, tokens/s

    def build(self, tick: FleetTick, now: float) -> FleetObservation:
        self._rate.add(now, tick.arrivals)
        rate = self._rate.total(now) / max(1e-9, min(self.rate_window_s, now - self.t0))
        batch_rates = [w.tokens_per_s for w in tick.workers if w.pool == POOL_BATCH and w.tokens_per_s is not None]
        full_rates = [w.tokens_per_s for w in tick.workers
                      if w.pool == POOL_MIXED and w.full and w.tokens_per_s is not None]
        best = max((w.tokens_per_s for w in tick.workers if w.tokens_per_s is not None), default=0.0)
        if batch_rates:
            self._batch_pool.add(now, statistics.fmean(batch_rates))
        if best > 0:
            self._best.add(now, best)
        if tick.queue or tick.batch_inflight:          # measured while there is batch work, from its start
            self._batch_tokens.add(now, tick.batch_tokens_per_s)
            if full_rates:
                self._full_mixed.add(now, statistics.fmean(full_rates))
        else:
            self._batch_tokens = WindowSum(self.throughput_window_s)
            self._full_mixed = WindowSum(self.throughput_window_s)
        per_worker = self._batch_pool.mean(now) or self._full_mixed.mean(now) or self._best.max(now)
        mean, std = output_length(tick.outputs, tick.predicted_output)
        workers = dict.fromkeys(POOLS, 0)
        for w in tick.workers:
            workers[w.pool] = workers.get(w.pool, 0) + 1
        return FleetObservation(
            interactive_busy=interactive_busy(tick.workers, tick.waiting, self.busy_cap), workers=workers,
            pending={p: n for p, n in tick.pending.items() if n}, interactive_rate=rate, queue=tuple(tick.queue),
            batch_inflight=tick.batch_inflight, batch_tokens_per_s=self._batch_tokens.mean(now) or 0.0,
            worker_tokens_per_s=per_worker, output_mean=mean, output_std=std, placement_shortfall=tick.shortfall)
