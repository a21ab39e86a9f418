"""Rebalancing live: Aladdin's Algorithm 2 (appendix C) over the streams the gateway sent that have no first
token yet, through `ModelPlacement.rebalance`, the step the simulator calls too (simulator/cluster.py
`_rebalance`; the rule: policies/aladdin/rebalancing.py). This module is plumbing only:

    track     each generating leg of a model whose `rebalance` is on runs as a task the rebalancer can reach
              (`run_leg`), and its stream's token count is read on every look
    observe   every `interval_s`, per worker: the seconds per token its streams took since the last look, over
              its profile's performance model (eq. 3 at the worker's batch and mean context) -> observed ratio;
              a worker none of whose streams produced tokens (its traffic does not stream) is observed by its
              scraped engine counters instead: output tokens over its running sequences between two scrapes
    propose   the requests that may move: not streamed, or streamed and resumable; not P/D, never moved,
              without a token yet (a non-streaming answer shows none until it is whole), and
              among the last `waiting` (the worker's scraped queue) of its requests without one, so still queued
              in the engine (`still_queued`); ModelPlacement.rebalance with the observed ratios, within the
              model's budget of moves per second (`MoveBudget`)
    move      the leg's task is cancelled: its upstream connection closes and the engine aborts the request;
              `run_leg` returns `MoveAsked`, and the attempt loop places the request again (Attempts.place_again,
              MOVE) as the continuation of a stream that delivered nothing: the client sees a later first token

A non-streaming request moves like a stream: its client sees nothing before the whole answer, so a move only
makes that answer come sooner; one whose answer the relay began to send is never interrupted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter

from gateway.state.outage import quiet_loop, stop_task
from policies.aladdin.rebalancing import MoveBudget
from policies.rebalance import LegSeen, budget_for, propose_moves, queued_legs, step_ratio
from policies.types import ROLE_MIXED, Move, WorkerView

if TYPE_CHECKING:
    from gateway.config import GatewayConfig
    from gateway.fleet.registry import Registry, WorkerState
    from gateway.pipeline.learning import Learner
    from gateway.request.context import ModelRuntime, RequestContext
    from gateway.state.base import StateStore
    from gateway.wire.results import RelayResult

log = logging.getLogger("fleetgate.rebalancer")


@dataclass(frozen=True, slots=True)
class MoveAsked:
    """What `run_leg` returns when the rebalancer interrupted the leg to move its request towards `dst` (a
    preference: the attempt loop places it again through the placement step)."""

    dst: str


class Pipeline(Protocol):
    """What the rebalancer reads of the dispatcher (gateway/pipeline/dispatch.py): the models' runtimes, the learner's
    performance models, the reservations in flight and the workers."""

    runtimes: dict[str, ModelRuntime]
    learner: Learner
    store: StateStore
    registry: Registry


@dataclass(slots=True, eq=False)
class _Leg:
    ctx: RequestContext
    worker: str
    task: asyncio.Future
    movable: bool
    sent: float           # perf_counter() when the leg began: the order the worker got its requests
    seen_at: float = 0.0  # perf_counter() of the last look at which its token count changed
    seen: int = 0         # ... and that count
    move_to: str | None = None


class Rebalancer:
    """The live loop of rebalancing for every model that has it on (module docstring)."""

    def __init__(self, config: GatewayConfig, registry: CollectorRegistry) -> None:
        self.config = config
        self.d: Pipeline | None = None   # the dispatcher, set by start()
        self.legs: dict[str, dict[str, _Leg]] = {}      # model -> request id -> its leg in flight
        self.budgets: dict[str, MoveBudget] = {}
        # worker id -> (scraped_at, generation_tokens, its last observed ratio) from its engine's counters
        self._scraped: dict[str, tuple[float, float, float | None]] = {}
        self._task: asyncio.Task | None = None
        self.moves = Counter("fleetgate_rebalance_moves", "Requests moved by rebalancing (Aladdin's Algorithm 2, "
                             "or off a worker observed slower than its model) before their first token.",
                             ["model"], registry=registry)
        self.moves_met = Counter("fleetgate_rebalance_moves_met_slo", "Moved requests that then met their SLO.",
                                 ["model"], registry=registry)

    @staticmethod
    def wanted(config: GatewayConfig) -> bool:
        """Does any model have rebalancing on?"""
        return config.rebalance.enabled or any(m.rebalance is not None and m.rebalance.enabled
                                               for m in config.models.values())

    async def start(self, dispatcher: Pipeline) -> None:
        """Run the loop for `dispatcher` (gateway/pipeline/dispatch.py, which is given this rebalancer when it is built)."""
        self.d = dispatcher
        interval = min([self.config.rebalance.interval_s]
                       + [m.rebalance.interval_s for m in self.config.models.values() if m.rebalance is not None])
        self._task = asyncio.get_running_loop().create_task(quiet_loop(interval, self.tick, log, "rebalancer"))

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)     # repeats a cancellation a Redis command in the loop swallowed

    # --- the request path --------------------------------------------------------------------------------------
    async def run_leg(self, ctx: RequestContext, ws: WorkerState, leg: Coroutine[Any, Any, RelayResult],
                      movable: bool) -> RelayResult | MoveAsked:
        """Run a generating leg of `ctx` where the rebalancer can move it: its result, or `MoveAsked` when the
        rebalancer interrupted it (the attempt loop, gateway/pipeline/attempts.py, decides what follows)."""
        model = ctx.rt.model
        if not self.config.rebalance_for(model).enabled:
            return await leg
        task = asyncio.ensure_future(leg)
        entry = _Leg(ctx, ws.id, task, movable and ctx.moved_to is None, time.perf_counter())
        legs = self.legs.setdefault(model, {})
        rid = ctx.feats.request_id
        legs[rid] = entry
        try:
            return await task
        except asyncio.CancelledError:
            cur = asyncio.current_task()
            if entry.move_to is not None and task.cancelled() and (cur is None or not cur.cancelling()):
                return MoveAsked(entry.move_to)
            raise
        finally:
            if legs.get(rid) is entry:
                del legs[rid]

    def finished(self, model: str, slo_met: bool | None) -> None:
        """A moved request ended; `slo_met`: whether it met its SLO."""
        if slo_met:
            self.moves_met.labels(model).inc()

    # --- the loop ---------------------------------------------------------------------------------------------
    async def tick(self, now: float | None = None, observed: Mapping[str, float] | None = None) -> list[Move]:
        """One look at every model's legs; the moves made. The loop calls it with neither argument: the clock
        is `time.perf_counter()` and each worker's step ratio is measured. A harness that drives this side and
        the simulator's (simulator/rebalance_sim.py) with the same observations passes both: `now` on the
        perf_counter clock (the move budget's clock and the legs' token timestamps), `observed` the step ratios
        to judge (worker -> observed over predicted step) for the workers it names, instead of measuring them
        (tests/test_pipeline_parity_moves.py)."""
        at = time.perf_counter() if now is None else now
        made: list[Move] = []
        for model, legs in list(self.legs.items()):
            if legs:
                made += self._look(model, legs, at, observed)
        return made

    def _look(self, model: str, legs: dict[str, _Leg], now: float,
              observed: Mapping[str, float] | None) -> list[Move]:
        cfg = self.config.rebalance_for(model)
        rt = self.d.runtimes.get(model)
        if rt is None or not cfg.enabled:
            return []
        views = self._views(model)
        by_id = {v.id: v for v in views}
        samples: dict[str, list[tuple[float, int]]] = {}
        decoding: dict[str, list[int]] = {}
        seen: list[LegSeen] = []
        for leg in legs.values():
            n = leg.ctx.state.tokens
            if n > 0:
                if leg.seen > 0 and n > leg.seen:
                    samples.setdefault(leg.worker, []).append((now - leg.seen_at, n - leg.seen))
                if n != leg.seen:
                    leg.seen, leg.seen_at = n, now
                decoding.setdefault(leg.worker, []).append(leg.ctx.feats.prompt_tokens + n)
            elif not leg.ctx.stream:   # its answer comes whole: it may be decoding, its context a guess
                decoding.setdefault(leg.worker, []).append(leg.ctx.feats.prompt_tokens)
            seen.append(LegSeen(leg.ctx.feats.request_id, leg.worker, leg.ctx.feats, n, leg.sent,
                                leg.movable and not leg.task.done() and leg.move_to is None))
        queued = queued_legs(seen, {v.id: v.waiting for v in views})
        ratios: dict[str, float] = dict(observed) if observed is not None else {}
        for wid in {*samples, *(leg.worker for leg in seen if leg.tokens == 0 and leg.movable)} - ratios.keys():
            v = by_id.get(wid)
            pm = self.d.learner.model_for(v.profile) if v is not None and v.profile else None
            if pm is None:
                continue
            r = (step_ratio(samples[wid], decoding.get(wid, ()), v.running, pm) if wid in samples
                 else self._scraped_ratio(wid, v.running, pm, decoding.get(wid, ())))
            if r is not None:
                ratios[wid] = r
        log.debug("model %s: step ratios %s; %d still queued", model, {w: round(r, 2) for w, r in ratios.items()},
                  len(queued))
        budget = self.budgets.get(model)
        if budget is None:
            budget = self.budgets[model] = budget_for(cfg.max_moves_per_s)
        moves = propose_moves(rt.placement, queued, views, time.time(), ratios, cfg.slow_ratio, budget, now)
        made: list[Move] = []
        for m in moves:
            leg = legs.get(m.request_id)
            if (leg is None or leg.ctx.state.tokens > 0 or leg.task.done() or m.dst not in by_id
                    or (leg.ctx.state.started and not leg.ctx.stream)):   # a whole answer being sent
                continue
            leg.move_to = m.dst
            if leg.task.cancel():
                made.append(m)
                self.moves.labels(model).inc()
                log.info("request %s: moved off %s (to %s; observed step ratio %.2f)", m.request_id, m.src, m.dst,
                         ratios.get(m.src, 1.0))
            else:
                leg.move_to = None
        budget.spend(len(made))
        return made

    def _scraped_ratio(self, wid: str, running: int, pm: Any, contexts: Sequence[int]) -> float | None:
        """Observed over predicted decode step of a worker from its scraped engine counters: the seconds between
        two scrapes times its running sequences over the output tokens generated meanwhile (None: no new
        scrape with tokens yet; the last ratio until the next one)."""
        ws = self.d.registry.workers.get(wid)
        if ws is None:
            return None
        m = ws.metrics
        prev = self._scraped.get(wid)
        if prev is not None and m.scraped_at <= prev[0]:
            return prev[2]
        ratio = None
        if prev is not None and running > 0 and m.generation_tokens - prev[1] >= running:
            ratio = step_ratio([((m.scraped_at - prev[0]) * running, int(m.generation_tokens - prev[1]))], contexts,
                               running, pm)
        self._scraped[wid] = (m.scraped_at, m.generation_tokens, ratio)
        return ratio

    def _views(self, model: str) -> list[WorkerView]:
        """Every healthy mixed worker of the model, at its cap or not (a full worker can still be a source)."""
        inflight = self.d.store.inflight()
        out: list[WorkerView] = []
        for ws in self.d.registry.candidates(model):
            if ws.rec.role != ROLE_MIXED:
                continue
            f = inflight.get(ws.rec.id)
            out.append(ws.view(f.requests, f.tokens) if f is not None else ws.view(0, 0))
        return out
