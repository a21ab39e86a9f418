"""Which feasible worker takes a request (Algorithm 1, section 4.2), when to wait, and when to trust the model.

  * `fit="best"` is Algorithm 1: the fullest bin by capacity_norm that still fits (with a margin m, the
    fullest of those keeping at least m relative headroom on every constraint, else the one with the most);
    `fit="worst"` takes the one with the most headroom (the constraints then act as admission control).
  * Risk mode waits for a worker within the stall-risk budget only while the TTFT allows; at the deadline
    (or once the TTFT is lost anyway) it takes the feasible ((b), (c), (e)) worker with the least risk.
  * Trust: each worker's recent SLO miss rate (an EWMA); above `max_miss_rate` the model is not trusted there.
"""

from __future__ import annotations

import numpy as np

from policies.aladdin.constraints import Constraints, Feasibility
from policies.aladdin.ledger import INF, Ledger

# Which feasible worker takes the request: "best" is Algorithm 1 (the fullest bin by capacity_norm; with a
# margin, the fullest among those keeping at least that headroom on every constraint, else the one with the
# most), "worst" the one with the most headroom (spread, with the constraints as admission control).
FIT_BEST, FIT_WORST = "best", "worst"
FITS = (FIT_BEST, FIT_WORST)


def pick_fit(fit: str, margin: float, ok: np.ndarray, head: np.ndarray, norm: np.ndarray) -> int:
    """Algorithm 1 (or worst fit): the index of the chosen worker among the feasible ones (`ok`)."""
    if fit == FIT_WORST:
        return int(np.argmax(np.where(ok, head, -INF)))
    cand = ok & (head >= margin) if margin > 0 else ok
    if not cand.any():   # nobody keeps the margin: the most headroom
        return int(np.argmax(np.where(ok, head, -INF)))
    order = np.argsort(-norm, kind="stable")
    return int(order[int(np.argmax(cand[order]))])


def pick_least_risk(cons: Constraints, feas: Feasibility, rows: np.ndarray, at_deadline: bool) -> int | None:
    """Risk mode, no worker within the stall-risk budget: the worker where the prefill breaks the fewest
    ATGTs among those meeting (b), (c) and (e) (ties: the fullest bin), or None to keep waiting (at the
    deadline check: while some worker would still meet the TTFT after `deadline_margin_s` more)."""
    base, later, risk = feas.base, feas.later, feas.risk
    assert base is not None and later is not None and risk is not None
    if at_deadline and (not base.any() or later.any()):
        return None
    idx = np.nonzero(base)[0]
    if not len(idx):
        return None
    idx = idx[cons.kv_fits(rows[idx], feas.l_in, feas.lp, feas.var, feas.z)[0]]
    if not len(idx):
        return None
    return int(idx[np.lexsort((-feas.norm[idx], risk[idx]))[0]])


def risk_deadline(feas: Feasibility | None, ttft_s: float, deadline_margin_s: float, now: float) -> float | None:
    """Risk mode, waiting for a worker within the budget: the time after which no worker would meet the
    TTFT with `deadline_margin_s` to spare any more (then the policy takes the least risk), i.e. when the
    caller should ask again even if nothing changes meanwhile. None outside risk mode."""
    if feas is None or feas.later is None or feas.ttft is None:
        return None
    later = feas.later
    if not later.any():
        return None
    # At least a millisecond on: at the boundary itself the next call decides.
    return now + max(float(np.max(ttft_s - deadline_margin_s - feas.ttft[later])), 1e-3)


def untrusted(ledger: Ledger, rows: np.ndarray, max_miss_rate: float) -> np.ndarray:
    """Workers whose recent SLO miss rate says the model is wrong there."""
    return ledger.miss_rate[rows] > max_miss_rate


def note_outcome(ledger: Ledger, r: int, slo_met: bool, alpha: float) -> None:
    """One more outcome in worker r's miss rate (an EWMA with weight `alpha`)."""
    ledger.miss_rate[r] += alpha * ((0.0 if slo_met else 1.0) - ledger.miss_rate[r])
