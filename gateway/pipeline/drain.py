"""Graceful drain: what the gateway does between SIGTERM and its exit.

A rolling upgrade (Kubernetes, Compose) sends SIGTERM, waits its grace period, then SIGKILLs. In between:

1. `begin()`: the gateway stops taking work. `/ready` answers 503 at once, so load balancers stop sending;
   `/health` (the liveness probe) stays 200, so the drain is not killed for it; a request that still arrives
   on the proxy routes gets a 503 with `Retry-After` and `Connection: close` (a clear answer a client retries
   elsewhere, not a reset). The listening socket stays open for that.
2. `wait(drain_timeout_s)`: requests in flight finish on their own (streams to their `[DONE]`).
3. `cut()`: those still running when the drain time is up are cancelled; the dispatcher ends each one as
   `end_request` says (a stream: an SSE error event then `[DONE]`; a request without an answer yet: a 503) and
   writes its access-log line as for any other request, then the process exits 0.

Why the hard-coded `timeout_graceful_shutdown=5` of uvicorn was not enough: uvicorn closes the listening socket
first (new clients get connection refused, which some do not retry) and after the timeout cancels the request
tasks, which ended streams mid-body with no `[DONE]`, no error event and no access-log line.
The server (gateway/server.py) drives the steps; the app (gateway/app.py) refuses and tracks requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from engine_adapters.openai_errors import sse_error_event
from gateway.wire.errors import GatewayError

if TYPE_CHECKING:
    from gateway.wire.results import ResponseState

DRAIN_MESSAGE = "The gateway is shutting down; retry the request."
STATUS_DRAINED = 503   # what the access log and metrics count for a request the drain ended
_POLL_S = 0.05


def draining_error(retry_after_s: float = 1.0) -> GatewayError:
    """The answer to a request that arrives, or had not started, while the gateway drains."""
    return GatewayError(503, DRAIN_MESSAGE, "service_unavailable_error", None, "shutting_down", retry_after_s)


class Drain:
    """The drain state of one gateway process (module docstring)."""

    def __init__(self) -> None:
        self.draining = False
        self.started_at: float | None = None   # time.monotonic() of begin()
        self._tasks: set[asyncio.Task] = set()   # requests in flight on the proxy routes
        self._cut: set[asyncio.Task] = set()     # ... that cut() cancelled

    def begin(self) -> None:
        if not self.draining:
            self.draining = True
            self.started_at = time.monotonic()

    @property
    def inflight(self) -> int:
        return len(self._tasks)

    @contextmanager
    def track(self) -> Iterator[None]:
        """Count the current task (one request) as in flight for its duration."""
        task = asyncio.current_task()
        if task is None:
            yield
            return
        self._tasks.add(task)
        try:
            yield
        finally:
            self._tasks.discard(task)
            self._cut.discard(task)

    async def wait(self, timeout_s: float) -> int:
        """Wait until no request is in flight, at most `timeout_s`; how many are still in flight."""
        deadline = time.monotonic() + timeout_s
        while self._tasks and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        return len(self._tasks)

    def cut(self) -> int:
        """Cancel every request still in flight (each ends itself, see `end_request`); how many."""
        for task in list(self._tasks):
            if task not in self._cut:
                self._cut.add(task)
                task.cancel(DRAIN_MESSAGE)
        return len(self._cut)

    def was_cut(self, task: asyncio.Task | None) -> bool:
        """Whether `task`'s cancellation is the drain's (the request is to be ended, not abandoned)."""
        return task is not None and task in self._cut


async def refuse(send, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:  # noqa: ANN001 - ASGI send
    """Answer a request with the drain's 503 (`Retry-After`, `Connection: close`): one that arrives while the
    gateway drains, or one the drain cut before its answer started."""
    err = draining_error()
    body = err.body()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [*err.headers(), (b"content-length", b"%d" % len(body)), (b"connection", b"close"),
                            *headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def end_request(send, state: ResponseState, headers: list[tuple[bytes, bytes]]) -> int:  # noqa: ANN001
    """End a request the drain cut: a 503 when the client has no answer yet; else, a stream still open, an
    error event and [DONE] (what vLLM sends when it aborts a stream). The status to count it under."""
    with contextlib.suppress(Exception):   # the client may be gone too
        if not state.started:
            state.started = state.ended = True
            await refuse(send, headers)
        elif not state.ended:
            state.ended = True
            await send({"type": "http.response.body", "more_body": False,
                        "body": sse_error_event(DRAIN_MESSAGE, "service_unavailable_error", "shutting_down")})
    return STATUS_DRAINED


__all__ = ["DRAIN_MESSAGE", "STATUS_DRAINED", "Drain", "draining_error", "end_request", "refuse"]
