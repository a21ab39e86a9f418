"""`fleetgate plan`: closed forms propose deployments (policies/planning.py), the virtual-time simulator scores the
best few on the workload (simulator/deployment.py), and the winner is printed with the runner-ups and why they lost.

Objective cost: each scored candidate is grown (one instance at a time for its worst-served model) until its
simulated SLO attainment reaches the target, then shrunk while it still does; the cheapest that reaches it wins.
Objective throughput: each scored candidate's throughput at SLO is found in the simulator (the largest multiple of
the offered traffic whose attainment still reaches the target, by bisection from its closed-form capacity); the
highest wins.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from policies.hardware import model_spec
from policies.planning import (
    COST,
    Candidate,
    GpuStock,
    InstanceGroup,
    ServiceDemand,
    Slo,
    candidates,
    grow,
    instance_options,
    parse_stock,
)
from policies.types import ROLE_DECODE, ROLE_PREFILL
from simulator.deployment import DeploymentRun, ServiceShare, simulate_deployment
from simulator.workload import load_workload, rate_of, trace_rows

Progress = Callable[[int, int], None]
SEED_STRIDE = 1000      # scoring seeds are seed, seed + 1000, ...: seed + 1 stays free for a held-out check


@dataclass(frozen=True)
class PlanRequest:
    services: tuple[ServiceShare, ...]
    stocks: tuple[GpuStock, ...]
    run: DeploymentRun
    objective: str = COST
    budget: float | None = None          # USD per hour, at most
    target: float = 0.95                 # SLO attainment a cost plan must reach in the simulator
    score_top: int = 3                   # closed-form candidates the simulator scores
    max_steps: int = 6                   # grow / shrink steps per scored candidate
    score_seeds: int = 2                 # traffic draws each score pools (seed, seed + 1000, ...)


@dataclass
class ScoredPlan:
    candidate: Candidate
    sim: dict[str, Any]
    offered_rps: float
    steps: list[str] = field(default_factory=list)
    why: str = ""

    @property
    def attainment(self) -> float:
        return float(self.sim["slo_attainment"])

    def to_dict(self) -> dict[str, Any]:
        c = self.candidate
        return {"method": c.method, "groups": [g.to_dict() for g in c.groups if g.count], "gpus": c.gpus,
                "cost_per_hour": round(c.cost_per_hour, 4), "offered_rps": round(self.offered_rps, 4),
                "slo_attainment": round(self.attainment, 4), "goodput_rps": round(self.sim["goodput_rps"], 4),
                "throughput_rps": round(self.sim["throughput_rps"], 4),
                "output_tokens_per_s": round(self.sim["output_tokens_per_s"], 2),
                "closed_form_capacity_rps": {m: round(v, 3) for m, v in c.capacity.items()},
                "steps": self.steps, **({"why_lost": self.why} if self.why else {})}


# ---- parsing the command line's specs ------------------------------------------------------------------------
def parse_models(items: Sequence[str]) -> tuple[ServiceShare, ...]:
    """`NAME[:share]` (shares default to equal, normalised to 1)."""
    if not items:
        raise ValueError("give at least one --model NAME[:share]")
    out = []
    for item in items:
        name, _, share = item.partition(":")
        try:
            value = float(share) if share else 1.0
        except ValueError:
            raise ValueError(f"--model {item!r}: the share must be a number") from None
        if not value > 0 or value == float("inf"):
            raise ValueError(f"--model {item!r}: the share must be > 0")
        out.append(ServiceShare(model_spec(name).name, value))
    if len({s.model for s in out}) != len(out):
        raise ValueError("each --model may be given once")
    total = sum(s.share for s in out)
    return tuple(ServiceShare(s.model, s.share / total) for s in out)


def parse_gpus(items: Sequence[str]) -> tuple[GpuStock, ...]:
    """`TYPE:COUNT[:PRICE]` (price in USD per GPU-hour; default from policies/hardware.py)."""
    return tuple(parse_stock(items, "--gpus"))


def offered_rate(run: DeploymentRun) -> float:
    """The total arrival rate the run replays: --rate, or the trace's own over the window."""
    if run.rate is not None:
        return run.rate
    return rate_of(load_workload(run.trace, duration=run.duration, seed=run.seed))


def demands_for(services: Sequence[ServiceShare], run: DeploymentRun) -> list[ServiceDemand]:
    """Each service's rate (its share of --rate, or of the trace's own rate) and length moments, over the requests
    its model can serve at all: a prompt beyond the model's context is refused (vLLM's 400) by any deployment,
    loads none and counts in no attainment (simulator/simulate.py)."""
    rows = trace_rows(run.trace)
    total = offered_rate(run)
    out = []
    for s in services:
        context = model_spec(s.model).context
        fit = [(p, q) for p, q in rows if p < context] or rows
        i = statistics.fmean(p for p, _ in fit)
        o = statistics.fmean(q for _, q in fit)
        i2 = statistics.fmean(p * p for p, _ in fit)
        out.append(ServiceDemand(s.model, total * s.share * len(fit) / len(rows), i, o, i2))
    return out


