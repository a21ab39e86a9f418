"""What switching models on a host costs, and how many models are active at once.

Sources (Aegaeon, "Effective GPU Pooling for Concurrent LLM Serving on the Market", SOSP 2025):
- Appendix A.2, eq. 4: with Aegaeon's optimized re-initialization (section 5: engine components reused,
  explicit memory management), switching models costs only the weight load,
  T_switch = weight bytes / PCIe bandwidth x beta, beta a profiled factor (0.625 in the paper's evaluation).
- Section 5.1: a stock engine's scale-up costs far more than the weight copy (26.9 s for a 13B model
  unoptimized); vLLM's sleep mode (docs/reference/vllm-interface.md §6.1) keeps the engine alive and reloads
  only the weights on wake (level 1), plus a fixed wake overhead we take from the worker profile.
- Section 3.1, Theorem 3.1 (proof in appendix A.1): with Poisson arrivals of rate lambda per model and a mean
  time T a request spends being served, E[m] = M (1 - e^{-lambda T}) models have a request in the system.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

AEGAEON_BETA = 0.625          # appendix A.2, the profiled PCIe-inefficiency factor of eq. 4
REINIT_OPTIMIZED = "optimized"  # Aegaeon's component reuse (section 5): the weight copy alone, eq. 4
REINIT_SLEEP = "sleep"          # vLLM sleep level 1 wake-up: the weight copy plus the engine's wake overhead
REINIT_MODES = (REINIT_OPTIMIZED, REINIT_SLEEP)


@dataclass(frozen=True, slots=True)
class SwapCost:
    """Seconds to bring one model's weights onto a host (scale up) and to put them away (scale down)."""

    load_s: float
    offload_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.load_s + self.offload_s


def switch_time_s(weight_bytes: float, link_bytes_per_s: float, beta: float = AEGAEON_BETA) -> float:
    """Aegaeon's eq. 4: weight bytes over the host link's bandwidth, times the profiled factor beta."""
    if weight_bytes < 0 or link_bytes_per_s <= 0 or beta <= 0:
        raise ValueError("weight_bytes >= 0, link_bytes_per_s > 0 and beta > 0 are required")
    return weight_bytes / link_bytes_per_s * beta


def swap_cost(weight_bytes: float, link_bytes_per_s: float, reinit: str = REINIT_OPTIMIZED,
              wake_overhead_s: float = 0.0, beta: float = AEGAEON_BETA) -> SwapCost:
    """The swap cost of a model under a re-initialization mode. `optimized`: eq. 4, and scaling down is free
    (Aegaeon drops the weights: they stay cached in host memory). `sleep`: vLLM sleep level 1 offloads the
    weights over the same link (no beta: vLLM's plain copy) and wakes with `wake_overhead_s` on top."""
    if reinit == REINIT_OPTIMIZED:
        return SwapCost(switch_time_s(weight_bytes, link_bytes_per_s, beta))
    if reinit == REINIT_SLEEP:
        copy = switch_time_s(weight_bytes, link_bytes_per_s, 1.0)
        return SwapCost(copy + wake_overhead_s, copy)
    raise ValueError(f"reinit must be one of {', '.join(REINIT_MODES)}, got {reinit!r}")


def kv_copy_time_s(tokens: int, kv_bytes_per_token: float, link_bytes_per_s: float) -> float:
    """Seconds to copy `tokens` of KV cache over the host link (Aegaeon section 5.3 moves a preempted
    batch's KV to host memory and back)."""
    return tokens * kv_bytes_per_token / link_bytes_per_s


def expected_active_models(rates: Sequence[float], service_time_s: float) -> float:
    """Theorem 3.1 with one rate per model: sum over models of 1 - e^{-lambda_i T}. With M equal rates this is
    the paper's M (1 - e^{-lambda T})."""
    if service_time_s < 0 or any(r < 0 for r in rates):
        raise ValueError("rates and the service time must be >= 0")
    return sum(1.0 - math.exp(-r * service_time_s) for r in rates)
