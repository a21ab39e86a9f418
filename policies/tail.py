"""Tail bounds for chance-constrained placement (Aladdin section 4.3 and appendix F).

A worker's quantity S (a latency, a context sum, KV demand) with mean μ and variance σ² is bounded by
μ + γ(τ)·σ, which holds with probability at least 1 − τ. The global violation budget δ is split over
the workers that can violate, τ_j = β_j·δ with Σβ_j <= 1, so by the union bound the cluster-level
violation probability stays within δ.
"""

from __future__ import annotations

import math
from statistics import NormalDist

CANTELLI, NORMAL = "cantelli", "normal"
TAIL_MODES = (CANTELLI, NORMAL)

_STD_NORMAL = NormalDist()


def cantelli_factor(tau: float) -> float:
    """Appendix F: Cantelli's inequality gives Pr(Y >= μ + γσ) <= τ for γ(τ) = sqrt((1 − τ)/τ)."""
    _check_tau(tau)
    return math.sqrt((1.0 - tau) / tau)


def normal_factor(tau: float) -> float:
    """Appendix F: under a normal approximation γ(τ) = z_{1−τ} = Φ⁻¹(1 − τ)."""
    _check_tau(tau)
    return _STD_NORMAL.inv_cdf(1.0 - tau)


def tail_factor(mode: str, tau: float) -> float:
    if mode == CANTELLI:
        return cantelli_factor(tau)
    if mode == NORMAL:
        return normal_factor(tau)
    raise ValueError(f"unknown tail mode {mode!r}; use one of {', '.join(TAIL_MODES)}")


def split_budget(delta: float, workers: int) -> float:
    """Appendix F: equal weights β_j = 1/n over n workers, τ_j = δ/n (so Σ τ_j = δ)."""
    if not 0.0 < delta < 1.0:
        raise ValueError(f"violation budget delta must be in (0, 1), got {delta}")
    return delta / max(workers, 1)


def upper_bound(mean: float, variance: float, factor: float) -> float:
    """μ + γ·σ: the one-sided bound that appendix F requires to stay under the SLO threshold."""
    return mean + factor * math.sqrt(max(variance, 0.0))


def _check_tau(tau: float) -> None:
    if not 0.0 < tau < 1.0:
        raise ValueError(f"tail probability must be in (0, 1), got {tau}")
