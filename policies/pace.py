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

A silence past those limits is a stall only when it is long relative to the fleet too, and only when the
exchange has somewhere better to go (`FleetPace.judge`; judged on the worker's pace alone, a fleet slowed
250x lost its streams to "not resumed (no other worker)" errors):

- paces learn from exchanges in flight, not only from finished ones: a silence of at least `notable` x its
  limit that the worker then ended itself (its next token came) is remembered for `live_window_s`
  (`note_late`), and raises that worker's limits to `factor` x the longest such silence;
- the fleet's limit is the upper median of the paced workers' own limits, and at least `factor` x the longest
  silence any worker recently ended itself: when the whole fleet slows down, every limit rises with it;
- a silence past both limits is given up only when another worker the stream could move to is progressing (it
  has nothing in flight, or its latest token came within `notable` x its own gap limit and x this worker's
  silence: peers that went quiet together are no better); otherwise the exchange is kept and judged again
  `recheck_s` later (the gateway's fixed `timeouts` stay the upper bound);
- the silence that counts is the worker's as a whole: an exchange is given up (and the worker ejected) only
  when no token came on any of its exchanges within the limit (a zombie, a frozen process); a worker feeding
  its other streams is working through its queue (a burst, a preempted request), not hung.

A zombie among progressing peers is thus cut at the same limit as before: its peers are progressing, and a
healthy fleet has no long silences to learn from.

A stalled or failing worker is ejected with Envoy's outlier-ejection backoff (`ejection_s`): the base ejection
time times the number of times it has been ejected, capped (envoyproxy.io docs, "Outlier detection",
base_ejection_time / max_ejection_time), and at most `max_ejected` workers of a pool out at once
(max_ejection_percent). Pure: the caller measures durations on its own clock and passes them in; the
gateway's relay (gateway/pipeline/relay.py) turns the limits into read timeouts.
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
    live_window_s: float = 60.0     # how long a silence a worker outlasted the limit with, then ended, counts
    recheck_s: float = 1.0          # a kept exchange (nowhere better to go) is judged again this often
    notable: float = 0.5            # a silence at least this fraction of its limit, ended by the worker, is
                                    # evidence of its current pace (note_late)



class WorkerPace:
    """The recent pace of one worker and the waits it may take before it is suspect."""

    __slots__ = ("settings", "_first", "_gaps", "_limits", "_stale", "last_token_at", "_late")

    def __init__(self, settings: PaceSettings) -> None:
        self.settings = settings
        self._first: deque[float] = deque(maxlen=settings.window)
        self._gaps: deque[float] = deque(maxlen=settings.window)
        self._limits = (settings.cold_first_s, settings.cold_gap_s)
        self._stale = 0  # samples since the limits were computed
        self.last_token_at: float | None = None  # the caller's clock: the latest token of any exchange here
        # silences outlasting the limit that the worker then ended itself, in flight: (when, first?, seconds)
        self._late: deque[tuple[float, bool, float]] = deque(maxlen=64)

    def note_late(self, silent_s: float, first: bool, now: float) -> None:
        """An exchange in flight got its first (`first`) or next token after `silent_s`, near or past its limit:
        the worker is slower than its pace said, not hung."""
        self._late.append((now, first, silent_s))

    def live_limits(self, now: float) -> tuple[float, float]:
        """(first-token, gap) limits from the silences this worker recently ended itself (0: none)."""
        horizon = now - self.settings.live_window_s
        while self._late and self._late[0][0] < horizon:
            self._late.popleft()
        first = gap = 0.0
        for _, is_first, silent in self._late:
            if is_first:
                first = max(first, silent)
            else:
                gap = max(gap, silent)
        k = self.settings.factor
        return k * first, k * gap

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


FLEET_CACHE_S = 0.25  # the fleet's limits are recomputed at most this often


class FleetPace:
    """WorkerPace per worker id. `unpaced`: workers whose silences are planned, not hangs (engines of shared hosts
    running Aegaeon's turns, gateway/control/turns.py: a stream waits a whole round of other models' turns); they have no
    pace limit, only the gateway's fixed timeouts."""

    def __init__(self, settings: PaceSettings, unpaced: Iterable[str] = ()) -> None:
        self.settings = settings
        self._workers: dict[str, WorkerPace] = {}
        self.unpaced = frozenset(unpaced)
        self._fleet: tuple[float, tuple[float, float]] = (-math.inf, (0.0, 0.0))  # (when, fleet_limits)

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

    def fleet_limits(self, now: float, fresh: bool = False) -> tuple[float, float]:
        """The fleet's (first-token, gap) limits: the upper median of the paced workers' own limits, and at least
        what any worker's recent silences in flight allow; (0, 0) while no worker has a pace. `fresh`: not the
        value computed up to FLEET_CACHE_S ago."""
        at, cached = self._fleet
        if not fresh and 0 <= now - at < FLEET_CACHE_S:   # judged for every kept exchange every recheck_s: not recomputed each time
            return cached
        firsts, gaps = [], []
        live_first = live_gap = 0.0
        for wid, p in self._workers.items():
            if wid in self.unpaced:
                continue
            lf, lg = p.live_limits(now)
            live_first, live_gap = max(live_first, lf), max(live_gap, lg)
            if p.paced:
                f, g = p.limits()
                firsts.append(f)
                gaps.append(g)
        self._fleet = (now, (max(_upper_median(firsts), live_first), max(_upper_median(gaps), live_gap)))
        return self._fleet[1]

    def progressing(self, worker_id: str, busy: bool, now: float, than_s: float = math.inf) -> bool:
        """Whether `worker_id` could take an exchange over from a worker quiet for `than_s`: nothing in flight
        there, or its latest token well within its own gap limit and that quiet (`notable` x the smaller: a peer
        that went quiet at the same moment, as a whole fleet slowing down does, is no better)."""
        if not busy:
            return True
        p = self._workers.get(worker_id)
        if p is None or p.last_token_at is None:
            return False
        return now - p.last_token_at < self.settings.notable * min(max(p.limits()[1], p.live_limits(now)[1]),
                                                                   than_s)

    def judge(self, worker_id: str, started: bool, silent_s: float, first_s: float | None, now: float,
              peers: Iterable[tuple[str, bool]]) -> float | None:
        """An exchange on `worker_id` has been silent `silent_s` (`started`: since its last token, else since it
        was sent; `first_s`: its first-token limit, None: the worker's pace), now `now` on the caller's clock.
        `peers`: (worker id, has exchanges in flight) of the workers it could move to. How much longer to wait
        before judging it again, or None: a stall, give the exchange up (and eject the worker). Module docstring."""
        if worker_id in self.unpaced:
            return math.inf
        p = self.of(worker_id)
        first, gap = p.limits()
        live_first, live_gap = p.live_limits(now)
        quiet = None if p.last_token_at is None else now - p.last_token_at
        than = silent_s if quiet is None else min(silent_s, quiet)
        better = any(self.progressing(w, busy, now, than) for w, busy in peers if w != worker_id)
        wait: float | None = 0.0
        for fresh in (False, True):   # a stall is confirmed on fresh fleet limits (a peer's token may just have come)
            fleet_first, fleet_gap = self.fleet_limits(now, fresh)
            # a first token takes an engine iteration too: never judged stricter than a gap (a paced one, not cold)
            limit = max(gap if started or p.paced else 0.0, live_gap, fleet_gap)
            if not started:
                limit = max(limit, first if first_s is None else first_s, live_first, fleet_first)
            wait = stall_verdict(silent_s, quiet, limit, better, self.settings.recheck_s)
            if wait is not None:
                break
        return wait


def stall_verdict(silent_s: float, worker_quiet_s: float | None, limit_s: float, better_peer: bool,
                  recheck_s: float) -> float | None:
    """The stall rule on an exchange silent `silent_s` on a worker whose latest token on any exchange came
    `worker_quiet_s` ago (None: never), against `limit_s` (the larger of the worker's and the fleet's limits):
    how long to wait before judging again, or None (a stall). The worker's silence as a whole counts: one that
    feeds its other streams is working through its queue, not hung. Past the limit, the exchange is kept while
    no better peer is progressing."""
    quiet = silent_s if worker_quiet_s is None else min(silent_s, worker_quiet_s)
    if quiet < limit_s:
        return limit_s - quiet
    return None if better_peer else recheck_s


def _upper_median(values: list[float]) -> float:
    """The upper of the two middle values (with two workers, the slower one's): 0 for none."""
    if not values:
        return 0.0
    values.sort()
    return values[len(values) // 2]


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


EJECT_AFTER_ERRORS = 5   # failed requests in a row that eject a worker (the gateway's resume.eject_after_errors)


def error_streak(in_row: int, ok: bool, limit: int) -> tuple[int, bool]:
    """Envoy's consecutive_5xx outlier detection: a worker's count of failed requests in a row after one more
    outcome, and whether that ejects it (`limit` failures in a row; 0: never). The count starts again after an
    ejection. The gateway (gateway/fleet/registry.py `note_outcome`) and the simulator's failing workers
    (simulator/worker_faults.py) count with it."""
    if ok:
        return 0, False
    in_row += 1
    if limit and in_row >= limit:
        return 0, True
    return in_row, False


__all__ = ["EJECT_AFTER_ERRORS", "EjectionSettings", "FleetPace", "PaceSettings", "WorkerPace", "ejection_s", "error_streak",
           "first_token_limit", "may_eject", "stall_verdict", "times_ejected"]
