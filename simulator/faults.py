"""Fault injection for one simulated vLLM server (sim-only; real vLLM has nothing like it).

A `Faults` object is read by the server on every generation request and by the driver on every
engine step. It is set at start (fleet YAML / CLI) and changed at run time through the admin
endpoints `GET/POST/DELETE /sim/faults` (see simulator/vllm_api.py).

    drop_after_tokens  close the TCP connection once a response has carried N tokens (0: before any)
    hang               accept generation requests and never answer (until the client goes away)
    slowdown           every engine iteration takes this many times longer (1.0: normal)
    stall_after_tokens the engine freezes once a request has generated N tokens (N >= 1): that response stops
                       after its Nth token and stays open, no request gets another token, new ones get none, while
                       /health keeps answering (a deadlocked engine behind a live API server: a zombie only its
                       pace gives away); clearing the fault lets the engine go on. Unlike slowdown, the point
                       where the stall starts does not depend on when the fault was posted
    error_status       answer generation requests with this status (429 or 5xx) and a vLLM-style error body: 5xx
                       as a failing engine answers; 429 as a worker behind its own rate limiter or router does
                       (vLLM itself refuses overload with 503, docs/reference/vllm-interface.md §1.2)
    error_rate         fraction of generation requests that get `error_status` (default all)
    health_fail        /health and /ping answer 503 (as vLLM does when its engine is dead)
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields
from typing import Any

_FIELDS = ("drop_after_tokens", "hang", "slowdown", "stall_after_tokens", "error_status", "error_rate", "health_fail")


class FaultConfigError(ValueError):
    """A fault specification that cannot be applied; the message says which field and why."""


@dataclass(slots=True)
class Faults:
    drop_after_tokens: int | None = None
    hang: bool = False
    slowdown: float = 1.0
    stall_after_tokens: int | None = None
    error_status: int | None = None
    error_rate: float = 1.0
    health_fail: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def update(self, spec: dict[str, Any]) -> None:
        """Apply a partial spec (unknown keys and bad values raise FaultConfigError, nothing changes)."""
        merged = parse_faults(spec, base=self)
        for f in fields(self):
            setattr(self, f.name, getattr(merged, f.name))

    def reset(self) -> None:
        self.update(Faults().to_dict())

    @property
    def active(self) -> bool:
        return self != Faults()

    def should_error(self, rng: random.Random) -> bool:
        return self.error_status is not None and (self.error_rate >= 1.0 or rng.random() < self.error_rate)


def parse_faults(spec: dict[str, Any] | None, base: Faults | None = None) -> Faults:
    """Validate a fault spec (a mapping from YAML or JSON) into a new Faults, starting from `base`."""
    out = Faults(**(base.to_dict() if base else {}))
    if spec is None:
        return out
    if not isinstance(spec, dict):
        raise FaultConfigError("faults must be a JSON object")
    unknown = sorted(set(spec) - set(_FIELDS))
    if unknown:
        raise FaultConfigError(f"unknown fault field(s) {unknown}; known: {list(_FIELDS)}")
    if "drop_after_tokens" in spec:
        out.drop_after_tokens = _opt_int(spec, "drop_after_tokens", lo=0)
    if "hang" in spec:
        out.hang = _bool(spec, "hang")
    if "slowdown" in spec:
        v = spec["slowdown"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise FaultConfigError("slowdown must be a number > 0")
        out.slowdown = float(v)
    if "stall_after_tokens" in spec:
        out.stall_after_tokens = _opt_int(spec, "stall_after_tokens", lo=1)
    if "error_status" in spec:
        v = spec["error_status"]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not (v == 429 or 500 <= v <= 599)):
            raise FaultConfigError("error_status must be null, 429 or an integer in [500, 599]")
        out.error_status = v
    if "error_rate" in spec:
        v = spec["error_rate"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise FaultConfigError("error_rate must be a number in [0, 1]")
        out.error_rate = float(v)
    if "health_fail" in spec:
        out.health_fail = _bool(spec, "health_fail")
    return out


def _opt_int(spec: dict[str, Any], key: str, lo: int, hi: int | None = None) -> int | None:
    v = spec[key]
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise FaultConfigError(f"{key} must be null or an integer {bound}")
    return v


def _bool(spec: dict[str, Any], key: str) -> bool:
    v = spec[key]
    if not isinstance(v, bool):
        raise FaultConfigError(f"{key} must be true or false")
    return v
