"""The vLLM engine adapter: /metrics parsing, SSE scanning and stripping, request shaping, usage."""

from __future__ import annotations

import random
import re
from pathlib import Path

import httpx
import orjson
import pytest

from engine_adapters.vllm import VllmAdapter
from engine_adapters.vllm.metrics_parser import parse_vllm_metrics
from engine_adapters.vllm.sse import VllmStreamScanner

SAMPLE = Path(__file__).parent / "data" / "vllm-cpu-metrics-sample.txt"
adapter = VllmAdapter()


# --- /metrics ------------------------------------------------------------------------------------

def _value(text: str, name: str) -> float:
    """Independent reference: the single sample of `name` found with a plain regex."""
    m = re.search(rf"^{re.escape(name)}(?:{{[^\n]*}})? ([^ \n]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_metrics_sample_from_real_vllm() -> None:
    text = SAMPLE.read_text()
    m = parse_vllm_metrics(text, now=123.0)
    assert m.running == _value(text, "vllm:num_requests_running")
    assert m.waiting == _value(text, "vllm:num_requests_waiting")
    assert m.kv_usage == _value(text, "vllm:kv_cache_usage_perc")
    assert m.prefix_cache_queries == _value(text, "vllm:prefix_cache_queries_total")
    assert m.prefix_cache_hits == _value(text, "vllm:prefix_cache_hits_total")
    info = re.search(r"^vllm:cache_config_info\{(.*)\}", text, re.M).group(1)
    assert m.num_gpu_blocks == int(re.search(r'\bnum_gpu_blocks="(\d+)"', info).group(1))
    assert m.block_size == int(re.search(r'\bblock_size="(\d+)"', info).group(1))
    assert m.scraped_at == 123.0
    # the look-alike series must not leak in
    assert "vllm:num_requests_waiting_by_reason" in text and "vllm:external_prefix_cache_queries_total" in text


def test_metrics_label_order_old_names_timestamps_and_engines() -> None:
    rng = random.Random(7)
    run = [rng.randint(0, 50) for _ in range(2)]
    wait = [rng.randint(0, 50) for _ in range(2)]
    kv = [round(rng.random(), 4) for _ in range(2)]
    text = "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f'vllm:num_requests_running{{model_name="m",engine="0"}} {run[0]}.0',
        f'vllm:num_requests_running{{engine="1",model_name="m"}} {run[1]}.0 1700000000000',
        f"vllm:num_requests_waiting {wait[0]}",
        f'vllm:num_requests_waiting{{engine="1", model_name="with \\"quotes\\" and }} brace"}} {wait[1]}',
        # pre-0.9 name only: still understood
        f'vllm:gpu_cache_usage_perc{{engine="0",model_name="m"}} {kv[0]}',
        f'vllm:gpu_cache_usage_perc{{engine="1",model_name="m"}} {kv[1]}',
        # counters without _total (multiprocess exposition) and the deprecated gpu_ aliases
        'vllm:gpu_prefix_cache_queries{model_name="m"} 500',
        'vllm:gpu_prefix_cache_hits_total{model_name="m"} 100',
        'vllm:cache_config_info{num_gpu_blocks="None",block_size="16",engine="0"} 1.0',
        "vllm:garbage_line_without_value",
        "vllm:num_requests_running{broken",
        "",
    ])
    m = parse_vllm_metrics(text)
    assert m.running == sum(run)
    assert m.waiting == sum(wait)
    assert m.kv_usage == pytest.approx(sum(kv) / 2)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (500, 100)
    assert (m.num_gpu_blocks, m.block_size) == (None, 16)


def test_metrics_new_names_win_over_deprecated_aliases() -> None:
    text = "\n".join([
        'vllm:gpu_cache_usage_perc{engine="0"} 0.9',
        'vllm:kv_cache_usage_perc{engine="0"} 0.25',
        'vllm:gpu_prefix_cache_queries_total{engine="0"} 10',
        'vllm:prefix_cache_queries_total{engine="0"} 40',
    ])
    m = parse_vllm_metrics(text)
    assert m.kv_usage == 0.25 and m.prefix_cache_queries == 40


def test_metrics_empty_or_foreign_text_gives_defaults() -> None:
    for text in ("", "# nothing\nprocess_cpu_seconds_total 3.0\n", "\x00\xff garbage {{{"):
        m = parse_vllm_metrics(text)
        assert (m.running, m.waiting, m.kv_usage, m.num_gpu_blocks) == (0, 0, 0, None)