# ---- the search ------------------------------------------------------------------------------------------------
def make_plan(req: PlanRequest, progress: Progress | None = None) -> dict[str, Any]:
    """The plan as a dict (the `--json` form; its `deployment` section is a deployment file)."""
    t0 = time.perf_counter()
    slo = Slo(req.run.slo_ttft_s, req.run.slo_tpot_s)
    demands = demands_for(req.services, req.run)
    found = candidates(demands, req.stocks, slo, req.objective, req.budget, keep=max(req.score_top, 6))
    if not found:
        raise ValueError("no deployment within the GPUs and budget given serves every model")
    scored_ones = _distinct_shapes(found, req.score_top)
    total_rate = offered_rate(req.run)        # what the simulator replays (demands count the servable part)
    budget_sims = len(scored_ones) * (1 + req.max_steps)
    done = [0]

    def sim(c: Candidate, offered: float | None) -> dict[str, Any]:
        """`offered` None: the run's own arrivals (its --rate, or the trace's timestamps)."""
        run = req.run if offered is None else replace(req.run, rate=offered)
        res = pooled([simulate_deployment(c.groups, req.services, replace(run, seed=run.seed + SEED_STRIDE * k))
                      .summary() for k in range(req.score_seeds)])
        done[0] += 1
        if progress is not None:
            progress(done[0], max(budget_sims, done[0]))
        return res

    if req.objective == COST:
        options = {d.model: instance_options(d, [s.gpu for s in req.stocks], slo) for d in demands}
        scored = [_fit_to_target(c, demands, options, req, lambda c: sim(c, None), total_rate) for c in scored_ones]
        scored.sort(key=lambda s: (s.attainment < req.target, s.candidate.cost_per_hour, -s.attainment))
    else:
        scored = [_rate_at_target(c, c.scale(demands) * total_rate, req, sim) for c in scored_ones]
        scored.sort(key=lambda s: (-(s.offered_rps if s.attainment >= req.target else 0.0), s.candidate.cost_per_hour))
    seen: set[tuple] = set()
    scored = [s for s in scored if not (s.candidate.key() in seen or seen.add(s.candidate.key()))]  # fits that met
    best, rest = scored[0], scored[1:]
    for s in rest:
        s.why = _why_lost(s, best, req)
    unscored = [{"method": c.method, "groups": [g.to_dict() for g in c.groups], "gpus": c.gpus,
                 "cost_per_hour": round(c.cost_per_hour, 4),
                 "closed_form_capacity_rps": {m: round(v, 3) for m, v in c.capacity.items()},
                 "why_lost": "not simulated: ranked below the scored candidates by the closed form"}
                for c in found if c not in scored_ones]
    return {
        "deployment": {
            "groups": [g.to_dict() for g in best.candidate.groups if g.count],
            "services": [{"model": s.model, "share": round(s.share, 6)} for s in req.services],
            "policy": req.run.policy,
            "slo": {"ttft_ms": req.run.slo_ttft_s * 1000, "tpot_ms": req.run.slo_tpot_s * 1000},
        },
        "predicted": {k: v for k, v in best.to_dict().items() if k not in ("groups", "why_lost")},
        "meets_target": best.attainment >= req.target if req.objective == COST else None,
        "objective": req.objective,
        "target_attainment": req.target,
        "budget_per_hour": req.budget,
        "workload": {"trace": req.run.trace, "rate_rps": round(total_rate, 4), "duration_s": req.run.duration,
                     "seed": req.run.seed,
                     "demands": [{"model": d.model, "rate_rps": round(d.rate, 4), "mean_input": round(d.mean_input, 1),
                                  "mean_output": round(d.mean_output, 1)} for d in demands]},
        "runner_ups": [s.to_dict() for s in rest] + unscored,
        "search": {"closed_form_candidates": len(found), "simulations": done[0],
                   "seeds_per_score": [req.run.seed + SEED_STRIDE * k for k in range(req.score_seeds)],
                   "wall_s": round(time.perf_counter() - t0, 2)},
    }


