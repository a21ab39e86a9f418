"""`fleetgate simulate`: one virtual-time run of a workload on a fleet. The benchmarks call `simulate` with a
`SimSpec` too, so a number in bench/results is what the CLI prints for the same spec.

    res = simulate(SimSpec(trace="sharegpt", rate=8, workers=12, policy="aladdin", seed=1))
    res.to_dict()["slo_attainment"]          # over the servable requests

What a run sees (the same for every policy, and what the live gateway would see):
- Output lengths: an online predictor (policies/length_predictor.py, the gateway's), fed every completion and
  warm-started with `warmup` (prompt, output) pairs of the same trace that are not in the replayed window (a
  deployment's history; Aladdin learns lengths "from the historical data"). `lengths="oracle"` hands every
  policy the true output length instead, by name only.
- The placement step and the admission queue of the gateway (policies/placement.py, policies/admission.py),
  with the gateway's defaults unless the spec says otherwise.
- SLOs: TTFT and TPOT (ATGT) targets; with `ttft_slowdown` k a request's TTFT target is the larger of the base
  target and k times its prompt's prefill on an idle worker of the profile (the rule for long-context traces,
  whose prompts alone may take seconds).
- Services (`services`): several request streams with their own lengths share the engines; `service_priority`
  orders them (policies/service_priority.py, simulator/service_sim.py) and the summary adds normalized latency.
- Requests no worker can serve (prompt over the model's context) are refused with vLLM's 400 and reported as
  `rejected_too_long`, outside the attainment's denominator; refusals for capacity (429) are misses.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from policies.admission import DEFAULT_QUEUE_LOOKAHEAD
from policies.length_predictor import LengthPredictor
from policies.pd import parse_pd_split
from policies.perf_model import PerfModel
from policies.service_priority import SERVICE_PRIORITIES
from simulator.cluster import ClusterSim, RequestResult, SimResult
from simulator.engine import EngineConfig
from simulator.profiles import load_profile
from simulator.services import parse_services, service_workload
from simulator.workload import WorkloadRequest, load_workload, trace_rows

LENGTHS = ("predicted", "oracle")


@dataclass
class SimSpec:
    """Everything that decides a run's numbers (with `seed`, the run is reproducible)."""

    trace: str = "azure_conv"
    rate: float | None = None            # synthetic arrivals (req/s); None: the trace's own timestamps
    rate_scale: float = 1.0
    arrival: str = "poisson"             # poisson | gamma
    cv: float = 1.0                      # gamma arrivals' coefficient of variation
    duration: float | None = None        # simulated seconds of arrivals
    seed: int = 0
    profile: str = "llama3-8b-h100"      # one name, or several comma-separated (a mixed fleet)
    workers: int = 8
    policy: str = "least_requests"      # what benches built on SimSpec ran; `fleetgate simulate` defaults to least_tokens
    policy_params: dict[str, Any] = field(default_factory=dict)
    slo_ttft_s: float = 0.6
    slo_tpot_s: float = 0.03
    ttft_slowdown: float | None = None   # TTFT target >= this x the prompt's prefill alone (long contexts)
    pd: str | None = None                # "P:D" prefill and decode workers (replaces `workers`)
    lengths: str = "predicted"           # predicted | oracle
    warmup: int = 2000                   # history pairs the length predictor starts from
    queue_lookahead: int = DEFAULT_QUEUE_LOOKAHEAD
    queue_poll_s: float | None = None
    # Services sharing the engines (simulator/services.py: "sharegpt,arxiv,azure_conv,code"); replaces `trace`.
    services: str | None = None
    service_priority: str | None = None  # fcfs | round_robin | seallm (policies/service_priority.py)
    service_preempt: bool = False        # re-prioritise running requests by preemption (simulator only)
    max_num_seqs: int | None = None      # the engines' --max-num-seqs (None: the profile's)
    rebalance_s: float | None = None     # Aladdin's Algorithm 2 every this many seconds (None: off)
    shed: bool = True                    # refuse what will miss its SLO (the gateway's limits.shed_will_miss)

    def __post_init__(self) -> None:
        if self.lengths not in LENGTHS:
            raise ValueError(f"lengths must be one of {', '.join(LENGTHS)}, got {self.lengths!r}")
        if self.warmup < 0:
            raise ValueError("warmup must be >= 0")
        if self.ttft_slowdown is not None and not self.ttft_slowdown > 0:
            raise ValueError("ttft_slowdown must be > 0")
        if self.service_priority is not None and self.service_priority not in SERVICE_PRIORITIES:
            raise ValueError(f"service priority must be one of {', '.join(SERVICE_PRIORITIES)}, "
                             f"got {self.service_priority!r}")
        if self.service_preempt and self.service_priority is None:
            raise ValueError("service preemption needs a service priority")
        if self.services is not None:
            parse_services(self.services)
            if self.rate is None or self.duration is None:
                raise ValueError("services need an arrival rate (the total over all services) and a duration")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")

    @property
    def profiles(self) -> list[str]:
        return [p.strip() for p in self.profile.split(",") if p.strip()]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_workload(spec: SimSpec) -> list[WorkloadRequest]:
    """The requests of the run, with each request's TTFT target under `ttft_slowdown`."""
    if spec.services is not None:
        wl = service_workload(parse_services(spec.services), rate=spec.rate * spec.rate_scale, duration=spec.duration,
                              arrival=spec.arrival, cv=spec.cv, seed=spec.seed)
    else:
        wl = load_workload(spec.trace, rate=spec.rate, rate_scale=spec.rate_scale, arrival=spec.arrival, cv=spec.cv,
                           duration=spec.duration, seed=spec.seed)
    if not wl:
        raise ValueError("the workload is empty (check --duration / --rate)")
    if spec.ttft_slowdown is not None:
        model = PerfModel.from_step_profile(load_profile(spec.profiles[0]))
        for r in wl:
            r.slo_ttft_s = max(spec.slo_ttft_s, spec.ttft_slowdown * model.prefill_time(r.prompt_tokens))
    return wl


