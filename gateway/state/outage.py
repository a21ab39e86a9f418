"""How the gateway's control loops report failures: a line when a failure starts, a reminder while it lasts,
a line when it ends; never a traceback per round.

A state store that cannot be reached (StoreUnavailableError) is the store's to report (RedisStore logs when
Redis goes, reminds while it stays away and says when it is back), so a loop says nothing about it. Any other
failure is logged with its traceback the first time, then counted; a reminder with the count comes at most
every `remind_s`, and one line when the loop runs cleanly again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator

from gateway.state.jobs import StoreUnavailableError

REMIND_S = 30.0


class LoopErrors:
    """Failure reporting for one control loop (see the module docstring)."""

    def __init__(self, log: logging.Logger, what: str, remind_s: float = REMIND_S) -> None:
        self.log = log
        self.what = what
        self.remind_s = remind_s
        self.failures = 0           # consecutive failures other than the store being away
        self._since = 0.0
        self._reminded = 0.0

    def failed(self, exc: BaseException) -> None:
        if isinstance(exc, StoreUnavailableError):
            return
        now = time.monotonic()
        self.failures += 1
        if self.failures == 1:
            self._since = self._reminded = now
            self.log.error("%s failed", self.what, exc_info=exc)
        elif now - self._reminded >= self.remind_s:
            self._reminded = now
            self.log.error("%s still failing: %d rounds in %.0f s (last: %s: %s)", self.what, self.failures,
                           now - self._since, type(exc).__name__, exc)

    def ok(self) -> None:
        if self.failures:
            self.log.warning("%s works again after %d failed round(s)", self.what, self.failures)
            self.failures = 0

    @contextlib.contextmanager
    def round(self) -> Iterator[None]:
        """`with errors.round(): ...` one round of a loop: a failure is reported, never raised (cancellation
        passes: it is not an Exception)."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - a control loop must survive anything
            self.failed(e)
        else:
            self.ok()


async def stop_task(task: asyncio.Task | None) -> None:
    """Cancel a loop's task and wait for it to end. The cancellation is repeated while the task runs on: on Python
    3.11 a cancel that lands as an `asyncio.timeout` inside the loop expires can be taken for the timeout (the
    loop's `suppress(TimeoutError)` then swallows it) and the loop goes on; a gateway's shutdown waited forever
    on such a batch-runner loop under load (seen in tests/test_gateway_replan.py teardowns)."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def quiet_loop(interval: float, fn: Callable[[], Awaitable[object]], log: logging.Logger, what: str) -> None:
    """Run `fn` every `interval` seconds forever, reporting failures through LoopErrors."""
    errors = LoopErrors(log, what)
    while True:
        await asyncio.sleep(interval)
        with errors.round():
            await fn()
