"""Re-planning as traffic moves (SeaLLM section 4.3): what the autoscaler's leader (gateway/control/replanner.py) and the
diurnal experiment (bench/replan.py) both run, pure arithmetic with the clock passed in.

- `next_interval`: SeaLLM's adaptive re-placement interval (section 4.3, eq. 8): at the end of interval t, with
  the estimated performance M_est (what the plan was predicted to achieve) and the achieved M_real,
  I_{t+1} = (1 - β)·I_t when |M_real - M_est| / M_est > β (traffic moved away from what the plan was made for:
  re-plan sooner), (1 + β)·I_t when it is < β (traffic is stable: re-plan less often); β = 0.1 in the paper's
  evaluation (section 6.1). Clamped to the operator's bounds.
- `TrafficTotals` / `demands_between`: per-model cumulative arrivals and length sums, and the ServiceDemand
  (rate, mean input, mean output, E[input²]) of the window between two of them.
- `replan`: the closed-form plan for the observed demands (policies/planning.py `candidates`, best first: SeaLLM's
  two-stage allocation and Aladdin eq. 6-7 over the GPU stock), and whether to move to it: the current plan no
  longer covers the demand (its closed-form capacity is below the rate of some model), or the new one is cheaper
  by more than `min_saving` while covering it. Otherwise the current plan stays (no flapping on noise).
- `closed_form_attainment`: the attainment a plan is estimated to reach without simulating it: the target when
  its capacity covers every model's rate, else the target times the covered fraction of the worst-served model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from policies.hardware import derive_profile, fits, gpu_spec, model_spec
from policies.planning import (
    COST,
    Candidate,
    GpuStock,
    InstanceGroup,
    ServiceDemand,
    Slo,
    candidates,
    instance_capacity,
    parse_stock,
)
from policies.types import ROLE_DECODE, ROLE_MIXED, ROLE_PREFILL

SEALLM_BETA = 0.1          # β of SeaLLM eq. 8 (section 6.1)


def next_interval(current_s: float, m_est: float, m_real: float, beta: float = SEALLM_BETA,
                  lo_s: float = 0.0, hi_s: float = math.inf) -> float:
    """SeaLLM eq. 8 (module docstring), clamped to [lo_s, hi_s]; an undefined gap (M_est = 0 or NaN) keeps I_t."""
    if not 0 < beta < 1:
        raise ValueError("beta must be in (0, 1)")
    if m_est > 0 and math.isfinite(m_est) and math.isfinite(m_real):
        gap = abs(m_real - m_est) / m_est
        if gap > beta:
            current_s *= 1 - beta
        elif gap < beta:
            current_s *= 1 + beta
    return min(max(current_s, lo_s), hi_s)


def group_key(g: InstanceGroup) -> str:
    """A plan group's identity across plans: model/gpu/tpN/role (the count is what changes)."""
    return f"{g.model}/{g.gpu}/tp{g.tp}/{g.role}"


# ---- observed traffic -----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ModelTotals:
    """Cumulative counts of one model since some start: arrivals, and the lengths of the finished requests."""

    arrivals: float = 0.0
    finished: float = 0.0
    input_sum: float = 0.0
    input_sq_sum: float = 0.0
    output_sum: float = 0.0

    def __add__(self, o: ModelTotals) -> ModelTotals:
        return ModelTotals(self.arrivals + o.arrivals, self.finished + o.finished, self.input_sum + o.input_sum,
                           self.input_sq_sum + o.input_sq_sum, self.output_sum + o.output_sum)

    def __sub__(self, o: ModelTotals) -> ModelTotals:
        return ModelTotals(self.arrivals - o.arrivals, self.finished - o.finished, self.input_sum - o.input_sum,
                           self.input_sq_sum - o.input_sq_sum, self.output_sum - o.output_sum)

    def to_list(self) -> list[float]:
        return [self.arrivals, self.finished, self.input_sum, self.input_sq_sum, self.output_sum]

    @classmethod
    def from_list(cls, v: Sequence[float]) -> ModelTotals:
        return cls(*(float(x) for x in v[:5]))


TrafficTotals = Mapping[str, ModelTotals]       # short model name -> totals


def demands_between(before: TrafficTotals, after: TrafficTotals, seconds: float, min_finished: int = 1,
                    fallback: Mapping[str, ServiceDemand] | None = None) -> list[ServiceDemand]:
    """Each model's demand over a window: its arrival rate, and its mean lengths from the requests that finished
    in the window (from `fallback`, e.g. the last plan's, when fewer than `min_finished` did)."""
    out = []
    fallback = fallback or {}
    for model, now in sorted(after.items()):
        d = now - before.get(model, ModelTotals())
        rate = max(d.arrivals, 0.0) / seconds if seconds > 0 else 0.0
        prev = fallback.get(model)
        if d.finished >= min_finished and d.finished > 0:
            i, o, i2 = d.input_sum / d.finished, d.output_sum / d.finished, d.input_sq_sum / d.finished
        elif prev is not None:
            i, o, i2 = prev.mean_input, prev.mean_output, prev.input_sq
        else:
            continue          # nothing known about its lengths yet
        out.append(ServiceDemand(model, rate, i, max(o, 1.0), i2))
    return out


