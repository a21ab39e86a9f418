"""Operator logs and traces: the access log per request (logfmt / JSON), state-change lines, rate limiting,
and OpenTelemetry spans with the W3C traceparent the worker received."""

from __future__ import annotations

import io
import json
import logging

import httpx
import pytest

from gateway.config import load_config
from gateway.ops.logs import ACCESS_LOGGER, RateLimitFilter, setup_logging
from gateway.ops.tracing import Tracing
from gateway.server import GatewayServer
from tests.helpers import MODEL, loopback_app, poll, running_gateway, worker_entries

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.fixture
def log_stream():
    stream = io.StringIO()
    handler = setup_logging("info", "json", stream=stream)
    yield stream
    logging.getLogger().removeHandler(handler)


def _lines(stream: io.StringIO, logger: str | None = None) -> list[dict]:
    out = [json.loads(x) for x in stream.getvalue().splitlines() if x.strip()]
    return [d for d in out if logger is None or d["logger"] == logger]


async def test_access_log_has_one_json_line_per_request(sim_fleet, log_stream) -> None:
    fleet = sim_fleet(2, time_scale=20)
    async with running_gateway(fleet.urls, default_policy="round_robin") as gw, httpx.AsyncClient() as c:
        r = await c.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                         headers={"x-request-id": "req-logged-1"})
        assert r.status_code == 200
        r2 = await c.post(gw.url + "/v1/chat/completions", json={**CHAT, "model": "nope"})
        assert r2.status_code == 404
        await poll(lambda: len(_lines(log_stream, ACCESS_LOGGER)) >= 2, what="two access-log lines")
    ok, missing = _lines(log_stream, ACCESS_LOGGER)[:2]
    assert ok["request_id"] == "req-logged-1" and ok["status"] == 200 and ok["model"] == MODEL
    assert ok["worker"] in {"w0", "w1"} and ok["policy"] == "round_robin" and ok["path"] == "/v1/chat/completions"
    assert ok["completion_tokens"] == 4 and ok["prompt_tokens"] > 0
    assert 0 < ok["ttft_ms"] <= ok["total_ms"] and ok["attempts"] == 1 and ok["resumes"] == 0
    assert "key" in ok  # filled once API keys have names
    assert missing["status"] == 404 and missing["worker"] is None and missing["model"] == "_unknown"


async def test_access_log_records_retries_and_logfmt(sim_fleet) -> None:
    stream = io.StringIO()
    handler = setup_logging("info", "logfmt", stream=stream)
    try:
        fleet = sim_fleet(1, time_scale=20)
        dead = "http://127.0.0.1:9"  # discard port: refused
        workers = [{"id": "dead", "url": dead, "models": [MODEL]}, {"id": "alive", "url": fleet.urls[0]}]
        async with running_gateway(workers=workers, default_policy="round_robin",
                                   health={"interval_s": 30, "failures_to_eject": 5}) as gw:
            gw.gateway.registry.workers["dead"].healthy = True  # in rotation until the data path fails
            gw.gateway.registry._rebuild()
            async with httpx.AsyncClient() as c:
                for _ in range(2):
                    assert (await c.post(gw.url + "/v1/chat/completions", json=CHAT)).status_code == 200
            await poll(lambda: stream.getvalue().count("logger=fleetgate.access") >= 2, what="access lines")
    finally:
        logging.getLogger().removeHandler(handler)
    access = [x for x in stream.getvalue().splitlines() if "logger=fleetgate.access" in x]
    retried = [x for x in access if "attempts=2" in x]
    assert retried, access
    assert "errors=connect" in retried[0] and "worker=alive" in retried[0] and "status=200" in retried[0]


async def test_worker_that_never_comes_up_is_logged_once(log_stream) -> None:
    async with running_gateway(workers=[{"id": "ghost", "url": "http://127.0.0.1:9"}],
                               health={"interval_s": 0.05, "timeout_s": 0.2}) as gw:
        await poll(lambda: any("ghost" in d["msg"] for d in _lines(log_stream)), what="a line about ghost")
        registry = gw.gateway.registry
        checks = registry.workers["ghost"].fails
        await poll(lambda: registry.workers["ghost"].fails >= checks + 10, what="ten more failed checks")
    about = [d for d in _lines(log_stream) if "ghost" in d["msg"]]
    assert len(about) == 1, about
    assert about[0]["level"] == "warning" and "unreachable" in about[0]["msg"] and "not in rotation yet" in about[0]["msg"]


