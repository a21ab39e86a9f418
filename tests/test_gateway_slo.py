"""SLOs through the gateway: headers and config decide each request's targets, /metrics counts met and missed.

Integration tests drive a simulated fleet through the gateway with the official `openai` client; unit
tests cover the resolution order, the queue budget, the sliding window and the met/missed rule.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from engine_adapters.base import Usage
from gateway.config import load_config
from gateway.pipeline.slo import SloBook, _Window, parse_target_ms
from gateway.wire.errors import GatewayError
from gateway.wire.results import RelayResult
from policies.admission import queue_budget
from policies.types import RequestFeatures
from tests.helpers import MODEL, metric
from tests.helpers import running_gateway as gateway

GENEROUS = {"x-slo-ttft-ms": "60000", "x-slo-tpot-ms": "60000"}
IMPOSSIBLE = {"x-slo-ttft-ms": "0.001", "x-slo-tpot-ms": "0.001"}


# --- helpers -------------------------------------------------------------------------------------------
def slo_counts(text: str, rclass: str = "interactive") -> tuple[float, float, float | None]:
    """(met, missed, windowed ratio) of MODEL for one class."""
    lab = {"model": MODEL, "class": rclass}
    met = metric(text, "fleetgate_slo_requests_total", {**lab, "result": "met"}) or 0.0
    missed = metric(text, "fleetgate_slo_requests_total", {**lab, "result": "missed"}) or 0.0
    return met, missed, metric(text, "fleetgate_slo_attainment_ratio", lab)


async def chat(client: openai.AsyncOpenAI, headers: dict[str, str], stream: bool, tokens: int = 8,
               text: str = "hello") -> None:
    kw = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
          "extra_headers": {**headers, "x-sim-output-tokens": str(tokens)}}
    if stream:
        out = await client.chat.completions.create(stream=True, **kw)
        n = 0
        async for chunk in out:
            n += bool(chunk.choices and chunk.choices[0].delta.content)
        assert n == tokens
    else:
        out = await client.chat.completions.create(**kw)
        assert out.usage.completion_tokens == tokens


# --- through the gateway -----------------------------------------------------------------------------
async def test_slo_headers_decide_met_and_missed(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    async with gateway(fleet.urls) as gw, httpx.AsyncClient(timeout=30) as http:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
        await chat(client, {}, stream=True)  # no target anywhere: not judged
        assert slo_counts((await http.get(gw.url + "/metrics")).text) == (0.0, 0.0, None)

        await chat(client, GENEROUS, stream=True)
        await chat(client, GENEROUS, stream=False)
        assert slo_counts((await http.get(gw.url + "/metrics")).text) == (2.0, 0.0, 1.0)

        await chat(client, IMPOSSIBLE, stream=True)
        await chat(client, IMPOSSIBLE, stream=False)
        assert slo_counts((await http.get(gw.url + "/metrics")).text) == (2.0, 2.0, 0.5)

        # ATGT alone: a generous TTFT but 1 us per token after the first is missed on a stream. At this time
        # scale a token takes 0.1 ms, so a host stall could send all 12 in one write (the gateway would then
        # measure a TPOT of 0); slowed 100x (~10 ms a token) they leave in separate writes.
        assert (await http.post(fleet.urls[0] + "/sim/faults", json={"slowdown": 100})).status_code == 200
        await chat(client, {"x-slo-ttft-ms": "60000", "x-slo-tpot-ms": "0.001"}, stream=True, tokens=12)
        assert (await http.delete(fleet.urls[0] + "/sim/faults")).status_code == 200
        assert slo_counts((await http.get(gw.url + "/metrics")).text) == (2.0, 3.0, 0.4)

        # The windowed ratio moves with new requests.
        for _ in range(5):
            await chat(client, GENEROUS, stream=True)
        assert slo_counts((await http.get(gw.url + "/metrics")).text) == (7.0, 3.0, 0.7)


async def test_config_slos_per_model_and_class_and_header_precedence(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    cfg = {
        "slo": {"ttft_ms": 0.001},  # every model: impossible...
        "models": {MODEL: {"slo": {"ttft_ms": 60000, "tpot_ms": 60000},  # ...but this one is generous
                           "slo_classes": {"batch": {"ttft_ms": 0.001}}}},  # except for its batch class
    }
    async with gateway(fleet.urls, **cfg) as gw, httpx.AsyncClient(timeout=30) as http:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
        await chat(client, {}, stream=True)
        await chat(client, {"x-request-class": "batch"}, stream=True)
        await chat(client, {"x-request-class": "batch", "x-slo-ttft-ms": "60000"}, stream=False)
        text = (await http.get(gw.url + "/metrics")).text
    assert slo_counts(text, "interactive") == (1.0, 0.0, 1.0)
    assert slo_counts(text, "batch") == (1.0, 1.0, 0.5)


async def test_bad_slo_headers_get_a_clear_400(sim_fleet) -> None:
    fleet = sim_fleet(1, time_scale=20)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with gateway(fleet.urls) as gw, httpx.AsyncClient(timeout=30) as http:
        for header in ("x-slo-ttft-ms", "x-slo-tpot-ms"):
            for bad in ("abc", "-5", "0", "nan", "inf", "1e12", ""):
                r = await http.post(gw.url + "/v1/chat/completions", json=body, headers={header: bad})
                assert r.status_code == 400, (header, bad, r.text)
                err = r.json()["error"]
                assert err["param"] == header and "milliseconds" in err["message"], err
        r = await http.post(gw.url + "/v1/chat/completions", json=body, headers={"x-slo-ttft-ms": "2500.5"})
        assert r.status_code == 200


# --- units ----------------------------------------------------------------------------------------------
def book(**cfg: Any) -> SloBook:
    return SloBook(load_config(None, **cfg), CollectorRegistry())


def feats(ttft: float | None, tpot: float | None, rclass: str = "interactive", arrival: float = 0.0) -> RequestFeatures:
    return RequestFeatures("r", "m", 10, slo_ttft_s=ttft, slo_tpot_s=tpot, request_class=rclass, arrival=arrival)


def test_resolution_order_per_target() -> None:
    b = book(slo={"ttft_ms": 1000, "tpot_ms": 100}, slo_classes={"batch": {"ttft_ms": 9000}},
             models={"m": {"slo": {"tpot_ms": 50}, "slo_classes": {"batch": {"tpot_ms": 70}}}})
    assert b.config_targets("m", "interactive") == (1.0, 0.05)     # model tpot, global ttft
    assert b.config_targets("m", "batch") == (9.0, 0.07)           # class overrides at both levels
    assert b.config_targets("other", "batch") == (9.0, 0.1)
    assert b.config_targets("other", "interactive") == (1.0, 0.1)
    assert b.targets("m", "batch", b"250", None) == (0.25, 0.07)   # a header wins for its target only
    assert book().config_targets("m", "interactive") == (None, None)


def test_parse_target_ms() -> None:
    assert parse_target_ms(None, "x") is None
    assert parse_target_ms(b"600", "x") == 0.6
    for bad in (b"0", b"-1", b"nan", b"inf", b"x", b"1e9"):
        with pytest.raises(GatewayError) as e:
            parse_target_ms(bad, "x-slo-ttft-ms")
        assert e.value.status == 400 and e.value.param == "x-slo-ttft-ms"


def test_queue_budget_is_the_ttft_left_for_interactive_requests() -> None:
    now = 1000.0  # policies/admission.py takes the clock as an argument (the simulator passes virtual time)
    budget, why = queue_budget(feats(2.0, None, arrival=now - 0.5), now, 5.0)
    assert budget == pytest.approx(1.5) and "TTFT" in why
    assert queue_budget(feats(2.0, None, arrival=now - 3.0), now, 5.0)[0] == 0.0
    assert queue_budget(feats(9.0, None, arrival=now), now, 5.0)[0] == 5.0     # the timeout is shorter
    assert queue_budget(feats(2.0, None, "batch", now), now, 5.0)[0] == 5.0    # batch waits the timeout
    assert queue_budget(feats(None, 0.05, arrival=now), now, 5.0)[0] == 5.0
    # a model that must be woken first: its swap counts into the TTFT target (the pooled demo's 1 s swap, 1 s TTFT)
    budget, why = queue_budget(feats(1.0, None, arrival=now - 0.5), now, 5.0, swap_s=1.64)
    assert budget == pytest.approx(2.14) and "1.64 s swap" in why
    assert queue_budget(feats(1.0, None, arrival=now), now, 5.0, swap_s=10.0)[0] == 5.0   # still the timeout at most


def test_window_counts_only_recent_requests() -> None:
    w = _Window(10.0)
    for t, met in [(0.0, True), (1.0, False), (5.0, True), (12.0, True)]:
        w.add(t, met)
    w.prune(12.0)  # drops t=0 and t=1
    assert (len(w.events), w.met, w.ratio()) == (2, 2, 1.0)
    w.prune(100.0)
    assert w.ratio() is None


def test_met_rule_streaming_and_whole_answers() -> None:
    b = book()
    streamed = RelayResult(status=200, usage=Usage(5, 11), tokens=11, first_token_at=10.3, last_token_at=11.3)
    b.record(feats(0.5, 0.1), True, 10.0, streamed, 11.4)      # TTFT 0.3 s, ATGT 1.0 / 10 = 0.1 s: met
    b.record(feats(0.5, 0.09), True, 10.0, streamed, 11.4)     # ATGT 0.1 > 0.09: missed
    b.record(feats(0.2, None), True, 10.0, streamed, 11.4)     # TTFT 0.3 > 0.2: missed
    whole = RelayResult(status=200, usage=Usage(5, 11))
    b.record(feats(0.5, 0.1), False, 10.0, whole, 11.4)        # 1.4 <= 0.5 + 0.1 x 10: met
    b.record(feats(0.5, 0.05), False, 10.0, whole, 11.4)       # 1.4 > 0.5 + 0.05 x 10: missed
    b.record(feats(0.5, 0.1), True, 10.0, RelayResult(status=400), 10.1)  # a worker's 400: not judged
    broken = RelayResult(status=200, tokens=3, first_token_at=10.1, last_token_at=10.2, midstream_error="cut")
    b.record(feats(5.0, 5.0), True, 10.0, broken, 10.3)        # broke mid-stream: missed
    b.record_refused(feats(5.0, None))                         # 429: missed
    b.record_refused(feats(None, None))                        # no target: not judged
    w = b._windows[("m", "interactive")]
    assert (w.met, len(w.events)) == (2, 7)
