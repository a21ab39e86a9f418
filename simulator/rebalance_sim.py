"""Rebalancing in the virtual-time simulator: the live rebalancer's rules (policies/rebalance.py), looked at every
`interval_s` of simulated time, as gateway/pipeline/rebalancer.py looks every `rebalance.interval_s` of wall time.

What each side sees differs only in where it reads it: the gateway counts its streams' tokens and reads the
engines' queues from their scraped /metrics; the simulator reads its engines' token counts (`output_so_far`) and
the same scraped view of their queues (`ClusterSim._view`, refreshed every `scrape_interval_s`). The observed
step ratio of a worker is its requests' seconds per token since the last look over the profile's performance
model (`PerfModel.from_step_profile`, the model the gateway's learner starts from). A move aborts the request on its engine, gives
back its reservation, tells the placement step it ended there, and places it again through the placement step
(`move_exclusions`: the proposed destination if still under its cap, else any other worker), as the gateway's
attempt loop does (`Attempts.place_again`, MOVE); with no worker free it waits in the admission queue.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from policies.perf_model import PerfModel
from policies.placement import has_room, reserved_tokens
from policies.rebalance import (
    INTERVAL_S,
    MAX_MOVES_PER_S,
    SLOW_RATIO,
    LegSeen,
    budget_for,
    move_exclusions,
    propose_moves,
    queued_legs,
    step_ratio,
)
from policies.types import ROLE_MIXED, Move

if TYPE_CHECKING:
    from simulator.cluster import ClusterSim


class SimRebalancer:
    """The simulator's rebalancing loop over one ClusterSim (module docstring)."""

    def __init__(self, sim: ClusterSim, interval_s: float = INTERVAL_S, max_moves_per_s: float = MAX_MOVES_PER_S,
                 slow_ratio: float = SLOW_RATIO) -> None:
        self.sim = sim
        self.interval_s = interval_s
        self.slow_ratio = slow_ratio
        self.budget = budget_for(max_moves_per_s)
        self.moved: set[str] = set()                   # requests moved once (never again, as live)
        self._seen: dict[str, tuple[int, float]] = {}  # request -> (tokens, when that count was first seen)
        self._models: dict[str, PerfModel] = {}

    def _perf_model(self, sim: ClusterSim, wid: str) -> PerfModel:
        prof = sim.workers[wid].profile
        pm = self._models.get(prof.name)
        if pm is None:
            pm = self._models[prof.name] = PerfModel.from_step_profile(prof)
        return pm

    def look(self, now: float, observed: Mapping[str, float] | None = None) -> list[Move]:
        """One look: the moves made. `observed`: step ratios to judge (worker -> observed over predicted step)
        for the workers it names, instead of measuring them, as the gateway's `Rebalancer.tick` takes them (a harness driving both sides
        with the same observations: tests/test_pipeline_parity_moves.py)."""
        sim = self.sim
        views = [sim._view(w, now) for w in sim.workers.values() if not w.draining and w.role == ROLE_MIXED]
        by_id = {v.id: v for v in views}
        samples: dict[str, list[tuple[float, int]]] = {}
        decoding: dict[str, list[int]] = {}
        legs: list[LegSeen] = []
        seen: dict[str, tuple[int, float]] = {}
        for rid, (_, feats) in sim._pending.items():
            res = sim.results[rid]
            wid = res.worker_id
            if wid not in by_id:
                continue
            n = sim.workers[wid].engine.output_so_far(rid)
            if n > 0:
                prev = self._seen.get(rid)
                if prev is not None and n > prev[0]:
                    samples.setdefault(wid, []).append((now - prev[1], n - prev[0]))
                seen[rid] = (n, now) if prev is None or n != prev[0] else prev
                decoding.setdefault(wid, []).append(feats.prompt_tokens + n)
            legs.append(LegSeen(rid, wid, feats, n, res.dispatched or 0.0,
                                rid not in sim._pd_legs and rid not in self.moved))
        self._seen = seen
        queued = queued_legs(legs, {v.id: v.waiting for v in views})
        ratios: dict[str, float] = dict(observed) if observed is not None else {}
        for wid in {*samples, *(leg.worker for leg in legs if leg.tokens == 0 and leg.movable)} - ratios.keys():
            if wid in samples:
                r = step_ratio(samples[wid], decoding.get(wid, ()), by_id[wid].running, self._perf_model(sim, wid))
                if r is not None:
                    ratios[wid] = r
        moves = propose_moves(sim.placement, queued, views, now, ratios, self.slow_ratio, self.budget, now)
        made = [m for m in moves if m.dst in by_id and self._move(m, now)]
        if made:
            self.budget.spend(len(made))
        return made

    def _move(self, m: Move, now: float) -> bool:
        sim = self.sim
        src = sim.workers.get(m.src)
        rid = m.request_id
        if src is None or rid not in sim._pending or not src.engine.holds(rid) or src.engine.output_so_far(rid):
            return False
        r, feats = sim._pending.pop(rid)
        if src.step_end is not None and src.step_end > now:
            sim._truncate(src, now)
        src.engine.abort(rid, now)
        src.reserve(reserved_tokens(feats), -1)
        sim.placement.finished(feats, src.id, 0, now)
        self.moved.add(rid)
        sim.moves += 1
        candidates = [w.id for w in sim.workers.values() if not w.draining and has_room(w.inflight, w.cap)]
        for exclude in move_exclusions(m.dst, candidates, (src.id,)):
            if sim._try_dispatch(r, feats, now, exclude) is None:
                break
        else:
            sim._requeue(r, feats, now)
        sim._maybe_retire(src, now)
        return True
