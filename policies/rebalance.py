"""The rebalancer's rules, one copy for the live gateway (gateway/pipeline/rebalancer.py) and the virtual-time simulator
(simulator/rebalance_sim.py): which requests may move, how slow each worker is observed to be, how many moves a
look may make, and where a moved request goes. Each caller only gathers what it sees (the gateway: its streams'
token counts and the scraped engines; the simulator: its engines) and carries the moves out.

    observe   `step_ratio`: a worker's measured seconds per output token since the last look (the median of its
              requests', policies/aladdin/rebalancing.py `observed_ratio`) over its performance model's decode
              step at its batch (the larger of its requests decoding and its scraped running count) and their mean
              context
    select    `queued_legs`: of a worker's requests without a first token that may move (not P/D, never moved),
              in the order the worker got them, the last `waiting` (its scraped engine queue: `still_queued`, the
              earlier ones are in prefill already)
    propose   `propose_moves`: `ModelPlacement.rebalance` (Aladdin's Algorithm 2, or off slow workers) with the
              observed ratios and `slow_ratio`, at most what the model's `MoveBudget` allows now; the moves made
              are spent from it by the caller
    re-place  `move_exclusions`: a moved request is placed again through the placement step, first on the
              proposed destination alone (if it is still a candidate: under its cap), else on any worker it has
              not tried; no worker: it waits in the admission queue like a new request
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from policies.aladdin.rebalancing import MoveBudget, observed_ratio, still_queued
from policies.perf_model import PerfModel
from policies.placement import ModelPlacement
from policies.types import Move, RequestFeatures, WorkerView

MAX_MOVES_PER_S = 4.0   # the default budget of moves per second per model (config rebalance.max_moves_per_s)
SLOW_RATIO = 3.0        # a worker measured slower than its model by more than this is slow (rebalance.slow_ratio)
INTERVAL_S = 0.25       # the default time between two looks (rebalance.interval_s)


@dataclass(frozen=True, slots=True)
class LegSeen:
    """One request in flight on a worker, as a look sees it."""

    request_id: str
    worker: str
    feats: RequestFeatures
    tokens: int           # output tokens so far (0: no first token)
    sent: float           # when the worker got it (orders its queue)
    movable: bool         # not P/D, never moved (and, live, streamed resumably or not streamed)


def budget_for(max_moves_per_s: float) -> MoveBudget:
    """A model's move budget: `max_moves_per_s`, a burst of at least one move."""
    return MoveBudget(max_moves_per_s, max(1.0, max_moves_per_s))


def step_ratio(samples: Sequence[tuple[float, int]], contexts: Sequence[int], running: int,
               perf_model: PerfModel) -> float | None:
    """Observed over predicted decode step of one worker (module docstring); None without samples."""
    ctxs = list(contexts) or [0]
    step = perf_model.decode_step(max(len(ctxs), running), sum(ctxs) / len(ctxs))
    return observed_ratio(samples, step)


def queued_legs(legs: Iterable[LegSeen], waiting: Mapping[str, int]) -> dict[str, tuple[str, RequestFeatures]]:
    """The requests a look may move: per worker, its movable requests without a token, oldest first, the last
    `waiting[worker]` of them (request id -> (worker, features))."""
    by_worker: dict[str, list[LegSeen]] = {}
    for leg in legs:
        if leg.tokens == 0 and leg.movable:
            by_worker.setdefault(leg.worker, []).append(leg)
    out: dict[str, tuple[str, RequestFeatures]] = {}
    for wid, ws in by_worker.items():
        if wid not in waiting:
            continue
        ws.sort(key=lambda leg: leg.sent)
        feats = {leg.request_id: leg.feats for leg in ws}
        for rid in still_queued([leg.request_id for leg in ws], waiting[wid]):
            out[rid] = (wid, feats[rid])
    return out


def propose_moves(placement: ModelPlacement, queued: Mapping[str, tuple[str, RequestFeatures]],
                  views: Sequence[WorkerView], now: float, ratios: Mapping[str, float], slow_ratio: float,
                  budget: MoveBudget, budget_now: float) -> list[Move]:
    """The moves of one look, within the budget at `budget_now` (the caller's monotonic clock; `now`: the
    policies' clock)."""
    if not queued:
        return []
    allowed = budget.available(budget_now)
    if allowed <= 0:
        return []
    return placement.rebalance(queued, views, now, observed=ratios, bound=slow_ratio, max_moves=allowed)


def move_exclusions(dst: str | None, candidates: Iterable[str], tried: Collection[str]) -> list[Collection[str]]:
    """The workers to leave out at each try of placing a moved request again, in order: all but the proposed
    destination (it alone, if still a candidate), then the ones it already tried."""
    out: list[Collection[str]] = []
    if dst is not None:
        out.append([c for c in candidates if c != dst])
    out.append(tried)
    return out
