"""Model fallbacks: which failure of a request that has not started lets it move to another model, and to which
models, in which order. Pure: the gateway's pipeline (gateway/pipeline/dispatch.py `place_again`, FALL_BACK) asks here.

Rules:
- Only a failure before the client saw a byte moves a request, and only one the model (not the caller) caused:
  no worker of the model in rotation, a 429 (the gateway's admission or a worker's), a 5xx or an unreachable
  worker, no first byte in time; the model's `fallbacks` then apply. A prompt longer than the model's context
  takes its `context_window_fallbacks` instead. A caller's own rate limit or a worker's other 4xx moves nothing.
- The requested model's lists are followed in order, aliases resolved; a fallback's own lists are not (no
  chains), nor a model the request was placed on already, nor one the caller may not use.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

NO_WORKER = "no_worker"          # no worker of the model in rotation
REFUSED = "refused"              # 429: the gateway's admission or the workers'
ERROR = "error"                  # a 5xx answer or an unreachable worker
TIMEOUT = "timeout"              # no first byte in time
CONTEXT_WINDOW = "context_window"  # the prompt is longer than the model's context


def refusal_reason(status: int, too_long: bool = False) -> str | None:
    """Why a request the gateway itself could not place (its error's `status`; `too_long`: over every
    candidate's context) may fall back, or None (it may not)."""
    if too_long:
        return CONTEXT_WINDOW
    if status == 503:
        return NO_WORKER
    return REFUSED if status == 429 else None


def failure_reason(status: int | None, timed_out: bool, too_long: bool) -> str | None:
    """Why a request whose workers all failed before its first byte may fall back, or None: `status` the last
    worker's answer (None: no answer, `timed_out` or unreachable), `too_long` its refusal of a prompt over its
    context."""
    if too_long:
        return CONTEXT_WINDOW
    if status is None:
        return TIMEOUT if timed_out else ERROR
    if status == 429:
        return REFUSED
    return ERROR if status >= 500 else None


def fallback_targets(fallbacks: Sequence[str], context_window_fallbacks: Sequence[str], reason: str,
                     aliases: Mapping[str, str], placed_on: Collection[str],
                     may_use: Callable[[str], bool] | None = None) -> list[str]:
    """The models a request may still move to for `reason`, in order: the requested model's list for it,
    aliases resolved, without repeats, the models in `placed_on` (the requested one first) and those `may_use`
    refuses."""
    names = [aliases.get(m, m) for m in (context_window_fallbacks if reason == CONTEXT_WINDOW else fallbacks)]
    return [m for i, m in enumerate(names) if m not in placed_on and m not in names[:i]
            and (may_use is None or may_use(m))]
