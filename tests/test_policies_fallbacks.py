"""policies/fallbacks.py: which failures move a request to another model, and to which models in which order."""

from __future__ import annotations

from policies.fallbacks import (
    CONTEXT_WINDOW,
    ERROR,
    NO_WORKER,
    REFUSED,
    TIMEOUT,
    failure_reason,
    fallback_targets,
    refusal_reason,
)


def test_the_gateways_own_refusals() -> None:
    assert refusal_reason(503) == NO_WORKER
    assert refusal_reason(429) == REFUSED
    assert refusal_reason(400, too_long=True) == CONTEXT_WINDOW
    assert refusal_reason(400) is None and refusal_reason(404) is None


def test_worker_failures_before_the_first_byte() -> None:
    assert failure_reason(None, True, False) == TIMEOUT
    assert failure_reason(None, False, False) == ERROR            # unreachable
    assert failure_reason(503, False, False) == ERROR
    assert failure_reason(500, False, False) == ERROR
    assert failure_reason(429, False, False) == REFUSED
    assert failure_reason(400, False, True) == CONTEXT_WINDOW
    assert failure_reason(400, False, False) is None              # the client's own bad request
    assert failure_reason(422, False, False) is None


def test_targets_in_order_aliases_resolved_without_the_models_tried_or_forbidden() -> None:
    aliases = {"fast": "m-fast"}
    fb, cw = ["fast", "m2", "m-fast", "m3", "m1"], ["m-long"]
    assert fallback_targets(fb, cw, ERROR, aliases, ["m1"]) == ["m-fast", "m2", "m3"]
    assert fallback_targets(fb, cw, REFUSED, aliases, ["m1", "m-fast"]) == ["m2", "m3"]
    assert fallback_targets(fb, cw, ERROR, aliases, ["m1"], lambda m: m != "m2") == ["m-fast", "m3"]
    assert fallback_targets(fb, cw, CONTEXT_WINDOW, aliases, ["m1"]) == ["m-long"]
    assert fallback_targets([], cw, NO_WORKER, aliases, ["m1"]) == []
