"""Batch progress in the log: how far each running batch is, and a warning when one stops moving.

Every `every_s` (default 30 s) each in-progress batch that moved gets one line
    batch batch_x: 120/500 done (3 failed), 4.0 req/s, ~95 s left
and a batch whose finished count has not changed for `stall_s` (default 60 s) while requests are pending gets
one warning (once per stall; `moving again` when it resumes):
    batch batch_x stalled: no request finished for 60 s (380 pending, 0 running anywhere)
The batch runner calls `sweep` from its own periodic sweep (gateway/batch/runner.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.state.base import StateStore
    from gateway.state.jobs import QueueSnapshot

log = logging.getLogger("fleetgate.batch")


@dataclass(slots=True)
class _Seen:
    done: int
    moved_at: float       # last time `done` changed
    logged_at: float
    logged_done: int
    stalled: bool = False


class BatchProgressLog:
    def __init__(self, every_s: float = 30.0, stall_s: float = 60.0, check_s: float = 5.0) -> None:
        self.every_s = every_s
        self.stall_s = stall_s
        self.check_s = check_s  # read the batches' counts at most this often
        self._seen: dict[str, _Seen] = {}
        self._next = 0.0

    async def sweep(self, store: StateStore, snapshot: QueueSnapshot, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now < self._next:
            return
        self._next = now + self.check_s
        live = set()
        for doc in await store.list_batches():
            if doc.get("status") != "in_progress":
                continue
            bid = doc["id"]
            live.add(bid)
            s = await store.batch_stats(bid)
            self.observe(bid, s.completed + s.failed, s.failed, s.pending, snapshot.running, now)
        for bid in [b for b in self._seen if b not in live]:
            del self._seen[bid]

    def observe(self, batch_id: str, done: int, failed: int, pending: int, running: int, now: float) -> None:
        seen = self._seen.get(batch_id)
        if seen is None:
            self._seen[batch_id] = _Seen(done, now, now, done)
            return
        total = done + pending
        fields = {"batch": batch_id, "done": done, "failed": failed, "pending": pending}
        if done != seen.done:
            seen.done, seen.moved_at = done, now
            if seen.stalled:
                seen.stalled = False
                log.info("batch %s moving again: %d/%d done", batch_id, done, total, extra={"fields": fields})
        elif pending > 0 and not seen.stalled and now - seen.moved_at >= self.stall_s:
            seen.stalled = True
            log.warning("batch %s stalled: no request finished for %.0f s (%d pending, %d running anywhere)",
                        batch_id, now - seen.moved_at, pending, running, extra={"fields": fields})
        if now - seen.logged_at >= self.every_s and done != seen.logged_done:
            rate = (done - seen.logged_done) / (now - seen.logged_at)
            left = f", ~{pending / rate:.0f} s left" if rate > 0 else ""
            log.info("batch %s: %d/%d done (%d failed), %.1f req/s%s", batch_id, done, total, failed, rate, left,
                     extra={"fields": fields})
            seen.logged_at, seen.logged_done = now, done
