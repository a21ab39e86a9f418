"""The request observer: the access log and tracing of every proxied request, as a request hook.

The dispatcher opens the request's record (`begin`, gateway/ops/observe.py `RequestRecord`) into its context when
it arrives; the observer hears its placement (`placed`) and closes the record with the outcome (`finished`):
the access-log line (gateway/ops/access_log.py) and the trace's end (gateway/ops/tracing.py). Built only when one of
them is on (`make`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gateway.ops.observe import AccessLog, RequestRecord, Tracing, note_placement
from gateway.request.hooks import RequestHook

if TYPE_CHECKING:
    from gateway.fleet.registry import WorkerState
    from gateway.request.context import Outcome, RequestContext


class RequestObserver(RequestHook):
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
        return rec

    # --- request hooks (gateway/request/hooks.py) ----------------------------------------------------------------
    def placed(self, ctx: RequestContext, worker: WorkerState) -> None:
        d = ctx.decision
        note_placement(ctx.record, worker.id, d.reason if d is not None else "", ctx.routing_s,
                       ctx.prefill.id if ctx.prefill is not None else None)

    def finished(self, ctx: RequestContext, outcome: Outcome) -> None:
        rec = ctx.record
        if rec is None:
            return
        rec.model, rec.policy = outcome.model, outcome.policy or None
        total_s = time.perf_counter() - rec.t0
        if rec.trace is not None:
            rec.trace.end(rec, outcome.status, outcome.feats, outcome.result, total_s)
        if self.access_log is not None:
            self.access_log.emit(rec, outcome.status, outcome.feats, outcome.result, total_s)