# ---- plans ----------------------------------------------------------------------------------------------------
def plan_capacity(groups: Sequence[InstanceGroup], demands: Sequence[ServiceDemand], slo: Slo) -> dict[str, float]:
    """Closed-form requests/s each model's groups sustain at these demands' lengths (policies/planning.py
    `instance_capacity`; a prefill/decode split sustains the smaller of its two phases)."""
    out: dict[str, float] = {}
    by_model = {d.model: d for d in demands}
    for model, d in by_model.items():
        mixed = prefill = decode = 0.0
        for g in (g for g in groups if g.model == model and g.count > 0):
            m, gpu = model_spec(g.model), gpu_spec(g.gpu)
            if not fits(m, gpu, g.tp):
                continue
            cap = g.count * instance_capacity(derive_profile(m, gpu, g.tp), d, slo, role=g.role)
            if g.role == ROLE_PREFILL:
                prefill += cap
            elif g.role == ROLE_DECODE:
                decode += cap
            else:
                mixed += cap
        out[model] = mixed + min(prefill, decode)
    return out


def coverage(capacity: Mapping[str, float], demands: Sequence[ServiceDemand]) -> float:
    """How many times the offered traffic the capacity sustains (the least served model decides; inf: no
    traffic)."""
    return min((capacity.get(d.model, 0.0) / d.rate for d in demands if d.rate > 0), default=math.inf)


def closed_form_attainment(scale: float, target: float) -> float:
    """Estimated attainment of a plan covering `scale` times the traffic (module docstring)."""
    return target if scale >= 1.0 else target * max(scale, 0.0)


@dataclass(frozen=True)
class Replan:
    """The outcome of one re-planning round."""

    groups: tuple[InstanceGroup, ...]     # the plan to run (the current one when `changed` is False)
    changed: bool
    reason: str
    scale: float                          # closed-form coverage of the demand by `groups`
    estimated_attainment: float
    changes: dict[str, int] = field(default_factory=dict)   # group key -> count delta

    @property
    def cost_per_hour(self) -> float:
        return _cost(self.groups)


def plan_changes(current: Sequence[InstanceGroup], new: Sequence[InstanceGroup]) -> dict[str, int]:
    """Count deltas per group key between two plans (groups absent from one count 0 there)."""
    cur = {group_key(g): g.count for g in current}
    nxt = {group_key(g): g.count for g in new}
    return {k: nxt.get(k, 0) - cur.get(k, 0) for k in sorted(set(cur) | set(nxt)) if nxt.get(k, 0) != cur.get(k, 0)}


def replan(demands: Sequence[ServiceDemand], stocks: Sequence[GpuStock], slo: Slo,
           current: Sequence[InstanceGroup], target: float = 0.95, objective: str = COST,
           budget: float | None = None, headroom: float = 1.0, min_saving: float = 0.1,
           mixed_only: bool = False) -> Replan:
    """One round (module docstring). `headroom` > 1 plans for that multiple of the observed rates. A model of the
    current plan without observed demand (none seen, or a rate of 0) keeps its groups: no traffic in one window is
    no reason to remove a service, and the others are planned around it.
    `mixed_only`: only plans of mixed-role instances (an actuator that starts no prefill/decode pairs)."""
    planned = [ServiceDemand(d.model, d.rate * headroom, d.mean_input, d.mean_output, d.input_sq) for d in demands
               if d.rate > 0]
    seen = {d.model for d in planned}
    keep = tuple(g for g in current if g.model not in seen)
    cur_scale = coverage(plan_capacity(current, demands, slo), demands)
    if not planned:
        return Replan(tuple(current), False, "no traffic observed", cur_scale,
                      closed_form_attainment(cur_scale, target))
    kept_stock = _minus(stocks, keep)
    best: Candidate | None = None
    try:
        found = [c for c in candidates(planned, kept_stock, slo, objective, budget)
                 if not mixed_only or all(g.role == ROLE_MIXED for g in c.groups)]
        best = found[0] if found else None
    except ValueError:
        best = None
    if best is None:
        return Replan(tuple(current), False, "no plan within the GPUs and budget serves every model", cur_scale,
                      closed_form_attainment(cur_scale, target))
    new = tuple(g for g in best.groups if g.count) + keep
    new_scale = coverage(plan_capacity(new, demands, slo), demands)
    cur_cost = _cost(current)
    changes = plan_changes(current, new)
    if not changes:
        return Replan(tuple(current), False, "the plan is unchanged", cur_scale,
                      closed_form_attainment(cur_scale, target))
    if cur_scale < headroom and new_scale > cur_scale:
        reason = f"the current plan covers {cur_scale:.2f}x the observed traffic"
    elif cur_scale >= headroom and best.cost_per_hour + 1e-9 < (1 - min_saving) * (cur_cost - _cost(keep)):
        reason = f"a plan {1 - (best.cost_per_hour + _cost(keep)) / cur_cost:.0%} cheaper covers the traffic"
    else:
        return Replan(tuple(current), False, "the current plan still covers the traffic", cur_scale,
                      closed_form_attainment(cur_scale, target))
    return Replan(new, True, reason, new_scale, closed_form_attainment(new_scale, target), changes)


def _cost(groups: Sequence[InstanceGroup]) -> float:
    return sum(g.cost_per_hour for g in groups)


def _minus(stocks: Sequence[GpuStock], groups: Sequence[InstanceGroup]) -> list[GpuStock]:
    """The stock left after the GPUs `groups` hold."""
    used: dict[str, int] = {}
    for g in groups:
        name = gpu_spec(g.gpu).name
        used[name] = used.get(name, 0) + g.gpus
    return [GpuStock(s.gpu, s.count - used.get(s.gpu.name, 0)) for s in stocks if s.count - used.get(s.gpu.name, 0) > 0]


__all__ = ["ROLE_MIXED", "ModelTotals", "Replan", "closed_form_attainment", "coverage", "demands_between",
           "group_key", "next_interval", "parse_stock", "plan_capacity", "plan_changes", "replan"]

