"""Fault injection: set at start or through /sim/faults, seen by real HTTP clients."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator.faults import FaultConfigError, Faults, parse_faults
from simulator.fleet import SimFleet
from simulator.vllm_api import ConfigError
from tests.helpers import poll_sync as poll

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "ignore_eos": True}


def sample(client: httpx.Client, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


@pytest.fixture
def client(sim_url):
    with httpx.Client(base_url=sim_url, timeout=30) as c:
        yield c


def test_parse_faults_validates():
    assert parse_faults(None) == Faults()
    f = parse_faults({"slowdown": 2, "error_status": 503})
    assert (f.slowdown, f.error_status, f.error_rate) == (2.0, 503, 1.0)
    assert parse_faults({"error_status": 429}).error_status == 429
    for bad, msg in [({"bogus": 1}, "unknown fault"), ({"slowdown": 0}, "slowdown"), ({"error_status": 404}, "429"),
                     ({"error_status": 428}, "429"), ({"error_status": True}, "429"),
                     ({"error_rate": 2}, "error_rate"), ({"hang": "yes"}, "hang"),
                     ({"drop_after_tokens": -1}, "drop_after_tokens"), ({"stall_after_tokens": 0}, "stall_after"),
                     ({"stall_after_tokens": 2.5}, "stall_after"), ([1], "JSON object")]:
        with pytest.raises(FaultConfigError, match=msg):
            parse_faults(bad)


def test_admin_endpoint_roundtrip_and_errors(client):
    assert client.get("/sim/faults").json() == Faults().to_dict()
    r = client.post("/sim/faults", json={"slowdown": 1.5})
    assert r.status_code == 200 and r.json()["slowdown"] == 1.5
    assert client.post("/sim/faults", json={"health_fail": True}).json()["slowdown"] == 1.5  # partial update
    r = client.post("/sim/faults", json={"slowdown": -1})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    assert "slowdown" in r.json()["error"]["message"]
    r = client.post("/sim/faults", json={"nope": True})
    assert r.status_code == 400 and "unknown fault" in r.json()["error"]["message"]
    r = client.post("/sim/faults", content=b"{oops")
    assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request"
    assert client.get("/sim/faults").json()["slowdown"] == 1.5  # a rejected update changes nothing
    assert client.delete("/sim/faults").json() == Faults().to_dict()


def test_error_status(client):
    client.post("/sim/faults", json={"error_status": 503})
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("Service Unavailable", 503, None)
    assert "Simulated fault" in err["message"]
    client.post("/sim/faults", json={"error_status": 500})
    oa = openai.OpenAI(base_url=str(client.base_url).rstrip("/") + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as exc:
        oa.chat.completions.create(model=MODEL, messages=CHAT["messages"])
    assert exc.value.status_code == 500
    assert client.get("/health").status_code == 200  # only generation is affected
    client.post("/sim/faults", json={"error_status": 502, "error_rate": 0.5})
    statuses = {client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code
                for _ in range(30)}
    assert statuses == {200, 502}
    client.post("/sim/faults", json={"error_status": 429, "error_rate": 1.0})
    with pytest.raises(openai.RateLimitError) as limited:
        oa.chat.completions.create(model=MODEL, messages=CHAT["messages"])
    err = limited.value.response.json()["error"]
    assert (err["type"], err["code"]) == ("Too Many Requests", 429)
    client.delete("/sim/faults")
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_health_fail(client):
    client.post("/sim/faults", json={"health_fail": True})
    for path in ("/health", "/ping"):
        r = client.get(path)
        assert (r.status_code, r.content) == (503, b"")
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    client.post("/sim/faults", json={"health_fail": False})
    assert client.get("/health").status_code == 200


def test_drop_mid_stream(client):
    # Long answers (1000 tokens, ~0.1 s of wall time at this time scale): the handler sees the 3rd token while
    # the request still runs even when a stalled host runs many engine steps in one burst, so every cut is an
    # abort. (A request the engine already finished counts as finished; its whole answer is not cut at all.)
    client.post("/sim/faults", json={"drop_after_tokens": 3})
    got = []
    with pytest.raises(httpx.RemoteProtocolError), \
            client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 1000}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                got.append(line)
    assert len(got) == 1 + 3  # the role chunk and three tokens, then the connection closes; no [DONE]
    with pytest.raises(httpx.RemoteProtocolError):
        client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1000, "ignore_eos": True})
    oa = openai.OpenAI(base_url=str(client.base_url).rstrip("/") + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIConnectionError):
        oa.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=1000,
                                   extra_body={"ignore_eos": True})
    poll(lambda: sample(client, "vllm:request_success_total", finished_reason="abort") == 3)
    assert sample(client, "vllm:num_requests_running") == 0
    # a response shorter than the threshold is not cut
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_hang(client):
    client.post("/sim/faults", json={"hang": True})
    with pytest.raises(httpx.ReadTimeout):  # accepted, never answered
        client.post("/v1/chat/completions", json=CHAT, timeout=0.3)
    poll(lambda: client.get("/sim/state").json()["inflight_http"] == 0)  # closed when the client gave up
    assert client.get("/health").status_code == 200
    client.post("/sim/faults", json={"hang": False})
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_stall_after_tokens_freezes_the_engine_at_that_token_until_cleared(client):
    # The point where the stream stops is the fault's N, however late the reader runs: the engine freezes after
    # the step that brings a request to N tokens, the response stays open, and nothing else progresses either.
    client.post("/sim/faults", json={"stall_after_tokens": 5})
    tokens: list[str] = []
    ends: list[str | None] = []

    def read() -> None:
        with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 50}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    if choice["delta"].get("content"):
                        tokens.append(choice["delta"]["content"])
                    ends.append(choice["finish_reason"])

    reader = threading.Thread(target=read)
    reader.start()
    poll(lambda: len(tokens) == 5, what="five tokens")
    assert client.get("/sim/state").json()["stalled"]
    time.sleep(0.3)  # 0.3 s is ~400 decode steps at this time scale: none of them ran
    assert len(tokens) == 5 and reader.is_alive()
    assert client.get("/health").status_code == 200  # a zombie: alive to its health checks
    with pytest.raises(httpx.ReadTimeout):  # new work gets nothing either (a gateway's probe fails)
        client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=0.3)
    client.delete("/sim/faults")
    reader.join(10)
    assert not reader.is_alive() and len(tokens) == 50 and ends[-1] == "length"  # went on where it stopped
    assert not client.get("/sim/state").json()["stalled"]
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_a_short_answer_under_stall_after_tokens_is_untouched(client):
    client.post("/sim/faults", json={"stall_after_tokens": 5})
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 4 and not client.get("/sim/state").json()["stalled"]


def test_hung_request_does_not_block_shutdown(sim_fleet):
    fleet = sim_fleet(1, time_scale=20, faults={"hang": True})
    errors: list[Exception] = []

    def call() -> None:
        try:
            httpx.post(fleet.urls[0] + "/v1/completions", json={"prompt": "x"}, timeout=10)
        except httpx.HTTPError as exc:
            errors.append(exc)

    t = threading.Thread(target=call)
    t.start()
    with httpx.Client(base_url=fleet.urls[0]) as c:
        poll(lambda: c.get("/load").json() == {"server_load": 1})
    t0 = time.monotonic()
    fleet.stop()
    t.join(5)
    assert time.monotonic() - t0 < 3 and not t.is_alive() and errors  # the client saw the connection end


def test_slowdown_stretches_decode_steps(client):
    def mean_itl() -> float:
        return sample(client, "vllm:inter_token_latency_seconds_sum") / sample(
            client, "vllm:inter_token_latency_seconds_count")

    body = {"prompt": "x", "max_tokens": 30, "ignore_eos": True}
    client.post("/v1/completions", json=body)
    base = mean_itl()
    s0 = sample(client, "vllm:inter_token_latency_seconds_sum")
    client.post("/sim/faults", json={"slowdown": 3})
    t0 = time.perf_counter()
    client.post("/v1/completions", json=body)
    wall = time.perf_counter() - t0
    slow = (sample(client, "vllm:inter_token_latency_seconds_sum") - s0) / 29
    assert slow == pytest.approx(3 * base, rel=0.05)
    assert wall >= 29 * slow / 20 * 0.95  # and it really takes that long (time_scale 20)


def test_faults_from_start_config(sim_fleet):
    fleet = sim_fleet(1, time_scale=20, faults={"health_fail": True, "slowdown": 2.0})
    with httpx.Client(base_url=fleet.urls[0]) as c:
        assert c.get("/health").status_code == 503
        assert c.get("/sim/faults").json()["slowdown"] == 2.0
    with pytest.raises(ConfigError, match="faults"):
        SimFleet.of(1, faults={"slowdown": "fast"})


def test_a_dropped_unary_answer_is_cut_even_when_the_engine_finished_first(sim_fleet):
    """A host behind the wall clock runs many engine steps in one burst (simulator/driver.py), so a short
    request may be finished before its handler wakes: the drop fault still cuts its answer. (It once sent the
    whole answer then: under load, tests that count on the cut saw the dropped worker answer.) A time scale so
    high that every step is already due reproduces the burst on an idle machine."""
    url = sim_fleet(1, time_scale=1e6).urls[0]
    with httpx.Client(base_url=url, timeout=30) as client:
        client.post("/sim/faults", json={"drop_after_tokens": 0})
        for _ in range(5):
            with pytest.raises(httpx.RemoteProtocolError):
                client.post("/v1/completions", json={"prompt": "x" * 4000, "max_tokens": 12, "ignore_eos": True})
        client.post("/sim/faults", json={"drop_after_tokens": 12})   # not longer than the threshold: whole
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 12, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
