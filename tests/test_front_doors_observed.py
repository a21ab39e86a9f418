"""What an operator sees of the front doors that run over the chat pipeline (gateway/wire/translated.py): the access
log, the trace and the status counters name the route the client called (`/v1/responses`, `/v1/messages`), not the
chat route they were rewritten to, and count the status the client received (Messages: 529 where the pipeline
answered 503, 500 where it answered 504)."""

from __future__ import annotations

import logging

import anthropic
import httpx
import openai
import pytest

from tests.helpers import ADMIN, ADMIN_KEY, MODEL, metric, poll, running_gateway
from tests.test_ops_logs_tracing import traced_server

KEY = "sk-front-doors-observed"
AUTH = {"admin_key": ADMIN_KEY, "keys": [{"key": KEY, "name": "dev"}]}
HI = [{"role": "user", "content": "hi"}]


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [r.fields for r in caplog.records if r.name == "fleetgate.access"]


def statuses(text: str, name: str) -> dict[str, float]:
    """The samples of counter `name` summed by their `status` label."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[s.labels["status"]] = out.get(s.labels["status"], 0) + s.value
    return out


async def test_access_log_and_counters_name_the_route_called(sim_fleet, caplog) -> None:
    caplog.set_level(logging.INFO, logger="fleetgate.access")
    fleet = sim_fleet(1, time_scale=20)
    async with running_gateway(fleet.urls, auth=AUTH) as gw, httpx.AsyncClient(timeout=20) as http:
        oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=20)
        an = anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEY, max_retries=0, timeout=20)
        await oa.responses.create(model=MODEL, input="hi", max_output_tokens=3)
        await an.messages.create(model=MODEL, max_tokens=3, messages=HI)
        async with an.messages.stream(model=MODEL, max_tokens=3, messages=HI) as stream:
            await stream.get_final_message()
        await oa.chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
        with pytest.raises(anthropic.BadRequestError):   # refused by the front door itself: counted too
            await an.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": [{}]}])
        text = (await http.get(gw.url + "/metrics", headers=ADMIN)).text
    lines = access_lines(caplog)
    assert [(a["path"], a["status"]) for a in lines] == [
        ("/v1/responses", 200), ("/v1/messages", 200), ("/v1/messages", 200), ("/v1/chat/completions", 200)]
    assert all(a["worker"] == "w0" and a["model"] == MODEL for a in lines)
    assert metric(text, "fleetgate_responses_total", {"status": "200", "reason": "ok"}) == 4
    assert metric(text, "fleetgate_responses_total", {"status": "400", "reason": "invalid_request_error"}) == 1


async def test_messages_counts_529_and_500_where_the_pipeline_answered_503_and_504(sim_fleet, caplog) -> None:
    caplog.set_level(logging.INFO, logger="fleetgate.access")
    # no worker at all: the pipeline's 503 is the client's 529 overloaded_error
    dead = [{"id": "w0", "url": "http://127.0.0.1:9", "models": [MODEL]}]   # nothing listens there
    async with running_gateway(workers=dead, auth=AUTH, health={"interval_s": 0.2}) as gw, \
            httpx.AsyncClient(timeout=20) as http:
        an = anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEY, max_retries=0, timeout=20)
        with pytest.raises(anthropic.APIStatusError) as e:
            await an.messages.create(model=MODEL, max_tokens=2, messages=HI)
        assert e.value.status_code == 529
        text = (await http.get(gw.url + "/metrics", headers=ADMIN)).text
    assert statuses(text, "fleetgate_responses_total") == {"529": 1}
    assert statuses(text, "fleetgate_requests_total") == {"529": 1}
    assert [(a["path"], a["status"]) for a in access_lines(caplog)] == [("/v1/messages", 529)]
    caplog.clear()
    # a hung worker given up on: the pipeline's 504 (or 502) is the client's 500 api_error
    fleet = sim_fleet(1, time_scale=20)
    timeouts = {"connect_s": 1, "first_byte_s": 0.3, "idle_s": 60}
    async with running_gateway(fleet.urls, auth=AUTH, timeouts=timeouts) as gw, \
            httpx.AsyncClient(timeout=20) as http:
        await http.post(fleet.urls[0] + "/sim/faults", json={"hang": True})
        an = anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEY, max_retries=0, timeout=20)
        with pytest.raises(anthropic.InternalServerError) as e:
            await an.messages.create(model=MODEL, max_tokens=2, messages=HI)
        assert e.value.status_code == 500 and e.value.body["error"]["type"] == "api_error"
        await http.delete(fleet.urls[0] + "/sim/faults")
        text = (await http.get(gw.url + "/metrics", headers=ADMIN)).text
    assert statuses(text, "fleetgate_responses_total") == {"500": 1}
    assert metric(text, "fleetgate_responses_total", {"status": "500", "class": "5xx"}) == 1
    assert [(a["path"], a["status"]) for a in access_lines(caplog)] == [("/v1/messages", 500)]


@pytest.mark.parametrize("route", ["/v1/responses", "/v1/messages"])
async def test_the_trace_is_named_by_the_route_called(sim_fleet, route: str) -> None:
    fleet = sim_fleet(1, time_scale=20)
    server, exporter = traced_server(fleet.urls)
    body = ({"model": MODEL, "input": "hi", "max_output_tokens": 3} if route == "/v1/responses"
            else {"model": MODEL, "max_tokens": 3, "messages": HI})
    async with server as gw, httpx.AsyncClient(timeout=20) as c:
        r = await c.post(gw.url + route, json=body)
        assert r.status_code == 200
        await poll(lambda: any(s.name.startswith("POST") for s in exporter.get_finished_spans()), what="root span")
    roots = [s for s in exporter.get_finished_spans() if s.name.startswith("POST")]
    assert [s.name for s in roots] == [f"POST {route}"]
    assert roots[0].attributes["url.path"] == route and roots[0].attributes["http.response.status_code"] == 200
