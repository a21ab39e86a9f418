"""Prefill/decode disaggregation over HTTP with vLLM's NIXL `kv_transfer_params` protocol (ref section 4.2)."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator.tokenizer import count_tokens, render_chat, synthetic_text

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def counters(client: httpx.Client) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for s in fam.samples:
            if s.name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                          "vllm:time_to_first_token_seconds_sum", "vllm:num_requests_running"):
                out[s.name] = s.value
    return out


@pytest.fixture
def pd_pair(sim_fleet):
    fleet = sim_fleet(fleet={"servers": [{"name": "p", "role": "kv_producer"},
                                         {"name": "d", "role": "kv_consumer"}]}, time_scale=20)
    with httpx.Client(base_url=fleet.urls[0], timeout=30) as p, \
            httpx.Client(base_url=fleet.urls[1], timeout=30) as d:
        yield p, d


def prefill(p: httpx.Client, body: dict, request_id: str = "pd-1") -> dict:
    """The proxy's first leg (toy_proxy_server.py): max_tokens 1, no streaming, do_remote_decode."""
    leg = {**body, "kv_transfer_params": PREFILL_PARAMS, "stream": False, "max_tokens": 1}
    leg.pop("stream_options", None)
    r = p.post("/v1/chat/completions", json=leg, headers={"X-Request-Id": request_id})
    assert r.status_code == 200, r.text
    return r.json()


def test_prefill_on_p_decode_on_d(pd_pair):
    p, d = pd_pair
    messages = [{"role": "user", "content": synthetic_text(1000, "pd")}]
    n = count_tokens(render_chat(messages))
    body = {"messages": messages, "max_tokens": 20, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    p0, d0 = counters(p), counters(d)

    first = prefill(p, body)
    params = first["kv_transfer_params"]
    assert list(params) == ["do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                            "remote_host", "remote_port", "tp_size"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert len(params["remote_block_ids"]) == math.ceil(n / 16)
    assert all(isinstance(b, int) for b in params["remote_block_ids"])
    assert params["remote_engine_id"] == p.get("/sim/state").json()["engine_id"]
    assert params["remote_host"] == "127.0.0.1" and isinstance(params["remote_port"], int)
    assert params["tp_size"] == 1
    assert first["choices"][0]["finish_reason"] == "length" and first["usage"]["completion_tokens"] == 1
    state = p.get("/sim/state").json()
    assert state["held"] == 1 and state["pinned_kv"] == 1 and state["kv_usage"] > 0  # blocks stay pinned

    r = d.post("/v1/chat/completions", json={**body, "kv_transfer_params": params},
               headers={"X-Request-Id": "pd-1"})
    events = [e[len("data: "):] for e in r.text.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage == {"prompt_tokens": n, "total_tokens": n + 20, "completion_tokens": 20}

    p1, d1 = counters(p), counters(d)
    assert p1["vllm:prompt_tokens_total"] - p0["vllm:prompt_tokens_total"] == n      # prefill ran on P
    assert d1["vllm:prompt_tokens_total"] == d0["vllm:prompt_tokens_total"]          # ... and not on D
    assert d1["vllm:generation_tokens_total"] - d0["vllm:generation_tokens_total"] == 20
    # D's TTFT includes the 15 ms API overhead plus the KV pull: 1 ms setup + n x 128 KiB / 40 GB/s
    transfer = 0.001 + n * 131072 / 40e9
    assert d1["vllm:time_to_first_token_seconds_sum"] >= 0.015 + transfer
    state = p.get("/sim/state").json()
    assert state["held"] == 0 and state["pinned_kv"] == 0 and state["kv_usage"] == 0  # D told P to release

    # the same params again: P's blocks are gone, so D prefills locally (kv_load_failure_policy recompute);
    # the pulled KV now sits in D's own prefix cache, so only the tail past the last full block is computed
    again = {k: v for k, v in body.items() if k != "stream_options"}
    r = d.post("/v1/chat/completions", json={**again, "stream": False, "kv_transfer_params": params})
    assert r.status_code == 200, r.text
    recomputed = counters(d)["vllm:prompt_tokens_total"] - d1["vllm:prompt_tokens_total"]
    assert 0 < recomputed <= 16


def test_unknown_or_malformed_params_fall_back_to_local_prefill(pd_pair):
    _, d = pd_pair
    messages = [{"role": "user", "content": "short prompt"}]
    n = count_tokens(render_chat(messages))
    bogus = [
        {"do_remote_prefill": True, "remote_engine_id": "no-such-engine", "remote_block_ids": [1, 2]},
        {"do_remote_prefill": True, "remote_engine_id": 42, "remote_block_ids": "x"},
        {"do_remote_prefill": True},
    ]
    for i, params in enumerate(bogus, 1):
        r = d.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3,
                                                 "kv_transfer_params": params})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        assert counters(d)["vllm:prompt_tokens_total"] == n * i


def test_expired_pins_fall_back(sim_fleet):
    # P holds KV for 1 model-ms only (VLLM_NIXL_ABORT_REQUEST_TIMEOUT analogue): D arrives too late.
    fleet = sim_fleet(fleet={"servers": [{"role": "kv_producer", "kv_lease_s": 0.001}, {"role": "kv_consumer"}]},
                      time_scale=20)
    with httpx.Client(base_url=fleet.urls[0]) as p, httpx.Client(base_url=fleet.urls[1]) as d:
        body = {"messages": [{"role": "user", "content": synthetic_text(100, "e")}], "max_tokens": 4}
        params = prefill(p, body)["kv_transfer_params"]
        assert params is not None
        d.post("/v1/chat/completions", json={**body, "kv_transfer_params": params})
        assert counters(d)["vllm:prompt_tokens_total"] > 0


def test_kv_both_serves_either_leg_and_streaming_prefill_is_accepted(sim_fleet):
    fleet = sim_fleet(2, time_scale=20)  # default role kv_both: the request decides
    with httpx.Client(base_url=fleet.urls[0]) as a, httpx.Client(base_url=fleet.urls[1]) as b:
        body = {"prompt": synthetic_text(64, "kb"), "max_tokens": 1,
                "kv_transfer_params": PREFILL_PARAMS}
        params = a.post("/v1/completions", json=body).json()["kv_transfer_params"]
        assert params["remote_engine_id"] == a.get("/sim/state").json()["engine_id"]
        r = b.post("/v1/completions", json={"prompt": body["prompt"], "max_tokens": 5, "ignore_eos": True,
                                             "kv_transfer_params": params})
        assert r.json()["usage"]["completion_tokens"] == 5 and counters(b)["vllm:prompt_tokens_total"] == 0
        # vLLM 0.11 accepts do_remote_decode with stream: true (llm-d-sim would answer 400)
        r = a.post("/v1/completions", json={**body, "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")


def test_non_producer_ignores_remote_decode(sim_fleet):
    fleet = sim_fleet(fleet={"servers": [{"role": "kv_consumer"}]}, time_scale=20)
    with httpx.Client(base_url=fleet.urls[0]) as d:
        r = d.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS})
        assert r.json()["kv_transfer_params"] is None
        assert d.get("/sim/state").json()["held"] == 0
