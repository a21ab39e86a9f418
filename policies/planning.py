"""Capacity planning: which instances (model, GPU type, TP degree, count) serve a workload at its SLOs.

Closed forms propose and prune; the caller (simulator/deployment.py) scores the best few candidates in the
virtual-time simulator. Everything here is pure arithmetic over the step-time profiles of policies/hardware.py.

- `instance_capacity`: the largest arrival rate one instance sustains at the TPOT target. Aladdin section 4.1
  (eq. 6) bounds per-worker throughput by the KV cache (M / m_r sequences) and by the decode-iteration SLO (batch
  B at T_decode); we turn that into requests/s with the engine's time budget: decode steps at pace T = γ·TPOT
  each cost t(b) (the profile's step time, batch b = λ·O·T by Little's law, mean context I + O/2), and every
  request's prefill costs its compute once, so λ is feasible when t(b)/T + λ·t_prefill <= 1,
  b <= min(KV tokens / (I + O/2), max_num_seqs), and a lone mean prompt meets the TTFT target.
- `best_tp` (Aladdin eq. 6): the TP degree with the highest per-GPU (or per-dollar) capacity; `homogeneous`
  (eq. 7, N_w = ceil(k5·r + c5) with k5 = 1/capacity, c5 = 0): the instance count for a rate.
- `algorithm1_throughput`: the heterogeneous-cluster paper's Algorithm 1 (section 3.2): static batches as big as
  the KV cache allows, each costing eq. 3 + eq. 4; system tokens/s = u/t · one instance's tokens/s.
- `mixed_types`: the heterogeneous paper's deployment search (section 3) for one model over machines of several
  GPU types, one TP degree per type: a Pareto frontier of (cost, capacity) over the types' (TP, count) options.
- `seallm_allocation`: SeaLLM's two-stage placement (section 4.1, appendix A.1, Algorithm 1) for several
  services: partition the GPUs into groups of one TP size p (merging groups where a model needs more), then give
  groups, one at a time, to the service with the highest unserved index UI_s = unserved rate + α·load (eq. 6 with
  the load λ/capacity standing in for the normalized latency) until every service is served (objective cost) or
  the groups run out (objective throughput).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from policies.hardware import TP_DEGREES, GpuSpec, ModelSpec, derive_profile, fits, gpu_spec, model_spec
from policies.perf_model import PerfModel
from policies.types import ROLE_DECODE, ROLE_MIXED, ROLE_PREFILL

COST, THROUGHPUT = "cost", "throughput"
OBJECTIVES = (COST, THROUGHPUT)
TPOT_HEADROOM = 0.8        # γ: plan decode steps at 80 % of the TPOT target (prefill chunks and bursts share them)
SEALLM_ALPHA = 1e-4        # α of SeaLLM eq. 6 (the paper's setting, section 6.1)
PREFILL_UTILIZATION = 0.7  # a prefill-only instance planned at most 70 % busy (prompts queue for TTFT beyond it)


@dataclass(frozen=True, slots=True)
class ServiceDemand:
    """One model's traffic: its rate and the moments of its request lengths (tokens)."""

    model: str                 # short model name (policies/hardware.py)
    rate: float                # requests / s
    mean_input: float
    mean_output: float
    mean_input_sq: float = 0.0  # E[I²] (prefill attention); 0: mean_input²

    @property
    def input_sq(self) -> float:
        return self.mean_input_sq or self.mean_input * self.mean_input


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True, slots=True)
class GpuStock:
    gpu: GpuSpec
    count: int


@dataclass(frozen=True, slots=True)
class InstanceOption:
    """One instance of a model on `tp` GPUs of one type, with its closed-form capacity (requests / s)."""

    model: str
    gpu: GpuSpec
    tp: int
    capacity: float

    @property
    def cost_per_hour(self) -> float:
        return self.tp * self.gpu.price_per_hour


