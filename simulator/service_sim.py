"""A service-aware priority (policies/service_priority.py) driving the virtual-time cluster (simulator/cluster.py)
the way the gateway drives it, plus one thing only the simulator can do.

- Every request is announced at arrival; the gateway's admission queue tries waiting requests in the scheduler's
  order; each request reaches its engine with vLLM's `priority` field set from the scheduler, on engines running
  `--scheduling-policy priority` (the engine then orders its WAITING queue by it and, short of KV blocks, preempts
  the lowest priority, as vLLM); its finish teaches the scheduler its service's execution cost.
- `preempt=True` (SIMULATOR ONLY, vLLM fixes a request's priority at arrival): before every engine step each live
  request's priority is recomputed from the tokens it has generated (SeaLLM's budget shrinks and doubles as it
  runs), and the worst running request the scheduler lets go (`preemptible`: for SeaLLM one that outran its first
  budget) is set aside whenever a better waiting one cannot start beside it (EngineCore.reprioritize). It keeps its
  KV, as over SeaLLM's unified KV cache (section 4.4), and resumes where it was; only when blocks run short is a
  paused request's KV dropped (it then recomputes, as after vLLM's preemption).
- Token accounting (`vtc`): a request's prompt is charged when it leaves for its engine and its output tokens at its
  finish; with `preempt=True` they are charged as the engine steps (the per-step `progressed` report; VTC itself
  never preempts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from policies.service_priority import ServiceScheduler, make_service_scheduler
from simulator.engine import EngineConfig, EngineCore, SimRequest

if TYPE_CHECKING:
    from policies.admission import Waiting
    from simulator.cluster import RequestResult
    from simulator.workload import WorkloadRequest

__all__ = ["ServicePriority", "ServiceScheduler", "service_summary"]


class ServicePriority:
    """The glue between one ServiceScheduler and a ClusterSim (see the module docstring)."""

    def __init__(self, scheduler: ServiceScheduler, preempt: bool = False) -> None:
        self.scheduler = scheduler
        self.preempt = preempt

    @classmethod
    def build(cls, priority: str | ServiceScheduler, preempt: bool = False) -> ServicePriority:
        sched = make_service_scheduler(priority) if isinstance(priority, str) else priority
        return cls(sched, preempt)

    @property
    def name(self) -> str:
        return self.scheduler.name + ("+preempt" if self.preempt else "")

    def engine_config(self, config: EngineConfig | None) -> EngineConfig:
        """The engines' config with vLLM's `--scheduling-policy priority`."""
        return replace(config or EngineConfig(), scheduling_policy="priority")

    def attach(self, engine: EngineCore) -> None:
        if self.preempt:
            engine.reprioritize = self._reprioritize

    def arrived(self, r: WorkloadRequest, now: float) -> None:
        self.scheduler.arrived(r.request_id, r.service, now, prompt_tokens=r.prompt_tokens)

    def queue_order(self, now: float) -> Callable[[Waiting], Any]:
        key = self.scheduler.key
        return lambda w: key(w.features.request_id, now)

    def engine_priority(self, r: WorkloadRequest, now: float) -> int:
        """The request leaves for its engine: vLLM's `priority` field for it."""
        self.scheduler.started(r.request_id, now)
        return self.scheduler.engine_priority(r.request_id, now)

    def finished(self, r: WorkloadRequest, res: RequestResult, now: float) -> None:
        self.scheduler.finished(r.request_id, r.prompt_tokens, res.output_tokens, now, completed=res.completed)

    def _reprioritize(self, req: SimRequest, generated: int, now: float) -> tuple[float, bool]:
        sched = self.scheduler
        sched.progressed(req.request_id, req.prompt_len, generated, now)
        return sched.engine_priority(req.request_id, now), sched.preemptible(req.request_id, now)


def _stats(rs: list[RequestResult]) -> dict[str, Any]:
    servable = [r for r in rs if r.servable]
    norm = np.array([r.normalized_latency for r in servable if r.completed and r.normalized_latency is not None])
    met = sum(1 for r in servable if r.slo_met)
    return {
        "requests": len(rs),
        "slo_attainment": met / len(servable) if servable else 0.0,
        "norm_latency_mean": float(norm.mean()) if norm.size else None,
        "norm_latency_p99": float(np.percentile(norm, 99)) if norm.size else None,
    }


def service_summary(rs: list[RequestResult]) -> dict[str, Any]:
    """Runs whose requests have services only: normalized latency (e2e / output tokens, completed requests) mean and
    p99 over all, and per service the same with its attainment."""
    names = sorted({r.service for r in rs if r.service})
    if not names:
        return {}
    total = _stats(rs)
    return {"norm_latency_mean": total["norm_latency_mean"], "norm_latency_p99": total["norm_latency_p99"],
            "services": {n: _stats([r for r in rs if r.service == n]) for n in names}}
