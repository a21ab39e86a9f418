"""The admission queue of one model in the live gateway: the pure queue of policies/admission.py (its rules:
who waits, in what order a drain tries them, when each gives up) driven by asyncio.

A waiting request awaits a future. One drain at a time per model tries the waiting requests (placement and
reservation, `place`), resolves the futures of those it placed and fails the ones past their deadline with a
429. A drain runs when capacity may have been freed (`kick`: a release on this replica or announced by another,
a registry change), at the earliest time a policy asked to be retried or a deadline falls due, and every
`poll_s` while requests wait. Only a `kick` makes the requests that already found no worker worth a try again
(policies/admission.py, bounded decision cost): the other drains try those never tried or whose retry_at came.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.wire import errors
from policies.admission import AdmissionQueue, Waiting

log = logging.getLogger("fleetgate.admission")

# `place(handle) -> (placed, retry_at)`: True when the request got its worker(s) (or was answered otherwise);
# retry_at: when its policy asked to be tried again (None: when capacity changes).
PlaceFn = Callable[[Any], Awaitable[tuple[bool, float | None]]]


class ModelQueue:
    __slots__ = ("model", "queue", "place", "poll_s", "retry_after_s", "on_depth", "order", "drain_s", "_draining",
                 "_again", "_timer", "_timer_at")

    def __init__(self, model: str, queue: AdmissionQueue, place: PlaceFn, poll_s: float, retry_after_s: float,
                 on_depth: Callable[[int], None] | None = None,
                 order: Callable[[float], Callable[[Waiting], Any]] | None = None,
                 drain_s: Callable[[Any, float], float] | None = None) -> None:
        self.model = model
        # Retry-After of a request refused at its deadline: the predicted drain time (policies/shedding.py), given
        # its features and the clock; None: `retry_after_s`
        self.drain_s = drain_s
        self.order = order     # a service-aware priority's order (gateway/tenancy/services.py); None: arrival order
        self.queue = queue
        self.place = place
        self.poll_s = poll_s
        self.retry_after_s = retry_after_s
        self.on_depth = on_depth
        self._draining = False
        self._again = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def __len__(self) -> int:
        return len(self.queue)

    async def wait(self, handle: Any, feats: Any, retry_at: float | None, swap_s: float = 0.0,
                   prefill_s: float = 0.0) -> None:
        """Queue `handle` until a drain placed it (returns) or refused it (raises a 429 GatewayError). The
        caller checked `queue.full()`. A cancelled waiter (client gone) leaves the queue. `swap_s`: the time its
        model needs to be woken on a shared host, `prefill_s` its predicted prefill (policies/admission.py
        `queue_budget`)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        w = self.queue.enter(feats, time.time(), (handle, fut), swap_s, retry_at, prefill_s=prefill_s)
        self._depth()
        self.kick(changed=False)   # a request the caller has not tried yet (the queue was not empty) tries now
        self._arm()
        try:
            await fut
        finally:
            if w.queued:
                self.queue.remove(w)
                self._depth()

    def kick(self, changed: bool = True) -> None:
        """Capacity may have been freed (`changed`; False: only a request's own time came): drain now (or again
        right after the drain under way)."""
        if not len(self.queue):
            return
        if changed:
            self.queue.changed()
        if self._draining:
            self._again = True
            return
        self._draining = True
        asyncio.get_running_loop().create_task(self._drain(), name=f"fg-queue-{self.model}")

    async def _drain(self) -> None:
        try:
            while True:
                self._again = False
                now = time.time()
                for w in self.queue.expired(now):
                    _, fut = w.handle
                    if not fut.done():
                        ra = self.drain_s(w.features, now) if self.drain_s is not None else self.retry_after_s
                        fut.set_exception(errors.overloaded(self.model, ra, w.reason))
                for w in self.queue.candidates(self.order(now) if self.order is not None else None, now):
                    handle, fut = w.handle
                    if fut.done():          # its client left while it waited
                        self.queue.remove(w)
                        continue
                    try:
                        placed, retry_at = await self.place(handle)
                    except Exception as e:  # noqa: BLE001 - the waiter gets the error, the drain goes on
                        self.queue.remove(w)
                        if not fut.done():
                            fut.set_exception(e)
                        continue
                    self.queue.tried(w, placed, retry_at)
                    if placed and not fut.done():
                        fut.set_result(None)
                if not self._again:
                    break
        except Exception:  # a bug here must not leave requests waiting forever: they time out via the timer
            log.exception("admission queue drain of %s failed", self.model)
        finally:
            self._draining = False
            self._depth()
            self._arm()

    def _arm(self) -> None:
        """A timer at the next due time: a policy's retry_at, a deadline, or the next poll."""
        if not len(self.queue):
            return
        now = time.time()
        at = self.queue.due(now, self.poll_s)
        if self._timer is not None and self._timer_at <= at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = asyncio.get_running_loop().call_later(max(at - now, 0.0), self._on_timer)

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, math.inf
        if self._draining:
            self._again = True       # the drain under way re-arms when it ends
        else:
            self.kick(changed=False)

    def _depth(self) -> None:
        if self.on_depth is not None:
            self.on_depth(len(self.queue))

    def waiting(self) -> list[Waiting]:
        return list(self.queue)
