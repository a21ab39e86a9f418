"""Admission that sheds what will miss: a request is taken only if its predicted TTFT meets its target.

The rule, for every policy (the placement step, policies/placement.py, applies it after its policy decided):

- A request with a TTFT target (not of the batch class) placed on worker w is refused (429) when its predicted
  TTFT there (the time it waited, the prefill work queued on w, its own prefill, the decodes batched with its
  prefill chunks, the wait for a batch slot) misses the target. Predicted wait + predicted prefill is Aladdin's
  TTFT estimate ((c) of section 4.2, eq. 2 and 3), corrected for chunked prefill and cached prefixes
  (bench/results/aladdin_estimates.md): `Constraints.ttft`, the one estimate of the code base. Nothing here
  is a second formula.
- A request the policy could not place (it would queue) is refused at once when even the best candidate misses:
  waiting only adds to its TTFT. A queued request's budget ends at target − predicted prefill
  (policies/admission.py `queue_budget`, `prefill_s` here): past that moment it cannot start in time.
- The same for its time per output token when it has a TPOT target (on a worker that refused lately, against θ
  times the target: Aladdin's error margin on its decode constraints, section 4.2): its predicted ATGT once it
  joins the
  worker's batch (`Constraints.paced_atgt`: eq. 3 at that batch, stretched by the prefill work placed there
  lately and its own, which stall every decode under chunked prefill). Without it, a fleet without caps grows
  its batches until every decode misses (at 10x, virtual time: 0 TTFT misses among admitted, 95% TPOT misses).
- A request that cannot meet its target even on an idle worker (a prompt whose prefill alone takes longer) is
  not shed: no fleet state would serve it in time, so it is served best effort (aladdin's "best_effort").
- The 429's Retry-After is the predicted drain time: how long until the worker's backlog ahead of the request
  has shrunk enough for a request like it to meet its target (at least 1 s).

The estimate needs a ledger of what every worker holds. aladdin keeps one already and is read directly; for
every other policy a tracker (an AladdinPolicy that never chooses: its ledger and its hooks only) hears the
same dispatch / progress / completion events from the placement step, and the learned performance models of
each worker profile (gateway/pipeline/learning.py `set_perf_model`; the simulator's step profiles). Pure: the
clock is passed in; the gateway and ClusterSim call this same object through ModelPlacement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from policies.aladdin.policy import AladdinPolicy
from policies.base import Policy
from policies.types import CLASS_BATCH, RequestFeatures, WorkerView

WILL_MISS = "will_miss"      # Decision.reason of a request shed by this rule (the caller answers 429)
REFUSING_ALPHA = 1.0 / 32    # the refused share of a worker's recent requests: an EWMA over ~32 of them
SATURATED = 0.5              # ... above which the worker is saturated (`Shedder.check`: θ applies)


@dataclass(frozen=True, slots=True)
class Shed:
    """Why a request is refused: its predicted TTFT (or time per output token, `metric`) on `worker_id` (the
    chosen or the best candidate), its target and the predicted drain time (the 429's Retry-After, whole
    seconds >= 1)."""

    predicted_s: float
    target_s: float
    retry_after_s: float
    worker_id: str | None
    metric: str = "time to first token"

    @property
    def message(self) -> str:
        return (f"its predicted {self.metric}, {self.predicted_s * 1000:.0f} ms, misses its target of "
                f"{self.target_s * 1000:g} ms")


def sheddable(feats: RequestFeatures) -> bool:
    """Does the rule apply: the request has a TTFT target and is not of the batch class."""
    return feats.slo_ttft_s is not None and feats.request_class != CLASS_BATCH


class Shedder:
    """The rule of the module docstring over one model's placement step. `policy`: the model's policy (aladdin
    is read directly; any other gets a tracker of its own, `own_tracker`); `theta`: Aladdin's error margin θ on
    the decode side (0.8, as AladdinPolicy's default): on a saturated worker the predicted ATGT may take that
    share of the target (`check`)."""

    __slots__ = ("tracker", "own_tracker", "theta", "shed", "checks", "_rows", "_refusing")

    def __init__(self, policy: Policy, theta: float = 0.8) -> None:
        if not 0.0 < theta <= 1.0:
            raise ValueError(f"theta (error margin) must be in (0, 1], got {theta}")
        self.theta = theta     # the share of its TPOT target a request's predicted ATGT may take (`check`)
        if isinstance(policy, AladdinPolicy):
            self.tracker, self.own_tracker = policy, False
        else:
            # Only the ledger and its hooks are used: no choice, so no fallback; (d) plays no part in a TTFT.
            self.tracker, self.own_tracker = AladdinPolicy(slack="off", fallback=None), True
        self.shed = 0          # requests refused by the rule
        self.checks = 0
        self._rows: np.ndarray | None = None   # the candidates' ledger rows at the last check
        self._refusing: dict[str, float] = {}   # worker -> share of the requests that asked for it it refused (EWMA)

    # --- the rule ------------------------------------------------------------------------------------------
    def check(self, feats: RequestFeatures, views: Sequence[WorkerView], now: float,
              worker_id: str | None, swap_s: float = 0.0) -> Shed | None:
        """None when the request may go on (placed on `worker_id`, or queued when None and some candidate could
        still serve it in time); else why it is refused. `swap_s`: its model's wake it waited for, counted in its
        TTFT target (policies/admission.py `queue_budget` does the same)."""
        if not views or not sheddable(feats):
            return None
        self.checks += 1
        t = self.tracker
        led = t.ledger
        rows = led.rows_for_views(views)
        led.advance(rows, now)
        self._rows = rows
        cons = t.constraints
        cached = cons.cached_for(feats, list(views))
        ttft, terms, _, _ = cons.ttft(feats, rows, now, cached)
        target = float(feats.slo_ttft_s) + max(swap_s, 0.0)  # type: ignore[arg-type]  (sheddable)
        if worker_id is None:
            i = int(np.argmin(ttft))
        else:
            i = next((k for k, v in enumerate(views) if v.id == worker_id), -1)
            if i < 0:
                return None
        # On a saturated worker (it refused most of the requests that asked for it lately: what it admits fills it
        # up to the threshold) the ATGT is judged against θ·target, Aladdin's error margin on its decode
        # constraints ((b), (d), section 4.2): admitting up to the target itself holds a saturated worker at the
        # target and half its requests miss (measured live: TPOT p50 100.1 ms against 100 ms). Elsewhere the
        # target itself: a burst's one refusal must not close the worker to the requests it serves in time
        # (bench/results/shedding.md).
        wid = views[i].id
        saturated = self._refusing.get(wid, 0.0) > SATURATED
        tpot = None
        if feats.slo_tpot_s is not None:
            tpot = feats.slo_tpot_s * (self.theta if saturated else 1.0)
        atgt = b = slope = free = None
        if tpot is not None:
            atgt, b, slope, free = cons.paced_atgt(feats, rows, now)
            if worker_id is None:      # queued: the best candidate that meets both, if any does
                both = (ttft <= target) & (atgt <= tpot)
                if both.any():
                    return None
        shed = self._judge(feats, views, rows, i, ttft, terms.waited, target, tpot, atgt, b, slope, free, cached)
        self._refusing[wid] = self._refusing.get(wid, 0.0) * (1.0 - REFUSING_ALPHA) + (REFUSING_ALPHA if shed else 0.0)
        if shed is not None:
            self.shed += 1
        return shed

    def _judge(self, feats: RequestFeatures, views: Sequence[WorkerView], rows: np.ndarray, i: int,
               ttft: np.ndarray, waited: float, target: float, tpot: float | None, atgt: np.ndarray | None,
               b: np.ndarray | None, slope: np.ndarray | None, free: np.ndarray | None,
               cached: np.ndarray | float) -> Shed | None:
        """The verdict on candidate i (`check`)."""
        led = self.tracker.ledger
        if ttft[i] > target:
            if self._alone(feats, rows, cached) > target:
                return None      # no state of the fleet serves it in time: best effort, not shed
            return Shed(float(ttft[i]), target, _drain(float(ttft[i] - waited), target), views[i].id)
        if atgt is not None and b is not None and slope is not None and free is not None and atgt[i] > tpot:
            if float(np.min(led.c3[rows] + slope)) > tpot:
                return None      # not even alone: best effort
            # the batch its target allows at this prefill pace, and how long the excess takes to complete
            allowed = max((tpot * float(free[i]) - float(led.c3[rows[i]])) / float(slope[i]), 1.0)
            lp, _ = self.tracker.constraints.predicted(feats)
            drain = max(float(b[i]) - allowed, 0.0) / float(b[i]) * lp * float(atgt[i])
            return Shed(float(atgt[i]), float(feats.slo_tpot_s), _drain(drain, 0.0), views[i].id,  # type: ignore[arg-type]
                        "time per output token")
        return None

    def prefill_s(self, feats: RequestFeatures, views: Sequence[WorkerView]) -> float:
        """The request's own predicted prefill (eq. 2, its uncached part) on the candidate where it is shortest;
        its queue budget ends that long before its TTFT target. 0 without candidates."""
        if not views:
            return 0.0
        t = self.tracker
        rows = t.ledger.rows_for_views(views)
        return self._alone(feats, rows, t.constraints.cached_for(feats, list(views)))

    def _alone(self, feats: RequestFeatures, rows: np.ndarray, cached: np.ndarray | float) -> float:
        """The request's prefill on an idle worker (eq. 2 over its uncached part), the least over `rows`."""
        led = self.tracker.ledger
        l_in = float(max(feats.prompt_tokens, 0))
        own = led.c1[rows] + np.maximum(led.prefill_floor[rows], led.k1[rows] * led.prefill_work(rows, l_in, cached))
        return float(np.min(own))

    def drain_s(self, feats: RequestFeatures, now: float) -> float:
        """The predicted drain time for a request refused at its queue deadline: over the candidates of the last
        check, how long until one's backlog lets a request like it meet its target (Retry-After, >= 1 s)."""
        rows = self._rows
        if rows is None or not len(rows) or not sheddable(feats):
            return 1.0
        t = self.tracker
        t.ledger.advance(rows, now)
        ttft, terms, _, _ = t.constraints.ttft(feats, rows, now)
        return _drain(float(np.min(ttft)) - terms.waited, float(feats.slo_ttft_s))  # type: ignore[arg-type]

    # --- what the tracker hears (only when it is the shedder's own: aladdin hears it as the policy) ---------
    def dispatched(self, feats: RequestFeatures, worker_id: str, now: float) -> None:
        if self.own_tracker:
            self.tracker.on_dispatch(feats, worker_id, now)

    def moved(self, feats: RequestFeatures, old: str, new: str, now: float) -> None:
        if self.own_tracker:
            self.tracker.on_complete(feats, old, now)
            self.tracker.on_dispatch(feats, new, now)

    def progress(self, feats: RequestFeatures, tokens: int, now: float) -> None:
        if self.own_tracker:
            self.tracker.report_progress(feats.request_id, tokens, now)

    def finished(self, feats: RequestFeatures, worker_id: str, output_tokens: int, now: float) -> None:
        if self.own_tracker:
            if output_tokens > 0:
                self.tracker.observe_completion(feats, output_tokens, now)
            self.tracker.on_complete(feats, worker_id, now)


def _drain(ttft_s: float, target_s: float) -> float:
    """Seconds until the backlog ahead drains enough (the estimate less the target: queued work drains in real
    time), whole and at least 1 (Retry-After)."""
    over = ttft_s - target_s
    return float(max(1, math.ceil(over))) if math.isfinite(over) else 1.0
