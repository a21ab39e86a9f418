"""Request shaping for vLLM's OpenAI server: what the gateway changes in a body before sending it."""

from __future__ import annotations

from typing import Any

import orjson

from engine_adapters.base import ShapedRequest


def shape_for_vllm(raw: bytes, body: dict[str, Any], stream: bool, changed: bool) -> ShapedRequest:
    """Forward `raw` untouched unless something must change.

    A stream without `stream_options.include_usage` gets it switched on so the gateway learns the
    exact token counts; the relay then strips the usage event again (docs/reference/vllm-interface.md §2).
    """
    strip = False
    if stream:
        opts = body.get("stream_options")
        if not (isinstance(opts, dict) and opts.get("include_usage") is True):
            body["stream_options"] = {**opts, "include_usage": True} if isinstance(opts, dict) else {
                "include_usage": True}
            strip = changed = True
    return ShapedRequest(orjson.dumps(body) if changed else raw, strip)
