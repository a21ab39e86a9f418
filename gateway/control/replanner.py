"""Re-planning as traffic moves (config `replan:`; SeaLLM section 4.3), run by the autoscaler's leader.

Every replica adds its traffic since start to its autoscaler load document (`autoscale:load:<replica>`, key
`replan`): per model, the requests answered (any status: what arrived; gateway/ops/metrics.py), the prompt and output
tokens of the finished ones (gateway/pipeline/learning.py) and the SLO judgements (met, missed; gateway/pipeline/slo.py). Models
are planned by their short names (policies/hardware.py); a served name the hardware table does not know is left
out of the plan.

The leader (the replica holding the `autoscaler` lease), at the end of each re-planning interval:
1. sums the replicas' documents and takes the window since the last round: each model's arrival rate and mean
   lengths (policies/replan.py `demands_between`), rates in model seconds (`replan.time_scale`, default the sim
   actuator's K: a simulated fleet runs K model seconds per wall second) and the achieved SLO attainment;
2. adapts the interval with SeaLLM eq. 8 (section 4.3; policies/replan.py `next_interval`): the attainment the
   plan in force was estimated to reach against the achieved one;
3. re-plans with the closed forms only (policies/replan.py `replan` over policies/planning.py `candidates`:
   SeaLLM's two-stage allocation, Aladdin eq. 6-7); the virtual-time simulator does not score candidates in
   this loop (a score takes seconds to minutes of CPU on the gateway's machine; `fleetgate plan` does it
   offline). The estimate of a plan is therefore closed-form too (`closed_form_attainment`);
4. hands a changed plan to the actuator (`sim`: gateway/control/actuators.py `apply_groups` starts the new instances
   and drains the removed ones exactly as a scale-in, so requests in flight finish), and publishes the state
   as `replan:state`, which every replica exports.

While re-planning is on, the plan decides the fleet: the autoscaler still computes and exports Chiron's pool
sizes, but only the plan is acted on. The initial plan is the config's `deployment:` section.

Metrics: `fleetgate_plan_changes_total`, `fleetgate_plan_predicted_attainment`, `fleetgate_plan_gpus`,
`fleetgate_plan_cost_per_hour`, `fleetgate_plan_instances{group}`, `fleetgate_replan_interval_seconds`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge

from policies.hardware import gpu_spec, model_spec
from policies.planning import InstanceGroup, ServiceDemand, Slo, parse_stock
from policies.replan import ModelTotals, demands_between, group_key, next_interval, replan

if TYPE_CHECKING:
    from gateway.config import GatewayConfig
    from gateway.control.actuators import Actuator
    from gateway.ops.metrics import GatewayMetrics
    from gateway.pipeline.dispatch import Dispatcher
    from gateway.state.base import StateStore

log = logging.getLogger("fleetgate.replanner")

DOC_STATE = "replan:state"
HISTORY = 50          # rounds kept in the state document


class Replanner:
    def __init__(self, config: GatewayConfig, store: StateStore, metrics: GatewayMetrics, actuator: Actuator) -> None:
        self.cfg = rc = config.replan
        self.store = store
        self.actuator = actuator
        self.dispatcher: Dispatcher | None = None
        act = config.autoscale.actuator
        self.k = rc.time_scale or (act.sim.time_scale if act.kind == "sim" else 1.0)
        self.slo = Slo((config.slo.ttft_ms or 0.0) * self.k / 1000, (config.slo.tpot_ms or 0.0) * self.k / 1000)
        self.stocks = parse_stock(rc.gpus)
        prices = {s.gpu.name: s.gpu.price_per_hour for s in self.stocks}
        self.current: tuple[InstanceGroup, ...] = tuple(
            InstanceGroup(model_spec(g.model).name, gpu_spec(g.gpu).name, g.tp, g.count, g.role,
                          prices.get(gpu_spec(g.gpu).name, gpu_spec(g.gpu).price_per_hour))
            for g in (config.deployment.groups if config.deployment is not None else ()))
        self.interval_s = rc.interval_s
        self.m_est: float | None = None
        self.changes = 0
        self.history: list[dict[str, Any]] = []
        self._base: tuple[dict[str, ModelTotals], dict[str, tuple[float, float]], float] | None = None
        self._next = 0.0
        self._last: dict[str, ServiceDemand] = {}
        self._short: dict[str, str | None] = {}
        self._exported_changes = 0
        r = metrics.registry
        self.c_changes = Counter("fleetgate_plan_changes", "Plan changes the re-planner applied.",
                                 registry=r)
        self.g_att = Gauge("fleetgate_plan_predicted_attainment",
                           "SLO attainment the plan in force is estimated to reach (closed form).", registry=r)
        self.g_gpus = Gauge("fleetgate_plan_gpus", "GPUs of the plan in force.", registry=r)
        self.g_cost = Gauge("fleetgate_plan_cost_per_hour", "Cost per hour (USD) of the plan in force.", registry=r)
        self.g_instances = Gauge("fleetgate_plan_instances", "Instances per plan group (model/gpu/tpN/role).",
                                 ["group"], registry=r)
        self.g_interval = Gauge("fleetgate_replan_interval_seconds",
                                "The current re-planning interval (SeaLLM eq. 8, wall seconds).", registry=r)
        self.g_interval.set(self.interval_s)

    # --- lifecycle (the actuator's process) -----------------------------------------------------------
    async def start(self, dispatcher: Dispatcher) -> None:
        """Start the initial plan's instances (no cold start: they are the fleet the gateway starts with)."""
        self.dispatcher = dispatcher
        apply = getattr(self.actuator, "apply_groups", None)
        if apply is not None and self.current:
            await apply(self.current, cold_start_s=0.0, wait=True)
        self._export(self._state(0.0))

    # --- every replica ------------------------------------------------------------------------------------
    def short_name(self, served: str) -> str | None:
        hit = self._short.get(served, "")
        if hit == "":
            try:
                hit = model_spec(served).name
            except ValueError:
                hit = None
            self._short[served] = hit
        return hit

    def traffic_doc(self) -> dict[str, Any]:
        """This replica's totals since start, by short model name (the `replan` key of its load document)."""
        d = self.dispatcher
        if d is None:
            return {}
        traffic: dict[str, list[float]] = {}
        for served, n in d.metrics.requests_by_model().items():
            short = self.short_name(served)
            if short is not None:
                traffic.setdefault(short, [0.0] * 5)[0] += n
        for served, (fin, s_in, s_in2, s_out) in d.learner.traffic.items():
            short = self.short_name(served)
            if short is not None:
                t = traffic.setdefault(short, [0.0] * 5)
                t[1] += fin
                t[2] += s_in
                t[3] += s_in2
                t[4] += s_out
        slo: dict[str, list[float]] = {}
        for served, (met, missed) in d.slo.totals().items():
            short = self.short_name(served)
            if short is not None:
                acc = slo.setdefault(short, [0.0, 0.0])
                acc[0] += met
                acc[1] += missed
        return {"traffic": traffic, "slo": slo}

    async def export_shared(self) -> None:
        """A replica that is not the leader shows the leader's state."""
        state = await self.store.get_doc(DOC_STATE)
        if state:
            self._export(state)

    # --- the leader -------------------------------------------------------------------------------------
    async def tick(self, now: float, docs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
        """One leader round at wall time `now` over the replicas' fresh load documents; the state when a
        re-planning round ran, else None."""
        totals, slo = _sum_docs(docs)
        if self._base is None:
            self._base, self._next = (totals, slo, now), now + self.interval_s
            return None
        if now < self._next:
            return None
        before, slo_before, t0 = self._base
        demands = demands_between(before, totals, (now - t0) * self.k, self.cfg.min_finished, self._last)
        met = sum(v[0] - slo_before.get(m, (0.0, 0.0))[0] for m, v in slo.items())
        judged = met + sum(v[1] - slo_before.get(m, (0.0, 0.0))[1] for m, v in slo.items())
        achieved = met / judged if judged > 0 else None
        if achieved is not None and self.m_est is not None:
            self.interval_s = next_interval(self.interval_s, self.m_est, achieved, self.cfg.beta,
                                            self.cfg.min_interval_s, self.cfg.max_interval_s)
        r = replan(demands, self.stocks, self.slo, self.current, self.cfg.target, self.cfg.objective,
                   self.cfg.budget_per_hour, self.cfg.headroom, self.cfg.min_saving, mixed_only=True)
        if r.changed:
            apply = getattr(self.actuator, "apply_groups", None)
            if apply is not None:
                await apply(r.groups)
            self.current = r.groups
            self.changes += 1
            log.info("re-plan: %s; %s -> %s", r.reason, ", ".join(f"{k} {v:+d}" for k, v in r.changes.items()),
                     ", ".join(f"{g.count}x {group_key(g)}" for g in r.groups), extra={"unlimited": True})
        self.m_est = r.estimated_attainment
        self._last = {d.model: d for d in demands}
        self._base, self._next = (totals, slo, now), now + self.interval_s
        self.history.append({"t": now, "changed": r.changed, "reason": r.reason, "achieved": achieved,
                             "estimated": r.estimated_attainment, "interval_s": self.interval_s,
                             "demands": {d.model: round(d.rate, 4) for d in demands}, "changes": r.changes})
        del self.history[:-HISTORY]
        state = self._state(now)
        await self.store.put_doc(DOC_STATE, state)
        self._export(state)
        return state

    def _state(self, now: float) -> dict[str, Any]:
        return {"t": now, "interval_s": self.interval_s, "changes": self.changes,
                "estimated_attainment": self.m_est, "gpus": sum(g.gpus for g in self.current),
                "cost_per_hour": sum(g.cost_per_hour for g in self.current),
                "groups": {group_key(g): g.count for g in self.current}, "history": self.history}

    def _export(self, state: Mapping[str, Any]) -> None:
        grow = int(state.get("changes", 0)) - self._exported_changes
        if grow > 0:
            self.c_changes.inc(grow)
            self._exported_changes += grow
        if state.get("estimated_attainment") is not None:
            self.g_att.set(state["estimated_attainment"])
        self.g_gpus.set(state.get("gpus", 0))
        self.g_cost.set(state.get("cost_per_hour", 0.0))
        self.g_interval.set(state.get("interval_s", self.interval_s))
        groups = state.get("groups", {})
        for key, n in groups.items():
            self.g_instances.labels(key).set(n)
        for labels in list(self.g_instances._metrics):  # noqa: SLF001 - groups the plan dropped go to 0
            if labels[0] not in groups:
                self.g_instances.labels(*labels).set(0)


def _sum_docs(docs: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, ModelTotals], dict[str, tuple[float, float]]]:
    totals: dict[str, ModelTotals] = {}
    slo: dict[str, tuple[float, float]] = {}
    for d in docs.values():
        part = d.get("replan") or {}
        for model, v in (part.get("traffic") or {}).items():
            totals[model] = totals.get(model, ModelTotals()) + ModelTotals.from_list(v)
        for model, (met, missed) in (part.get("slo") or {}).items():
            a, b = slo.get(model, (0.0, 0.0))
            slo[model] = (a + met, b + missed)
    return totals, slo
