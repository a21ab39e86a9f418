"""The simulated vLLM server over real HTTP: shapes, SSE framing, errors, /metrics, engine behaviour.

Expected bytes are written out from the vLLM 0.11 layouts in the interface reference (section 1.3 and 2):
key order and explicit nulls matter to strict clients.
"""

from __future__ import annotations

import asyncio
import json
import time
from string import Template

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator.tokenizer import count_tokens, render_chat, synthetic_text
from tests.helpers import MODEL, metric
from tests.helpers import poll as apoll
from tests.helpers import poll_sync as poll

SMALL = {"max_model_len": 1024}  # profile override: small context for the length-error tests


# --- helpers -------------------------------------------------------------------------------------
def metrics(url: str) -> dict[str, float]:
    """Sample name (+ labels except engine/model_name) -> value, parsed with prometheus_client."""
    text = httpx.get(url + "/metrics").text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("engine", "model_name"))
            out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return out


class HttpxClient(httpx.Client):
    """A kept-alive client (a fresh httpx.Client per call costs ~25 ms of SSL setup)."""

    def __init__(self, url: str):
        super().__init__(base_url=url, timeout=30)


def sse_events(body: str) -> list[str]:
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


def stream_ttft(client: httpx.Client, body: dict) -> float:
    """Wall seconds from sending a streaming completion to its first token chunk (kept-alive connection)."""
    t0 = time.perf_counter()
    ttft = None
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: {") and '"text":"' in line:
                ttft = time.perf_counter() - t0
    assert ttft is not None, "no token chunk"
    return ttft


# --- shapes and framing ------------------------------------------------------------------------------
def test_models_health_version_load(sim_url):
    body = httpx.get(sim_url + "/v1/models").json()
    card = body["data"][0]
    assert body["object"] == "list" and len(body["data"]) == 1
    assert list(card) == ["id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"]
    assert card["id"] == card["root"] == MODEL and card["owned_by"] == "vllm" and card["parent"] is None
    assert card["max_model_len"] == 131072
    assert card["permission"][0]["object"] == "model_permission"
    assert card["permission"][0]["id"].startswith("modelperm-")
    r = httpx.get(sim_url + "/health")
    assert r.status_code == 200 and r.content == b""
    assert httpx.get(sim_url + "/ping").status_code == 200
    assert httpx.post(sim_url + "/ping").status_code == 200
    assert httpx.get(sim_url + "/version").json() == {"version": "0.11.0"}
    assert httpx.get(sim_url + "/load").json() == {"server_load": 0}


def test_chat_non_streaming_bytes(sim_url):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    r = httpx.post(sim_url + "/v1/chat/completions", headers={"X-Request-Id": "abc123"},
                   json={"model": MODEL, "messages": messages, "max_tokens": 7, "ignore_eos": True})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    data = r.json()
    content = data["choices"][0]["message"]["content"]
    p = count_tokens(render_chat(messages))
    expected = Template(
        '{"id":"chatcmpl-abc123","object":"chat.completion","created":$created,"model":"$model","choices":[{'
        '"index":0,"message":{"role":"assistant","content":$content,"refusal":null,"annotations":null,"audio":null,'
        '"function_call":null,"tool_calls":[],"reasoning_content":null},"logprobs":null,"finish_reason":"length",'
        '"stop_reason":null,"token_ids":null}],"service_tier":null,"system_fingerprint":null,'
        '"usage":{"prompt_tokens":$p,"total_tokens":$total,"completion_tokens":7,"prompt_tokens_details":null},'
        '"prompt_logprobs":null,"prompt_token_ids":null,"kv_transfer_params":null}'
    ).substitute(created=data["created"], model=MODEL, content=json.dumps(content), p=p, total=p + 7)
    assert r.text == expected
    assert count_tokens(content) == 7  # the filler text re-tokenizes to the generated count


def test_completion_non_streaming_bytes_and_default_max_tokens(sim_url):
    prompt = "The quick brown fox jumps over the lazy dog"
    r = httpx.post(sim_url + "/v1/completions", json={"prompt": prompt, "ignore_eos": True})
    data = r.json()
    assert data["id"].startswith("cmpl-") and len(data["id"]) == len("cmpl-") + 32
    p = count_tokens(prompt)
    expected = Template(
        '{"id":"$id","object":"text_completion","created":$created,"model":"$model","choices":[{"index":0,'
        '"text":$text,"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null,'
        '"prompt_logprobs":null,"prompt_token_ids":null}],"service_tier":null,"system_fingerprint":null,'
        '"usage":{"prompt_tokens":$p,"total_tokens":$total,"completion_tokens":16,"prompt_tokens_details":null},'
        '"kv_transfer_params":null}'
    ).substitute(id=data["id"], created=data["created"], model=MODEL, text=json.dumps(data["choices"][0]["text"]),
                 p=p, total=p + 16)
    assert r.text == expected  # completions default max_tokens is 16 (ref 1.3)


def test_chat_stream_bytes_with_usage(sim_url):
    messages = [{"role": "user", "content": "stream please"}]
    r = httpx.post(sim_url + "/v1/chat/completions", headers={"X-Request-Id": "s1"},
                   json={"messages": messages, "max_tokens": 3, "ignore_eos": True, "stream": True,
                         "stream_options": {"include_usage": True}})
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    ev = sse_events(r.text)
    head = Template('{"id":"chatcmpl-s1","object":"chat.completion.chunk","created":$created,"model":"$model",'
                    '"choices":').substitute(created=json.loads(ev[0])["created"], model=MODEL)
    assert ev[0] == head + ('[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
                            '"finish_reason":null}],"prompt_token_ids":null}')
    words = [json.dumps(json.loads(e)["choices"][0]["delta"]["content"]) for e in ev[1:4]]
    token = Template('[{"index":0,"delta":{"content":$w},"logprobs":null,"finish_reason":null,"token_ids":null}]}')
    last = Template('[{"index":0,"delta":{"content":$w},"logprobs":null,"finish_reason":"length",'
                    '"stop_reason":null,"token_ids":null}]}')
    assert ev[1] == head + token.substitute(w=words[0])
    assert ev[2] == head + token.substitute(w=words[1])
    assert ev[3] == head + last.substitute(w=words[2])
    p = count_tokens(render_chat(messages))
    assert ev[4] == head + f'[],"usage":{{"prompt_tokens":{p},"total_tokens":{p + 3},"completion_tokens":3}}}}'
    assert ev[5] == "[DONE]" and len(ev) == 6


def test_chat_stream_continuous_usage(sim_url):
    r = httpx.post(sim_url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "ignore_eos": True,
                         "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    ev = [json.loads(e) for e in sse_events(r.text)[:-1]]
    p = ev[-1]["usage"]["prompt_tokens"]
    assert [e["usage"] for e in ev] == [{"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c}
                                        for c in (0, 1, 2, 2)]
    assert list(ev[0]) == ["id", "object", "created", "model", "choices", "usage", "prompt_token_ids"]


def test_completion_stream_bytes(sim_url):
    r = httpx.post(sim_url + "/v1/completions", headers={"X-Request-Id": "c1"},
                   json={"prompt": "abcdefgh", "max_tokens": 2, "ignore_eos": True, "stream": True,
                         "stream_options": {"include_usage": True}})
    ev = sse_events(r.text)
    head = Template('{"id":"cmpl-c1","object":"text_completion","created":$created,"model":"$model","choices":'
                    ).substitute(created=json.loads(ev[0])["created"], model=MODEL)
    texts = [json.dumps(json.loads(e)["choices"][0]["text"]) for e in ev[:2]]
    chunk = Template('[{"index":0,"text":$t,"logprobs":null,"finish_reason":$f,"stop_reason":null,'
                     '"prompt_token_ids":null,"token_ids":null}],"usage":null}')
    assert ev[0] == head + chunk.substitute(t=texts[0], f="null")
    assert ev[1] == head + chunk.substitute(t=texts[1], f='"length"')
    assert ev[2] == head + '[],"usage":{"prompt_tokens":2,"total_tokens":4,"completion_tokens":2}}'
    assert ev[3] == "[DONE]" and len(ev) == 4


def test_output_length_header_and_stop(sim_url):
    r = httpx.post(sim_url + "/v1/completions", headers={"x-sim-output-tokens": "5"},
                   json={"prompt": "hi", "max_tokens": 50})
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert (choice["finish_reason"], usage["completion_tokens"]) == ("stop", 5)
    r = httpx.post(sim_url + "/v1/completions", headers={"x-sim-output-tokens": "500"},
                   json={"prompt": "hi", "max_tokens": 4})
    assert (r.json()["choices"][0]["finish_reason"], r.json()["usage"]["completion_tokens"]) == ("length", 4)


def test_openai_client_chat_and_completions(sim_url):
    client = openai.OpenAI(base_url=sim_url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Say something"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                          extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 6
    assert resp.usage.prompt_tokens == count_tokens(render_chat(messages))
    assert count_tokens(resp.choices[0].message.content) == 6

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert count_tokens(text) == 4 and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4

    comp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3,
                                     extra_body={"ignore_eos": True})
    assert comp.usage.prompt_tokens == count_tokens("Once upon a time") and comp.usage.completion_tokens == 3
    streamed = list(client.completions.create(model=MODEL, prompt="Once", max_tokens=3, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert [c.choices[0].finish_reason for c in streamed] == [None, None, "length"]


# --- errors --------------------------------------------------------------------------------------------
def _err(r: httpx.Response, status: int, err_type: str, message: str | None = None) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["error"] and list(body["error"]) == ["message", "type", "param", "code"]
    assert body["error"]["type"] == err_type and body["error"]["code"] == status
    if message is not None:
        assert body["error"]["message"] == message
    return body["error"]["message"]


def test_bad_input_errors(sim_fleet):
    url = sim_fleet(1, time_scale=20, profile_overrides=SMALL).urls[0]
    httpx = HttpxClient(url)
    chat, comp = "/v1/chat/completions", "/v1/completions"
    msgs = [{"role": "user", "content": "hi"}]
    p_chat = count_tokens(render_chat(msgs))
    _err(httpx.post(comp, content=b"{not json", headers={"content-type": "application/json"}), 400, "Bad Request")
    _err(httpx.post(comp, json=["a list"]), 400, "Bad Request")
    assert "prompt" in _err(httpx.post(comp, json={"max_tokens": 3}), 400, "Bad Request")
    _err(httpx.post(chat, json={"messages": "not a list"}), 400, "Bad Request")
    _err(httpx.post(chat, json={"messages": [{"content": "no role"}]}), 400, "Bad Request")
    _err(httpx.post(chat, json={"messages": msgs, "max_tokens": "many"}), 400, "Bad Request")
    _err(httpx.post(chat, json={"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
         400, "Bad Request")
    _err(httpx.post(chat, json={"messages": msgs, "kv_transfer_params": "x"}), 400, "Bad Request")
    _err(httpx.post(chat, json={"model": "foo", "messages": msgs}), 404, "NotFoundError",
         "The model `foo` does not exist.")
    _err(httpx.post(comp, json={"model": "foo", "prompt": "x"}), 404, "NotFoundError")
    long_text = synthetic_text(1100, "long")
    n = count_tokens(render_chat([{"role": "user", "content": long_text}]))
    _err(httpx.post(chat, json={"messages": [{"role": "user", "content": long_text}]}), 400, "BadRequestError",
         f"This model's maximum context length is 1024 tokens. However, your request has {n} input tokens. "
         "Please reduce the length of the input messages.")
    _err(httpx.post(chat, json={"messages": msgs, "max_tokens": 1020}), 400, "BadRequestError",
         f"'max_tokens' or 'max_completion_tokens' is too large: 1020. This model's maximum context length is "
         f"1024 tokens and your request has {p_chat} input tokens (1020 > 1024 - {p_chat}).")
    _err(httpx.post(chat, json={"messages": msgs, "max_completion_tokens": 1020}), 400, "BadRequestError")
    _err(httpx.post(comp, json={"prompt": synthetic_text(1000, "p"), "max_tokens": 100}), 400, "BadRequestError",
         "This model's maximum context length is 924 tokens. However, your request has 1000 input tokens. "
         "Please reduce the length of the input messages.")
    _err(httpx.post(comp, json={"prompt": "x", "max_tokens": 0}), 400, "BadRequestError",
         "max_tokens must be at least 1, got 0.")
    _err(httpx.post(chat, json={"messages": msgs, "max_tokens": -3}), 400, "BadRequestError",
         "max_tokens must be at least 1, got -3.")
    _err(httpx.post(comp, json={"prompt": ""}), 400, "BadRequestError", "The decoder prompt cannot be empty")
    _err(httpx.post(comp, json={"prompt": "x", "n": 2}), 400, "BadRequestError")
    _err(httpx.post(comp, json={"prompt": "x", "priority": 3}), 400, "BadRequestError",
         "Got priority 3 but Priority scheduling is not enabled.")
    _err(httpx.post(comp, json={"prompt": "x"}, headers={"x-sim-output-tokens": "lots"}), 400, "BadRequestError")
    _err(httpx.post(comp, json={"prompt": [5, -1]}), 400, "BadRequestError")
    _err(httpx.post(comp, json={"prompt": ["a", "b"]}), 400, "BadRequestError")
    _err(httpx.post(comp, json={"prompt": "x", "stream_options": {"include_usage": True}}), 400, "Bad Request",
         "Stream options can only be defined when `stream=True`.")
    r = httpx.get("/v1/nothing")
    assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})
    r = httpx.get("/v1/completions")
    assert (r.status_code, r.json()) == (405, {"detail": "Method Not Allowed"})
    # and a good request still works afterwards
    assert httpx.post(comp, json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_openai_client_sees_vllm_errors(sim_fleet):
    url = sim_fleet(1, time_scale=20, profile_overrides=SMALL).urls[0]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5000)
    assert exc.value.status_code == 400 and "maximum context length" in exc.value.message


def test_tokenize_detokenize(sim_url):
    r = httpx.post(sim_url + "/tokenize", json={"prompt": "hello world!"})
    assert r.json()["count"] == count_tokens("hello world!") == 3
    assert list(r.json()) == ["count", "max_model_len", "tokens", "token_strs"]
    assert r.json()["max_model_len"] == 131072 and len(r.json()["tokens"]) == 3
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(sim_url + "/tokenize", json={"messages": msgs, "return_token_strs": True})
    assert r.json()["count"] == count_tokens(render_chat(msgs))
    assert "".join(r.json()["token_strs"]) == render_chat(msgs)
    tokens = r.json()["tokens"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    assert httpx.post(sim_url + "/tokenize", json={"messages": parts}).json()["count"] == r.json()["count"]
    text = httpx.post(sim_url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert count_tokens(text) == len(tokens)
    _err(httpx.post(sim_url + "/tokenize", json={}), 400, "Bad Request")
    _err(httpx.post(sim_url + "/detokenize", json={"tokens": "abc"}), 400, "Bad Request")
    _err(httpx.post(sim_url + "/tokenize", json={"prompt": "x", "model": "other"}), 404, "NotFoundError")


# --- /metrics --------------------------------------------------------------------------------------------
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    "vllm:e2e_request_latency_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                                         50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
}


def test_metrics_names_labels_buckets_and_counters(sim_url):
    before = metrics(sim_url)
    for reason in ("stop", "length", "abort"):
        assert before[f"vllm:request_success_total{{finished_reason={reason}}}"] == 0
    prompt = "count these prompt tokens please"
    httpx.post(sim_url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "ignore_eos": True})
    text = httpx.get(sim_url + "/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    counters = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
                "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success")
    histograms = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                  "vllm:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds",
                  "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                  "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
                  "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
                  "vllm:request_generation_tokens", "vllm:iteration_tokens_total")
    for name in gauges:
        assert fams[name].type == "gauge"
    for name in counters:
        assert fams[name].type == "counter"
    for name in histograms:
        assert fams[name].type == "histogram"
    for name in gauges + counters + histograms:
        for s in fams[name].samples:
            assert s.labels["engine"] == "0" and s.labels["model_name"] == MODEL, s
    for name, buckets in HISTOGRAMS.items():
        les = [float(s.labels["le"]) for s in fams[name].samples if s.name.endswith("_bucket")]
        assert les == [float(b) for b in buckets] + [float("inf")]
    assert fams["vllm:num_requests_running"].documentation == "Number of requests in model execution batches."
    assert fams["vllm:kv_cache_usage_perc"].documentation == "KV-cache usage. 1 means 100 percent usage."
    info = fams["vllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["block_size"] == "16" and info.labels["engine"] == "0"
    assert info.labels["num_gpu_blocks"] == "27255" and info.labels["enable_prefix_caching"] == "True"

    after = metrics(sim_url)
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == count_tokens(prompt)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 4
    assert after["vllm:request_success_total{finished_reason=length}"] == 1
    assert after["vllm:time_to_first_token_seconds_count"] == 1
    assert after["vllm:inter_token_latency_seconds_count"] == 3
    assert after["vllm:time_per_output_token_seconds_count"] == 3
    assert after["vllm:request_generation_tokens_sum"] == 4
    # model time: TTFT >= the profile's 15 ms API overhead; ITL at least one decode step of the H100 profile. The
    # upper bounds only say "seconds, not milliseconds": a loaded machine delays the simulated engine's loop (one
    # run saw a 176 ms TTFT with both cores busy), and what it reports is the time the request really took.
    assert 0.015 <= after["vllm:time_to_first_token_seconds_sum"] < 2.0
    assert 0.005 < after["vllm:inter_token_latency_seconds_sum"] / 3 < 0.5
    om = httpx.get(sim_url + "/metrics", headers={"Accept": "application/openmetrics-text"})
    assert om.headers["content-type"].startswith("application/openmetrics-text") and om.text.endswith("# EOF\n")


# --- engine behaviour seen over HTTP ---------------------------------------------------------------------
def test_ttft_grows_with_prompt_length(sim_fleet):
    url = sim_fleet(1, time_scale=5, seed=1).urls[0]
    prefill = "vllm:request_prefill_time_seconds_sum"   # the engine's own, in model time (see the next test)
    with httpx.Client(base_url=url, timeout=30) as client:
        stream_ttft(client, {"prompt": "warm up", "max_tokens": 1})
        m0 = metrics(url)
        for i in range(3):
            stream_ttft(client, {"prompt": synthetic_text(16, i), "max_tokens": 1})
        m1 = metrics(url)
        for i in range(3):
            stream_ttft(client, {"prompt": synthetic_text(16000, i), "max_tokens": 1})
        m2 = metrics(url)
    short, long = m1[prefill] - m0[prefill], m2[prefill] - m1[prefill]
    # model: ~22 ms vs ~15 ms + 2 x 8192-token chunks (~0.45 s) per request
    assert long > short * 5, (short, long)


def test_prefix_cache_hit_lowers_ttft(sim_fleet):
    url = sim_fleet(1, time_scale=5).urls[0]
    body = {"prompt": synthetic_text(8000, "shared"), "max_tokens": 1}
    with httpx.Client(base_url=url, timeout=30) as client:
        stream_ttft(client, {"prompt": "warm up", "max_tokens": 1})
        m0 = metrics(url)
        stream_ttft(client, body)
        m1 = metrics(url)
        stream_ttft(client, body)
        m2 = metrics(url)
    assert m1["vllm:prefix_cache_hits_total"] == m0["vllm:prefix_cache_hits_total"]
    hits = m2["vllm:prefix_cache_hits_total"] - m1["vllm:prefix_cache_hits_total"]
    assert hits >= 7900 and hits % 16 == 0  # whole blocks, the last token is recomputed
    assert m2["vllm:prefix_cache_queries_total"] - m1["vllm:prefix_cache_queries_total"] == 8000
    # The engine's own prefill time (model time, from first scheduled to first token) is the part a cache hit
    # saves; the wall TTFT around it is mostly HTTP and tokenizing 8000 tokens, which no cache hit shortens and
    # a loaded machine stretches at random.
    prefill = "vllm:request_prefill_time_seconds_sum"
    first, second = m1[prefill] - m0[prefill], m2[prefill] - m1[prefill]
    assert 0 < second < first * 0.1, (first, second)


async def test_kv_exhaustion_preempts(sim_fleet):
    # 64 blocks x 16 = 1024 tokens of KV; 6 requests of 200 + 150 tokens need 2100.
    url = sim_fleet(1, time_scale=50, profile_overrides={"num_gpu_blocks": 64, "max_model_len": 1024}).urls[0]
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        rs = await asyncio.gather(*(client.post("/v1/completions", json={
            "prompt": synthetic_text(200, i), "max_tokens": 150, "ignore_eos": True}) for i in range(6)))
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 150 for r in rs)
    m = metrics(url)
    assert m["vllm:num_preemptions_total"] > 0
    assert m["vllm:request_success_total{finished_reason=length}"] == 6


async def _finish_order(url: str, priorities: list[int]) -> list[int]:
    """Occupy the single slot, queue requests with these priorities, return their completion order."""
    order: list[int] = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        async def one(i: int, prio: int) -> None:
            body = {"prompt": f"q{i}", "max_tokens": 2, "ignore_eos": True}
            if prio:
                body["priority"] = prio
            await client.post("/v1/completions", json=body)
            order.append(i)

        tasks = []
        # a practically endless stream holds the slot until we hang up on it (its abort frees the slot)
        async with client.stream("POST", "/v1/completions", json={
                "prompt": "blocker", "max_tokens": 100_000, "ignore_eos": True, "stream": True}):
            await _wait_state(client, lambda s: s["running"] == 1)
            for i, prio in enumerate(priorities):
                tasks.append(asyncio.ensure_future(one(i, prio)))
                await _wait_state(client, lambda s, n=i + 1: s["waiting"] == n)
        await asyncio.gather(*tasks)
    return order


async def _wait_state(client: httpx.AsyncClient, cond, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = (await client.get("/sim/state")).json()
        if cond(state):
            return state
        assert time.monotonic() < deadline, state
        await asyncio.sleep(0.002)


async def test_priority_overtakes_fcfs(sim_fleet):
    # One sequence slot: everything else queues; lower priority value = served first (vLLM semantics).
    prio = sim_fleet(1, time_scale=10, scheduling_policy="priority",
                     profile_overrides={"max_num_seqs": 1}).urls[0]
    fcfs = sim_fleet(1, time_scale=10, profile_overrides={"max_num_seqs": 1}).urls[0]
    assert await _finish_order(prio, [5, 5, 5, -1]) == [3, 0, 1, 2]
    assert await _finish_order(fcfs, [0, 0, 0, 0]) == [0, 1, 2, 3]


async def test_client_disconnect_aborts(sim_url):
    body = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 5000, "ignore_eos": True,
            "stream": True}
    async with httpx.AsyncClient(base_url=sim_url, timeout=30) as client, \
            client.stream("POST", "/v1/chat/completions", json=body) as r:
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break
        assert metrics(sim_url)["vllm:num_requests_running"] == 1
    # leaving the block closed the connection mid-stream
    poll(lambda: metrics(sim_url)["vllm:request_success_total{finished_reason=abort}"] == 1)
    m = metrics(sim_url)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0


async def test_sleep_wake(sim_fleet):
    url = sim_fleet(1, time_scale=10).urls[0]  # wake-up costs 1.0 model s = 0.1 s wall
    body = {"prompt": synthetic_text(600, "cached"), "max_tokens": 2, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        await client.post("/v1/completions", json=body)
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}
        r = await client.post("/sleep", params={"level": 1})
        assert (r.status_code, r.content) == (200, b"")
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
        hits_before = metrics(url)["vllm:prefix_cache_hits_total"]
        pending = asyncio.ensure_future(client.post("/v1/completions", json=body))
        await _wait_state(client, lambda s: s["waiting"] == 1)
        assert not pending.done()
        assert (await client.get("/sim/state")).json()["waiting"] == 1  # still parked while asleep
        t0 = time.perf_counter()
        r = await client.post("/wake_up")
        assert r.status_code == 200 and time.perf_counter() - t0 >= 0.09
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}
        assert (await pending).json()["usage"]["completion_tokens"] == 2
        # the cache was dropped on sleep: the repeated prompt found nothing
        assert metrics(url)["vllm:prefix_cache_hits_total"] == hits_before
        r = await client.post("/sleep", params={"level": "x"})
        assert r.status_code == 400


def test_reset_prefix_cache(sim_url):
    body = {"prompt": synthetic_text(400, "r"), "max_tokens": 1}
    httpx.post(sim_url + "/v1/completions", json=body)
    httpx.post(sim_url + "/v1/completions", json=body)
    hits = metrics(sim_url)["vllm:prefix_cache_hits_total"]
    assert hits > 0
    assert httpx.post(sim_url + "/reset_prefix_cache").status_code == 200
    httpx.post(sim_url + "/v1/completions", json=body)
    assert metrics(sim_url)["vllm:prefix_cache_hits_total"] == hits


def test_dev_mode_off_hides_sleep_routes(sim_fleet):
    url = sim_fleet(1, time_scale=20, dev_mode=False).urls[0]
    assert httpx.post(url + "/sleep").status_code == 404
    assert httpx.get(url + "/is_sleeping").status_code == 404


async def test_queue_time_is_waiting_for_a_slot_not_for_the_next_step(sim_fleet):
    """vLLM takes new requests in between engine steps and stamps them QUEUED there: a request that finds a free slot
    has a queue time of 0 however long the step it arrived in, one that waits for a slot counts that wait."""
    url = sim_fleet(1, time_scale=5, profile_overrides={"max_num_seqs": 2}).urls[0]
    q = "vllm:request_queue_time_seconds"
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        def post(i: int, tokens: int):
            return client.post("/v1/completions", json={"prompt": synthetic_text(64, i), "max_tokens": tokens,
                                                        "ignore_eos": True})
        long = asyncio.ensure_future(post(0, 2000))   # holds one slot to the end (cancelled there)

        async def long_is_running() -> bool:
            return (metric((await client.get("/metrics")).text, "vllm:num_requests_running") or 0) >= 1
        await apoll(long_is_running, what="the long request in the running batch")
        m0 = metrics(url)
        assert (await post(1, 5)).status_code == 200           # the second slot is free
        m1 = metrics(url)
        assert m1[q + "_count"] - m0[q + "_count"] == 1
        assert m1[q + "_sum"] - m0[q + "_sum"] < 1e-6
        both = await asyncio.gather(post(2, 40), post(3, 5))   # one slot for two: one of them waits
        m2 = metrics(url)
        assert all(r.status_code == 200 for r in both) and not long.done()
        assert m2[q + "_count"] - m1[q + "_count"] == 2
        assert m2[q + "_sum"] - m1[q + "_sum"] > 0.01          # model seconds of the other's decode
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)
