"""The admission queue: requests that found no placement wait here, in arrival order, until one is found or
their budget runs out. Pure: the caller passes its clock; the gateway (gateway/request/admission.py) and the
virtual-time simulator (simulator/cluster.py) drive this same object.

Rules (in one place, so the simulator and the gateway cannot drift):
- A new request tries to place itself at once only while fewer than `lookahead` requests wait (with a
  lookahead of 1: only when nobody waits, so it never overtakes one that waits).
- A drain tries the waiting requests in arrival order (or in a service-aware priority's order, when the caller
  gives one) and stops after `lookahead` of them found no worker
  (lookahead 1: head-of-line; larger: a head that does not fit, e.g. one an SLO-aware policy holds back until
  its own deadline, does not block the requests behind it).
- A request gives up at its deadline (`queue_budget`): an interactive request when it can no longer start in
  time, its TTFT target less its predicted prefill (`prefill_s`, policies/shedding.py: a request that starts
  later is certain to miss), else after the configured queue timeout. It is refused with 429.
  A request whose model must first be woken on a shared host (none of its engines awake) has the swap time its
  model needs added to that target (`swap_s`): the swap is part of its first token's time, as the pooled
  simulator prices it, so it waits for the swap and a 429 means that the fleet really is full.
- When to drain: whenever capacity may have been freed (a request finished, a worker joined) and at the
  earliest `retry_at` a policy asked for (Decision.retry_at: e.g. aladdin's risk-mode deadline), plus the
  earliest deadline (to refuse on time).
- Bounded decision cost: a request that found no worker is not tried again until something that can change the
  answer happened: capacity changed (`changed`: a completion, a released reservation, a worker joined; each
  bumps the queue's `epoch`) or its policy's `retry_at` came. A drain for any other reason (a poll, another
  request entering) skips it without asking the policy. Without this an SLO-aware policy re-checked every
  waiting request against every worker at every poll (bench/results/peers_sched.md counted ~10^5 worker checks
  for 800 requests); with it a waiting request costs at most one check per capacity change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from policies.types import CLASS_BATCH, RequestFeatures

DEFAULT_QUEUE_SIZE = 256          # waiting requests per model (gateway config limits.queue_size)
DEFAULT_QUEUE_TIMEOUT_S = 5.0     # the longest wait without a TTFT target (limits.queue_timeout_s)
# limits.queue_lookahead: how many waiting requests behind a head that fits nowhere may be placed. 16 is what the
# placement study's leave-one-trace-out protocol chose in every fold (bench/results/placement.md); policies that
# never refuse a request (round_robin, least_requests, ...) never queue, so it changes nothing for them.
DEFAULT_QUEUE_LOOKAHEAD = 16


def queue_budget(feats: RequestFeatures, now: float, timeout_s: float, swap_s: float = 0.0,
                 prefill_s: float = 0.0) -> tuple[float, str]:
    """How long the request may wait for a worker from `now`, and why that long: an interactive request with a
    TTFT target gives up when it can no longer start in time: the target (from its arrival, `feats.arrival`,
    on the caller's clock) less `prefill_s`, its own predicted prefill (policies/shedding.py), counted after
    `swap_s`, the time its model needs to be woken (0: an engine of it is awake); else the configured queue
    timeout."""
    if feats.slo_ttft_s is not None and feats.request_class != CLASS_BATCH:
        pre = min(max(prefill_s, 0.0), feats.slo_ttft_s)
        left = feats.slo_ttft_s - pre + max(swap_s, 0.0) - max(now - feats.arrival, 0.0)
        if left < timeout_s:
            swap = f" after its model's {swap_s:g} s swap" if swap_s > 0 else ""
            if pre > 0:
                return max(left, 0.0), (f"it could no longer start in time to meet its TTFT target of "
                                        f"{feats.slo_ttft_s * 1000:g} ms{swap} (its prefill takes {pre * 1000:.0f} ms)")
            return max(left, 0.0), f"its TTFT target of {feats.slo_ttft_s * 1000:g} ms{swap} passed while queued"
    return timeout_s, f"waited {timeout_s:g}s in the admission queue"


@dataclass(slots=True, eq=False)
class Waiting:
    """One queued request. `handle` is the caller's (an asyncio future in the gateway, the workload request in
    the simulator)."""

    features: RequestFeatures
    entered: float
    deadline: float
    reason: str                  # why it is refused at the deadline (the 429's message)
    handle: Any = None
    retry_at: float = math.inf   # the earliest time its policy asked to be retried (Decision.retry_at)
    queued: bool = field(default=True)
    tried_epoch: int = -1        # the queue's epoch when it last found no worker (-1: not tried yet)


class AdmissionQueue:
    """FIFO of the requests of one model that wait for a placement (see the module docstring)."""

    __slots__ = ("max_size", "lookahead", "timeout_s", "_items", "peak", "epoch", "skipped")

    def __init__(self, max_size: int = DEFAULT_QUEUE_SIZE, lookahead: int = DEFAULT_QUEUE_LOOKAHEAD,
                 timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S) -> None:
        if max_size < 0 or lookahead < 1 or timeout_s < 0:
            raise ValueError("max_size >= 0, lookahead >= 1 and timeout_s >= 0 are required")
        self.max_size = max_size
        self.lookahead = lookahead
        self.timeout_s = timeout_s
        self._items: dict[Waiting, None] = {}   # insertion-ordered; O(1) removal
        self.peak = 0
        self.epoch = 0       # bumped by `changed`: capacity may have been freed
        self.skipped = 0     # tries a drain saved (nothing changed for the request since its last one)

    def __len__(self) -> int:
        return len(self._items)

    def full(self) -> bool:
        return len(self._items) >= self.max_size

    def admits_directly(self) -> bool:
        """May a newly arrived request try to place itself before waiting?"""
        return len(self._items) < self.lookahead

    def enter(self, feats: RequestFeatures, now: float, handle: Any = None, swap_s: float = 0.0,
              retry_at: float | None = None, tried: bool | None = None, prefill_s: float = 0.0) -> Waiting:
        """Queue a request (the caller checked `full` first); its deadline from `queue_budget` (`swap_s`: the time
        its model needs to be woken, 0 when awake; `prefill_s`: its predicted prefill); `retry_at`: when the policy that could not place it asked to
        be tried again (None: when capacity changes); `tried`: the caller just tried to place it (None: it did
        when it has a `retry_at`), so a drain skips it until capacity changes."""
        budget, reason = queue_budget(feats, now, self.timeout_s, swap_s, prefill_s)
        w = Waiting(feats, now, now + budget, reason, handle, retry_at if retry_at is not None else math.inf)
        if tried or (tried is None and retry_at is not None):
            w.tried_epoch = self.epoch
        self._items[w] = None
        self.peak = max(self.peak, len(self._items))
        return w

    def remove(self, w: Waiting) -> None:
        if w.queued:
            w.queued = False
            del self._items[w]

    def expired(self, now: float) -> list[Waiting]:
        """Remove and return the requests whose deadline has passed (the caller refuses them)."""
        gone = [w for w in self._items if w.deadline <= now]
        for w in gone:
            self.remove(w)
        return gone

    def changed(self) -> None:
        """Capacity may have been freed (a completion, a released reservation, a worker joined): every waiting
        request is worth a try again."""
        self.epoch += 1

    def candidates(self, order: Callable[[Waiting], Any] | None = None, now: float | None = None
                   ) -> Iterator[Waiting]:
        """The waiting requests to try now, in arrival order (or sorted by `order`, smaller first: a service-aware
        priority, policies/service_priority.py). The caller `remove`s each one it placed before asking for the
        next; one still queued then counts as not placed, and after `lookahead` of those the drain ends. Given
        `now`, a request tried since the last `changed` whose `retry_at` has not come is skipped (the module
        docstring's bounded decision cost) and counts as a miss."""
        misses = 0
        items = list(self._items) if order is None else sorted(self._items, key=order)
        for w in items:
            if not w.queued:
                continue
            if now is not None and w.tried_epoch == self.epoch and w.retry_at > now:
                self.skipped += 1      # known not to fit: a miss like a tried one (head-of-line stays so)
                misses += 1
                if misses >= self.lookahead:
                    return
                continue
            yield w
            if w.queued:
                misses += 1
                if misses >= self.lookahead:
                    return

    def tried(self, w: Waiting, placed: bool, retry_at: float | None = None) -> None:
        """A drain tried `w`: placed, it leaves the queue; not placed, it waits on until `retry_at` (its
        Decision's; None: until capacity changes). Both drains (gateway/request/admission.py, simulator/cluster.py)
        report every candidate through here."""
        if placed:
            self.remove(w)
        else:
            w.retry_at = retry_at if retry_at is not None else math.inf
            w.tried_epoch = self.epoch

    def due(self, now: float, poll_s: float | None = None) -> float:
        """When the next drain should run without any capacity freed: `next_wake`, and within `poll_s` while
        requests wait (None: no polling)."""
        t = self.next_wake()
        return t if poll_s is None else min(t, now + poll_s)

    def next_wake(self) -> float:
        """The earliest time a drain is due without any capacity freed: a retry a policy asked for, or a
        deadline (math.inf: none)."""
        t = math.inf
        for w in self._items:
            t = min(t, w.retry_at, w.deadline)
        return t

    def __iter__(self) -> Iterator[Waiting]:
        return iter(list(self._items))