@dataclass(frozen=True, slots=True)
class InstanceGroup:
    """`count` identical instances: what a plan lists and what a deployment starts."""

    model: str
    gpu: str
    tp: int
    count: int
    role: str = ROLE_MIXED
    price_per_gpu_hour: float = 0.0

    @property
    def gpus(self) -> int:
        return self.tp * self.count

    @property
    def cost_per_hour(self) -> float:
        return self.gpus * self.price_per_gpu_hour

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "gpu": self.gpu, "tp": self.tp, "role": self.role, "count": self.count,
                "gpus": self.gpus, "price_per_gpu_hour": self.price_per_gpu_hour,
                "cost_per_hour": round(self.cost_per_hour, 4)}


@dataclass(frozen=True)
class Candidate:
    """A deployment proposed by a closed form, with its estimated capacity per model (requests / s)."""

    groups: tuple[InstanceGroup, ...]
    capacity: Mapping[str, float]
    method: str
    notes: tuple[str, ...] = field(default=())

    @property
    def gpus(self) -> int:
        return sum(g.gpus for g in self.groups)

    @property
    def cost_per_hour(self) -> float:
        return sum(g.cost_per_hour for g in self.groups)

    def key(self) -> tuple:
        return tuple(sorted((g.model, g.gpu, g.tp, g.role, g.count) for g in self.groups if g.count))

    def scale(self, demands: Sequence[ServiceDemand]) -> float:
        """How many times the offered traffic the plan sustains (the least served service decides)."""
        return min((self.capacity.get(d.model, 0.0) / d.rate for d in demands if d.rate > 0), default=0.0)


def parse_stock(items: Sequence[str], flag: str = "") -> list[GpuStock]:
    """`TYPE:COUNT[:PRICE]` items (USD per GPU-hour; default from policies/hardware.py), one per GPU type;
    `flag` names where they came from in error messages (e.g. "--gpus")."""
    where = f"{flag} " if flag else ""
    if not items:
        raise ValueError(f"give at least one {where}TYPE:COUNT[:price]")
    out: list[GpuStock] = []
    for item in items:
        parts = str(item).split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"{where}{item!r}: expected TYPE:COUNT or TYPE:COUNT:PRICE")
        try:
            count = int(parts[1])
            price = float(parts[2]) if len(parts) == 3 else None
        except ValueError:
            raise ValueError(f"{where}{item!r}: COUNT must be an integer and PRICE a number") from None
        if not 0 < count <= 4096:
            raise ValueError(f"{where}{item!r}: COUNT must be 1..4096")
        out.append(GpuStock(gpu_spec(parts[0], price), count))
    if len({s.gpu.name for s in out}) != len(out):
        raise ValueError(f"each GPU type may be given once{' in ' + flag if flag else ''}")
    return out


# ---- one instance ---------------------------------------------------------------------------------------------
def instance_capacity(profile: Mapping[str, Any], demand: ServiceDemand, slo: Slo,
                      headroom: float = TPOT_HEADROOM, role: str = ROLE_MIXED) -> float:
    """Requests / s one instance sustains at the SLOs (0 if a lone mean request misses them). A prefill instance
    only prefills (at most PREFILL_UTILIZATION busy, so prompts rarely queue past the TTFT target); a decode
    instance only decodes (its prompts' KV arrives from a prefill instance)."""
    p = profile
    i, o = demand.mean_input, max(demand.mean_output, 1.0)
    ctx = i + o / 2.0
    pace = headroom * slo.tpot_s
    chunks = max(1, math.ceil(i / p["max_num_batched_tokens"]))
    prefill = p["k_prefill_s"] * i + p["k_attn_s"] * demand.input_sq / 2.0 + (chunks - 1) * p["c_step_s"]
    lone_ttft = p["ttft_overhead_s"] + p["c_step_s"] + max(p["t_weights_s"], prefill)
    if role == ROLE_PREFILL:
        return PREFILL_UTILIZATION / (lone_ttft - p["ttft_overhead_s"]) if lone_ttft <= slo.ttft_s else 0.0
    if role == ROLE_DECODE:
        prefill = 0.0
    elif lone_ttft > slo.ttft_s:
        return 0.0
    if step_time(p, 1, ctx) > pace:
        return 0.0
    batch_cap = min(p["num_gpu_blocks"] * p["block_size"] / ctx, p["max_num_seqs"])

    def feasible(rate: float) -> bool:
        b = rate * o * pace
        return b <= batch_cap and step_time(p, b, ctx) / pace + rate * prefill <= 1.0

    lo, hi = 0.0, batch_cap / (o * pace)
    if feasible(hi):
        return hi
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if feasible(mid) else (lo, mid)
    return lo


