"""Aladdin's Algorithm 2 (appendix C): move new requests between workers to cancel prediction errors.

Algorithm 2 (appendix C, "Re-balancing with prediction error") as printed: each worker's estimation error
(l^e, b^e) from its ongoing requests (underestimated outputs re-predicted, early finishes), then new requests
move from over- to under-estimated workers while that lowers the summed distance of the errors from each
worker's eq. 4 line (`propose_moves`). The simulator (simulator/cluster.py `_rebalance`) and the live gateway
(gateway/pipeline/rebalancer.py) both reach it through `ModelPlacement.rebalance`.

Two additions for the live gateway, both pure, clock and observations passed in:

- observed error: a worker whose decode steps are measured `ratio` times slower than eq. 3 predicts for what it
  holds carries that as an error on its own line (`observed_error`). Algorithm 2 cancels it against workers
  that are over-estimated, but a transfer to a balanced worker (error 0) leaves the summed distance unchanged
  (the distance is linear on each side of the line), so a worker that is simply slow would keep its queue.
  Requests still queued on a worker past the `bound` (`slow_workers`) therefore move in a second pass to the
  feasible, not slow worker left with the least error distance (`propose_moves(slow=...)`);
- what may move, and how fast: only the requests the engine still queues (`still_queued`), and a budget of
  moves per second per model (`MoveBudget`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from policies.aladdin.ledger import Ledger
from policies.types import Move


@dataclass(slots=True)
class WorkerError:
    """Algorithm 2's per-worker estimation errors: l^e (output tokens) and b^e (requests)."""

    l_err: float = 0.0
    b_err: float = 0.0


def error_distance(err: WorkerError, alpha: float, beta: float) -> float:
    """Algorithm 2 line 22: distance |α·l^e + β·b^e| / sqrt(α² + β²) of a worker's error line from the origin."""
    return abs(alpha * err.l_err + beta * err.b_err) / math.hypot(alpha, beta)


def propose_moves(
    placements: Mapping[str, tuple[str, float]],
    errors: Mapping[str, WorkerError],
    coeffs: Mapping[str, tuple[float, float]],
    feasible: Callable[[str, str], bool] | None = None,
    max_moves: int | None = None,
    slow: Collection[str] = (),
) -> list[Move]:
    """Algorithm 2 (appendix C): move new requests between workers to cancel prediction errors.

    placements: request_id -> (worker, l_pred) of new (not yet started) requests; errors: worker ->
    WorkerError from its ongoing requests; coeffs: worker -> (α, β) of its eq. 4 error line (k2, c2).
    Moving j from x to y does b^e_x −= 1, l^e_x −= l_pred_j, b^e_y += 1, l^e_y += l_pred_j (lines
    16-20). Greedy: apply the move that lowers Σ distance the most, until none helps; each request
    moves at most once. `feasible(request_id, dst)` may veto a destination. `slow`: workers observed slower
    than their model beyond the bound (module docstring); after the greedy pass, their requests still there
    move to the feasible worker outside `slow` left with the least distance.
    """
    err = {w: WorkerError(e.l_err, e.b_err) for w, e in errors.items()}
    for w in coeffs:
        err.setdefault(w, WorkerError())
    where = {rid: w for rid, (w, _) in placements.items()}
    moves: dict[str, Move] = {}
    limit = len(placements) if max_moves is None else max_moves

    def dist(w: str, dl: float, db: float) -> float:
        a, b = coeffs[w]
        return error_distance(WorkerError(err[w].l_err + dl, err[w].b_err + db), a, b)

    while len(moves) < limit:
        best: tuple[float, str, str] | None = None
        for rid, (_, lp) in placements.items():
            if rid in moves:
                continue
            x = where[rid]
            if x not in coeffs:
                continue
            gain_x = dist(x, 0, 0) - dist(x, -lp, -1)
            for y in coeffs:
                if y == x:
                    continue
                gain = gain_x + dist(y, 0, 0) - dist(y, lp, 1)
                if gain > 1e-12 and (best is None or gain > best[0]) and (feasible is None or feasible(rid, y)):
                    best = (gain, rid, y)
        if best is None:
            break
        _, rid, y = best
        x, lp = where[rid], placements[rid][1]
        err[x].l_err -= lp
        err[x].b_err -= 1
        err[y].l_err += lp
        err[y].b_err += 1
        where[rid] = y
        moves[rid] = Move(rid, x, y)
    for rid, (x, lp) in placements.items():
        if len(moves) >= limit:
            break
        if rid in moves or x not in slow or x not in coeffs:
            continue
        dest: tuple[float, str] | None = None
        for y in coeffs:
            if y == x or y in slow or (feasible is not None and not feasible(rid, y)):
                continue
            cost = dist(y, lp, 1)   # the least error after the move (the increase ties on one side of the line)
            if dest is None or cost < dest[0]:
                dest = (cost, y)
        if dest is not None:
            y = dest[1]
            err[x].l_err -= lp
            err[x].b_err -= 1
            err[y].l_err += lp
            err[y].b_err += 1
            moves[rid] = Move(rid, x, y)
    return list(moves.values())


