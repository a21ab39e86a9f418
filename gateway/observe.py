"""What one request leaves behind for operators: its access-log line and its trace.

The dispatcher opens a `RequestRecord` per request (`RequestObserver.begin`, only when the access log or
tracing is on) and closes it with the outcome (`end`). In between the pipeline reports through module
functions that find the record in a context variable and return at once when there is none, so the hot
path pays one ContextVar lookup per call when both are off:

    note_placement(worker, reason, routing_s, prefill=None)   a policy placed the request (reservation held)
    note_queue(wait_s)                                        it waited this long in the admission queue
    headers = leg(kind, worker, headers)                      an upstream leg starts (returns the headers to
                                                              send: with `traceparent` when tracing)
    leg_failed(kind, detail)                                  that leg failed before the client saw a byte
    note_resume()                                             a broken stream was resumed on another worker

The record's fields are the access log's (gateway/access_log.py); the spans are gateway/tracing.py's.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.access_log import AccessLog
    from gateway.relay import RelayResult
    from gateway.tracing import RequestTrace, Tracing
    from policies.types import RequestFeatures

CURRENT: ContextVar[RequestRecord | None] = ContextVar("fleetgate_request", default=None)


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


def note_placement(worker: str, reason: str, routing_s: float, prefill: str | None = None) -> None:
    rec = CURRENT.get()
    if rec is None:
        return
    rec.worker, rec.reason, rec.routing_s, rec.prefill_worker = worker, reason, routing_s, prefill
    rec.placed_ns = time.time_ns()


def note_queue(wait_s: float) -> None:
    rec = CURRENT.get()
    if rec is not None:
        rec.queue_s = wait_s


def leg(kind: str, worker: str, headers: bytes) -> bytes:
    """An upstream leg (`upstream`, `prefill`, `decode`) to `worker` starts; returns the headers to send."""
    rec = CURRENT.get()
    if rec is None:
        return headers
    rec.attempts += 1
    if kind != "prefill":
        rec.worker = worker
    if rec.trace is None:
        return headers
    return rec.trace.leg(kind, worker, rec.attempts, headers)


def leg_failed(kind: str, detail: str) -> None:
    rec = CURRENT.get()
    if rec is None:
        return
    rec.errors.append(kind)
    if rec.trace is not None:
        rec.trace.leg_failed(kind, detail)


def note_resume() -> None:
    rec = CURRENT.get()
    if rec is None:
        return
    rec.resumes += 1
    if rec.trace is not None:
        rec.trace.event("resume", {"fleetgate.resumes": rec.resumes})


class RequestObserver:
    """Access log and/or tracing for every proxied request; build it only when one of them is on."""

    def __init__(self, access_log: AccessLog | None, tracing: Tracing | None) -> None:
        self.access_log = access_log
        self.tracing = tracing

    @staticmethod
    def make(access_log: AccessLog | None, tracing: Tracing | None) -> RequestObserver | None:
        return RequestObserver(access_log, tracing) if access_log is not None or tracing is not None else None

    def begin(self, request_id: str, route: str, client_headers: list[tuple[bytes, bytes]]) -> RequestRecord:
        rec = RequestRecord(request_id, route, time.perf_counter(), time.time_ns())
        if self.tracing is not None:
            rec.trace = self.tracing.begin(rec, client_headers)
        CURRENT.set(rec)
        return rec

    def end(self, rec: RequestRecord, model: str | None, policy: str, status: int,
            feats: RequestFeatures | None, result: RelayResult | None) -> None:
        CURRENT.set(None)
        rec.model, rec.policy = model, policy or None
        total_s = time.perf_counter() - rec.t0
        if rec.trace is not None:
            rec.trace.end(rec, status, feats, result, total_s)
        if self.access_log is not None:
            self.access_log.emit(rec, status, feats, result, total_s)


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

