"""Sampling fields checked before a request is sent anywhere, answered in OpenAI's error shape.

Only the type and the range OpenAI documents (API reference, "Create chat completion") are checked; what
an engine additionally refuses (e.g. `n` > 1 on an engine without parallel sampling) stays its answer,
translated into OpenAI's shape by the engine adapter. Absent and null fields are the engine's defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from gateway.wire import errors


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # not NaN


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _stop(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and len(v) <= 64 and all(isinstance(s, str) for s in v))


# field -> (valid?, what it must be)
_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("temperature", lambda v: _number(v) and 0 <= v <= 2, "a number between 0 and 2"),
    ("top_p", lambda v: _number(v) and 0 < v <= 1, "a number greater than 0 and at most 1"),
    ("n", lambda v: _integer(v) and 1 <= v <= 128, "an integer between 1 and 128"),
    ("presence_penalty", lambda v: _number(v) and -2 <= v <= 2, "a number between -2 and 2"),
    ("frequency_penalty", lambda v: _number(v) and -2 <= v <= 2, "a number between -2 and 2"),
    ("seed", _integer, "an integer"),
    ("stop", _stop, "a string or an array of strings"),
    ("top_k", lambda v: _integer(v) and (v == -1 or v >= 0), "an integer: -1 or 0 (off) or a positive count"),
    ("min_p", lambda v: _number(v) and 0 <= v <= 1, "a number between 0 and 1"),
)


def check_sampling(body: dict[str, Any]) -> None:
    """Raise a 400 (OpenAI's `invalid_request_error`, `param` = the field) for the first bad sampling field."""
    for key, ok, what in _RULES:
        v = body.get(key)
        if v is not None and not ok(v):
            raise errors.bad_request(f"`{key}` must be {what}, got {_short(v)}.", key)


def _short(v: Any) -> str:
    text = repr(v) if isinstance(v, float) else orjson.dumps(v).decode()
    return text if len(text) <= 40 else text[:37] + "..."
