"""`AladdinPolicy`: the Policy interface over the ledger, the constraints, the choice rules, the shortfall and
Algorithm 2 (the package docstring, policies/aladdin/__init__.py, describes the whole policy)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from policies.aladdin.affinity import SessionCache
from policies.aladdin.choice import FITS, note_outcome, pick_fit, pick_least_risk, risk_deadline, untrusted
from policies.aladdin.constraints import SLACK_MODES, SLACK_RISK, Constraints, Feasibility
from policies.aladdin.ledger import PENDING, Ledger, PlacedRequest
from policies.aladdin.rebalancing import (
    WorkerError,
    observed_error,
    propose_moves,
    slow_workers,
    worker_errors,
)
from policies.aladdin.shortfall import Unplaced, UnplacedSet
from policies.base import Policy, make_policy, register
from policies.length_predictor import LengthPredictor
from policies.perf_model import PerfModel
from policies.slo_targets import DEFAULT_ATGT_S, DEFAULT_TTFT_S, SloTarget, target_for
from policies.tail import split_budget
from policies.types import Decision, Move, RequestFeatures, WorkerView


@register("aladdin")
class AladdinPolicy(Policy):
    """Best-fit packing under Aladdin's ATGT / TTFT / prefill-slack / KV constraints."""

    name = "aladdin"
    needs_perf_models = True

    def __init__(
        self,
        perf_models: Mapping[str, PerfModel | Mapping[str, Any]] | None = None,
        default_perf_model: PerfModel | Mapping[str, Any] | None = None,
        gamma: float = 0.5,
        theta: float = 0.8,
        tail: str | None = None,
        delta: float = 0.05,
        slo_ttft_s: float = DEFAULT_TTFT_S,
        slo_atgt_s: float = DEFAULT_ATGT_S,
        predictor: LengthPredictor | None = None,
        learn_lengths: bool | None = None,
        use_predictor: bool = False,
        slack: str = "risk",
        bucket_steps: int = 16,
        horizon_steps: int = 8192,
        unplaced_ttl_s: float = 30.0,
        prefill_chunk_tokens: int = 2048,
        count_wait: bool = True,
        stall_risk: float = 0.005,
        deadline_margin_s: float = 0.05,
        fit: str = "worst",       # chosen by the placement study's protocol (bench/results/placement.md)
        margin: float = 0.0,
        fallback: str | None = "least_requests",
        max_miss_rate: float = 0.1,
        miss_window: int = 64,
        price_cache: bool = True,    # multi-turn chats need it (bench/results/aladdin_estimates.md)
        infer_prefix: bool = True,  # without KV events: cached prefixes estimated from the prompt's prefix chain
    ) -> None:
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma (strictness knob) must be in [0, 1], got {gamma}")
        if not 0.0 < theta <= 1.0:
            raise ValueError(f"theta (error margin) must be in (0, 1], got {theta}")
        if tail not in (None, "none", "cantelli", "normal"):
            raise ValueError(f"tail must be None, 'cantelli' or 'normal', got {tail!r}")
        if bucket_steps < 1 or horizon_steps < bucket_steps:
            raise ValueError("bucket_steps >= 1 and horizon_steps >= bucket_steps required")
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {prefill_chunk_tokens}")
        split_budget(float(delta), 1)  # validates delta
        if slack not in SLACK_MODES:
            raise ValueError(f"slack must be one of {', '.join(SLACK_MODES)}, got {slack!r}")
        if not 0.0 <= stall_risk < 1.0 or deadline_margin_s < 0:
            raise ValueError("stall_risk must be in [0, 1) and deadline_margin_s >= 0")
        if fit not in FITS:
            raise ValueError(f"fit must be one of {', '.join(FITS)}, got {fit!r}")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        if not 0.0 < max_miss_rate <= 1.0 or miss_window < 1:
            raise ValueError("max_miss_rate must be in (0, 1] and miss_window >= 1")
        self.gamma, self.theta = float(gamma), float(theta)
        self.tail = None if tail in (None, "none") else tail
        self.delta = float(delta)
        self.slo = SloTarget(slo_ttft_s, slo_atgt_s)
        self.learn_lengths = (predictor is None) if learn_lengths is None else learn_lengths
        self.use_predictor = use_predictor
        self.slack = slack
        self.unplaced_ttl_s = unplaced_ttl_s
        self.stall_risk = float(stall_risk)
        self.deadline_margin_s = float(deadline_margin_s)
        self.fit, self.margin = fit, float(margin)
        self.fallback = make_policy(fallback) if fallback else None
        self.max_miss_rate, self._miss_alpha = float(max_miss_rate), 1.0 / miss_window
        self.price_cache = bool(price_cache)
        self.needs_kv_blocks = self.price_cache   # the caller fills cached_prefix_tokens only when asked
        self.infer_prefix = bool(infer_prefix)
        # ... and prefix_chain: what each worker was sent, and the conversation of a turn without an id (affinity.py).
        self.needs_prefix_chain = self.price_cache and self.infer_prefix
        self.ledger = Ledger(
            atgt_s=self.slo.atgt_s, predictor=predictor if predictor is not None else LengthPredictor(),
            tail=self.tail, risk_mode=slack == SLACK_RISK, bucket_steps=bucket_steps, horizon_steps=horizon_steps,
            default_model=_as_model(default_perf_model) if default_perf_model is not None else PerfModel(),
            models={k: _as_model(v) for k, v in (perf_models or {}).items()})
        self.constraints = Constraints(
            ledger=self.ledger, slo=self.slo, gamma=self.gamma, theta=self.theta, tail=self.tail, delta=self.delta,
            slack=slack, chunk=int(prefill_chunk_tokens), count_wait=count_wait, stall_risk=self.stall_risk,
            deadline_margin_s=self.deadline_margin_s, use_predictor=use_predictor, price_cache=self.price_cache,
            sessions=SessionCache(infer=self.infer_prefix) if self.price_cache else None)
        self.unplaced = UnplacedSet(unplaced_ttl_s, self.gamma, self.theta)
        self.last_feasibility: Feasibility | None = None   # of the latest request checked
        self.last_rejections: dict[str, int] = {}
        self.decisions = 0
        self.no_fits = 0
        self.best_efforts = 0
        self.late = 0
        self.deadline_placements = 0
        self.fallbacks = 0

    @property
    def predictor(self) -> LengthPredictor:
        """The output-length predictor the policy (and its ledger's re-predictions) read; replaceable."""
        return self.ledger.predictor

    @predictor.setter
    def predictor(self, value: LengthPredictor) -> None:
        self.ledger.predictor = value

    # --- models --------------------------------------------------------------------------------------
    def model_for(self, profile: str) -> PerfModel:
        return self.ledger.model_for(profile)

    def set_perf_model(self, profile: str, model: PerfModel | Mapping[str, Any]) -> None:
        """Install a (re)fitted model for a profile; workers with that profile use it from now on (and earn
        the model's trust afresh)."""
        self.ledger.set_model(profile, _as_model(model))

    # --- Policy interface ------------------------------------------------------------------------
    def _check(self, request: RequestFeatures, rows: np.ndarray, now: float, check_ttft: bool = True,
               cached: np.ndarray | float = 0.0) -> Feasibility:
        feas = self.constraints.feasible(request, rows, now, check_ttft=check_ttft, cached=cached)
        self.last_feasibility = feas
        self.last_rejections = feas.rejections
        return feas

    def choose(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float) -> Decision:
        self.decisions += 1
        if not workers:
            return Decision(None, "no_workers")
        rows = self.ledger.rows_for_views(workers)
        self.ledger.advance(rows, now)
        cached = self.constraints.cached_for(request, list(workers))
        feas = self._check(request, rows, now, cached=cached)
        ok = feas.ok
        distrusted = untrusted(self.ledger, rows, self.max_miss_rate)
        if distrusted.any() and self.fallback is not None:
            ok &= ~distrusted
            if not ok.any():    # the model is wrong where it would place: the robust baseline decides
                return self._fall_back(request, workers, now)
        if ok.any():
            return self._placed(request, workers, pick_fit(self.fit, self.margin, ok, feas.head, feas.norm),
                                "best_fit")
        if self.slack == SLACK_RISK:
            d = self._least_risk(request, workers, rows, feas, at_deadline=True)
            if d is not None:
                return d
        alone = self.constraints.fits_alone(request, rows, cached)
        if not alone.any():
            # Not even an empty worker meets its SLO (say a prompt whose prefill alone exceeds the TTFT
            # target): waiting cannot help, so it goes where the least work is, as a best effort.
            self.best_efforts += 1
            self.unplaced.drop(request.request_id)
            if self.fallback is not None:
                return Decision(self.fallback.choose(request, workers, now).worker_id, "best_effort")
            return Decision(workers[int(np.argmin(feas.norm))].id, "best_effort")
        if not feas.ttft_reachable:
            # No worker meets its TTFT any more (waiting only adds to the estimate: the wait grows as fast
            # as queued prefill can drain): place it where it harms nobody else's SLO ((b), (d), (e)) as
            # soon as there is such a worker.
            late = self._check(request, rows, now, check_ttft=False, cached=cached)
            if late.ok.any():
                self.late += 1
                return self._placed(request, workers, pick_fit(self.fit, self.margin, late.ok, late.head, late.norm),
                                    "late")
            if self.slack == SLACK_RISK:
                d = self._least_risk(request, workers, rows, late, at_deadline=False)
                if d is not None:
                    self.late += 1
                    return d
        self.no_fits += 1
        self._note_unplaced(request, rows, now)
        retry = (risk_deadline(self.last_feasibility, target_for(request, self.slo).ttft_s, self.deadline_margin_s,
                               now) if self.slack == SLACK_RISK else None)
        return Decision(None, "no_fit", retry_at=retry)

    def _placed(self, request: RequestFeatures, workers: Sequence[WorkerView], best: int, reason: str) -> Decision:
        self.unplaced.placed(request.request_id)
        return Decision(workers[best].id, reason)

    def _fall_back(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float) -> Decision:
        """The robust baseline's choice (`fallback`) where the model cannot be trusted: every worker it would
        place on misses too often (`observe_outcome`)."""
        assert self.fallback is not None
        self.fallbacks += 1
        self.unplaced.drop(request.request_id)
        d = self.fallback.choose(request, workers, now)
        return Decision(d.worker_id, "fallback")

    def _least_risk(self, request: RequestFeatures, workers: Sequence[WorkerView], rows: np.ndarray,
                    feas: Feasibility, at_deadline: bool) -> Decision | None:
        """Risk mode: no worker is within the stall-risk budget. Waiting for one costs TTFT, so wait only
        while some worker would still meet the TTFT after `deadline_margin_s` more; at that deadline (or
        once the TTFT is lost anyway) take the worker where the prefill breaks the fewest ATGTs."""
        best = pick_least_risk(self.constraints, feas, rows, at_deadline)
        if best is None:
            return None
        self.unplaced.placed(request.request_id)
        self.deadline_placements += 1
        return Decision(workers[best].id, "deadline" if at_deadline else "late")

    def on_dispatch(self, request: RequestFeatures, worker_id: str, now: float) -> None:
        led = self.ledger
        r = led.row_for_id(worker_id)
        led.advance_one(r, now)
        rid = request.request_id
        if rid in led.rows[r].reqs:
            return
        self.unplaced.placed(rid)
        slo = target_for(request, self.slo)
        lp, var = self.constraints.predicted(request)
        req = PlacedRequest(rid, request.model, max(int(request.prompt_tokens), 0), lp, var, slo.atgt_s, slo.ttft_s,
                            led.group(slo.atgt_s), request.max_tokens)
        cons = self.constraints
        cached = min(max(int(cons.prefix_view(request).get(worker_id, 0)), 0), req.l_in) if self.price_cache else 0
        led.add(r, req, float(cached))
        if cons.sessions is not None:
            cons.sessions.placed(request, worker_id)
        if req.l_in == 0:
            led.start_prefilled(r, now, now, float(led.prefill_done[r]))

    def report_progress(self, request_id: str, generated_tokens: int, now: float) -> None:
        """The caller saw `generated_tokens` tokens of the request so far (optional; corrects the ledger).

        Call it with the final count just before `on_complete` to teach the length predictor.
        """
        led = self.ledger
        r = led.req_row.get(request_id)
        if r is None or generated_tokens < 0:
            return
        led.advance_one(r, now, repredict=False)  # the report comes first
        req = led.rows[r].reqs.get(request_id)
        if req is None:
            return
        led.report(r, req, generated_tokens, now)

    def observe_completion(self, request: RequestFeatures, output_tokens: int, now: float) -> None:
        """The request completed after `output_tokens` tokens (called just before `on_complete`): corrects
        the ledger and, with `learn_lengths`, teaches the length predictor; its conversation's prefix is cached
        there now, answer included (policies/aladdin/affinity.py)."""
        r = self.ledger.req_row.get(request.request_id)
        if r is not None and self.constraints.sessions is not None:
            self.constraints.sessions.completed(request, self.ledger.rows[r].worker_id, output_tokens)
        self.report_progress(request.request_id, output_tokens, now)

    def observe_outcome(self, request: RequestFeatures, worker_id: str, slo_met: bool, now: float) -> None:
        """Whether a request that ran on `worker_id` met its SLO: the worker's recent miss rate (an EWMA over
        `miss_window` requests). A model that is right misses (almost) never where it placed; above
        `max_miss_rate` the worker's model is not trusted and the `fallback` baseline places there until
        the rate falls again or a new model is installed."""
        r = self.ledger.index.get(worker_id)
        if r is not None:
            note_outcome(self.ledger, r, slo_met, self._miss_alpha)

    def on_complete(self, request: RequestFeatures, worker_id: str, now: float) -> None:
        led = self.ledger
        r = led.index.get(worker_id)
        rid = request.request_id
        if r is None or rid not in led.rows[r].reqs:
            return
        led.advance_one(r, now)
        row = led.rows[r]
        req = row.reqs[rid]
        if req.state == PENDING:
            led.force_prefilled(r, req, now)
        gen = req.reported if req.reported is not None else max(led.step_clock[r] - req.g0 + 1.0, 1.0)
        if self.learn_lengths and req.reported is not None:
            self.predictor.observe(req.model, req.l_in, req.reported)
        if gen < req.lp0:  # Algorithm 2: an overestimate, l_real − l_pred, counted until the predicted end
            row.early.append((req.g0 + req.lp0 - 1.0, gen - req.lp0))
        led.remove(r, req)

    # --- introspection -----------------------------------------------------------------------------
    def worker_load(self, worker_id: str, now: float | None = None) -> dict[str, float]:
        """The ledger's view of one worker (for tests, metrics and debugging), brought to `now` if given."""
        led = self.ledger
        r = led.index.get(worker_id)
        if r is None:
            return {}
        if now is not None:
            led.advance_one(r, now)
        return {
            "requests": float(led.n_requests[r]), "decoding": float(led.n_decoding[r]),
            "pending_prefill_tokens": float(max(led.prefill_queued[r] - led.prefill_done[r], 0.0)),
            "context": float(led.sum_prompt[r] + self.gamma * led.sum_predicted[r]),
            "predicted_output": float(led.sum_predicted[r]), "step_clock": float(led.step_clock[r]),
            "step_time_s": led.step_time(r), "kv_now_blocks": led.kv_now(r),
        }

    def generated(self, request_id: str) -> float | None:
        """The ledger's estimate of tokens generated so far (0 while the prefill is queued)."""
        led = self.ledger
        r = led.req_row.get(request_id)
        if r is None:
            return None
        req = led.rows[r].reqs[request_id]
        return 0.0 if req.state == PENDING else float(led.step_clock[r] - req.g0 + 1.0)

    def predicted_length(self, request_id: str) -> float | None:
        r = self.ledger.req_row.get(request_id)
        return None if r is None else self.ledger.rows[r].reqs[request_id].lp

    # --- scale signal --------------------------------------------------------------------------------
    def _note_unplaced(self, request: RequestFeatures, rows: np.ndarray, now: float) -> None:
        lp, _ = self.constraints.predicted(request)
        model = self.model_for(self.ledger.rows[int(rows[0])].profile)
        item = Unplaced(now, max(int(request.prompt_tokens), 0), lp, target_for(request, self.slo), model)
        self.unplaced.note(request.request_id, item, now)

    @property
    def shortfall(self) -> int:
        """How many more (empty) workers the requests that found no fit need: first-fit of them into
        fresh bins under constraints (b), (c) and, conservatively, (e) on their final sizes. Requests
        leave the set when dispatched or after `unplaced_ttl_s` without a retry."""
        return self.unplaced.shortfall

    # --- Algorithm 2 -------------------------------------------------------------------------------
    def worker_errors(self) -> dict[str, WorkerError]:
        """Algorithm 2 lines 4-13 over the ledger (policies/aladdin/rebalancing.py `worker_errors`)."""
        return worker_errors(self.ledger)

    def rebalance(
        self, queued: Mapping[str, tuple[str, RequestFeatures]], workers: Sequence[WorkerView], now: float,
        observed: Mapping[str, float] | None = None, bound: float = 2.0, max_moves: int | None = None,
    ) -> list[Move]:
        """Proposals to move queued (placed but not yet sent) requests between `workers` (Algorithm 2).

        A destination must satisfy constraints (b)-(e) for the request. `observed`: worker -> its measured decode
        step over eq. 3's prediction; beyond `bound` it adds to the worker's error and its queued requests move
        off it (policies/aladdin/rebalancing.py). At most `max_moves` moves.
        """
        if not workers:
            return []
        led = self.ledger
        rows = led.rows_for_views(workers)
        led.advance(rows, now)
        ids = [v.id for v in workers]
        feas: dict[str, np.ndarray] = {}
        for rid, (_, req) in queued.items():
            feas[rid] = self._check(req, rows, now, cached=self.constraints.cached_for(req, list(workers))).ok
        errors = self.worker_errors()
        coeffs = {v.id: (float(led.k2[r]), float(led.c2[r])) for v, r in zip(workers, rows, strict=True)}
        placements = {rid: (w, self.constraints.predicted(req)[0]) for rid, (w, req) in queued.items()}
        pos = {w: i for i, w in enumerate(ids)}
        errs = {w: errors.get(w, WorkerError()) for w in ids}
        slow: set[str] = set()
        if observed:
            for v, r in zip(workers, rows, strict=True):
                ratio = observed.get(v.id)
                if ratio is None:
                    continue
                extra = observed_error(ratio, led.step_time(int(r)), float(led.k2[r]), bound)
                errs[v.id] = WorkerError(errs[v.id].l_err + extra.l_err, errs[v.id].b_err + extra.b_err)
            slow = slow_workers(observed, bound)
        return propose_moves(
            placements, errs, coeffs,
            feasible=lambda rid, dst: bool(feas[rid][pos[dst]]), max_moves=max_moves, slow=slow,
        )


def _as_model(m: PerfModel | Mapping[str, Any]) -> PerfModel:
    return m if isinstance(m, PerfModel) else PerfModel.from_prior(m)
