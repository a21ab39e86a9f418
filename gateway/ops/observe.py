"""What one request leaves behind for operators: its access-log line and its trace.

The request observer (gateway/pipeline/observer.py) opens a `RequestRecord` per request, only when the access log or
tracing is on, into the request's context (`RequestContext.record`, gateway/request/context.py) and closes it with the
outcome. In between the pipeline reports through module functions given that record; they return at once when
it is None, so the hot path pays one test per call when both are off:

    note_placement(rec, worker, reason, routing_s, prefill)   a policy placed the request (reservation held)
    note_queue(rec, wait_s)                                   it waited this long in the admission queue
    headers = leg(rec, kind, worker, headers)                 an upstream leg starts (returns the headers to
                                                              send: with `traceparent` when tracing)
    leg_failed(rec, kind, detail)                             that leg failed before the client saw a byte
    note_resume(rec)                                          a broken stream was resumed on another worker

The record's fields are the access log's (gateway/ops/access_log.py); the spans are gateway/ops/tracing.py's. Both
import this module; it names them only by the Protocols below, so neither is imported here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from gateway.wire.results import RelayResult
    from policies.types import RequestFeatures

class RequestTrace(Protocol):
    """One request's spans (gateway/ops/tracing.py's `RequestTrace`), as the record reports to them."""

    def leg(self, kind: str, worker: str, attempt: int, headers: bytes) -> bytes: ...
    def leg_failed(self, kind: str, detail: str) -> None: ...
    def event(self, name: str, attributes: dict[str, Any]) -> None: ...
    def end(self, rec: RequestRecord, status: int, feats: RequestFeatures | None, result: RelayResult | None,
            total_s: float) -> None: ...


class Tracing(Protocol):
    """Where a request's spans begin (gateway/ops/tracing.py's `Tracing`)."""

    def begin(self, rec: RequestRecord, client_headers: list[tuple[bytes, bytes]]) -> RequestTrace: ...


class AccessLog(Protocol):
    """Where a finished request's line goes (gateway/ops/access_log.py's `AccessLog`)."""

    def emit(self, rec: RequestRecord, status: int, feats: RequestFeatures | None, result: RelayResult | None,
             total_s: float) -> None: ...


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    route: str
    t0: float                      # perf_counter() at arrival
    wall_ns: int                   # time.time_ns() at arrival
    key: str | None = None         # the API key's name (filled by the tenants work when keys have names)
    model: str | None = None
    policy: str | None = None
    worker: str | None = None
    prefill_worker: str | None = None
    reason: str = ""
    routing_s: float = 0.0
    placed_ns: int = 0
    queue_s: float | None = None
    attempts: int = 0              # upstream legs started (P/D: decode legs and prefill legs)
    resumes: int = 0
    errors: list[str] = field(default_factory=list)
    trace: RequestTrace | None = None


def note_placement(rec: RequestRecord | None, worker: str, reason: str, routing_s: float,
                   prefill: str | None = None) -> None:
    if rec is None:
        return
    rec.worker, rec.reason, rec.routing_s, rec.prefill_worker = worker, reason, routing_s, prefill
    rec.placed_ns = time.time_ns()


def note_queue(rec: RequestRecord | None, wait_s: float) -> None:
    if rec is not None:
        rec.queue_s = wait_s


def leg(rec: RequestRecord | None, kind: str, worker: str, headers: bytes) -> bytes:
    """An upstream leg (`upstream`, `prefill`, `decode`) to `worker` starts; returns the headers to send."""
    if rec is None:
        return headers
    rec.attempts += 1
    if kind != "prefill":
        rec.worker = worker
    if rec.trace is None:
        return headers
    return rec.trace.leg(kind, worker, rec.attempts, headers)


def leg_failed(rec: RequestRecord | None, kind: str, detail: str) -> None:
    if rec is None:
        return
    rec.errors.append(kind)
    if rec.trace is not None:
        rec.trace.leg_failed(kind, detail)


def note_resume(rec: RequestRecord | None) -> None:
    if rec is None:
        return
    rec.resumes += 1
    if rec.trace is not None:
        rec.trace.event("resume", {"fleetgate.resumes": rec.resumes})


def result_tokens(result: RelayResult | None) -> tuple[int | None, int | None]:
    """(prompt, completion) tokens of a finished request: the usage block, else the streamed count."""
    if result is None:
        return None, None
    if result.usage is not None:
        return result.usage.prompt_tokens, result.usage.completion_tokens
    return None, result.tokens or None


def ttft_s(rec: RequestRecord, result: RelayResult | None) -> float | None:
    if result is None or result.first_token_at is None:
        return None
    return result.first_token_at - rec.t0

