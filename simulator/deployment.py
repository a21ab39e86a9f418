"""Plans that run: a deployment (a plan's instance groups) as simulated fleets, one per model.

    groups = [InstanceGroup("llama3-8b", "a100", 2, count=3)]
    res = simulate_deployment(groups, [ServiceShare("llama3-8b", 1.0)], DeploymentRun(trace="sharegpt", rate=12))
    res.summary()["slo_attainment"]

Each instance group becomes `count` workers of the profile policies/hardware.py derives for (model, GPU, TP);
each model's fleet replays its share of the traffic (the trace's lengths, `rate × share` req/s, or the trace's own
timestamps scaled by the share) through the same placement step, admission queue and policy as
`fleetgate simulate`. A deployment file is the JSON `fleetgate plan --json` prints (or the same in YAML): its
`deployment` section lists the groups and the services' shares.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from policies.hardware import derive_profile, gpu_spec, model_spec
from policies.planning import InstanceGroup
from policies.types import ROLES
from simulator.cluster import ClusterSim, SimResult
from simulator.profiles import Profile, profile_from_dict
from simulator.simulate import SimSpec, build_workload, history


@dataclass(frozen=True, slots=True)
class ServiceShare:
    model: str       # short model name
    share: float     # fraction of the traffic


@dataclass(frozen=True, slots=True)
class DeploymentRun:
    """How to replay traffic on a deployment (the SimSpec fields that are not about the fleet)."""

    trace: str = "sharegpt"
    rate: float | None = None          # total req/s over all services; None: the trace's timestamps
    duration: float | None = 120.0
    seed: int = 0
    policy: str = "hetero"
    slo_ttft_s: float = 0.6
    slo_tpot_s: float = 0.03
    warmup: int = 2000


@dataclass
class DeploymentResult:
    per_model: dict[str, SimResult] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """Totals over the models (attainment over all servable requests) and each model's own summary."""
        models = {m: r.to_dict() for m, r in self.per_model.items()}
        servable = sum(d["servable"] for d in models.values())
        met = sum(d["slo_met"] for d in models.values())
        return {
            "requests": sum(d["requests"] for d in models.values()),
            "servable": servable,
            "slo_met": met,
            "slo_attainment": met / servable if servable else 0.0,
            "goodput_rps": sum(d["goodput_rps"] for d in models.values()),
            "throughput_rps": sum(d["throughput_rps"] for d in models.values()),
            "output_tokens_per_s": sum(d["output_tokens_per_s"] for d in models.values()),
            "gpu_seconds": sum(d["gpu_seconds"] for d in models.values()),
            "models": {m: {k: d[k] for k in ("requests", "slo_attainment", "goodput_rps", "throughput_rps",
                                                "ttft_p99", "tpot_p99", "workers", "profile")}
                       for m, d in models.items()},
        }


@lru_cache(maxsize=256)
def group_profile(model: str, gpu: str, tp: int) -> Profile:
    """The simulator profile of one instance of a group (derived; cached)."""
    d = derive_profile(model, gpu, tp)
    return profile_from_dict(d, d["name"])


def simulate_deployment(groups: Sequence[InstanceGroup], services: Sequence[ServiceShare], run: DeploymentRun,
                        ) -> DeploymentResult:
    """Simulate every service's fleet on its share of the traffic; ValueError for a service without instances."""
    out = DeploymentResult()
    for k, svc in enumerate(services):
        mine = [g for g in groups if g.model == svc.model and g.count > 0]
        if not mine:
            raise ValueError(f"the deployment has no instances of {svc.model}")
        if svc.share <= 0:
            continue
        spec = service_spec(run, svc, k)
        workload = build_workload(spec)
        out.per_model[svc.model] = _fleet(mine, run, spec, workload).run(workload)
    return out


def service_spec(run: DeploymentRun, svc: ServiceShare, index: int) -> SimSpec:
    """The SimSpec of the `index`-th service's traffic (its share of the rate, its own seed)."""
    return SimSpec(trace=run.trace, rate=None if run.rate is None else run.rate * svc.share,
                   rate_scale=1.0 if run.rate is not None else svc.share, duration=run.duration,
                   seed=run.seed * 1000 + index, policy=run.policy, slo_ttft_s=run.slo_ttft_s,
                   slo_tpot_s=run.slo_tpot_s, warmup=run.warmup)