def _distinct_shapes(found: Sequence[Candidate], k: int) -> list[Candidate]:
    """The best `k` candidates of different shapes (the set of (model, GPU, TP, role) they use): growing and
    shrinking explore the counts of a shape, so scoring two counts of one shape would waste a simulation."""
    out: list[Candidate] = []
    shapes: set[frozenset] = set()
    for c in found:
        shape = frozenset((g.model, g.gpu, g.tp, g.role) for g in c.groups if g.count)
        if shape not in shapes:
            shapes.add(shape)
            out.append(c)
        if len(out) == k:
            break
    return out


def pooled(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' summaries as one: attainment over all their servable requests, rates averaged, each model's
    numbers from the runs pooled the same way."""
    if len(summaries) == 1:
        return summaries[0]
    n = len(summaries)
    servable = sum(s["servable"] for s in summaries)
    met = sum(s["slo_met"] for s in summaries)
    out = {k: sum(s[k] for s in summaries) / n for k in ("goodput_rps", "throughput_rps", "output_tokens_per_s",
                                                        "gpu_seconds")}
    out.update(requests=sum(s["requests"] for s in summaries), servable=servable, slo_met=met,
               slo_attainment=met / servable if servable else 0.0)
    models: dict[str, dict[str, Any]] = {}
    for m in summaries[0]["models"]:
        per = [s["models"][m] for s in summaries]
        req = sum(p["requests"] for p in per)
        models[m] = {**per[0], "requests": req,
                     "slo_attainment": sum(p["slo_attainment"] * p["requests"] for p in per) / max(req, 1),
                     "goodput_rps": sum(p["goodput_rps"] for p in per) / n,
                     "throughput_rps": sum(p["throughput_rps"] for p in per) / n}
    out["models"] = models
    return out


def _rate_at_target(c: Candidate, start: float, req: PlanRequest,
                    sim: Callable[[Candidate, float | None], dict[str, Any]]) -> ScoredPlan:
    """The largest offered rate (bisection, `req.max_steps` simulations after bracketing) at which the candidate's
    simulated attainment reaches the target, with that run's numbers; the lowest rate tried if none does."""
    lo: ScoredPlan | None = None
    rate = max(start, 1e-3)
    hi = ScoredPlan(c, sim(c, rate), rate)
    while hi.attainment >= req.target:                 # bracket from above
        lo, rate = hi, rate * 1.6
        hi = ScoredPlan(c, sim(c, rate), rate)
    low_rate = lo.offered_rps if lo is not None else 0.0
    for _ in range(req.max_steps if lo is not None else req.max_steps + 2):
        mid = (low_rate + hi.offered_rps) / 2
        trial = ScoredPlan(c, sim(c, mid), mid)
        if trial.attainment >= req.target:
            lo, low_rate = trial, mid
        else:
            hi = trial
    best = lo if lo is not None else hi
    best.steps.append(f"throughput at SLO: {best.offered_rps:.2f} req/s offered")
    return best


def _fit_to_target(c: Candidate, demands: Sequence[ServiceDemand], options: dict, req: PlanRequest,
                   sim: Callable[[Candidate], dict[str, Any]], total: float) -> ScoredPlan:
    """Grow until the simulated attainment reaches the target; if it did at once, shrink while it still does."""
    cur = ScoredPlan(c, sim(c), total)
    steps = 0
    while cur.attainment < req.target and steps < req.max_steps:
        bigger, served = None, None
        for d in _services_worst_first(cur, demands):       # the worst-served model that can still grow
            ttft_p99 = cur.sim["models"].get(d.model, {}).get("ttft_p99") or 0.0
            phase = ROLE_PREFILL if ttft_p99 > req.run.slo_ttft_s else ROLE_DECODE   # for prefill/decode splits
            bigger, served = grow(cur.candidate, d, options[d.model], req.stocks, req.budget, phase), d
            if bigger is not None:
                break
        if bigger is None or served is None:
            cur.steps.append("cannot grow: no GPUs or budget left for any model's instances")
            return cur
        steps += 1
        cur = ScoredPlan(bigger, sim(bigger), total, [*cur.steps, f"grew {bigger.notes[-1]} for {served.model}"])
    if steps == 0:
        while steps < req.max_steps:
            smaller = _shrink(cur.candidate)
            if smaller is None:
                break
            steps += 1
            trial = ScoredPlan(smaller, sim(smaller), total, [*cur.steps, smaller.notes[-1]])
            if trial.attainment < req.target:
                cur.steps.append(f"{smaller.notes[-1]} misses the target ({trial.attainment:.3f})")
                break
            cur = trial
    return cur


def _services_worst_first(s: ScoredPlan, demands: Sequence[ServiceDemand]) -> list[ServiceDemand]:
    per = s.sim["models"]
    return sorted(demands, key=lambda d: per.get(d.model, {}).get("slo_attainment", 0.0))


def _shrink(c: Candidate) -> Candidate | None:
    """One instance fewer from the group with the most GPUs, keeping at least one instance of every (model,
    role) the plan has."""
    groups = list(c.groups)
    order = sorted(range(len(groups)), key=lambda k: -groups[k].gpus)
    for k in order:
        g = groups[k]
        others = sum(h.count for h in groups if (h.model, h.role) == (g.model, g.role)) - 1
        if g.count >= 1 and others >= 1:
            groups[k] = replace(g, count=g.count - 1)
            groups = [h for h in groups if h.count > 0]
            return Candidate(tuple(groups), c.capacity, c.method, (*c.notes, f"shrank {g.role} {g.gpu} tp{g.tp}"))
    return None


def _why_lost(s: ScoredPlan, best: ScoredPlan, req: PlanRequest) -> str:
    if req.objective == COST:
        if s.attainment < req.target <= best.attainment:
            return f"simulated attainment {s.attainment:.3f} < target {req.target:.2f}"
        diff = s.candidate.cost_per_hour - best.candidate.cost_per_hour
        if diff > 1e-9:
            return f"costs ${diff:.2f}/h more for the same target"
        return f"same cost, lower attainment ({s.attainment:.3f} vs {best.attainment:.3f})"
    if s.attainment < req.target:
        return f"misses the {req.target:.2f} target even at {s.offered_rps:.2f} req/s"
    return f"reaches the target up to {s.offered_rps:.2f} req/s, not {best.offered_rps:.2f}"


def groups_table(groups: Sequence[InstanceGroup]) -> list[str]:
    return [f"{g.count} x {g.model} on {g.tp}x {g.gpu} ({g.role})" for g in groups if g.count]


# ---- the CLI -----------------------------------------------------------------------------------------------------
def run_plan_cli(models: Sequence[str], gpus: Sequence[str], run: DeploymentRun, objective: str,
                 budget: float | None, target: float, score_top: int, as_json: bool, out: str | None,
                 score_seeds: int = 2) -> None:
    import json
    import sys

    import typer

    from simulator.progress import stderr_progress

    try:
        if not 0 < target <= 1:
            raise ValueError("--target must be in (0, 1]")
        if budget is not None and not budget > 0:
            raise ValueError("--budget must be > 0")
        if score_top < 1 or score_seeds < 1:
            raise ValueError("--score-top and --score-seeds must be >= 1")
        req = PlanRequest(parse_models(models), parse_gpus(gpus), run, objective, budget, target, score_top,
                          score_seeds=score_seeds)
        with stderr_progress("plan: simulating candidates") as progress:
            plan = make_plan(req, progress)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    if out:
        with open(out, "w") as fh:
            json.dump(plan, fh, indent=2)
    if as_json:
        print(json.dumps(plan))
        return
    _print_plan(plan)


def _print_plan(plan: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    pred, wl = plan["predicted"], plan["workload"]
    table = Table(title=f"fleetgate plan ({plan['objective']}, {wl['rate_rps']:.2f} req/s of {wl['trace']})")
    for col in ("model", "GPU", "TP", "role", "count", "GPUs", "$/h"):
        table.add_column(col, justify="right" if col in ("TP", "count", "GPUs", "$/h") else "left")
    for g in plan["deployment"]["groups"]:
        table.add_row(g["model"], g["gpu"], str(g["tp"]), g["role"], str(g["count"]), str(g["gpus"]),
                      f"{g['cost_per_hour']:.2f}")
    console.print(table)
    console.print(f"predicted: SLO attainment {pred['slo_attainment']:.3f} (target {plan['target_attainment']}), "
                  f"goodput {pred['goodput_rps']:.2f} req/s, {pred['output_tokens_per_s']:.0f} output tok/s, "
                  f"{pred['gpus']} GPUs, ${pred['cost_per_hour']:.2f}/h  "
                  + escape(f"[{pred['method']}; {'; '.join(pred['steps']) or 'as proposed'}]"))
    if plan.get("meets_target") is False:
        console.print("[bold red]no candidate reached the target within the GPUs and budget given[/]")
    for r in plan["runner_ups"]:
        shape = ", ".join(f"{g['count']}x {g['model']}@{g['tp']}x{g['gpu']}"
                          + ("" if g["role"] == "mixed" else f" {g['role']}") for g in r["groups"])
        console.print(escape(f"runner-up {r['method']}: {shape}; {r['gpus']} GPUs, ${r['cost_per_hour']:.2f}/h — "
                             f"{r['why_lost']}"))
    s = plan["search"]
    console.print(f"search: {s['closed_form_candidates']} closed-form candidates, {s['simulations']} simulations, "
                  f"{s['wall_s']} s")