def history(spec: SimSpec, workload: list[WorkloadRequest]) -> list[tuple[int, int]]:
    """`spec.warmup` (prompt, output) pairs of the trace that the run does not replay (its own stream of draws); none
    for a run of services (the predictor then learns from the run's completions)."""
    if not spec.warmup or spec.services is not None:
        return []
    rows = trace_rows(spec.trace)
    used = {r.source_row for r in workload if r.source_row is not None}
    pool = [rows[i] for i in range(len(rows)) if i not in used] or rows
    rng = random.Random(10_000 + spec.seed)
    return [pool[rng.randrange(len(pool))] for _ in range(spec.warmup)]


def build_sim(spec: SimSpec, workload: list[WorkloadRequest]) -> ClusterSim:
    workers, prefill = spec.workers, 0
    if spec.pd is not None:
        prefill, decode = parse_pd_split(spec.pd)
        workers = prefill + decode
    if workers < 1:
        raise ValueError("--workers must be >= 1")
    profiles = spec.profiles
    predictor = LengthPredictor()
    model = load_profile(profiles[0]).model
    for p, o in history(spec, workload):
        predictor.observe(model, p, o)
    sim = ClusterSim(profiles, workers, spec.policy, slo_ttft_s=spec.slo_ttft_s, slo_tpot_s=spec.slo_tpot_s,
                     predicted_output_tokens=predictor, policy_params=spec.policy_params or None,
                     prefill_workers=prefill, queue_lookahead=spec.queue_lookahead, queue_poll_s=spec.queue_poll_s,
                     seed=spec.seed, rebalance_s=spec.rebalance_s, service_priority=spec.service_priority,
                     service_preempt=spec.service_preempt, shed=spec.shed,
                     engine_config=EngineConfig(max_num_seqs=spec.max_num_seqs) if spec.max_num_seqs else None)
    if spec.lengths == "oracle":
        sim.predicted_output_tokens = lambda r: r.output_tokens   # told by name; the predictor still learns
    return sim


def simulate(spec: SimSpec, progress: Callable[[int, int], None] | None = None,
             on_finish: Callable[[ClusterSim, RequestResult], Any] | None = None) -> SimResult:
    """Run the spec. `on_finish(sim, result)` sees every request as it ends (it may raise to stop the run)."""
    wl = build_workload(spec)
    sim = build_sim(spec, wl)
    if on_finish is not None:
        sim.on_finish.append(on_finish)
    return sim.run(wl, progress=progress)


# ---- the CLI ----------------------------------------------------------------------------------------------
def parse_params(items: list[str]) -> dict[str, Any]:
    """`key=value` pairs; values parsed as JSON where they parse (numbers, true/false, null), else strings."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--policy-param needs key=value, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def run_simulate_cli(spec: SimSpec, as_json: bool) -> None:
    extra: dict[str, Any] = {"trace": spec.trace if spec.services is None else spec.services}
    if spec.service_priority is not None:
        extra["service_priority"] = spec.service_priority + ("+preempt" if spec.service_preempt else "")
    extra["seed"] = spec.seed
    run_cli(f"simulate {spec.policy} on {spec.services or spec.trace}",
            lambda progress: simulate(spec, progress=progress), extra, as_json)


def run_cli(title: str, run: Callable[[Callable[[int, int], None]], Any], extra: dict[str, Any], as_json: bool) -> None:
    """One simulation for the CLI: progress on stderr, `run(progress).to_dict()` plus `extra` printed as one JSON
    object or a table; a ValueError exits 2 with its message."""
    import typer

    from simulator.progress import stderr_progress

    try:
        with stderr_progress(title) as progress:
            result = run(progress)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    summary = {**result.to_dict(), **extra}
    if as_json:
        print(json.dumps(summary))
        return
    print_summary(summary)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="fleetgate simulate", show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in summary.items():
        table.add_row(k, _fmt(v))
    Console().print(table)