def step_time(p: Mapping[str, Any], batch: float, mean_context: float) -> float:
    """A decode step of `batch` sequences (simulator/profiles.py's step time with no prefill)."""
    return p["c_step_s"] + max(p["t_weights_s"], p["c_decode_s"] * batch) + p["k_ctx_s"] * batch * mean_context


def instance_options(demand: ServiceDemand, gpus: Sequence[GpuSpec], slo: Slo,
                     tps: Sequence[int] = TP_DEGREES) -> list[InstanceOption]:
    """Every (GPU type, TP) on which the model fits and meets the SLOs alone, with its capacity."""
    m = model_spec(demand.model)
    out = []
    for g in gpus:
        for tp in tps:
            prof = _profile(m, g, tp)
            if prof is not None:
                cap = instance_capacity(prof, demand, slo)
                if cap > 0:
                    out.append(InstanceOption(m.name, g, tp, cap))
    return out


def _profile(m: ModelSpec, g: GpuSpec, tp: int) -> dict[str, Any] | None:
    if not fits(m, g, tp):
        return None
    try:
        return derive_profile(m, g, tp)
    except ValueError:          # heads that do not split over tp
        return None


def best_tp(options: Sequence[InstanceOption], per: str = "gpu") -> InstanceOption | None:
    """Aladdin eq. 6: the option with the highest capacity per GPU (or per dollar with `per="dollar"`)."""
    def value(o: InstanceOption) -> float:
        return o.capacity / (o.cost_per_hour if per == "dollar" and o.cost_per_hour > 0 else o.tp)
    return max(options, key=lambda o: (value(o), -o.tp), default=None)


def homogeneous_count(option: InstanceOption, rate: float) -> int:
    """Aladdin eq. 7: N_w = ceil(k5·r + c5), k5 = 1 / capacity, c5 = 0 (at least one worker)."""
    return max(1, math.ceil(rate / option.capacity - 1e-9))


# ---- heterogeneous-cluster paper, Algorithm 1 ----------------------------------------------------------------
def algorithm1_throughput(profile: Mapping[str, Any], lengths: Sequence[tuple[int, int]], tp: int,
                          gpus: int) -> float:
    """System tokens / s of `gpus` GPUs split into instances of `tp` (Algorithm 1: static KV-bound batches)."""
    model = PerfModel.from_step_profile(profile)
    kv_tokens = profile["num_gpu_blocks"] * profile["block_size"]
    total_time, n, q = 0.0, 0, len(lengths)
    while n < q:
        i_sum, max_i, max_o, end = 0, 0, 0, n
        while end < q:
            i, o = lengths[end]
            if (i_sum + i) + (end - n + 1) * max(max_o, o) > kv_tokens and end > n:
                break
            i_sum, max_i, max_o, end = i_sum + i, max(max_i, i), max(max_o, o), end + 1
        b = end - n
        total_time += model.hetero_prefill(b, max_i) + model.hetero_decode(b, max_i, max_o)
        n = end
    tokens = sum(i + o for i, o in lengths)
    return gpus / tp * tokens / total_time if total_time > 0 else 0.0


# ---- one model over several GPU types (heterogeneous paper, section 3) ----------------------------------------
@dataclass(frozen=True, slots=True)
class _Mix:
    cost: float
    capacity: float
    parts: tuple[tuple[InstanceOption, int], ...]


