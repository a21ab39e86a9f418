"""The vLLM engine adapter: glue over the format helpers in this package."""

from __future__ import annotations

import re
from typing import Any

import orjson

from engine_adapters.base import EngineAdapter, ShapedRequest, Usage
from engine_adapters.types import EngineMetrics
from engine_adapters.vllm.errors import context_exceeded, openai_error_body
from engine_adapters.vllm.metrics_parser import parse_vllm_metrics
from engine_adapters.vllm.shaping import shape_for_vllm
from engine_adapters.vllm.sse import VllmStreamScanner

_PROMPT_RE = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION_RE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


class VllmAdapter(EngineAdapter):
    name = "vllm"

    def shape_request(self, raw: bytes, body: dict[str, Any], stream: bool, changed: bool) -> ShapedRequest:
        return shape_for_vllm(raw, body, stream, changed)

    def openai_error(self, status: int, body: bytes) -> bytes:
        return openai_error_body(status, body)

    def context_exceeded(self, status: int, body: bytes) -> bool:
        return status == 400 and context_exceeded(body)

    def new_stream_scanner(self, strip_usage: bool, whole_events: bool = False) -> VllmStreamScanner:
        return VllmStreamScanner(strip_usage, whole_events)

    def parse_usage(self, body: bytes) -> Usage | None:
        # The usage object is the last top-level key family in vLLM's responses (docs/reference/vllm-interface.md §1.3); scan
        # from its position instead of decoding the whole document.
        at = body.rfind(b'"usage"')
        if at < 0:
            return None
        p = _PROMPT_RE.search(body, at)
        c = _COMPLETION_RE.search(body, at)
        if p is None or c is None:
            return None
        return Usage(prompt_tokens=int(p.group(1)), completion_tokens=int(c.group(1)))

    def parse_metrics(self, text: str, now: float) -> EngineMetrics:
        return parse_vllm_metrics(text, now)

    def parse_models(self, payload: bytes) -> list[dict[str, Any]]:
        """Cards from `{"object": "list", "data": [{"id": ...}, ...]}`; malformed entries are skipped."""
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return []
        data = obj.get("data") if isinstance(obj, dict) else None
        if not isinstance(data, list):
            return []
        return [card for card in data if isinstance(card, dict) and isinstance(card.get("id"), str)]