def observed_error(ratio: float, step_s: float, k2: float, bound: float) -> WorkerError:
    """A worker whose decode step is measured `ratio` times eq. 3's prediction `step_s` for what it holds: the same
    error on its eq. 4 line, as the context tokens that would explain it, l^e = (ratio − 1)·step_s / k2 (b^e = 0);
    positive for a slow worker (over-utilized), negative for a fast one. None (a zero error) while the ratio stays
    within [1/bound, bound]: measurement noise, not a worker to act on."""
    if not (ratio > 0 and step_s > 0 and k2 > 0) or 1.0 / bound <= ratio <= bound:
        return WorkerError()
    return WorkerError((ratio - 1.0) * step_s / k2, 0.0)


def slow_workers(ratios: Mapping[str, float], bound: float) -> set[str]:
    """The workers whose observed decode step is more than `bound` times their model's prediction."""
    return {w for w, r in ratios.items() if r > bound}


def observed_ratio(samples: Sequence[tuple[float, int]], predicted_step_s: float) -> float | None:
    """Observed over predicted decode step of one worker: `samples` are (seconds, tokens) its streams produced
    since the last look, one per stream; the median stream's seconds per token over `predicted_step_s`. None
    without a stream that produced tokens."""
    per_token = [dt / n for dt, n in samples if n > 0 and dt > 0]
    if not per_token or not predicted_step_s > 0:
        return None
    return statistics.median(per_token) / predicted_step_s


def still_queued(no_first_token: Sequence[str], waiting: int) -> list[str]:
    """Of a worker's requests without a first token, in the order they were sent, the ones its engine still
    queues: the last `waiting` (vLLM schedules first come first served, so the earlier ones are in prefill
    already and a move would waste it)."""
    if waiting <= 0:
        return []
    return list(no_first_token[-waiting:])


@dataclass(slots=True)
class MoveBudget:
    """At most `rate` moves per second (a token bucket of `burst`); the caller's clock is passed in."""

    rate: float
    burst: float
    tokens: float = math.nan
    at: float = math.nan

    def available(self, now: float) -> int:
        """How many moves may be made at `now`."""
        if math.isnan(self.tokens):
            self.tokens, self.at = self.burst, now
        elif now > self.at:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
        return int(self.tokens)

    def spend(self, n: int) -> None:
        """`n` moves were made."""
        self.tokens -= n


def worker_errors(ledger: Ledger) -> dict[str, WorkerError]:
    """Algorithm 2 lines 4-13 over the ledger: underestimates of ongoing requests (re-predicted length minus
    the original prediction, +1 request each) and recent early finishes (l_real − l_pred, −1 request each,
    kept until the originally predicted end). O(in-flight): for the periodic rebalancing loop, not for the
    per-request path."""
    out: dict[str, WorkerError] = {}
    for row in ledger.rows:
        e = WorkerError()
        g = ledger.step_clock[row.idx]
        for req in row.reqs.values():
            if req.lp > req.lp0:
                e.l_err += req.lp - req.lp0
                e.b_err += 1
        while row.early and row.early[0][0] < g:
            row.early.popleft()
        for _, l_err in row.early:
            e.l_err += l_err
            e.b_err -= 1
        out[row.worker_id] = e
    return out