def test_metrics_from_the_simulator(sim_url: str) -> None:
    text = httpx.get(sim_url + "/metrics").text
    m = parse_vllm_metrics(text)
    state = httpx.get(sim_url + "/sim/state").json()
    info = re.search(r"^vllm:cache_config_info\{(.*)\}", text, re.M).group(1)
    assert m.num_gpu_blocks == int(re.search(r'\bnum_gpu_blocks="(\d+)"', info).group(1))
    assert m.block_size == int(re.search(r'\bblock_size="(\d+)"', info).group(1))
    assert m.running == _value(text, "vllm:num_requests_running") == 0
    assert m.waiting == 0 and m.kv_usage == 0
    assert state["model"]


# --- SSE -------------------------------------------------------------------------------------------

def _chat_events(n_tokens: int, with_usage: bool) -> list[bytes]:
    head = b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":1,"model":"M","choices":['
    events = [head + b'{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n']
    for i in range(n_tokens):
        fin = b'"stop"' if i == n_tokens - 1 else b"null"
        events.append(head + b'{"index":0,"delta":{"content":" w%d"},"logprobs":null,"finish_reason":%s}]}\n\n'
                      % (i, fin))
    if with_usage:
        events.append(head + b'],"usage":{"prompt_tokens":12,"total_tokens":%d,"completion_tokens":%d}}\n\n'
                      % (12 + n_tokens, n_tokens))
    events.append(b"data: [DONE]\n\n")
    return events


def _feed_in_pieces(scanner: VllmStreamScanner, data: bytes, cuts: list[int]) -> bytes:
    out = []
    prev = 0
    for c in [*cuts, len(data)]:
        out.append(scanner.feed(data[prev:c]))
        prev = c
    return b"".join(out)


@pytest.mark.parametrize("strip", [False, True])
def test_sse_scanner_any_split_keeps_bytes_and_finds_usage(strip: bool) -> None:
    events = _chat_events(5, with_usage=True)
    data = b"".join(events)
    expected = b"".join(e for e in events if b'"choices":[]' not in e) if strip else data
    rng = random.Random(1)
    for trial in range(200):
        cuts = sorted(rng.sample(range(1, len(data)), k=rng.randint(0, 12))) if trial else list(range(1, len(data)))
        s = VllmStreamScanner(strip_usage=strip)
        assert _feed_in_pieces(s, data, cuts) == expected
        assert s.done and s.tokens == 5
        assert (s.usage.prompt_tokens, s.usage.completion_tokens) == (12, 5)
        assert s.at_boundary()


def test_sse_scanner_without_usage_event_and_error_event_framing() -> None:
    events = _chat_events(3, with_usage=False)
    data = b"".join(events)
    s = VllmStreamScanner(strip_usage=False)
    assert s.feed(data[:-5]) == data[:-5]
    assert s.usage is None and not s.done and s.tokens == 3
    # mid-event: the error event must start on a fresh event boundary
    err = s.error_event("worker died")
    assert err.startswith(b"\n\n") and err.endswith(b"data: [DONE]\n\n")
    payload = orjson.loads(err.strip().split(b"\n\n")[0][len(b"data: "):])
    assert payload["error"]["message"] == "worker died"


def test_shaping_forwards_raw_bytes_unless_usage_must_be_injected() -> None:
    raw = b'{"model": "m", "prompt": "x", "stream": false}'
    shaped = adapter.shape_request(raw, orjson.loads(raw), stream=False, changed=False)
    assert shaped.body is raw and not shaped.strip_usage
    raw = b'{"model":"m","prompt":"x","stream":true,"stream_options":{"include_usage":true}}'
    shaped = adapter.shape_request(raw, orjson.loads(raw), stream=True, changed=False)
    assert shaped.body is raw and not shaped.strip_usage
    raw = b'{"model":"m","prompt":"x","stream":true,"stream_options":{"continuous_usage_stats":false}}'
    shaped = adapter.shape_request(raw, orjson.loads(raw), stream=True, changed=False)
    assert shaped.strip_usage
    assert orjson.loads(shaped.body)["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}


def test_usage_and_models_parsing() -> None:
    body = orjson.dumps({"id": "x", "choices": [{"text": '"usage": {"prompt_tokens": 1}'}],
                         "usage": {"prompt_tokens": 31, "total_tokens": 40, "completion_tokens": 9}})
    u = adapter.parse_usage(body)
    assert (u.prompt_tokens, u.completion_tokens) == (31, 9)
    assert adapter.parse_usage(b'{"error": {"message": "x"}}') is None
    cards = adapter.parse_models(b'{"object":"list","data":[{"id":"a"},{"nope":1},"junk",{"id":"b","root":"r"}]}')
    assert [c["id"] for c in cards] == ["a", "b"]
    assert adapter.parse_models(b"not json") == [] and adapter.parse_models(b"[1,2]") == []