def _fleet(groups: Sequence[InstanceGroup], run: DeploymentRun, spec: SimSpec, workload: list) -> ClusterSim:
    from policies.length_predictor import LengthPredictor

    profiles = [group_profile(g.model, g.gpu, g.tp) for g in groups]
    predictor = LengthPredictor()
    for p, o in history(spec, workload):
        predictor.observe(profiles[0].model, p, o)
    sim = ClusterSim(list(dict.fromkeys(profiles)), 0, run.policy, slo_ttft_s=run.slo_ttft_s,
                     slo_tpot_s=run.slo_tpot_s, predicted_output_tokens=predictor, seed=spec.seed,
                     queue_lookahead=spec.queue_lookahead, queue_poll_s=spec.queue_poll_s)   # the gateway's queue
    for g, prof in zip(groups, profiles, strict=True):
        for _ in range(g.count):
            sim.add_worker(prof, role=g.role, now=0.0)
    return sim


# ---- deployment files ------------------------------------------------------------------------------------------
def parse_deployment(data: Mapping[str, Any], source: str = "<deployment>",
                     ) -> tuple[list[InstanceGroup], list[ServiceShare]]:
    """Groups and service shares of a deployment mapping (a plan's JSON, or its `deployment` section alone)."""
    section = data.get("deployment", data) if isinstance(data, Mapping) else None
    if not isinstance(section, Mapping) or not isinstance(section.get("groups"), list) or not section["groups"]:
        raise ValueError(f"{source}: a deployment needs a non-empty `groups` list")
    groups = [_group(g, f"{source}: groups[{i}]") for i, g in enumerate(section["groups"])]
    raw = section.get("services") or [{"model": m, "share": 1.0} for m in dict.fromkeys(g.model for g in groups)]
    services = []
    for i, s in enumerate(raw):
        where = f"{source}: services[{i}]"
        if not isinstance(s, Mapping) or "model" not in s:
            raise ValueError(f"{where}: needs a model")
        share = _number(s.get("share", 1.0), f"{where}.share")
        services.append(ServiceShare(model_spec(str(s["model"])).name, share))
    total = sum(s.share for s in services)
    if total <= 0:
        raise ValueError(f"{source}: the services' shares add up to 0")
    return groups, [ServiceShare(s.model, s.share / total) for s in services]


def _group(raw: Any, where: str) -> InstanceGroup:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: must be a mapping")
    missing = [k for k in ("model", "gpu", "tp", "count") if k not in raw]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    role = str(raw.get("role", "mixed"))
    if role not in ROLES:
        raise ValueError(f"{where}: role must be one of {', '.join(ROLES)}, got {role!r}")
    tp, count = int(_number(raw["tp"], f"{where}.tp")), int(_number(raw["count"], f"{where}.count"))
    try:
        model, gpu = model_spec(str(raw["model"])), gpu_spec(str(raw["gpu"]))
        group_profile(model.name, gpu.name, tp)         # fits, splits, valid
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    price = _number(raw.get("price_per_gpu_hour", gpu.price_per_hour), f"{where}.price_per_gpu_hour")
    return InstanceGroup(model.name, gpu.name, tp, count, role, price)


def _number(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0 or v == float("inf"):
        raise ValueError(f"{where}: must be a number >= 0, got {v!r}")
    return float(v)


def load_deployment(path: str | Path) -> tuple[list[InstanceGroup], list[ServiceShare]]:
    """Read a deployment file (JSON or YAML)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"{p}: cannot read: {exc.strerror}") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {exc}") from None
    return parse_deployment(data, str(p))


def deployment_defaults(path: str | Path) -> dict[str, Any]:
    """The policy and SLOs a plan file was scored with (empty for a bare deployment section)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text()) if p.suffix == ".json" else yaml.safe_load(p.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    section = data.get("deployment", data) if isinstance(data, Mapping) else {}
    out: dict[str, Any] = {}
    if isinstance(section, Mapping):
        if isinstance(section.get("policy"), str):
            out["policy"] = section["policy"]
        slo = section.get("slo")
        if isinstance(slo, Mapping):
            for key, name in (("ttft_ms", "slo_ttft_s"), ("tpot_ms", "slo_tpot_s")):
                if isinstance(slo.get(key), int | float) and slo[key] > 0:
                    out[name] = slo[key] / 1000.0
    return out


def run_deployment_cli(path: str, run: DeploymentRun, as_json: bool) -> None:
    """`fleetgate simulate --deployment FILE`: every model's fleet of the file on its share of the traffic."""
    import sys

    import typer

    try:
        groups, services = load_deployment(path)
        summary = simulate_deployment(groups, services, run).summary()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    summary.update(trace=run.trace, seed=run.seed, policy=run.policy,
                   gpus=sum(g.gpus for g in groups), cost_per_hour=round(sum(g.cost_per_hour for g in groups), 4))
    if as_json:
        print(json.dumps(summary))
        return
    from simulator.simulate import _print_summary

    models = summary.pop("models")
    _print_summary(summary)
    for m, d in models.items():
        print(f"{m}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items()))
