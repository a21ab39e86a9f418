"""SLO targets, the per-request TTFT / ATGT checks, and attainment counters (plain data).

ATGT (Aladdin's decode SLO; the gateway's `x-slo-tpot-ms`) is the average time per output token
after the first: (t_last_token − t_first_token) / (output_tokens − 1). A request attains its SLO when
both TTFT and ATGT are within target (Aladdin appendix G, "Metrics").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from policies.types import CLASS_INTERACTIVE, RequestFeatures

DEFAULT_TTFT_S = 0.600  # Aladdin table 3, Llama2-chat 13b on A100: prefill SLO 600 ms
DEFAULT_ATGT_S = 0.030  # Aladdin table 3, Llama2-chat 13b on A100: decode SLO 30 ms


@dataclass(frozen=True, slots=True)
class SloTarget:
    ttft_s: float = DEFAULT_TTFT_S
    atgt_s: float = DEFAULT_ATGT_S

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.atgt_s > 0):
            raise ValueError(f"SLO targets must be positive, got ttft_s={self.ttft_s}, atgt_s={self.atgt_s}")


def target_for(request: RequestFeatures, default: SloTarget) -> SloTarget:
    """The request's own SLO (headers x-slo-ttft-ms / x-slo-tpot-ms) where given, else the default."""
    ttft = request.slo_ttft_s if request.slo_ttft_s and request.slo_ttft_s > 0 else default.ttft_s
    atgt = request.slo_tpot_s if request.slo_tpot_s and request.slo_tpot_s > 0 else default.atgt_s
    if ttft == default.ttft_s and atgt == default.atgt_s:
        return default
    return SloTarget(ttft, atgt)


def atgt(first_token_s: float, last_token_s: float, output_tokens: int) -> float:
    """Average time per output token after the first; 0 when there is at most one token."""
    if output_tokens <= 1:
        return 0.0
    return max(last_token_s - first_token_s, 0.0) / (output_tokens - 1)


@dataclass(frozen=True, slots=True)
class SloCheck:
    ttft_s: float
    atgt_s: float
    ttft_met: bool
    atgt_met: bool

    @property
    def met(self) -> bool:
        return self.ttft_met and self.atgt_met


def check_slo(arrival_s: float, first_token_s: float | None, last_token_s: float | None, output_tokens: int,
              ttft_target_s: float | None, atgt_target_s: float | None) -> SloCheck:
    """Judge one streamed answer (the gateway's streams, every simulated request): TTFT and ATGT against their
    targets; a target of None holds trivially. No first token at all (error, abort) misses both. The one test
    of a streamed request's SLO: gateway/pipeline/slo.py `SloBook.judge` and simulator/cluster.py `RequestResult.slo_met`
    both call it."""
    if first_token_s is None:
        return SloCheck(math.inf, math.inf, False, False)
    ttft = first_token_s - arrival_s
    a = atgt(first_token_s, last_token_s if last_token_s is not None else first_token_s, output_tokens)
    return SloCheck(ttft, a, ttft_target_s is None or ttft <= ttft_target_s,
                    atgt_target_s is None or a <= atgt_target_s)


def whole_answer_met(arrival_s: float, end_s: float, output_tokens: int, ttft_target_s: float | None,
                     atgt_target_s: float | None) -> bool:
    """Judge a non-streamed answer, whose first byte is its whole answer (TTFT and ATGT are not separable): met iff
    it ended no later than a streamed answer within both targets would have, arrival + TTFT target + ATGT target
    x (n - 1). ATGT alone cannot be observed without a stream: a target of ATGT only holds trivially."""
    if ttft_target_s is None:
        return True
    return end_s - arrival_s <= ttft_target_s + (atgt_target_s or 0.0) * max(output_tokens - 1, 0)


@dataclass(slots=True)
class AttainmentCount:
    met: int = 0
    missed: int = 0

    @property
    def total(self) -> int:
        return self.met + self.missed

    @property
    def ratio(self) -> float:
        """Fraction met; 1.0 before any request (nothing has been missed)."""
        return self.met / self.total if self.total else 1.0


@dataclass(slots=True)
class SloAttainment:
    """Met / missed counters per (model, request class)."""

    counts: dict[tuple[str, str], AttainmentCount] = field(default_factory=dict)

    def record(self, model: str, request_class: str, met: bool) -> None:
        c = self.counts.get((model, request_class))
        if c is None:
            c = self.counts[(model, request_class)] = AttainmentCount()
        if met:
            c.met += 1
        else:
            c.missed += 1

    def get(self, model: str, request_class: str = CLASS_INTERACTIVE) -> AttainmentCount:
        return self.counts.get((model, request_class), AttainmentCount())

    def ratio(self, model: str | None = None, request_class: str | None = None) -> float:
        """Attainment over the matching keys (None matches all)."""
        met = missed = 0
        for (m, c), cnt in self.counts.items():
            if (model is None or m == model) and (request_class is None or c == request_class):
                met += cnt.met
                missed += cnt.missed
        return met / (met + missed) if met + missed else 1.0

    def to_dict(self) -> list[dict]:
        return [{"model": m, "class": c, "met": v.met, "missed": v.missed} for (m, c), v in self.counts.items()]