def test_rate_limit_filter_drops_repeats_and_counts_them() -> None:
    now = [0.0]
    f = RateLimitFilter(window_s=10, burst=2, clock=lambda: now[0])

    def rec(msg: str, name: str = "fleetgate.x") -> logging.LogRecord:
        return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, ("arg",), None)

    assert [f.filter(rec("boom %s")) for _ in range(5)] == [True, True, False, False, False]
    assert f.filter(rec("other %s"))  # another template is its own budget
    assert f.filter(rec("boom %s", ACCESS_LOGGER)) and f.filter(rec("boom %s", ACCESS_LOGGER))
    change = rec("boom %s")
    change.unlimited = True      # a line logged only on a change (the autoscaler's `fleet:`) is never dropped
    assert f.filter(change)
    now[0] = 11.0
    r = rec("boom %s")
    assert f.filter(r) and r.suppressed == 3


async def test_tracing_spans_and_traceparent_reach_the_worker(sim_fleet) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    fleet = sim_fleet(1, time_scale=20)
    cfg = load_config(None, listen={"host": "127.0.0.1", "port": 0}, workers=worker_entries(fleet.urls),
                      tracing={"enabled": True})
    exporter = InMemorySpanExporter()
    server = GatewayServer(cfg)
    server.gateway.tracing = Tracing(cfg.tracing, exporter=exporter)
    client_trace = "0af7651916cd43dd8448eb211c80319c"
    async with server as gw, httpx.AsyncClient() as c:
        r = await c.post(gw.url + "/v1/chat/completions", json=CHAT,
                         headers={"traceparent": f"00-{client_trace}-b7ad6b7169203331-01"})
        assert r.status_code == 200
        await poll(lambda: any(s.name.startswith("POST") for s in exporter.get_finished_spans()), what="root span")
        state = (await c.get(fleet.urls[0] + "/sim/state")).json()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"POST /v1/chat/completions", "admission", "placement", "upstream upstream"} <= set(spans)
    root = spans["POST /v1/chat/completions"]
    assert format(root.context.trace_id, "032x") == client_trace  # continues the client's trace
    assert root.attributes["fleetgate.model"] == MODEL and root.attributes["http.response.status_code"] == 200
    assert spans["placement"].attributes["fleetgate.worker"] == "w0"
    assert spans["placement"].attributes["fleetgate.policy"] == "least_tokens"
    leg = spans["upstream upstream"]
    assert leg.parent.span_id == root.context.span_id
    # The worker got the leg's traceparent, not the client's.
    assert state["traceparents"] == [f"00-{client_trace}-{leg.context.span_id:016x}-01"]


async def test_tracing_off_forwards_the_clients_traceparent_unchanged(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with running_gateway(fleet.urls) as gw, httpx.AsyncClient() as c:
        assert gw.gateway.dispatcher.observer is not None and gw.gateway.tracing is None
        assert (await c.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"traceparent": tp})).status_code == 200
        assert (await c.get(fleet.urls[0] + "/sim/state")).json()["traceparents"] == [tp]


async def test_spans_are_exported_over_otlp_http(sim_fleet) -> None:
    """A real OTLP/HTTP receiver on loopback gets the request's spans (protobuf, as a collector would)."""
    from aiohttp import web
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    received: list[ExportTraceServiceRequest] = []

    async def traces(request: web.Request) -> web.Response:
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(await request.read())
        received.append(msg)
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    fleet = sim_fleet(1, time_scale=20)
    async with loopback_app(app) as collector:
        tracing = {"enabled": True, "service_name": "fg-test", "otlp_endpoint": collector + "/v1/traces"}
        async with running_gateway(fleet.urls, tracing=tracing) as gw, httpx.AsyncClient() as c:
            assert (await c.post(gw.url + "/v1/chat/completions", json=CHAT)).status_code == 200
        # leaving the gateway shut the provider down, which flushes the batch processor
        await poll(lambda: received, 10, "an OTLP export")
    spans = [s for m in received for rs in m.resource_spans for ss in rs.scope_spans for s in ss.spans]
    names = {s.name for s in spans}
    assert {"POST /v1/chat/completions", "admission", "placement", "upstream upstream"} <= names
    service = {a.value.string_value for m in received for rs in m.resource_spans for a in rs.resource.attributes
               if a.key == "service.name"}
    assert service == {"fg-test"}
    assert len({s.trace_id for s in spans}) == 1
