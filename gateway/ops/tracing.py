"""OpenTelemetry traces of proxied requests (optional: `pip install 'fleetgate[tracing]'`, config `tracing:`).

One trace per request, as a child of the client's `traceparent` when it sent one:

    POST /v1/chat/completions      (server span: model, policy, status, tokens, ttft, request id)
    |- admission                   arrival -> placement: body, parsing, the admission queue (queue_wait_s)
    |- placement                   the policy's decision: policy, worker, reason, prefill worker
    |- upstream upstream|prefill|decode  (client span per leg: worker, attempt; error status when it failed)
    `- event `resume`              a broken stream resumed elsewhere

Each upstream leg carries its own W3C `traceparent` to the worker (vLLM reads it with
`--otlp-traces-endpoint`, so the engine's spans join the same trace); the client's own traceparent is not
forwarded as is. Export: OTLP over HTTP to `tracing.otlp_endpoint`, batched; tests hand in an exporter.
The provider is the gateway's own (never the process-global one), so several gateways share a process.

Off (the default) nothing here is imported and the hot path only finds no record (gateway/ops/observe.py).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.config import TracingConfig
    from gateway.ops.observe import RequestRecord
    from gateway.wire.results import RelayResult
    from policies.types import RequestFeatures

_TRACE_HEADERS = re.compile(rb"(?im)^(?:traceparent|tracestate):[^\r\n]*\r\n")
INSTALL_HINT = "tracing needs the OpenTelemetry SDK: pip install 'fleetgate[tracing]'"


class Tracing:
    def __init__(self, cfg: TracingConfig, exporter: Any = None) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:  # pragma: no cover - depends on the install
            raise RuntimeError(f"{INSTALL_HINT} ({e})") from None
        self.provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}),
                                       sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
        if exporter is not None:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        elif cfg.otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self.provider.add_span_processor(BatchSpanProcessor(
                OTLPSpanExporter(endpoint=cfg.otlp_endpoint, headers=dict(cfg.headers), timeout=cfg.timeout_s)))
        self.tracer = self.provider.get_tracer("fleetgate")
        self.propagator = TraceContextTextMapPropagator()

    def begin(self, rec: RequestRecord, client_headers: list[tuple[bytes, bytes]]) -> RequestTrace:
        return RequestTrace(self, rec, client_headers)

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes the batch processor


class RequestTrace:
    """The spans of one request; created at arrival, closed by `end`."""

    __slots__ = ("t", "root", "ctx", "open_leg")

    def __init__(self, tracing: Tracing, rec: RequestRecord, client_headers: list[tuple[bytes, bytes]]) -> None:
        from opentelemetry.trace import SpanKind, set_span_in_context

        self.t = tracing
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in client_headers
                   if k in (b"traceparent", b"tracestate")}
        parent = tracing.propagator.extract(carrier) if carrier else None
        self.root = tracing.tracer.start_span(
            f"POST {rec.route}", context=parent, kind=SpanKind.SERVER, start_time=rec.wall_ns,
            attributes={"http.request.method": "POST", "url.path": rec.route, "fleetgate.request_id": rec.request_id})
        self.ctx = set_span_in_context(self.root)
        self.open_leg: Any = None

    def leg(self, kind: str, worker: str, attempt: int, headers: bytes) -> bytes:
        from opentelemetry.trace import SpanKind, set_span_in_context

        self._close_leg()
        span = self.t.tracer.start_span(f"upstream {kind}", context=self.ctx, kind=SpanKind.CLIENT,
                                        attributes={"fleetgate.leg": kind, "fleetgate.worker": worker,
                                                    "fleetgate.attempt": attempt})
        self.open_leg = span
        carrier: dict[str, str] = {}
        self.t.propagator.inject(carrier, context=set_span_in_context(span))
        extra = "".join(f"{k}: {v}\r\n" for k, v in carrier.items()).encode("latin-1")
        return _TRACE_HEADERS.sub(b"", headers) + extra

    def leg_failed(self, kind: str, detail: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        span, self.open_leg = self.open_leg, None
        if span is not None:
            span.set_attribute("fleetgate.error.kind", kind)
            span.set_status(Status(StatusCode.ERROR, detail))
            span.end()

    def event(self, name: str, attributes: dict[str, Any]) -> None:
        self.root.add_event(name, attributes)

    def _close_leg(self, status: int | None = None) -> None:
        span, self.open_leg = self.open_leg, None
        if span is not None:
            if status is not None:
                span.set_attribute("http.response.status_code", status)
            span.end()

    def end(self, rec: RequestRecord, status: int, feats: RequestFeatures | None, result: RelayResult | None,
            total_s: float) -> None:
        from opentelemetry.trace import Status, StatusCode

        from gateway.ops.observe import result_tokens, ttft_s

        self._close_leg(status)
        tracer, root = self.t.tracer, self.root
        if rec.placed_ns:
            decided = rec.placed_ns - int(rec.routing_s * 1e9)
            adm = tracer.start_span("admission", context=self.ctx, start_time=rec.wall_ns)
            if rec.queue_s is not None:
                adm.set_attribute("fleetgate.queue_wait_s", rec.queue_s)
            adm.end(end_time=max(rec.wall_ns, decided))
            attrs = {"fleetgate.policy": rec.policy or "", "fleetgate.worker": rec.worker or "",
                     "fleetgate.reason": rec.reason}
            if rec.prefill_worker is not None:
                attrs["fleetgate.prefill_worker"] = rec.prefill_worker
            pl = tracer.start_span("placement", context=self.ctx, start_time=decided,
                                   attributes=attrs)
            pl.end(end_time=rec.placed_ns)
        prompt, completion = result_tokens(result)
        attrs: dict[str, Any] = {"http.response.status_code": status, "fleetgate.model": rec.model or "",
                                 "fleetgate.attempts": rec.attempts, "fleetgate.resumes": rec.resumes,
                                 "fleetgate.total_s": total_s}
        if rec.worker:
            attrs["fleetgate.worker"] = rec.worker
        if prompt is not None:
            attrs["gen_ai.usage.input_tokens"] = prompt
        if completion is not None:
            attrs["gen_ai.usage.output_tokens"] = completion
        ttft = ttft_s(rec, result)
        if ttft is not None:
            attrs["fleetgate.ttft_s"] = ttft
        if feats is not None:
            attrs["fleetgate.class"] = feats.request_class
        root.set_attributes(attrs)
        if status >= 500:
            root.set_status(Status(StatusCode.ERROR, f"status {status}"))
        root.end()
