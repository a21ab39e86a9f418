"""Fast reader for the few vLLM /metrics series a router needs (docs/reference/vllm-interface.md §3).

One pass over the lines; only lines starting with "vllm:" are looked at and only the wanted names are
parsed. Tolerant of label order, extra labels, several engines (DP ranks: gauges are summed, usage
averaged), a trailing timestamp, missing series, counters with or without `_total`, and the
renamed/deprecated names (`gpu_cache_usage_perc` before 0.9, `gpu_prefix_cache_*` aliases).
"""

from __future__ import annotations

import math
import re

from engine_adapters.types import AWAKE, PAUSED, EngineMetrics

# exposed name -> (field, preference); a lower preference wins when both spellings are present
# (0.11 with --show-hidden-metrics exposes the new and the deprecated name with equal values).
_WANTED: dict[str, tuple[str, int]] = {
    "vllm:num_requests_running": ("running", 0),
    "vllm:num_requests_waiting": ("waiting", 0),
    "vllm:kv_cache_usage_perc": ("kv_usage", 0),
    "vllm:gpu_cache_usage_perc": ("kv_usage", 1),
    "vllm:prefix_cache_queries_total": ("prefix_cache_queries", 0),
    "vllm:prefix_cache_queries": ("prefix_cache_queries", 0),
    "vllm:gpu_prefix_cache_queries_total": ("prefix_cache_queries", 1),
    "vllm:gpu_prefix_cache_queries": ("prefix_cache_queries", 1),
    "vllm:prefix_cache_hits_total": ("prefix_cache_hits", 0),
    "vllm:prefix_cache_hits": ("prefix_cache_hits", 0),
    "vllm:gpu_prefix_cache_hits_total": ("prefix_cache_hits", 1),
    "vllm:gpu_prefix_cache_hits": ("prefix_cache_hits", 1),
    # local autoscaler (gateway/control/autoscaler.py): throughput and inter-token latency (docs/reference/vllm-interface.md §3.2)
    "vllm:generation_tokens_total": ("generation_tokens", 0),
    "vllm:generation_tokens": ("generation_tokens", 0),
    "vllm:inter_token_latency_seconds_sum": ("itl_sum", 0),
    "vllm:inter_token_latency_seconds_count": ("itl_count", 0),
    "vllm:time_per_output_token_seconds_sum": ("itl_sum", 1),
    "vllm:time_per_output_token_seconds_count": ("itl_count", 1),
}
CACHE_CONFIG_INFO = "vllm:cache_config_info"
SLEEP_STATE = "vllm:engine_sleep_state"      # 0.33: one series per state, 1 for the current one
LORA_INFO = "vllm:lora_requests_info"       # one series per adapter set seen; the value: when it was last set
_LABEL_RE = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def parse_vllm_metrics(text: str, now: float = 0.0) -> EngineMetrics:
    """EngineMetrics from a vLLM Prometheus text exposition; absent series stay at their defaults."""
    # field -> [preference, sum, count]
    acc: dict[str, list[float]] = {}
    blocks: int | None = None
    block_size: int | None = None
    sleep_state = AWAKE
    lora: tuple[float, dict[str, str]] | None = None
    for line in text.split("\n"):
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        has_labels = brace != -1 and (space == -1 or brace < space)
        name = line[:brace] if has_labels else (line[:space] if space != -1 else line)
        if name not in _WANTED and name != CACHE_CONFIG_INFO and name != SLEEP_STATE and name != LORA_INFO:
            continue  # most lines: histogram buckets and series we do not use
        labels_end = _labels_end(line, brace) if has_labels else len(name)
        if labels_end < 0:
            continue
        if name == SLEEP_STATE:
            # any engine (DP rank) not awake makes the worker not awake: it must not take requests
            state = parse_labels(line[brace + 1 : labels_end - 1]).get("sleep_state") if has_labels else None
            value = _sample_value(line, labels_end)
            if state and state != AWAKE and value == 1:
                sleep_state = state
            elif state == AWAKE and value == 0 and sleep_state == AWAKE:
                sleep_state = PAUSED      # vLLM 0.32 after /sleep?level=0: awake 0 and no other state 1
            continue
        if name == LORA_INFO:
            value = _sample_value(line, labels_end)
            if has_labels and value is not None and (lora is None or value > lora[0]):
                lora = (value, parse_labels(line[brace + 1 : labels_end - 1]))
            continue
        if name == CACHE_CONFIG_INFO:
            labels = parse_labels(line[brace + 1 : labels_end - 1]) if has_labels else {}
            blocks = _int_or_none(labels.get("num_gpu_blocks")) if blocks is None else blocks
            block_size = _int_or_none(labels.get("block_size")) if block_size is None else block_size
            continue
        want = _WANTED.get(name)
        if want is None:
            continue
        value = _sample_value(line, labels_end)
        if value is None:
            continue
        field, pref = want
        cur = acc.get(field)
        if cur is None or pref < cur[0]:
            acc[field] = [pref, value, 1]
        elif pref == cur[0]:
            cur[1] += value
            cur[2] += 1
    m = EngineMetrics(scraped_at=now, num_gpu_blocks=blocks, block_size=block_size, sleep_state=sleep_state)
    if lora is not None:
        labels = lora[1]
        m.lora_running = _names(labels.get("running_lora_adapters", ""))
        m.lora_waiting = _names(labels.get("waiting_lora_adapters", ""))
        m.max_lora = _int_or_none(labels.get("max_lora"))
    for field, (_, total, count) in acc.items():
        # usage is a fraction per engine: average it; request counts and counters add up over engines
        setattr(m, field, total / count if field == "kv_usage" else total)
    return m


def parse_labels(body: str) -> dict[str, str]:
    """`a="1",b="x"` -> {"a": "1", "b": "x"} (escapes kept as written; we only read numbers)."""
    return {m.group(1): m.group(2) for m in _LABEL_RE.finditer(body)}


def _labels_end(line: str, brace: int) -> int:
    """Index just past the closing `}` of the label set, honouring quoted values; -1 if malformed."""
    i = brace + 1
    n = len(line)
    in_quotes = False
    while i < n:
        c = line[i]
        if in_quotes:
            if c == "\\":
                i += 1
            elif c == '"':
                in_quotes = False
        elif c == '"':
            in_quotes = True
        elif c == "}":
            return i + 1
        i += 1
    return -1


def _sample_value(line: str, start: int) -> float | None:
    parts = line[start:].split()
    if not parts:
        return None
    try:
        v = float(parts[0])  # a second token, if any, is the optional timestamp
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def _int_or_none(s: str | None) -> int | None:
    if s is None:
        return None
    try:
        return int(float(s))
    except ValueError:
        return None  # "None" when vLLM has not resolved the value


def _names(joined: str) -> tuple[str, ...]:
    """vLLM joins the adapter names of vllm:lora_requests_info's labels with commas."""
    return tuple(n for n in (p.strip() for p in joined.split(",")) if n)
