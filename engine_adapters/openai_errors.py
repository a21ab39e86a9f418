"""OpenAI-style error bodies and SSE error events: the wire format vLLM sends and the gateway answers in.

Body shape (OpenAI API reference, "Error codes"): {"error": {"message", "type", "param", "code"}}. A stream
that fails after its 200 ends with that body as an ordinary data event, then [DONE], as vLLM does it
(docs/reference/vllm-interface.md §2). The gateway re-exports both from gateway/wire/errors.py.
"""

from __future__ import annotations

import orjson


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type, "param": param, "code": code}})


def sse_error_event(message: str, type: str = "upstream_error", code: str | None = "worker_failed") -> bytes:
    """A mid-stream error as vLLM sends it: an ordinary data event, then [DONE]."""
    return b"data: " + error_body(message, type, None, code) + b"\n\ndata: [DONE]\n\n"


__all__ = ["error_body", "sse_error_event"]
