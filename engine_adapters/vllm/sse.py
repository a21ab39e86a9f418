"""Scan vLLM's OpenAI SSE stream without re-serializing it (docs/reference/vllm-interface.md §2).

Each event is `data: <json>\\n\\n`; the stream ends with `data: [DONE]\\n\\n`. With
`stream_options.include_usage` the last JSON event has `"choices":[]` and a `usage` object. The
scanner counts output-token events, picks up usage, and, when the gateway (not the client) asked for
usage, removes that event and nothing else, so the client sees the worker's framing byte for byte.
"""

from __future__ import annotations

import orjson

from engine_adapters.base import StreamScanner, Usage
from engine_adapters.openai_errors import sse_error_event

EVENT_END = b"\n\n"
DONE_EVENT = b"data: [DONE]"
_EMPTY_CHOICES = b'"choices":[]'
_USAGE_KEY = b'"usage":{'
# Events that carry no output token: the chat role preamble and an empty finish delta.
_ROLE_DELTA = b'"delta":{"role":"assistant","content":""}'
_EMPTY_DELTA = b'"delta":{}'


class VllmStreamScanner(StreamScanner):
    """`whole_events`: forward only complete events (a stream that may be resumed must never leave the client
    half an event); the bytes are the same, at most held back until their event is complete."""

    __slots__ = ("strip_usage", "whole", "tokens", "usage", "done", "_tail")

    def __init__(self, strip_usage: bool = False, whole_events: bool = False) -> None:
        self.strip_usage = strip_usage
        self.whole = strip_usage or whole_events
        self.tokens = 0
        self.usage: Usage | None = None
        self.done = False
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._tail + chunk if self._tail else chunk
        end = data.rfind(EVENT_END)
        if end < 0:
            self._tail = data
            return b"" if self.whole else chunk
        cut = end + 2
        if cut == len(data):  # the usual case: the chunk ends on an event boundary, nothing to copy
            complete = data
            self._tail = b""
        else:
            complete = data[:cut]
            self._tail = data[cut:]
        usage_at = self._scan(complete)
        if not self.strip_usage:
            return complete if self.whole else chunk
        if usage_at is None:
            return complete
        # drop exactly the usage event (start..its terminating blank line), keep the rest as sent
        start, stop = usage_at
        return complete[:start] + complete[stop:]

    def _scan(self, complete: bytes) -> tuple[int, int] | None:
        """Update counters from whole events; return the (start, stop) span of a usage event."""
        span = None
        pos = 0
        n = len(complete)
        find, starts = complete.find, complete.startswith  # searched in place: no copy per event
        while pos < n:
            stop = find(EVENT_END, pos)
            if stop < 0:
                break
            stop += 2
            if starts(DONE_EVENT, pos, stop):
                self.done = True
            elif find(_USAGE_KEY, pos, stop) >= 0 and find(_EMPTY_CHOICES, pos, stop) >= 0:
                self.usage = _usage_from_event(complete[pos:stop]) or self.usage
                span = (pos, stop)
            elif starts(b"data: {", pos, stop) and find(_ROLE_DELTA, pos, stop) < 0 \
                    and find(_EMPTY_DELTA, pos, stop) < 0 and not starts(b'data: {"error"', pos, stop):
                self.tokens += 1
            pos = stop
        return span

    def at_boundary(self) -> bool:
        return self.whole or not self._tail

    def error_event(self, message: str) -> bytes:
        prefix = b"" if self.at_boundary() else EVENT_END
        return prefix + sse_error_event(message)


def _usage_from_event(ev: bytes) -> Usage | None:
    try:
        obj = orjson.loads(ev[5:].strip())
    except orjson.JSONDecodeError:
        return None
    return usage_from_obj(obj)


def usage_from_obj(obj: object) -> Usage | None:
    u = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(u, dict):
        return None
    p, c = u.get("prompt_tokens"), u.get("completion_tokens")
    if not isinstance(p, int) or not isinstance(c, int):
        return None
    return Usage(prompt_tokens=p, completion_tokens=c)
