"""`aladdin`: SLO-aware best-fit bin packing of requests onto workers (Aladdin sections 3-4, appendices C, E, F).

For each candidate worker the policy keeps a ledger of the requests it placed there (input length,
predicted output, tokens generated so far) and checks, for the new request j, the constraints of the
section 4.2 MIP:

  (b) ATGT   Σ(l_in + γ·l_out) + (l_in_j + γ·l_pred_j) <= θ·l_d(b + 1)           (eq. 4, strictness γ)
  (c) TTFT   t_pre(pending prefill tokens + l_in_j) <= T_pre                       (eq. 2)
  (d) slack  t_pre(pending + l_in_j) <= θ·min_k (T_dec·l_out_k − t_dec_k)          over ongoing decodes
  (e) KV     max over future decode steps of Σ w_k + w_j <= M                      (the vector w, eq. 1)

and picks, among the feasible workers, the one with the largest capacity_norm (Algorithm 1: the
fullest bin that still fits, so workers are filled before others are opened). With no feasible worker
it answers Decision(None, "no_fit") and `shortfall` says how many more workers the unplaced requests
need. tail="cantelli"/"normal" replaces the point estimates by μ + γ(τ)·σ with the violation budget δ
split over the busy workers (section 4.3, appendix F).

How the ledger stays O(workers) per decision (no loop over in-flight requests):
  * Each worker has a decode-step clock G (every running request gains one token per step); it
    advances by elapsed / t_d(b, l_avg) (eq. 3). Prefill preempts decode (section 4.2, (d)): queued
    prompt tokens are consumed first at 1/k1 tokens/s while G stands still.
  * A request's tokens generated = G − g0 + 1 (g0: G when it started), so Σ generated, the mean
    context and every request's slack are aggregates; slack minima live in per-SLO-class heaps.
  * The future KV demand (the vector w) is a per-worker ring over decode steps in buckets of
    `bucket_steps`: bucket b holds N (requests alive) and A (Σ of their kv-line intercepts), so the
    demand at step g is h·g·N + A; a request adds itself over its predicted life on dispatch.
  * Requests that outlive their prediction are re-predicted by the conditional mean (appendix C) when
    G passes their predicted end (a heap per worker).
  * `report_progress` lets the caller correct a request's generated-token count when it knows it.
Events (dispatch, completion, report, re-prediction) cost O(log n) plus one numpy slice.

Choices beyond the paper (each a parameter):
  * slack="risk" (default) turns (d) into a risk budget: the new prefill stalls every decode on the
    worker, and a request that has not saved that much slack yet misses its ATGT only if its remaining
    output is too short to earn the deficit back. The expected number of such misses, summed over the
    worker's `_YOUNG` most recently started decodes and its not yet started requests, comes from the
    conditional distribution of output lengths (appendix C: P(L < g + x | L >= g) over the predictor's
    recent completed lengths) and must stay <= `stall_risk`. Until 32 lengths were seen it is "lifetime".
    "lifetime" adds to (d) a lower bound on the slack ongoing requests will still save (their fewest
    predicted remaining steps x (T_dec − current step time)): it trusts mean lengths, so the short
    answers miss; "paper" is (d) as printed (placed requests not decoding yet have slack 0), which closes
    a worker to any prompt after each admission; "off" drops (d). bench/results/placement.md compares them.
  * Risk mode waits for a worker within the budget only while the TTFT allows: once no worker would meet
    the TTFT after `deadline_margin_s` more, it takes the feasible ((b), (c), (e)) worker with the least
    risk ("deadline"). Decision.retry_at tells the admission queue when that moment comes.
  * Which feasible worker: `fit="best"` is Algorithm 1 (the fullest bin; with `margin` m, the fullest of
    those that keep at least m relative headroom on every constraint, else the one with the most); `fit=
    "worst"` takes the one with the most headroom (the constraints then act as admission control and a fleet
    larger than needed spreads its load instead of idling). Best fit minimises the workers in use, which pays
    when idle workers can be released; on a fixed fleet it leaves the model's errors no room. The default is
    "worst": the placement study's leave-one-trace-out protocol chose it, with a 16-deep admission queue
    look-ahead, in every fold (bench/results/placement.md).
  * Trust: `observe_outcome` keeps each worker's recent SLO miss rate (EWMA over `miss_window` requests). Where
    the model is right, requests it placed hardly ever miss; a worker above `max_miss_rate` is not trusted
    and, when every worker the model would place on is untrusted, the `fallback` baseline places the request
    ("fallback") until the rate falls or the learner installs a new model (which resets it).
  * (c) counts the time the request already waited (now − arrival, `count_wait`), the decode step in
    flight and, per prefill chunk of `prefill_chunk_tokens` (vLLM's max_num_batched_tokens), the ongoing
    decodes batched with it. A request whose TTFT is lost anyway ("late") is placed where (b), (d), (e)
    hold, or (risk mode) where the risk is least, instead of waiting and blocking others.
  * capacity_norm divides batch size and context by the worker's own limits (eq. 4 at b=1, (T−c3)/c2)
    so that workers of different profiles rank on one scale.
  * A request that fits no worker even when alone (e.g. its prefill exceeds the TTFT target) is placed by
    the `fallback` baseline ("best_effort") instead of waiting forever.
  * Engine-reported load (WorkerView running/waiting/kv_usage) beyond the ledger's (other gateway
    replicas) is counted in (b) and (e).
  * Cache pricing (`price_cache=True`, issue 22 item 3): the policy then declares `needs_kv_blocks`, so the
    gateway (from the engines' KV events) and the simulator fill RequestFeatures.cached_prefix_tokens, and
    on each worker only the prompt tokens its prefix cache does not hold count as prefill work in (c), (d)
    and the ledger's prefill queue (eq. 2's k1·l plus the quadratic term's k1q·(l_in² − cached²): the
    uncached tokens still attend to the cached ones). A cached prefix then wins a placement exactly when
    the TTFT or slack it saves is what makes a worker fit (or gives it the most headroom). (b) and (e)
    still count the whole context: cached blocks are decoded over and held like any other.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from policies.base import Policy, make_policy, register
from policies.length_predictor import LengthPredictor
from policies.perf_model import DECODE, PREFILL, PerfModel
from policies.slo_targets import DEFAULT_ATGT_S, DEFAULT_TTFT_S, SloTarget, target_for
from policies.tail import split_budget, tail_factor
from policies.types import Decision, Move, RequestFeatures, WorkerView

_PENDING, _DECODING = 0, 1
_MAX_SLO_GROUPS = 8
_INF = math.inf

# Constraint (d) modes: "paper" is Aladdin's θ·min(T_dec·l_out − t_dec), the slack saved so far;
# "lifetime" adds a lower bound on the slack still to come (a worker with only young requests is not
# closed to new prompts); "off" skips (d).
SLACK_PAPER, SLACK_LIFETIME, SLACK_RISK, SLACK_OFF = "paper", "lifetime", "risk", "off"
SLACK_MODES = (SLACK_PAPER, SLACK_LIFETIME, SLACK_RISK, SLACK_OFF)
_YOUNG = 8              # risk mode: the most recently started decodes tracked per worker
_MIN_SAMPLES = 32       # risk mode: fewer completed lengths than this -> the lifetime rule
_FAR = 1e12             # "never recovers", in tokens

# Which feasible worker takes the request: "best" is Algorithm 1 (the fullest bin by capacity_norm; with a
# margin, the fullest among those keeping at least that headroom on every constraint, else the one with the
# most), "worst" the one with the most headroom (spread, with the constraints as admission control).
FIT_BEST, FIT_WORST = "best", "worst"
FITS = (FIT_BEST, FIT_WORST)

# Constraint names, as counted in `last_rejections`.
C_ATGT, C_TTFT, C_SLACK, C_KV = "atgt", "ttft", "prefill_slack", "kv"


class _Req:
    """One placed request, as the ledger tracks it."""

    __slots__ = (
        "rid", "model", "l_in", "lp", "lp0", "var", "t_dec", "t_pre", "grp", "state", "g0", "t0",
        "pend_end", "kv_lo", "kv_hi", "a", "version", "max_tokens", "reported", "exhausted", "yslot",
    )

    def __init__(self, rid: str, model: str, l_in: int, lp: float, var: float, t_dec: float, t_pre: float,
                 grp: int, max_tokens: int | None) -> None:
        self.rid, self.model, self.l_in, self.lp, self.lp0, self.var = rid, model, l_in, lp, lp, var
        self.t_dec, self.t_pre, self.grp, self.max_tokens = t_dec, t_pre, grp, max_tokens
        self.state = _PENDING
        self.g0 = self.t0 = self.pend_end = self.a = 0.0
        self.kv_lo = self.kv_hi = 0
        self.version = 0
        self.reported: int | None = None
        self.exhausted = False
        self.yslot = -1


class _Row:
    """Per-worker Python-side state (the numeric aggregates live in the policy's arrays)."""

    __slots__ = ("idx", "worker_id", "profile", "reqs", "pending", "ends", "heaps", "tcount", "early", "young")

    def __init__(self, idx: int, worker_id: str, profile: str) -> None:
        self.idx, self.worker_id, self.profile = idx, worker_id, profile
        self.reqs: dict[str, _Req] = {}
        self.pending: deque[_Req] = deque()               # FIFO of requests waiting for their prefill
        self.ends: list[tuple[float, int, str]] = []      # heap of (predicted end step, version, rid)
        self.heaps: dict[int, list[tuple[float, int, str]]] = {}  # slack keys per SLO group
        self.tcount: dict[float, int] = {}                # ATGT target -> requests holding it
        self.early: deque[tuple[float, float]] = deque(maxlen=1024)  # (expiry step, l_real − l_pred)
        self.young: list[str | None] = [None] * _YOUNG                # risk mode: rids in the young slots


@dataclass(slots=True)
class WorkerError:
    """Algorithm 2's per-worker estimation errors: l^e (output tokens) and b^e (requests)."""

    l_err: float = 0.0
    b_err: float = 0.0


def error_distance(err: WorkerError, alpha: float, beta: float) -> float:
    """Algorithm 2 line 22: distance |α·l^e + β·b^e| / sqrt(α² + β²) of a worker's error line from the origin."""
    return abs(alpha * err.l_err + beta * err.b_err) / math.hypot(alpha, beta)


def propose_moves(
    placements: Mapping[str, tuple[str, float]],
    errors: Mapping[str, WorkerError],
    coeffs: Mapping[str, tuple[float, float]],
    feasible: Callable[[str, str], bool] | None = None,
    max_moves: int | None = None,
) -> list[Move]:
    """Algorithm 2 (appendix C): move new requests between workers to cancel prediction errors.

    placements: request_id -> (worker, l_pred) of new (not yet started) requests; errors: worker ->
    WorkerError from its ongoing requests; coeffs: worker -> (α, β) of its eq. 4 error line (k2, c2).
    Moving j from x to y does b^e_x −= 1, l^e_x −= l_pred_j, b^e_y += 1, l^e_y += l_pred_j (lines
    16-20). Greedy: apply the move that lowers Σ distance the most, until none helps; each request
    moves at most once. `feasible(request_id, dst)` may veto a destination.
    """
    err = {w: WorkerError(e.l_err, e.b_err) for w, e in errors.items()}
    for w in coeffs:
        err.setdefault(w, WorkerError())
    where = {rid: w for rid, (w, _) in placements.items()}
    moves: dict[str, Move] = {}
    limit = len(placements) if max_moves is None else max_moves

    def dist(w: str, dl: float, db: float) -> float:
        a, b = coeffs[w]
        return error_distance(WorkerError(err[w].l_err + dl, err[w].b_err + db), a, b)

    while len(moves) < limit:
        best: tuple[float, str, str] | None = None
        for rid, (_, lp) in placements.items():
            if rid in moves:
                continue
            x = where[rid]
            if x not in coeffs:
                continue
            gain_x = dist(x, 0, 0) - dist(x, -lp, -1)
            for y in coeffs:
                if y == x:
                    continue
                gain = gain_x + dist(y, 0, 0) - dist(y, lp, 1)
                if gain > 1e-12 and (best is None or gain > best[0]) and (feasible is None or feasible(rid, y)):
                    best = (gain, rid, y)
        if best is None:
            break
        _, rid, y = best
        x, lp = where[rid], placements[rid][1]
        err[x].l_err -= lp
        err[x].b_err -= 1
        err[y].l_err += lp
        err[y].b_err += 1
        where[rid] = y
        moves[rid] = Move(rid, x, y)
    return list(moves.values())


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
        price_cache: bool = False,
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
        self.gamma, self.theta = float(gamma), float(theta)
        self.tail = None if tail in (None, "none") else tail
        self.delta = float(delta)
        split_budget(self.delta, 1)  # validates delta
        self.slo = SloTarget(slo_ttft_s, slo_atgt_s)
        self.predictor = predictor if predictor is not None else LengthPredictor()
        self.learn_lengths = (predictor is None) if learn_lengths is None else learn_lengths
        self.use_predictor = use_predictor
        if slack not in SLACK_MODES:
            raise ValueError(f"slack must be one of {', '.join(SLACK_MODES)}, got {slack!r}")
        self.slack = slack
        self.bucket = int(bucket_steps)
        self.horizon_steps = int(horizon_steps)
        self.H = -(-self.horizon_steps // self.bucket) + 2
        self.unplaced_ttl_s = unplaced_ttl_s
        self.chunk = int(prefill_chunk_tokens)
        self.count_wait = count_wait
        if not 0.0 <= stall_risk < 1.0 or deadline_margin_s < 0:
            raise ValueError("stall_risk must be in [0, 1) and deadline_margin_s >= 0")
        self.stall_risk = float(stall_risk)
        self.deadline_margin_s = float(deadline_margin_s)
        if fit not in FITS:
            raise ValueError(f"fit must be one of {', '.join(FITS)}, got {fit!r}")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        self.fit, self.margin = fit, float(margin)
        if not 0.0 < max_miss_rate <= 1.0 or miss_window < 1:
            raise ValueError("max_miss_rate must be in (0, 1] and miss_window >= 1")
        self.fallback = make_policy(fallback) if fallback else None
        self.max_miss_rate, self._miss_alpha = float(max_miss_rate), 1.0 / miss_window
        self.fallbacks = 0
        self.price_cache = bool(price_cache)
        self.needs_kv_blocks = self.price_cache   # the caller fills cached_prefix_tokens only when asked
        self._head = np.zeros(0)
        self._kv_head = np.zeros(0)
        self._cdf_cache: dict[str, tuple[int, np.ndarray]] = {}
        self._parts: tuple[np.ndarray, ...] | None = None
        self._ttft_reachable = True
        self._default_model = _as_model(default_perf_model) if default_perf_model is not None else PerfModel()
        self._models: dict[str, PerfModel] = {k: _as_model(v) for k, v in (perf_models or {}).items()}

        self._rows: list[_Row] = []
        self._index: dict[str, int] = {}
        self._req_row: dict[str, int] = {}
        self._groups: list[float] = []          # ATGT targets of the slack groups
        self._Tg = np.zeros(_MAX_SLO_GROUPS)     # 0 for unused groups (their keys stay +inf)
        self._cap = 0
        self._grow(16)

        self._unplaced: OrderedDict[str, tuple[float, int, float, SloTarget, PerfModel]] = OrderedDict()
        self._shortfall: int | None = 0
        self.last_rejections: dict[str, int] = {}
        self.decisions = 0
        self.no_fits = 0
        self.best_efforts = 0
        self.late = 0
        self.deadline_placements = 0

    # --- storage ---------------------------------------------------------------------------------
    _SCALARS = (
        ("_t_last", -_INF), ("_G", 0.0), ("_C", 0.0), ("_P", 0.0), ("_next_pend", _INF), ("_next_end", _INF),
        ("_n_all", 0.0), ("_s_in", 0.0), ("_s_pred", 0.0), ("_s_var", 0.0), ("_n_dec", 0.0),
        ("_s_in_dec", 0.0), ("_s_g0", 0.0), ("_min_tdec", _INF), ("_vb", 0.0), ("_vkv", 0.0),
        ("_k1", 1.0), ("_c1", 0.0), ("_k2", 1.0), ("_c2", 0.0), ("_c3", 0.0), ("_h", 1.0), ("_j", 0.0),
        ("_M", 1.0), ("_bmax", 1.0), ("_rmse_pre", 0.0), ("_rmse_dec", 0.0), ("_bcap", 1.0), ("_ccap", 1.0),
        ("_k1q", 0.0), ("_pf", 0.0), ("_miss", 0.0),
    )

    def _grow(self, cap: int) -> None:
        old = self._cap
        for name, fill in self._SCALARS:
            arr = np.full(cap, fill, dtype=float)
            if old:
                arr[:old] = getattr(self, name)
            setattr(self, name, arr)
        cur = np.zeros(cap, dtype=np.int64)
        minkey = np.full((cap, _MAX_SLO_GROUPS), _INF)
        kn, ka = np.zeros((cap, self.H)), np.zeros((cap, self.H))
        yg, yt, yT, ypos = np.zeros((cap, _YOUNG)), np.zeros((cap, _YOUNG)), np.zeros((cap, _YOUNG)), np.zeros(cap, np.int64)
        if old:
            cur[:old], minkey[:old], kn[:old], ka[:old] = self._cur, self._minkey, self._KN, self._KA
            yg[:old], yt[:old], yT[:old], ypos[:old] = self._Yg0, self._Yt0, self._YT, self._Ypos
        self._cur, self._minkey, self._KN, self._KA = cur, minkey, kn, ka
        # risk mode: (g0, t0, ATGT target) of each worker's most recently started decodes (target 0: empty)
        self._Yg0, self._Yt0, self._YT, self._Ypos = yg, yt, yT, ypos
        self._cap = cap

    def _new_row(self, worker_id: str, profile: str) -> int:
        r = len(self._rows)
        if r >= self._cap:
            self._grow(self._cap * 2)
        self._rows.append(_Row(r, worker_id, profile))
        self._index[worker_id] = r
        self._apply_model(r, self.model_for(profile))
        return r

    def _apply_model(self, r: int, m: PerfModel) -> None:
        t = self.slo.atgt_s
        self._k1[r], self._c1[r], self._k2[r], self._c2[r], self._c3[r] = m.k1, m.c1, m.k2, m.c2, m.c3
        self._h[r], self._j[r], self._M[r], self._bmax[r] = m.h, m.j, m.kv_capacity, m.max_batch
        self._k1q[r], self._pf[r] = m.k1q, m.pf
        self._rmse_pre[r] = m.fit[PREFILL].rmse if PREFILL in m.fit else 0.0
        self._rmse_dec[r] = m.fit[DECODE].rmse if DECODE in m.fit else 0.0
        # capacity_norm scales (deviation: normalised so heterogeneous workers compare).
        self._bcap[r] = max(m.batch_limit(t), 1.0)
        self._ccap[r] = max(m.context_limit(1, t), 1.0)

    def model_for(self, profile: str) -> PerfModel:
        return self._models.get(profile, self._default_model)

    def set_perf_model(self, profile: str, model: PerfModel | Mapping[str, Any]) -> None:
        """Install a (re)fitted model for a profile; workers with that profile use it from now on."""
        m = _as_model(model)
        self._models[profile] = m
        for row in self._rows:
            if row.profile == profile:
                self._apply_model(row.idx, m)
                self._miss[row.idx] = 0.0     # a new model earns its trust afresh

    def _row_for_id(self, worker_id: str) -> int:
        r = self._index.get(worker_id)
        return self._new_row(worker_id, "") if r is None else r

    def _rows_for_views(self, workers: Sequence[WorkerView]) -> np.ndarray:
        """Ledger rows of the candidates, with their engine-reported batch and KV usage recorded."""
        index, rows_ = self._index, self._rows
        rows: list[int] = []
        vb: list[float] = []
        vkv: list[float] = []
        for v in workers:
            r = index.get(v.id)
            if r is None or rows_[r].profile != v.profile:
                r = self._row_for_view(v)
            rows.append(r)
            vb.append(max(v.running + v.waiting, v.inflight))
            vkv.append(v.kv_usage)
        idx = np.array(rows, dtype=np.intp)
        self._vb[idx] = vb
        self._vkv[idx] = vkv
        return idx

    def _row_for_view(self, v: WorkerView) -> int:
        r = self._index.get(v.id)
        if r is None:
            r = self._new_row(v.id, v.profile)
        elif self._rows[r].profile != v.profile:
            self._rows[r].profile = v.profile
            self._apply_model(r, self.model_for(v.profile))
        self._vb[r] = max(v.running + v.waiting, v.inflight)
        self._vkv[r] = v.kv_usage
        return r

    # --- the clock -------------------------------------------------------------------------------
    def _advance(self, rows: np.ndarray, now: float, repredict: bool = True) -> None:
        """Bring the workers' ledgers to `now`: the queued prefill runs first (it preempts decode), the
        requests whose prefill completed join the batch, then the decode clock runs for the rest."""
        t_prev = self._t_last[rows]
        dt = now - t_prev
        if not (dt > 0).any():
            return
        dt = np.where(dt > 0, np.minimum(dt, 1e9), 0.0)
        self._t_last[rows] = np.maximum(t_prev, now)
        k1 = self._k1[rows]
        c_prev = self._C[rows]
        consume = np.minimum(dt, np.maximum(self._P[rows] - c_prev, 0.0) * k1)  # drains at 1/k1 tokens/s (eq. 2)
        c_new = c_prev + consume / k1
        self._C[rows] = c_new
        for i in np.nonzero(self._next_pend[rows] <= c_new + 1e-9)[0]:
            t0 = float(t_prev[i]) if math.isfinite(t_prev[i]) else now
            self._start_prefilled(int(rows[i]), now, t0, float(c_prev[i]))
        n_dec = self._n_dec[rows]
        g_prev = self._G[rows]
        # eq. 3 in total-context form: k2·Σctx + c2·b + c3, with Σctx = Σl_in + Σ(G − g0 + 1)
        step = (self._k2[rows] * (self._s_in_dec[rows] + n_dec * (g_prev + 1.0) - self._s_g0[rows])
                + self._c2[rows] * n_dec + self._c3[rows])
        g_new = g_prev + np.where(n_dec > 0, (dt - consume) / step, 0.0)
        self._G[rows] = g_new
        cur_old = self._cur[rows]
        cur_new = np.floor(g_new / self.bucket).astype(np.int64)
        moved = np.nonzero(cur_new > cur_old)[0]
        if len(moved):
            self._cur[rows] = cur_new
            for i in moved:
                self._clear_buckets(int(rows[i]), int(cur_old[i]), int(cur_new[i]))
        if repredict:
            for i in np.nonzero(self._next_end[rows] < g_new)[0]:
                self._repredict_due(int(rows[i]))

    def _clear_buckets(self, r: int, lo: int, hi: int) -> None:
        """Zero the ring slots of the past buckets [lo, hi)."""
        H = self.H
        if hi - lo >= H:
            self._KN[r].fill(0.0)
            self._KA[r].fill(0.0)
            return
        a, b = lo % H, hi % H
        if a < b:
            self._KN[r, a:b] = 0.0
            self._KA[r, a:b] = 0.0
        else:
            self._KN[r, a:] = 0.0
            self._KA[r, a:] = 0.0
            self._KN[r, :b] = 0.0
            self._KA[r, :b] = 0.0

    def _kv_add(self, r: int, lo: int, hi: int, a: float, sign: float) -> None:
        """Add (sign=+1) or remove (−1) one request's kv line over buckets [lo, hi] (absolute)."""
        if hi < lo:
            return
        H = self.H
        s, e = lo % H, hi % H + 1
        if hi - lo + 1 >= H:
            s, e = 0, H
        if s < e:
            self._KN[r, s:e] += sign
            self._KA[r, s:e] += sign * a
        else:
            self._KN[r, s:] += sign
            self._KA[r, s:] += sign * a
            self._KN[r, :e] += sign
            self._KA[r, :e] += sign * a

    def _advance_one(self, r: int, now: float, repredict: bool = True) -> None:
        """`_advance` for one worker, in scalar arithmetic (the per-event path: numpy's per-call overhead
        would dominate on arrays of one)."""
        t_prev = float(self._t_last[r])
        dt = now - t_prev
        if not dt > 0:
            return
        dt = min(dt, 1e9)
        self._t_last[r] = now
        k1 = float(self._k1[r])
        c_prev = float(self._C[r])
        consume = min(dt, max(float(self._P[r]) - c_prev, 0.0) * k1)
        c_new = c_prev + consume / k1
        self._C[r] = c_new
        if self._next_pend[r] <= c_new + 1e-9:
            self._start_prefilled(r, now, t_prev if math.isfinite(t_prev) else now, c_prev)
        if self._n_dec[r] > 0:
            g_new = float(self._G[r]) + (dt - consume) / self._step_time(r)
            self._G[r] = g_new
            cur_old, cur_new = int(self._cur[r]), int(g_new // self.bucket)
            if cur_new > cur_old:
                self._cur[r] = cur_new
                self._clear_buckets(r, cur_old, cur_new)
            if repredict and self._next_end[r] < g_new:
                self._repredict_due(r)

    def _start_prefilled(self, r: int, now: float, t_prev: float, c_prev: float) -> None:
        """Requests whose place in the prefill queue has been consumed start decoding (at G, unchanged
        while the queue drained)."""
        row = self._rows[r]
        c = self._C[r]
        while row.pending and row.pending[0].pend_end <= c + 1e-9:
            req = row.pending.popleft()
            t0 = min(t_prev + max(req.pend_end - c_prev, 0.0) * self._k1[r], now)
            self._start_decode(r, req, t0)
        self._next_pend[r] = row.pending[0].pend_end if row.pending else _INF

    def _repredict_due(self, r: int) -> None:
        """Re-predict the requests whose predicted end the decode clock has passed."""
        row = self._rows[r]
        g = self._G[r]
        while row.ends and row.ends[0][0] < g:
            _, ver, rid = heapq.heappop(row.ends)
            req = row.reqs.get(rid)
            if req is not None and req.version == ver and req.state == _DECODING and not req.exhausted:
                self._repredict(r, req)
        self._refresh_ends(r)

    def _start_decode(self, r: int, req: _Req, t0: float) -> None:
        row = self._rows[r]
        req.state, req.t0 = _DECODING, t0
        self._n_dec[r] += 1
        self._s_in_dec[r] += req.l_in
        self._s_g0[r] += req.g0
        self._push_slack(row, req)
        if self.slack == SLACK_RISK:
            self._young_add(r, req)

    def _young_add(self, r: int, req: _Req) -> None:
        """Risk mode: the request takes the oldest of the worker's young slots."""
        row = self._rows[r]
        s = int(self._Ypos[r]) % _YOUNG
        self._Ypos[r] += 1
        prev = row.young[s]
        if prev is not None and (q := row.reqs.get(prev)) is not None:
            q.yslot = -1
        row.young[s] = req.rid
        req.yslot = s
        self._Yg0[r, s], self._Yt0[r, s], self._YT[r, s] = req.g0, req.t0, req.t_dec

    def _young_drop(self, r: int, req: _Req) -> None:
        s = req.yslot
        if s >= 0 and self._rows[r].young[s] == req.rid:
            self._rows[r].young[s] = None
            self._YT[r, s] = 0.0
        req.yslot = -1

    def _push_slack(self, row: _Row, req: _Req) -> None:
        # slack_k(t) = T·l_out − t_dec = T·(G − g0 + 1) − (t − t0) = T·(G + 1) − t + (t0 − T·g0)
        key = req.t0 - self._Tg[req.grp] * req.g0
        heapq.heappush(row.heaps.setdefault(req.grp, []), (key, req.version, req.rid))
        if key < self._minkey[row.idx, req.grp]:
            self._minkey[row.idx, req.grp] = key

    def _refresh_slack(self, row: _Row, grp: int) -> None:
        heap = row.heaps.get(grp)
        while heap:
            req = row.reqs.get(heap[0][2])
            if req is not None and req.version == heap[0][1] and req.state == _DECODING:
                break
            heapq.heappop(heap)
        self._minkey[row.idx, grp] = heap[0][0] if heap else _INF

    def _refresh_ends(self, r: int) -> None:
        row = self._rows[r]
        ends = row.ends
        while ends:
            req = row.reqs.get(ends[0][2])
            if req is not None and req.version == ends[0][1] and not req.exhausted:
                break
            heapq.heappop(ends)
        self._next_end[r] = ends[0][0] if ends else _INF

    def _repredict(self, r: int, req: _Req) -> None:
        """Appendix C: the request outlived its prediction; predict E[L | L > l_pred] (bounded).

        Conditioned on the moment it outlived the prediction, not on when the ledger noticed, so the
        result does not depend on how often the clock is advanced; `_repredict_due` repeats it while the
        new prediction is still behind the clock."""
        gen = float(math.floor(req.lp)) + 1.0
        cap = float(self.horizon_steps if req.max_tokens is None else min(req.max_tokens, self.horizon_steps))
        if gen >= cap:  # max_tokens bounds it: it ends at the cap
            new, var = cap, 0.0
        else:
            new = min(max(self.predictor.conditional_mean(req.model, req.l_in, gen, int(cap)), gen + 1.0), cap)
            var = self.predictor.conditional_std(req.model, req.l_in, gen) ** 2 if self.tail else 0.0
        req.exhausted = new >= cap
        if new <= req.lp:
            return
        self._s_pred[r] += new - req.lp
        self._s_var[r] += var - req.var
        req.lp, req.var = new, var
        self._extend_kv(r, req)
        heapq.heappush(self._rows[r].ends, (req.g0 + req.lp - 1.0, req.version, req.rid))

    def _extend_kv(self, r: int, req: _Req) -> None:
        hi = min(int((req.g0 + req.lp - 1.0) // self.bucket), int(self._cur[r]) + self.H - 1)
        if hi > req.kv_hi:
            self._kv_add(r, max(req.kv_hi + 1, int(self._cur[r])), hi, req.a, 1.0)
            req.kv_hi = hi

    def _place_kv(self, r: int, req: _Req) -> None:
        req.a = self._h[r] * (req.l_in - req.g0 + 1.0) + self._j[r]  # kv(g) = h·(l_in + g − g0 + 1) + j
        req.kv_lo = int(req.g0 // self.bucket)
        req.kv_hi = req.kv_lo - 1
        self._extend_kv(r, req)

    def _unplace_kv(self, r: int, req: _Req) -> None:
        self._kv_add(r, max(req.kv_lo, int(self._cur[r])), req.kv_hi, req.a, -1.0)

    def _step_time(self, r: int) -> float:
        n = self._n_dec[r]
        ctx = self._s_in_dec[r] + n * (self._G[r] + 1.0) - self._s_g0[r]
        return float(self._k2[r] * ctx + self._c2[r] * n + self._c3[r])

    # --- per-request inputs ----------------------------------------------------------------------
    def _predicted(self, request: RequestFeatures) -> tuple[float, float]:
        cap = self.horizon_steps if request.max_tokens is None else min(request.max_tokens, self.horizon_steps)
        lp = float(request.predicted_output_tokens)
        if self.use_predictor or not math.isfinite(lp) or lp <= 0:  # a bad value must not poison the sums
            lp = self.predictor.predict(request.model, request.prompt_tokens, request.max_tokens)
        lp = min(max(lp, 1.0), float(max(cap, 1)))
        var = self.predictor.predict_std(request.model, request.prompt_tokens) ** 2 if self.tail else 0.0
        return lp, var

    def _group(self, t_dec: float) -> int:
        try:
            return self._groups.index(t_dec)
        except ValueError:
            pass
        if len(self._groups) < _MAX_SLO_GROUPS:
            self._groups.append(t_dec)
            self._Tg[len(self._groups) - 1] = t_dec
            return len(self._groups) - 1
        # Full: share the slack group of the closest stricter target (conservative), else the strictest.
        stricter = [(t, i) for i, t in enumerate(self._groups) if t <= t_dec]
        return max(stricter)[1] if stricter else min((t, i) for i, t in enumerate(self._groups))[1]

    # --- Policy interface ------------------------------------------------------------------------
    def choose(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float) -> Decision:
        self.decisions += 1
        n = len(workers)
        if n == 0:
            return Decision(None, "no_workers")
        rows = self._rows_for_views(workers)
        self._advance(rows, now)
        cached = self._cached_for(request, workers)
        ok, norm = self._feasible(request, rows, now, cached=cached)
        untrusted = self._miss[rows] > self.max_miss_rate
        if untrusted.any() and self.fallback is not None:
            ok &= ~untrusted
            if not ok.any():    # the model is wrong where it would place: the robust baseline decides
                return self._fall_back(request, workers, now)
        if ok.any():
            return self._best_fit(request, workers, ok, norm, "best_fit")
        if self.slack == SLACK_RISK:
            d = self._least_risk(request, workers, rows, norm, at_deadline=True)
            if d is not None:
                return d
        alone = self._fits_alone(request, rows, cached)
        if not alone.any():
            # Not even an empty worker meets its SLO (say a prompt whose prefill alone exceeds the TTFT
            # target): waiting cannot help, so it goes where the least work is, as a best effort.
            self.best_efforts += 1
            self._unplaced.pop(request.request_id, None)
            if self.fallback is not None:
                return Decision(self.fallback.choose(request, workers, now).worker_id, "best_effort")
            return Decision(workers[int(np.argmin(norm))].id, "best_effort")
        if not self._ttft_reachable:
            # No worker meets its TTFT any more (waiting only adds to the estimate: the wait grows as fast
            # as queued prefill can drain): place it where it harms nobody else's SLO ((b), (d), (e)) as
            # soon as there is such a worker.
            late, norm = self._feasible(request, rows, now, check_ttft=False, cached=cached)
            if late.any():
                self.late += 1
                return self._best_fit(request, workers, late, norm, "late")
            if self.slack == SLACK_RISK:
                d = self._least_risk(request, workers, rows, norm, at_deadline=False)
                if d is not None:
                    self.late += 1
                    return d
        self.no_fits += 1
        self._note_unplaced(request, rows, now)
        return Decision(None, "no_fit", retry_at=self._risk_deadline(request, now))

    def _fall_back(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float) -> Decision:
        """The robust baseline's choice (`fallback`) where the model cannot be trusted: every worker it would
        place on misses too often (`observe_outcome`)."""
        self.fallbacks += 1
        self._unplaced.pop(request.request_id, None)
        d = self.fallback.choose(request, workers, now)
        return Decision(d.worker_id, "fallback")

    def _risk_deadline(self, request: RequestFeatures, now: float) -> float | None:
        """Risk mode, waiting for a worker within the budget: the time after which no worker would meet the
        TTFT with `deadline_margin_s` to spare any more (then `choose` takes the least risk), i.e. when the
        caller should ask again even if nothing changes meanwhile. None outside risk mode."""
        if self.slack != SLACK_RISK or self._parts is None:
            return None
        later, ttft = self._parts[1], self._parts[7]
        if not later.any():
            return None
        slo = target_for(request, self.slo)
        # At least a millisecond on: at the boundary itself the next call decides.
        return now + max(float(np.max(slo.ttft_s - self.deadline_margin_s - ttft[later])), 1e-3)

    def _best_fit(self, request: RequestFeatures, workers: Sequence[WorkerView], ok: np.ndarray, norm: np.ndarray,
                  reason: str) -> Decision:
        """Algorithm 1: the feasible worker with the largest capacity_norm (the fullest bin that fits), as `fit`
        and `margin` ask (module docstring): headroom is each worker's smallest relative slack over the
        constraints after the placement."""
        head = self._head
        if self.fit == FIT_WORST:
            best = int(np.argmax(np.where(ok, head, -_INF)))
        else:
            cand = ok & (head >= self.margin) if self.margin > 0 else ok
            if not cand.any():   # nobody keeps the margin: the most headroom
                best = int(np.argmax(np.where(ok, head, -_INF)))
            else:
                order = np.argsort(-norm, kind="stable")
                best = int(order[int(np.argmax(cand[order]))])
        if request.request_id in self._unplaced:
            del self._unplaced[request.request_id]
            self._shortfall = None
        return Decision(workers[int(best)].id, reason)

    def _least_risk(self, request: RequestFeatures, workers: Sequence[WorkerView], rows: np.ndarray,
                    norm: np.ndarray, at_deadline: bool) -> Decision | None:
        """Risk mode: no worker is within the stall-risk budget. Waiting for one costs TTFT, so wait only
        while some worker would still meet the TTFT after `deadline_margin_s` more; at that deadline (or
        once the TTFT is lost anyway) take the worker where the prefill breaks the fewest ATGTs."""
        base, later, risk, l_in, lp, var, z, _ = self._parts
        if at_deadline and (not base.any() or later.any()):
            return None
        idx = np.nonzero(base)[0]
        if not len(idx):
            return None
        idx = idx[self._kv_fits(rows[idx], l_in, lp, var, z)]
        if not len(idx):
            return None
        best = idx[np.lexsort((-norm[idx], risk[idx]))[0]]
        if request.request_id in self._unplaced:
            del self._unplaced[request.request_id]
            self._shortfall = None
        self.deadline_placements += 1
        return Decision(workers[int(best)].id, "deadline" if at_deadline else "late")

    def _cached_for(self, request: RequestFeatures, workers: Sequence[WorkerView]) -> np.ndarray | float:
        """Prompt tokens each candidate's prefix cache holds for the request (0 without cache pricing)."""
        view = request.cached_prefix_tokens
        if not self.price_cache or not view:
            return 0.0
        top = max(int(request.prompt_tokens), 0)
        return np.array([min(max(int(view.get(w.id, 0)), 0), top) for w in workers], dtype=float)

    def _prefill_work(self, rows: np.ndarray | int, l_in: float, cached: np.ndarray | float) -> Any:
        """Prefill work of a prompt of l_in tokens of which `cached` are in the prefix cache, in linear-token
        units (perf_model's k1·l + k1q·l², the quadratic part over the uncached tokens' attention)."""
        return (l_in - cached) + self._k1q[rows] / self._k1[rows] * (l_in * l_in - cached * cached)

    def _waited(self, request: RequestFeatures, now: float) -> float:
        """Time the request already spent waiting for a placement (it counts against its TTFT)."""
        if not self.count_wait or not request.arrival > 0:
            return 0.0
        return max(now - request.arrival, 0.0)

    def _fits_alone(self, request: RequestFeatures, rows: np.ndarray, cached: np.ndarray | float = 0.0) -> np.ndarray:
        """Constraints (b), (c), (e) for the request on an empty worker of each candidate's profile."""
        slo = target_for(request, self.slo)
        l_in = float(max(request.prompt_tokens, 0))
        lp, _ = self._predicted(request)
        k2, c2, c3 = self._k2[rows], self._c2[rows], self._c3[rows]
        ok_b = l_in + self.gamma * lp <= self.theta * (slo.atgt_s - c2 - c3) / k2           # eq. 4, b = 1
        pre = self._c1[rows] + np.maximum(self._pf[rows], self._k1[rows] * self._prefill_work(rows, l_in, cached))
        ok_c = pre <= slo.ttft_s                                                             # eq. 2
        ok_e = self._h[rows] * (l_in + lp) + self._j[rows] <= self._M[rows]                  # eq. 1
        return ok_b & ok_c & ok_e

    def _feasible(self, request: RequestFeatures, rows: np.ndarray, now: float, check_ttft: bool = True,
                  cached: np.ndarray | float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """Constraints (b)-(e) for every candidate row at once, and their capacity_norm; `cached`: the prompt
        tokens each row's prefix cache holds (`_cached_for`)."""
        g, th = self.gamma, self.theta
        slo = target_for(request, self.slo)
        l_in = float(max(request.prompt_tokens, 0))
        lp, var = self._predicted(request)
        n_all = self._n_all[rows]
        k1, c1, k2, c2, c3 = self._k1[rows], self._c1[rows], self._k2[rows], self._c2[rows], self._c3[rows]
        ctx = self._s_in[rows] + g * self._s_pred[rows]
        # capacity_norm (section 4.2): L2 norm of batch size and Σ(l_in + γ·l_out), here per capacity.
        norm = np.hypot(n_all / self._bcap[rows], ctx / self._ccap[rows])

        # Engine-reported load beyond the ledger (other gateway replicas): same mean context each.
        b_now = np.maximum(n_all, self._vb[rows])
        new_ctx = l_in + g * lp
        per = np.where(n_all > 0, ctx / np.maximum(n_all, 1.0), new_ctx)
        ctx_tot = ctx + (b_now - n_all) * per + new_ctx
        b = b_now + 1.0
        t_dec = np.minimum(self._min_tdec[rows], slo.atgt_s)
        limit = th * (t_dec - c2 * b - c3) / k2                       # (b) via eq. 4
        queued = np.maximum(self._P[rows] - self._C[rows], 0.0)       # prefill work, in linear-token units
        work = self._prefill_work(rows, l_in, cached)   # the uncached part (price_cache) or all of it
        l_new = l_in - cached
        pre = c1 + np.maximum(self._pf[rows], k1 * (queued + work))    # eq. 2 over queued + new
        # TTFT also pays what it waited, the decode step in flight and, in every prefill chunk, the ongoing
        # decodes (vLLM V1 batches them with the chunk): (chunks + 1) decode steps of eq. 3.
        n_dec = self._n_dec[rows]
        t_d = np.where(n_dec > 0, k2 * (self._s_in_dec[rows] + n_dec * (self._G[rows] + 1.0) - self._s_g0[rows])
                       + c2 * n_dec + c3, 0.0)
        ttft = self._waited(request, now) + pre + (np.ceil((queued + l_new) / self.chunk) + 1.0) * t_d
        z = 0.0
        if self.tail:
            busy = int(np.count_nonzero(n_all)) + 1
            z = tail_factor(self.tail, split_budget(self.delta, busy))
            ctx_tot = ctx_tot + z * np.sqrt(g * g * (self._s_var[rows] + var) + (self._rmse_dec[rows] / k2) ** 2)
            pre = pre + z * self._rmse_pre[rows]
            ttft = ttft + z * self._rmse_pre[rows]
        ok_b = (ctx_tot <= limit) & (b <= self._bmax[rows])
        ok_c = ttft <= slo.ttft_s if check_ttft else np.ones(len(rows), dtype=bool)  # (c)
        # Waiting never helps a TTFT that counts the wait (queued prefill drains at most as fast as it grows).
        self._ttft_reachable = bool(ok_c.any()) or not (self.count_wait and request.arrival > 0)
        if self.slack != SLACK_OFF:                                    # (d)
            G = self._G[rows]
            slack = (self._Tg * (G + 1.0)[:, None] - now + self._minkey[rows]).min(axis=1)
            F = self._length_cdf(request.model) if self.slack == SLACK_RISK else None
            if F is not None:
                risk = self._stall_risk(F, rows, now, pre / th, queued, t_d, l_in, slo.atgt_s, l_new)
                ok_d = risk <= self.stall_risk
            else:
                if self.slack in (SLACK_LIFETIME, SLACK_RISK):  # risk mode without length data: lifetime
                    slack = slack + self._future_slack(rows, G)
                else:  # the MIP's ongoing requests include placed ones not decoding yet: l_out = t_dec = 0
                    slack = np.where(queued > 0, np.minimum(slack, 0.0), slack)
                ok_d = pre <= th * slack
                risk = np.where(ok_d, 0.0, 1.0)
        else:
            ok_d = np.ones(len(rows), dtype=bool)
        if self.slack == SLACK_RISK:
            later = ok_b & (ttft + self.deadline_margin_s <= slo.ttft_s) if check_ttft else ok_b
            self._parts = (ok_b & ok_c, later, risk, l_in, lp, var, z, ttft)
        ok = ok_b & ok_c & ok_d
        rej = {C_ATGT: int(np.count_nonzero(~ok_b)), C_TTFT: int(np.count_nonzero(~ok_c)),
               C_SLACK: int(np.count_nonzero(~ok_d)), C_KV: 0}
        # Headroom after the placement: the smallest relative slack over (b), (c), (d) and the batch limit.
        head = np.minimum(1.0 - ctx_tot / np.maximum(limit, 1e-9), 1.0 - b / self._bmax[rows])
        if check_ttft:
            head = np.minimum(head, 1.0 - ttft / slo.ttft_s)
        if self.slack == SLACK_RISK and self.stall_risk > 0:
            head = np.minimum(head, 1.0 - risk / self.stall_risk)
        idx = np.nonzero(ok)[0]
        if len(idx):
            ok_e = self._kv_fits(rows[idx], l_in, lp, var, z)
            ok[idx] = ok_e
            rej[C_KV] = int(np.count_nonzero(~ok_e))
            head[idx] = np.minimum(head[idx], self._kv_head)
        self._head = head
        self.last_rejections = rej
        return ok, norm

    def _stall_risk(self, F: np.ndarray, rows: np.ndarray, now: float, need: np.ndarray,
                    queued: np.ndarray, t_d: np.ndarray, l_in: float, t_slo: float,
                    l_new: np.ndarray | float) -> np.ndarray:
        """Risk mode of (d): the expected number of ongoing requests whose ATGT the new prefill breaks.

        The prefill stalls every decode on the worker by `need` (= t_pre / θ). A request that has saved
        slack S (T·l_out − t_dec, the paper's (d)) and will still generate R tokens, each saving
        gain = T − t_d (eq. 3 with the newcomer), keeps its ATGT iff S + R·gain >= need. R is unknown:
        P(R < x | L >= g) for a request g tokens old comes from the completed output lengths (appendix C's
        conditional distribution), x = (need − S) / gain. Summed over the worker's youngest decodes (old
        ones have saved enough) and its not yet started requests (S = 0, g = 1), which only the part of the
        new prompt beyond the prefill chunk their own prefill ends in stalls (vLLM batches prompts up to
        max_num_batched_tokens per step). l_new: the new prompt's uncached tokens per row (its prefill)."""
        n = len(rows)
        n_dec = self._n_dec[rows]
        step = np.where(n_dec > 0, t_d, self._c3[rows]) + self._k2[rows] * l_in + self._c2[rows]
        gain = np.minimum(self._min_tdec[rows], t_slo) - step
        inv_gain = np.where(gain > 0, 1.0 / np.maximum(gain, 1e-12), _FAR)  # no saving: a deficit stays
        risk = np.zeros(n)
        # The young decodes: saved slack S = T·l_out − t_dec; only those short of `need` are at risk.
        T = self._YT[rows]
        gen = self._G[rows][:, None] - self._Yg0[rows] + 1.0
        deficit = need[:, None] - (T * gen - (now - self._Yt0[rows]))
        ri, ci = np.nonzero((T > 0) & (deficit > 0))
        if len(ri):
            p = _cond_cdf(F, np.maximum(gen[ri, ci], 1.0), deficit[ri, ci] * inv_gain[ri])
            risk += np.bincount(ri, weights=p, minlength=n)
        # The not yet started requests (S = 0, one token): stalled by the prompt beyond their last chunk.
        pend = self._n_all[rows] - n_dec
        beyond = queued + l_new - np.ceil(queued / self.chunk) * self.chunk
        pi = np.nonzero((pend > 0) & (beyond > 0))[0]
        if len(pi):
            x = self._k1[rows[pi]] * beyond[pi] / self.theta * inv_gain[pi]
            risk[pi] += pend[pi] * _cond_cdf(F, np.ones(len(pi)), x)
        return risk

    def _length_cdf(self, model: str) -> np.ndarray | None:
        """Sorted recent output lengths of `model` (the predictor's model-wide ring), cached."""
        st = getattr(self.predictor, "_models", {}).get(model)  # LengthPredictor keeps them per model
        if st is None or st.filled < _MIN_SAMPLES:
            return None
        cached = self._cdf_cache.get(model)
        if cached is None or st.n - cached[0] >= 64:
            cached = (st.n, np.sort(st.samples()))
            self._cdf_cache[model] = cached
        return cached[1]

    def _future_slack(self, rows: np.ndarray, G: np.ndarray) -> np.ndarray:
        """A lower bound on the slack ongoing requests will still save before they end: every one has
        at least min_k(remaining steps) steps left, each saving T_dec − t_d (eq. 3 at the current batch).
        Stalls already suffered are in the saved-so-far part, so the future part is not promised twice."""
        n = self._n_dec[rows]
        step = self._k2[rows] * (self._s_in_dec[rows] + n * (G + 1.0) - self._s_g0[rows]) + self._c2[rows] * n + self._c3[rows]
        gain = np.maximum(self._min_tdec[rows] - step, 0.0)
        remaining = np.maximum(self._next_end[rows] - G, 0.0)
        return np.where(np.isfinite(remaining) & np.isfinite(gain), remaining * gain, 0.0)

    def _kv_fits(self, rs: np.ndarray, l_in: float, lp: float, var: float, z: float) -> np.ndarray:
        """(e): the new request's w added to each worker's future KV demand stays within M at every step."""
        B, H = self.bucket, self.H
        G, cur, h, j, M = self._G[rs], self._cur[rs], self._h[rs], self._j[rs], self._M[rs]
        e_new = G + lp - 1.0
        nb = np.clip(np.floor(e_new / B).astype(np.int64) - cur + 1, 1, H)
        offs = np.arange(int(nb.max()))
        babs = cur[:, None] + offs[None, :]
        slot = babs % H
        N = self._KN[rs[:, None], slot]
        A = self._KA[rs[:, None], slot]
        g_end = ((babs + 1) * B - 1).astype(float)
        hh = h[:, None]
        new = hh * (l_in + np.minimum(g_end, e_new[:, None]) - G[:, None] + 1.0) + j[:, None]
        demand = np.where(offs[None, :] < nb[:, None], hh * g_end * N + A + new, -_INF)
        peak = demand.max(axis=1)
        # The engine's own KV usage, when higher than the ledger's (traffic the ledger does not see).
        now_model = h * G * N[:, 0] + A[:, 0]
        peak += np.maximum(self._vkv[rs] * M - now_model, 0.0)
        if z:
            peak += z * h * np.sqrt(self._s_var[rs] + var)
        self._kv_head = 1.0 - peak / M
        return peak <= M

    def on_dispatch(self, request: RequestFeatures, worker_id: str, now: float) -> None:
        r = self._row_for_id(worker_id)
        self._advance_one(r, now)
        row = self._rows[r]
        rid = request.request_id
        if rid in row.reqs:
            return
        if rid in self._unplaced:
            del self._unplaced[rid]
            self._shortfall = None
        slo = target_for(request, self.slo)
        lp, var = self._predicted(request)
        req = _Req(rid, request.model, max(int(request.prompt_tokens), 0), lp, var, slo.atgt_s, slo.ttft_s,
                   self._group(slo.atgt_s), request.max_tokens)
        req.g0 = float(self._G[r])
        cached = min(max(int(request.cached_prefix_tokens.get(worker_id, 0)), 0), req.l_in) if self.price_cache else 0
        self._P[r] += self._prefill_work(r, float(req.l_in), float(cached))  # prefill work (perf_model)
        req.pend_end = float(self._P[r])
        row.pending.append(req)
        if len(row.pending) == 1:
            self._next_pend[r] = req.pend_end
        row.reqs[rid] = req
        self._req_row[rid] = r
        self._n_all[r] += 1
        self._s_in[r] += req.l_in
        self._s_pred[r] += lp
        self._s_var[r] += var
        row.tcount[req.t_dec] = row.tcount.get(req.t_dec, 0) + 1
        self._min_tdec[r] = min(self._min_tdec[r], req.t_dec)
        self._place_kv(r, req)
        end = req.g0 + lp - 1.0
        heapq.heappush(row.ends, (end, req.version, rid))
        self._next_end[r] = min(self._next_end[r], end)
        if req.l_in == 0:
            self._start_prefilled(r, now, now, float(self._C[r]))

    def report_progress(self, request_id: str, generated_tokens: int, now: float) -> None:
        """The caller saw `generated_tokens` tokens of the request so far (optional; corrects the ledger).

        Call it with the final count just before `on_complete` to teach the length predictor.
        """
        r = self._req_row.get(request_id)
        if r is None or generated_tokens < 0:
            return
        self._advance_one(r, now, repredict=False)  # the report comes first
        row = self._rows[r]
        req = row.reqs.get(request_id)
        if req is None:
            return
        req.reported = int(generated_tokens)
        if generated_tokens < 1:
            return
        g0 = float(self._G[r]) - generated_tokens + 1.0
        if req.state == _PENDING:
            self._force_prefilled(r, req, now)
            req.t0 = now - (generated_tokens - 1) * self._step_time(r)  # decoding began that long ago
            self._rekey(r, req, g0)
        elif abs(g0 - req.g0) >= 0.5:
            self._rekey(r, req, g0)
        self._repredict_due(r)

    def observe_completion(self, request: RequestFeatures, output_tokens: int, now: float) -> None:
        """The request completed after `output_tokens` tokens (called just before `on_complete`): corrects
        the ledger and, with `learn_lengths`, teaches the length predictor."""
        self.report_progress(request.request_id, output_tokens, now)

    def observe_outcome(self, request: RequestFeatures, worker_id: str, slo_met: bool, now: float) -> None:
        """Whether a request that ran on `worker_id` met its SLO: the worker's recent miss rate (an EWMA over
        `miss_window` requests). A model that is right misses (almost) never where it placed; above
        `max_miss_rate` the worker's model is not trusted and the `fallback` baseline places there until
        the rate falls again or a new model is installed."""
        r = self._index.get(worker_id)
        if r is not None:
            self._miss[r] += self._miss_alpha * ((0.0 if slo_met else 1.0) - self._miss[r])

    def _force_prefilled(self, r: int, req: _Req, now: float) -> None:
        """The request's first token exists, so the prefill queue up to it has drained."""
        self._C[r] = max(self._C[r], req.pend_end)
        self._start_prefilled(r, now, now, float(self._C[r]))

    def _rekey(self, r: int, req: _Req, g0: float) -> None:
        row = self._rows[r]
        self._unplace_kv(r, req)
        if req.state == _DECODING:
            self._s_g0[r] += g0 - req.g0
        req.version += 1
        req.g0 = g0
        self._place_kv(r, req)
        heapq.heappush(row.ends, (req.g0 + req.lp - 1.0, req.version, req.rid))
        if req.state == _DECODING:
            self._push_slack(row, req)
            self._refresh_slack(row, req.grp)
            if req.yslot >= 0:
                self._Yg0[r, req.yslot], self._Yt0[r, req.yslot] = req.g0, req.t0

    def on_complete(self, request: RequestFeatures, worker_id: str, now: float) -> None:
        r = self._index.get(worker_id)
        rid = request.request_id
        if r is None or rid not in self._rows[r].reqs:
            return
        self._advance_one(r, now)
        row = self._rows[r]
        req = row.reqs[rid]
        if req.state == _PENDING:
            self._force_prefilled(r, req, now)
        gen = req.reported if req.reported is not None else max(self._G[r] - req.g0 + 1.0, 1.0)
        if self.learn_lengths and req.reported is not None:
            self.predictor.observe(req.model, req.l_in, req.reported)
        if gen < req.lp0:  # Algorithm 2: an overestimate, l_real − l_pred, counted until the predicted end
            row.early.append((req.g0 + req.lp0 - 1.0, gen - req.lp0))
        self._remove(r, req)

    def _remove(self, r: int, req: _Req) -> None:
        row = self._rows[r]
        if req.state == _DECODING:
            self._n_dec[r] -= 1
            self._s_in_dec[r] -= req.l_in
            self._s_g0[r] -= req.g0
        if req.yslot >= 0:
            self._young_drop(r, req)
        self._unplace_kv(r, req)
        del row.reqs[req.rid]
        self._req_row.pop(req.rid, None)
        req.version += 1
        self._n_all[r] -= 1
        self._s_in[r] -= req.l_in
        self._s_pred[r] -= req.lp
        self._s_var[r] -= req.var
        left = row.tcount[req.t_dec] - 1
        if left:
            row.tcount[req.t_dec] = left
        else:
            del row.tcount[req.t_dec]
            self._min_tdec[r] = min(row.tcount) if row.tcount else _INF
        if not row.reqs:  # exact zeros: no drift of float sums over long runs
            for arr in (self._n_all, self._s_in, self._s_pred, self._s_var, self._n_dec, self._s_in_dec, self._s_g0):
                arr[r] = 0.0
        if req.state == _DECODING:
            self._refresh_slack(row, req.grp)
        self._refresh_ends(r)
        self._compact(row)

    def _compact(self, row: _Row) -> None:
        """Drop stale heap entries (lazy deletion leaves them below the top) once they outnumber the live."""
        live = len(row.reqs)
        if len(row.ends) > 2 * live + 64:
            row.ends = [e for e in row.ends if (q := row.reqs.get(e[2])) is not None and q.version == e[1]]
            heapq.heapify(row.ends)
        for grp, heap in row.heaps.items():
            if len(heap) > 2 * live + 64:
                heap[:] = [e for e in heap if (q := row.reqs.get(e[2])) is not None and q.version == e[1]
                           and q.state == _DECODING and q.grp == grp]
                heapq.heapify(heap)

    # --- introspection -----------------------------------------------------------------------------
    def worker_load(self, worker_id: str, now: float | None = None) -> dict[str, float]:
        """The ledger's view of one worker (for tests, metrics and debugging), brought to `now` if given."""
        r = self._index.get(worker_id)
        if r is None:
            return {}
        if now is not None:
            self._advance_one(r, now)
        return {
            "requests": float(self._n_all[r]), "decoding": float(self._n_dec[r]),
            "pending_prefill_tokens": float(max(self._P[r] - self._C[r], 0.0)),
            "context": float(self._s_in[r] + self.gamma * self._s_pred[r]),
            "predicted_output": float(self._s_pred[r]), "step_clock": float(self._G[r]),
            "step_time_s": self._step_time(r), "kv_now_blocks": self._kv_now(r),
        }

    def _kv_now(self, r: int) -> float:
        s = int(self._cur[r]) % self.H
        return float(self._h[r] * self._G[r] * self._KN[r, s] + self._KA[r, s])

    def generated(self, request_id: str) -> float | None:
        """The ledger's estimate of tokens generated so far (0 while the prefill is queued)."""
        r = self._req_row.get(request_id)
        if r is None:
            return None
        req = self._rows[r].reqs[request_id]
        return 0.0 if req.state == _PENDING else float(self._G[r] - req.g0 + 1.0)

    def predicted_length(self, request_id: str) -> float | None:
        r = self._req_row.get(request_id)
        return None if r is None else self._rows[r].reqs[request_id].lp

    # --- scale signal --------------------------------------------------------------------------------
    def _note_unplaced(self, request: RequestFeatures, rows: np.ndarray, now: float) -> None:
        while self._unplaced:
            first = next(iter(self._unplaced.values()))
            if now - first[0] <= self.unplaced_ttl_s:
                break
            self._unplaced.popitem(last=False)
        lp, _ = self._predicted(request)
        model = self.model_for(self._rows[int(rows[0])].profile)
        self._unplaced.pop(request.request_id, None)
        self._unplaced[request.request_id] = (now, max(int(request.prompt_tokens), 0), lp, target_for(request, self.slo), model)
        self._shortfall = None

    @property
    def shortfall(self) -> int:
        """How many more (empty) workers the requests that found no fit need: first-fit of them into
        fresh bins under constraints (b), (c) and, conservatively, (e) on their final sizes. Requests
        leave the set when dispatched or after `unplaced_ttl_s` without a retry."""
        if self._shortfall is None:
            bins: list[_FreshBin] = []
            for _, l_in, lp, slo, model in self._unplaced.values():
                for b in bins:
                    if b.add(l_in, lp, slo, model, self.gamma, self.theta):
                        break
                else:
                    b = _FreshBin()
                    b.add(l_in, lp, slo, model, self.gamma, self.theta, force=True)
                    bins.append(b)
            self._shortfall = len(bins)
        return self._shortfall

    # --- Algorithm 2 -------------------------------------------------------------------------------
    def worker_errors(self) -> dict[str, WorkerError]:
        """Algorithm 2 lines 4-13 over the ledger: underestimates of ongoing requests (re-predicted
        length minus the original prediction, +1 request each) and recent early finishes
        (l_real − l_pred, −1 request each, kept until the originally predicted end). O(in-flight):
        for the periodic rebalancing loop, not for the per-request path."""
        out: dict[str, WorkerError] = {}
        for row in self._rows:
            e = WorkerError()
            g = self._G[row.idx]
            for req in row.reqs.values():
                if req.lp > req.lp0:
                    e.l_err += req.lp - req.lp0
                    e.b_err += 1
            while row.early and row.early[0][0] < g:
                row.early.popleft()
            for _, l_err in row.early:
                e.l_err += l_err
                e.b_err -= 1
            out[row.worker_id] = e
        return out

    def rebalance(
        self, queued: Mapping[str, tuple[str, RequestFeatures]], workers: Sequence[WorkerView], now: float
    ) -> list[Move]:
        """Proposals to move queued (placed but not yet sent) requests between `workers` (Algorithm 2).

        A destination must satisfy constraints (b)-(e) for the request.
        """
        if not workers:
            return []
        rows = self._rows_for_views(workers)
        self._advance(rows, now)
        ids = [v.id for v in workers]
        feas: dict[str, np.ndarray] = {}
        for rid, (_, req) in queued.items():
            feas[rid] = self._feasible(req, rows, now, cached=self._cached_for(req, workers))[0]
        errors = self.worker_errors()
        coeffs = {v.id: (float(self._k2[r]), float(self._c2[r])) for v, r in zip(workers, rows, strict=True)}
        placements = {rid: (w, self._predicted(req)[0]) for rid, (w, req) in queued.items()}
        pos = {w: i for i, w in enumerate(ids)}
        return propose_moves(
            placements, {w: errors.get(w, WorkerError()) for w in ids}, coeffs,
            feasible=lambda rid, dst: bool(feas[rid][pos[dst]]),
        )


class _FreshBin:
    """Aggregates of requests that would start together on an empty worker (for the scale signal)."""

    __slots__ = ("n", "s_in", "s_sq", "s_ctx", "s_tok", "t_dec", "t_pre")

    def __init__(self) -> None:
        self.n, self.s_in, self.s_sq, self.s_ctx, self.s_tok, self.t_dec, self.t_pre = 0, 0.0, 0.0, 0.0, 0.0, _INF, _INF

    def add(self, l_in: int, lp: float, slo: SloTarget, m: PerfModel, gamma: float, theta: float,
            force: bool = False) -> bool:
        n, s_in, s_ctx, s_tok = self.n + 1, self.s_in + l_in, self.s_ctx + l_in + gamma * lp, self.s_tok + l_in + lp
        s_sq = self.s_sq + float(l_in) * l_in
        t_dec, t_pre = min(self.t_dec, slo.atgt_s), min(self.t_pre, slo.ttft_s)
        fits = (n <= m.max_batch and s_ctx <= theta * m.context_limit(n, t_dec)   # (b), eq. 4
                and m.prefill_time(s_in, s_sq) <= t_pre                             # (c), eq. 2
                and m.kv_blocks(s_tok, n) <= m.kv_capacity)                         # (e) at final sizes
        if fits or force:
            self.n, self.s_in, self.s_sq, self.s_ctx, self.s_tok = n, s_in, s_sq, s_ctx, s_tok
            self.t_dec, self.t_pre = t_dec, t_pre
        return fits


def _cond_cdf(sorted_lengths: np.ndarray, gen: np.ndarray, x: np.ndarray) -> np.ndarray:
    """P(L < g + x | L >= g) from sorted samples of L (0 where x <= 0; 0 for g beyond every sample)."""
    f_g = np.searchsorted(sorted_lengths, gen, side="left")
    f_gx = np.searchsorted(sorted_lengths, gen + np.clip(x, 0.0, _FAR), side="left")
    return (f_gx - f_g) / np.maximum(len(sorted_lengths) - f_g, 1)


def _as_model(m: PerfModel | Mapping[str, Any]) -> PerfModel:
    return m if isinstance(m, PerfModel) else PerfModel.from_prior(m)