def mixed_types(options: Sequence[InstanceOption], stocks: Sequence[GpuStock], demand: ServiceDemand,
                objective: str, budget: float | None = None, keep: int = 6) -> list[Candidate]:
    """The best `keep` mixes of instances (one TP per GPU type) for one model: cheapest with capacity >= the rate
    (objective cost) or most capacity within the stock and budget (objective throughput)."""
    frontier = [_Mix(0.0, 0.0, ())]
    for stock in stocks:
        mine = [o for o in options if o.gpu.name == stock.gpu.name]
        choices = [(o, n) for o in mine for n in range(1, stock.count // o.tp + 1)]
        grown = list(frontier)
        for mix in frontier:
            for o, n in choices:
                cost = mix.cost + n * o.cost_per_hour
                if budget is not None and cost > budget + 1e-9:
                    continue
                grown.append(_Mix(cost, mix.capacity + n * o.capacity, (*mix.parts, (o, n))))
        frontier = _pareto(grown, demand.rate if objective == COST else None)
    if objective == COST:
        ok = sorted((m for m in frontier if m.capacity >= demand.rate), key=lambda m: (m.cost, -m.capacity))
    else:
        ok = sorted((m for m in frontier if m.parts), key=lambda m: (-m.capacity, m.cost))
    return [Candidate(tuple(_group(o, n) for o, n in m.parts), {demand.model: m.capacity}, "hetero-mix")
            for m in ok[:keep]]


def _pareto(mixes: list[_Mix], enough: float | None) -> list[_Mix]:
    """Non-dominated (cost, capacity) mixes; with `enough`, capacity beyond it is worth nothing more (so the
    frontier keeps every cheapest way to reach it, not only the biggest)."""
    def cap(m: _Mix) -> float:
        return min(m.capacity, enough * 1.5) if enough is not None else m.capacity
    best: list[_Mix] = []
    top = -1.0
    for m in sorted(mixes, key=lambda m: (m.cost, -m.capacity)):
        if cap(m) > top + 1e-12:
            best.append(m)
            top = cap(m)
    return best


def _group(o: InstanceOption, n: int, role: str = ROLE_MIXED) -> InstanceGroup:
    return InstanceGroup(o.model, o.gpu.name, o.tp, n, role, o.gpu.price_per_hour)


# ---- homogeneous sizing (Aladdin section 4.1) ------------------------------------------------------------------
def homogeneous(options: Sequence[InstanceOption], stocks: Sequence[GpuStock], demand: ServiceDemand,
                objective: str, budget: float | None = None) -> list[Candidate]:
    """Per GPU type: the eq. 6 TP degree, and eq. 7's count (cost) or as many as stock and budget allow."""
    out = []
    for stock in stocks:
        best = best_tp([o for o in options if o.gpu.name == stock.gpu.name])
        if best is None:
            continue
        most = stock.count // best.tp
        if budget is not None and best.cost_per_hour > 0:
            most = min(most, int(budget // best.cost_per_hour + 1e-9))
        n = homogeneous_count(best, demand.rate) if objective == COST else most
        if 0 < n <= most:
            out.append(Candidate((_group(best, n),), {demand.model: n * best.capacity}, "aladdin-eq6-7"))
    return out


# ---- prefill / decode split (Aladdin's decoupled setting, section 3) -----------------------------------------
def disaggregated(options: Sequence[InstanceOption], stocks: Sequence[GpuStock], demand: ServiceDemand, slo: Slo,
                  objective: str, budget: float | None = None) -> list[Candidate]:
    """Per GPU type, its eq. 6 shape as prefill and decode instances: counts for the rate (cost), or the type's
    stock split in proportion to the two phases' work (throughput)."""
    out = []
    m = model_spec(demand.model)
    for stock in stocks:
        best = best_tp([o for o in options if o.gpu.name == stock.gpu.name])
        prof = _profile(m, stock.gpu, best.tp) if best is not None else None
        if best is None or prof is None:
            continue
        mu_p = instance_capacity(prof, demand, slo, role=ROLE_PREFILL)
        mu_d = instance_capacity(prof, demand, slo, role=ROLE_DECODE)
        if mu_p <= 0 or mu_d <= 0:
            continue
        most = stock.count // best.tp
        if budget is not None and best.cost_per_hour > 0:
            most = min(most, int(budget // best.cost_per_hour + 1e-9))
        if objective == COST:
            n_p, n_d = math.ceil(demand.rate / mu_p - 1e-9), math.ceil(demand.rate / mu_d - 1e-9)
        else:
            n_p = min(max(1, round(most * mu_d / (mu_p + mu_d))), most - 1)
            n_d = most - n_p
        if n_p < 1 or n_d < 1 or n_p + n_d > most:
            continue
        groups = (_group(best, n_p, ROLE_PREFILL), _group(best, n_d, ROLE_DECODE))
        out.append(Candidate(groups, {demand.model: min(n_p * mu_p, n_d * mu_d)}, "pd-split"))
    return out


# ---- several services (SeaLLM section 4.1) ---------------------------------------------------------------------
def seallm_allocation(options: Mapping[str, Sequence[InstanceOption]], stocks: Sequence[GpuStock],
                      demands: Sequence[ServiceDemand], group_tp: int, objective: str,
                      budget: float | None = None) -> Candidate | None:
    """Stage 1: groups of `group_tp` GPUs per type; stage 2: allocation by unserved index (module docstring)."""
    free = {s.gpu.name: s.count // group_tp * group_tp for s in stocks}   # GPUs in whole groups
    capacity = {d.model: 0.0 for d in demands}
    counts: dict[tuple[str, str, int], int] = {}
    by_name = {s.gpu.name: s.gpu for s in stocks}
    spent = 0.0
    blocked: set[str] = set()
    while True:
        def unserved_index(d: ServiceDemand) -> float:
            cap = capacity[d.model]
            return max(d.rate - cap, 0.0) + SEALLM_ALPHA * (d.rate / cap if cap > 0 else 1e6)
        open_ = [d for d in demands if d.model not in blocked]
        if objective == COST:
            open_ = [d for d in open_ if capacity[d.model] < d.rate]
        if not open_:
            break
        d = max(open_, key=unserved_index)
        pick = _seallm_group(options.get(d.model, ()), free, group_tp, budget, spent)
        if pick is None:
            blocked.add(d.model)
            continue
        free[pick.gpu.name] -= pick.tp
        spent += pick.cost_per_hour
        capacity[d.model] += pick.capacity
        key = (d.model, pick.gpu.name, pick.tp)
        counts[key] = counts.get(key, 0) + 1
    if not counts:
        return None
    groups = tuple(InstanceGroup(m, g, tp, n, ROLE_MIXED, by_name[g].price_per_hour)
                   for (m, g, tp), n in sorted(counts.items()))
    return Candidate(groups, capacity, f"seallm-p{group_tp}")


def _seallm_group(options: Sequence[InstanceOption], free: Mapping[str, int], group_tp: int,
                  budget: float | None, spent: float) -> InstanceOption | None:
    """The service's instance on one free group of `group_tp` GPUs, or on merged groups where the model needs a
    larger TP (the smallest that fits); the best capacity per dollar among the GPU types."""
    usable = []
    for gpu_name in free:
        mine = sorted((o for o in options if o.gpu.name == gpu_name and o.tp >= group_tp), key=lambda o: o.tp)
        if not mine:
            continue
        o = mine[0]
        if o.tp <= free[gpu_name] and (budget is None or spent + o.cost_per_hour <= budget + 1e-9):
            usable.append(o)
    return max(usable, key=lambda o: (o.capacity / max(o.cost_per_hour, 1e-9), o.capacity), default=None)


# ---- the search --------------------------------------------------------------------------------------------------
def candidates(demands: Sequence[ServiceDemand], stocks: Sequence[GpuStock], slo: Slo, objective: str = COST,
               budget: float | None = None, keep: int = 6) -> list[Candidate]:
    """Closed-form candidates ranked best first (cost: cheapest that covers the rates; throughput: largest
    sustainable multiple of the offered traffic), duplicates removed, at most `keep`."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if not demands:
        raise ValueError("at least one model is needed")
    gpus = [s.gpu for s in stocks]
    options = {d.model: instance_options(d, gpus, slo) for d in demands}
    for d in demands:
        if not options[d.model]:
            raise ValueError(f"{d.model} meets the SLOs on none of the GPU types given (or does not fit)")
    found: list[Candidate] = []
    if len(demands) == 1:
        d = demands[0]
        found += mixed_types(options[d.model], stocks, d, objective, budget, keep)
        found += homogeneous(options[d.model], stocks, d, objective, budget)
        found += disaggregated(options[d.model], stocks, d, slo, objective, budget)
    for p in TP_DEGREES:
        c = seallm_allocation(options, stocks, demands, p, objective, budget)
        if c is not None:
            found.append(c)
    whole = [c for c in _unique(found) if all(any(g.model == d.model and g.count for g in c.groups) for d in demands)]
    return rank(whole, demands, objective)[:keep]   # a plan without any instance of some model serves it nothing


def rank(found: Sequence[Candidate], demands: Sequence[ServiceDemand], objective: str) -> list[Candidate]:
    if objective == COST:
        return sorted(found, key=lambda c: (c.scale(demands) < 1.0, c.cost_per_hour, -c.scale(demands)))
    return sorted(found, key=lambda c: (-c.scale(demands), c.cost_per_hour))


def _unique(found: Sequence[Candidate]) -> list[Candidate]:
    seen: dict[tuple, Candidate] = {}
    for c in found:
        seen.setdefault(c.key(), c)
    return list(seen.values())


def grow(candidate: Candidate, demand: ServiceDemand, options: Sequence[InstanceOption],
         stocks: Sequence[GpuStock], budget: float | None = None, phase: str = ROLE_DECODE) -> Candidate | None:
    """The candidate with one more instance for `demand`'s model: its best capacity per dollar among the options
    the remaining stock and budget allow (None if nothing fits). A model served by prefill and decode instances
    gets one more of the `phase` role, in the shape it already has."""
    used: dict[str, int] = {}
    for g in candidate.groups:
        used[g.gpu] = used.get(g.gpu, 0) + g.gpus
    left = {s.gpu.name: s.count - used.get(s.gpu.name, 0) for s in stocks}
    room = None if budget is None else budget - candidate.cost_per_hour
    split = [g for g in candidate.groups if g.model == demand.model and g.role == phase]
    if split:
        g = split[0]
        price = g.tp * g.price_per_gpu_hour
        if g.tp > left.get(g.gpu, 0) or (room is not None and price > room + 1e-9):
            return None
        groups = tuple(replace(h, count=h.count + 1) if h is g else h for h in candidate.groups)
        return Candidate(groups, candidate.capacity, candidate.method, (*candidate.notes, f"+1 {phase} {g.gpu} tp{g.tp}"))
    mine = {(g.gpu, g.tp) for g in candidate.groups if g.model == demand.model}
    usable = [o for o in options if o.tp <= left.get(o.gpu.name, 0) and (room is None or o.cost_per_hour <= room + 1e-9)]
    # Prefer a shape the plan already runs for this model (fewer distinct groups), then value for money.
    pick = max(usable, key=lambda o: ((o.gpu.name, o.tp) in mine, o.capacity / max(o.cost_per_hour, 1e-9)),
               default=None)
    if pick is None:
        return None
    groups = list(candidate.groups)
    for k, g in enumerate(groups):
        if (g.model, g.gpu, g.tp, g.role) == (pick.model, pick.gpu.name, pick.tp, ROLE_MIXED):
            groups[k] = InstanceGroup(g.model, g.gpu, g.tp, g.count + 1, g.role, g.price_per_gpu_hour)
            break
    else:
        groups.append(_group(pick, 1))
    capacity = dict(candidate.capacity)
    capacity[demand.model] = capacity.get(demand.model, 0.0) + pick.capacity
    return Candidate(tuple(groups), capacity, candidate.method, (*candidate.notes, f"+1 {pick.gpu.name} tp{pick.tp}"))
