"""Chiron's local autoscaler (Algorithm 1): a per-worker cap on concurrent requests from local backpressure.

    la = LocalAutoscaler(LocalConfig(itl_slo_s=0.2))
    la.observe(itl_s=0.08, tokens_per_s=240.0, saturated=True)    # one measurement window
    cap = la.update(now)                                          # the gateway enforces this cap

Backpressure (Chiron section 4.1): LBP = observed ITL / ITL SLO; TBP = previous / current throughput.
Update (Algorithm 1, lines 8-14): with bp = max(LBP, TBP) < 1 the cap grows by the EWMA
cap <- alpha * cap / bp + (1 - alpha) * cap (alpha = 0.5), slowing down as bp approaches 1; with bp >= 1
it halves. The result is kept in [min_cap, max_cap].

Where this implementation has to choose (the paper leaves it open):
- TBP compares throughput across a cap change, so it is only formed right after an increase, and only
  when the cap was binding (`saturated`) in both windows; otherwise throughput moves with the arrival
  rate, not with the cap, and a dip would halve the cap for no reason.
- The cap grows only while it binds (growth that no request uses teaches nothing and leaves a cap that
  a burst then overruns); it still halves whenever bp >= 1.
- One growth step is at most `max_growth` x (1/bp is unbounded as bp -> 0).
- After a change, `settle_windows` windows are skipped (only LBP >= 1 may still halve): the new batch
  has to form first (the admitted requests prefill, which dips the output rate), so TBP compares the
  window before the change with a steady window after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALPHA = 0.5     # Chiron Algorithm 1 input: EWMA smoothing factor


@dataclass(frozen=True, slots=True)
class LocalConfig:
    itl_slo_s: float
    alpha: float = ALPHA
    min_cap: int = 1
    max_cap: int = 1024
    initial_cap: int = 16
    max_growth: float = 2.0
    settle_windows: int = 1

    def __post_init__(self) -> None:
        if not self.itl_slo_s > 0:
            raise ValueError("itl_slo_s must be > 0")
        if not 0 < self.alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        if not 1 <= self.min_cap <= self.max_cap:
            raise ValueError("need 1 <= min_cap <= max_cap")
        if not self.min_cap <= self.initial_cap <= self.max_cap:
            raise ValueError("initial_cap must lie in [min_cap, max_cap]")
        if self.max_growth <= 1:
            raise ValueError("max_growth must be > 1")
        if self.settle_windows < 0:
            raise ValueError("settle_windows must be >= 0")


def ewma_growth(cap: float, bp: float, alpha: float = ALPHA, max_growth: float = math.inf) -> float:
    """Chiron Algorithm 1, lines 10-11: cap <- alpha * (1/bp) * cap + (1 - alpha) * cap, for bp < 1."""
    if bp <= 0:
        return cap * max_growth
    return min(alpha * cap / bp + (1 - alpha) * cap, cap * max_growth)


class LocalAutoscaler:
    """One worker's cap. `observe` records a window, `update(now)` applies Algorithm 1 once."""

    def __init__(self, config: LocalConfig, initial_cap: float | None = None) -> None:
        self.config = config
        start = config.initial_cap if initial_cap is None else initial_cap
        self._cap = float(min(max(start, config.min_cap), config.max_cap))
        self.lbp: float | None = None
        self.tbp: float | None = None
        self._itl: float | None = None
        self._thr: float | None = None
        self._saturated = False
        self._prev_thr: float | None = None
        self._prev_saturated = False
        self._last_change = 0          # +1 grew, -1 halved, 0 held
        self._itl_slo = config.itl_slo_s
        self._settle = 0               # windows still to skip after a change
        self.updates = 0
        self.last_update: float | None = None

    @property
    def cap(self) -> int:
        return max(self.config.min_cap, int(self._cap))

    @property
    def backpressure(self) -> float | None:
        """max(LBP, TBP) of the last update (None: no signal)."""
        vals = [v for v in (self.lbp, self.tbp) if v is not None]
        return max(vals) if vals else None

    def observe(self, *, itl_s: float | None = None, tokens_per_s: float | None = None, saturated: bool = True,
                itl_slo_s: float | None = None) -> None:
        """One measurement window: mean inter-token latency, output tokens/s, whether the cap was binding.

        `itl_slo_s` overrides the configured SLO for this window (Chiron section 4.2: a worker uses the
        smallest ITL SLO among the requests it runs).
        """
        if itl_s is not None and (itl_s < 0 or not math.isfinite(itl_s)):
            raise ValueError("itl_s must be a finite number >= 0")
        if tokens_per_s is not None and (tokens_per_s < 0 or not math.isfinite(tokens_per_s)):
            raise ValueError("tokens_per_s must be a finite number >= 0")
        if itl_slo_s is not None and not itl_slo_s > 0:
            raise ValueError("itl_slo_s must be > 0")
        self._itl, self._thr, self._saturated = itl_s, tokens_per_s, saturated
        self._itl_slo = itl_slo_s or self.config.itl_slo_s

    def update(self, now: float) -> int:
        cfg = self.config
        self.updates += 1
        self.last_update = now
        # Chiron section 4.1: LBP = ITL / ITL SLO; TBP = Throughput_prev / Throughput_curr.
        self.lbp = self._itl / self._itl_slo if self._itl is not None else None
        self.tbp = None
        if self._settle > 0:            # the batch is still forming after a change: only a violation acts
            self._settle -= 1
            if self.lbp is not None and self.lbp >= 1:
                self._cap = max(cfg.min_cap, self._cap / 2)
                self._last_change, self._settle = -1, cfg.settle_windows
            self._itl = self._thr = None
            return self.cap
        if (self._last_change > 0 and self._saturated and self._prev_saturated and self._thr is not None
                and self._prev_thr is not None):
            self.tbp = self._prev_thr / self._thr if self._thr > 0 else math.inf
        bp = self.backpressure
        change = 0
        if bp is not None and bp >= 1:
            self._cap = max(cfg.min_cap, self._cap / 2)            # Algorithm 1, line 14
            change = -1
        elif bp is not None and self._saturated:
            grown = min(cfg.max_cap, ewma_growth(self._cap, bp, cfg.alpha, cfg.max_growth))
            change = 1 if int(grown) > int(self._cap) else 0
            self._cap = grown
        self._last_change = change
        self._prev_thr, self._prev_saturated = self._thr, self._saturated    # the window at the old cap
        if change:
            self._settle = cfg.settle_windows
        self._itl = self._thr = None
        return self.cap
