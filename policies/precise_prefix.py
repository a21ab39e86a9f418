"""`precise_prefix`: weighted scorers on the exact prefix-cache view, behind a load guard.

Modelled on llm-d's scheduler (docs/reference/peer-routers.md §2: a filter, weighted scorers, a max-score picker) with its
precise prefix-cache scorer, which reads what each engine holds from vLLM's KV events rather than guessing
from what was sent (that guess is `prefix_affinity`, kept as it is for comparison). Per request:

1. filter: candidates whose load exceeds guard_factor x (min load + 1) + slack are dropped (the guard of
   `prefix_affinity`; a cache hit never justifies joining a queue far longer than the shortest);
2. score: each named scorer gives every remaining candidate a score in [0, 1]; the total is the weighted sum:
   - "prefix":   cached prompt tokens / prompt tokens (RequestFeatures.cached_prefix_tokens, exact);
   - "queue":    llm-d's queue scorer, (max load - load) / (max load - min load) over the candidates, 1 if equal;
   - "kv_cache": 1 - KV-cache usage (llm-d's kv-cache-utilization scorer);
   - "prefill":  work left to do, min-max normalised like "queue": the uncached prompt tokens of this request
                 plus the tokens already reserved on the worker (`inflight_tokens`); low is good;
3. pick: the highest total; ties go to the lower load, then rotate by id (as least_requests).

Weights are `scorers={"prefix": 3, "queue": 1, ...}` (the default); a scorer with weight 0 or absent is off. Without any
cached prefix on any candidate the choice is least_requests' (reason "prefix_miss").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from policies.base import Policy, register
from policies.baselines import NO_CANDIDATES, LeastRequests, _overloaded
from policies.types import Decision, RequestFeatures, WorkerView

# Chosen on a short grid (bench/prefix.py's workloads, other seeds / first 2000 mooncake requests): prefix 3 +
# queue 1 kept attainment at least as high as prefix 3 + queue 2 (llm-d's ratio) with 10-15 points more hits;
# "prefill" in place of "queue" did as well.
DEFAULT_SCORERS: dict[str, float] = {"prefix": 3.0, "queue": 1.0}

Scorer = Callable[[RequestFeatures, Sequence[WorkerView], Mapping[str, int]], list[float]]


def _minmax_low_is_good(values: list[float]) -> list[float]:
    lo, hi = min(values), max(values)
    if hi <= lo:
        return [1.0] * len(values)
    span = hi - lo
    return [(hi - v) / span for v in values]


def score_prefix(req: RequestFeatures, workers: Sequence[WorkerView], cached: Mapping[str, int]) -> list[float]:
    total = max(1, req.prompt_tokens)
    return [min(1.0, cached.get(w.id, 0) / total) for w in workers]


def score_queue(req: RequestFeatures, workers: Sequence[WorkerView], cached: Mapping[str, int]) -> list[float]:
    return _minmax_low_is_good([float(w.load) for w in workers])


def score_kv_cache(req: RequestFeatures, workers: Sequence[WorkerView], cached: Mapping[str, int]) -> list[float]:
    return [max(0.0, 1.0 - w.kv_usage) for w in workers]


def score_prefill(req: RequestFeatures, workers: Sequence[WorkerView], cached: Mapping[str, int]) -> list[float]:
    return _minmax_low_is_good([float(w.inflight_tokens + req.prompt_tokens - cached.get(w.id, 0)) for w in workers])


SCORERS: dict[str, Scorer] = {"prefix": score_prefix, "queue": score_queue, "kv_cache": score_kv_cache,
                              "prefill": score_prefill}


@register("precise_prefix")
class PrecisePrefix(Policy):
    name = "precise_prefix"
    needs_kv_blocks = True      # the caller fills RequestFeatures.cached_prefix_tokens from its KV-event index

    def __init__(self, scorers: Mapping[str, float] | None = None, guard_factor: float = 2.0,
                 slack: float = 4.0) -> None:
        weights = dict(DEFAULT_SCORERS if scorers is None else scorers)
        unknown = sorted(set(weights) - set(SCORERS))
        if unknown:
            raise ValueError(f"unknown scorer(s) {unknown}; known: {sorted(SCORERS)}")
        bad = [k for k, v in weights.items() if isinstance(v, bool) or not isinstance(v, int | float) or v < 0]
        if bad:
            raise ValueError(f"scorer weights must be numbers >= 0: {bad}")
        self.weights = {k: float(v) for k, v in weights.items() if v > 0}
        if not self.weights:
            raise ValueError("at least one scorer needs a weight > 0")
        if guard_factor < 1 or slack < 0:
            raise ValueError("guard_factor must be >= 1 and slack >= 0")
        self.guard_factor = guard_factor
        self.slack = slack
        self._fallback = LeastRequests()
        self._last: str | None = None

    def choose(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float) -> Decision:
        if not workers:
            return NO_CANDIDATES
        cached = request.cached_prefix_tokens
        if not cached or not any(cached.get(w.id, 0) for w in workers):
            return Decision(self._fallback.choose(request, workers, now).worker_id, "prefix_miss")
        min_load = min(w.load for w in workers)
        pool = [w for w in workers if not _overloaded(w, min_load, self.guard_factor, self.slack)]
        totals = [0.0] * len(pool)
        for name, weight in self.weights.items():
            for i, s in enumerate(SCORERS[name](request, pool, cached)):
                totals[i] += weight * s
        best_i = 0
        for i in range(1, len(pool)):
            a, b = pool[i], pool[best_i]
            if totals[i] > totals[best_i] + 1e-12 or (abs(totals[i] - totals[best_i]) <= 1e-12 and (
                    a.load < b.load or (a.load == b.load and _after(a.id, b.id, self._last)))):
                best_i = i
        w = pool[best_i]
        self._last = w.id
        return Decision(w.id, "prefix_hit" if cached.get(w.id, 0) else "prefix_load")


def _after(a: str, b: str, last: str | None) -> bool:
    """Rotation among equals: prefer the first id after `last` (cyclic), as least_requests does."""
    if last is None:
        return a < b
    ka, kb = (a <= last, a), (b <= last, b)
    return ka < kb
