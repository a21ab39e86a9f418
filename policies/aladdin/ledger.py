"""The per-worker ledger of `aladdin`: what each worker holds, advanced in time without a loop over requests.

For each worker the ledger keeps the requests the policy placed there (prompt length, predicted output,
tokens generated so far) as aggregates, so a decision costs O(workers) (Aladdin section 4.2 needs the
batch size, the total context, the pending prefill and the KV demand of every worker):

  * Each worker has a decode-step clock (`step_clock`, every running request gains one token per step); it
    advances by elapsed / t_d(b, l_avg) (eq. 3, section 3). Prefill preempts decode (section 4.2, (d)):
    queued prompt work is consumed first at 1/k1 tokens/s (eq. 2) while the step clock stands still.
  * A request's tokens generated = step_clock − start_step + 1, so Σ generated, the mean context and every
    request's slack are aggregates; slack minima live in per-SLO-class heaps.
  * The future KV demand (the vector w of eq. 1) is a per-worker ring over decode steps in buckets of
    `bucket_steps`: bucket b holds N (requests alive, `kv_alive`) and A (Σ of their kv-line intercepts,
    `kv_intercept`), so the demand at step g is h·g·N + A; a request adds itself over its predicted life.
  * Requests that outlive their prediction are re-predicted by the conditional mean (appendix C) when the
    step clock passes their predicted end (a heap per worker).
Events (dispatch, completion, report, re-prediction) cost O(log n) plus one numpy slice.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from policies.length_predictor import LengthPredictor
from policies.perf_model import DECODE, PREFILL, PerfModel
from policies.types import WorkerView

PENDING, DECODING = 0, 1
MAX_SLO_GROUPS = 8
RATE_WINDOW_S = 5.0     # the placed prefill work rate's EWMA time constant (`placed_rate_now`)
YOUNG = 8               # risk mode: the most recently started decodes tracked per worker
INF = math.inf


FULL_KV = 0.9          # KV usage from which an engine with requests waiting is full (not between two steps)


def engine_full(v: WorkerView) -> float:
    """The engine's running count when its report says it holds no more at once: requests wait while its KV
    cache is (nearly) full or its batch is at max_num_seqs' worth of running ones; else 0. Requests wait for a
    moment between two engine steps too, so waiting alone does not say it."""
    return float(v.running) if v.waiting > 0 and v.kv_usage >= FULL_KV else 0.0


class PlacedRequest:
    """One placed request, as the ledger tracks it."""

    __slots__ = (
        "rid", "model", "l_in", "lp", "lp0", "var", "t_dec", "t_pre", "grp", "state", "g0", "t0",
        "pend_end", "kv_lo", "kv_hi", "a", "version", "max_tokens", "reported", "exhausted", "yslot",
    )

    def __init__(self, rid: str, model: str, l_in: int, lp: float, var: float, t_dec: float, t_pre: float,
                 grp: int, max_tokens: int | None) -> None:
        self.rid, self.model, self.l_in, self.lp, self.lp0, self.var = rid, model, l_in, lp, lp, var
        self.t_dec, self.t_pre, self.grp, self.max_tokens = t_dec, t_pre, grp, max_tokens
        self.state = PENDING
        self.g0 = self.t0 = self.pend_end = self.a = 0.0   # start step, decode start time, prefill queue end
        self.kv_lo = self.kv_hi = 0                          # KV ring buckets the request occupies
        self.version = 0                                     # bumps invalidate its heap entries
        self.reported: int | None = None
        self.exhausted = False                               # re-predicted up to max_tokens: never again
        self.yslot = -1                                      # risk mode: its young slot, -1 if none


class WorkerRow:
    """Per-worker Python-side state (the numeric aggregates live in the ledger's arrays at `idx`)."""

    __slots__ = ("idx", "worker_id", "profile", "reqs", "pending", "ends", "heaps", "tcount", "early", "young")

    def __init__(self, idx: int, worker_id: str, profile: str) -> None:
        self.idx, self.worker_id, self.profile = idx, worker_id, profile
        self.reqs: dict[str, PlacedRequest] = {}
        self.pending: deque[PlacedRequest] = deque()      # FIFO of requests waiting for their prefill
        self.ends: list[tuple[float, int, str]] = []      # heap of (predicted end step, version, rid)
        self.heaps: dict[int, list[tuple[float, int, str]]] = {}  # slack keys per SLO group
        self.tcount: dict[float, int] = {}                # ATGT target -> requests holding it
        self.early: deque[tuple[float, float]] = deque(maxlen=1024)  # (expiry step, l_real − l_pred)
        self.young: list[str | None] = [None] * YOUNG                # risk mode: rids in the young slots


class Ledger:
    """Every worker's placed requests, as named per-worker arrays (one row per worker) plus `WorkerRow`s.

    The arrays, each indexed by row:
      state of the clock   t_last (last advanced), step_clock (G), prefill_done (C) and prefill_queued (P)
                           in prefill-work units, next_prefill_end, next_predicted_end, bucket_now
      aggregates           n_requests, sum_prompt, sum_predicted, sum_variance, n_decoding,
                           sum_prompt_decoding, sum_start_step, min_atgt
      engine view          engine_batch (running + waiting, or in flight), engine_full (`engine_full`),
                           engine_kv_usage, kv_at_scrape (the
                           ledger's own KV level when that engine value was first seen: `kv_correction`)
      model (perf_model)   k1, c1, k1q, prefill_floor (pf) of eq. 2; k2, c2, c3 of eq. 3; kv_per_token (h),
                           kv_per_request (j), kv_capacity (M) of eq. 1; max_batch; rmse_prefill,
                           rmse_decode; batch_scale, context_scale (capacity_norm's units); chunk (the
                           engine's prefill chunk, max_num_batched_tokens; 0: not known)
      trust                miss_rate (EWMA of SLO misses)
      pace                 placed_rate, placed_n (EWMAs of the prefill work and of the requests placed on the worker
                           per second: `placed_rate_now`), placed_t (their last update), placed_t0 (the first)
      per SLO group        slack_key (the least slack key of the group's decodes)
      KV ring              kv_alive (N), kv_intercept (A), one column per bucket
      risk mode            young_start_step, young_start_time, young_atgt (0: an empty slot), young_next
    """

    # One value per row (filled by `_grow` from _SCALARS below).
    t_last: np.ndarray
    step_clock: np.ndarray
    prefill_done: np.ndarray
    prefill_queued: np.ndarray
    next_prefill_end: np.ndarray
    next_predicted_end: np.ndarray
    n_requests: np.ndarray
    sum_prompt: np.ndarray
    sum_predicted: np.ndarray
    sum_variance: np.ndarray
    n_decoding: np.ndarray
    sum_prompt_decoding: np.ndarray
    sum_start_step: np.ndarray
    min_atgt: np.ndarray
    engine_batch: np.ndarray
    engine_full: np.ndarray
    engine_kv_usage: np.ndarray
    kv_at_scrape: np.ndarray
    k1: np.ndarray
    c1: np.ndarray
    k2: np.ndarray
    c2: np.ndarray
    c3: np.ndarray
    kv_per_token: np.ndarray
    kv_per_request: np.ndarray
    kv_capacity: np.ndarray
    max_batch: np.ndarray
    rmse_prefill: np.ndarray
    rmse_decode: np.ndarray
    batch_scale: np.ndarray
    context_scale: np.ndarray
    k1q: np.ndarray
    prefill_floor: np.ndarray
    miss_rate: np.ndarray
    placed_rate: np.ndarray
    placed_n: np.ndarray
    placed_t: np.ndarray
    placed_t0: np.ndarray
    chunk: np.ndarray

    _SCALARS = (
        ("t_last", -INF), ("step_clock", 0.0), ("prefill_done", 0.0), ("prefill_queued", 0.0),
        ("next_prefill_end", INF), ("next_predicted_end", INF),
        ("n_requests", 0.0), ("sum_prompt", 0.0), ("sum_predicted", 0.0), ("sum_variance", 0.0),
        ("n_decoding", 0.0), ("sum_prompt_decoding", 0.0), ("sum_start_step", 0.0), ("min_atgt", INF),
        ("engine_batch", 0.0), ("engine_full", 0.0), ("engine_kv_usage", 0.0), ("kv_at_scrape", 0.0),
        ("k1", 1.0), ("c1", 0.0), ("k2", 1.0), ("c2", 0.0), ("c3", 0.0), ("kv_per_token", 1.0),
        ("kv_per_request", 0.0), ("kv_capacity", 1.0), ("max_batch", 1.0), ("rmse_prefill", 0.0),
        ("rmse_decode", 0.0), ("batch_scale", 1.0), ("context_scale", 1.0),
        ("k1q", 0.0), ("prefill_floor", 0.0), ("miss_rate", 0.0), ("chunk", 0.0),
        ("placed_rate", 0.0), ("placed_n", 0.0), ("placed_t", -INF), ("placed_t0", INF),
    )

    def __init__(self, *, atgt_s: float, predictor: LengthPredictor, tail: str | None, risk_mode: bool,
                 bucket_steps: int, horizon_steps: int, default_model: PerfModel,
                 models: Mapping[str, PerfModel]) -> None:
        self.atgt_s = atgt_s               # the default ATGT target (capacity_norm's units)
        self.predictor = predictor
        self.tail = tail
        self.risk_mode = risk_mode          # track the young decodes (slack="risk")
        self.bucket = int(bucket_steps)
        self.horizon_steps = int(horizon_steps)
        self.H = -(-self.horizon_steps // self.bucket) + 2    # KV ring length, in buckets
        self.default_model = default_model
        self.models: dict[str, PerfModel] = dict(models)
        self.rows: list[WorkerRow] = []
        self.index: dict[str, int] = {}
        self.req_row: dict[str, int] = {}
        self.groups: list[float] = []               # ATGT targets of the slack groups
        self.group_atgt = np.zeros(MAX_SLO_GROUPS)   # 0 for unused groups (their keys stay +inf)
        self.cap = 0
        self._grow(16)

    # --- storage ---------------------------------------------------------------------------------
    def _grow(self, cap: int) -> None:
        old = self.cap
        for name, fill in self._SCALARS:
            arr = np.full(cap, fill, dtype=float)
            if old:
                arr[:old] = getattr(self, name)
            setattr(self, name, arr)
        cur = np.zeros(cap, dtype=np.int64)
        minkey = np.full((cap, MAX_SLO_GROUPS), INF)
        kn, ka = np.zeros((cap, self.H)), np.zeros((cap, self.H))
        yg, yt, yT, ypos = np.zeros((cap, YOUNG)), np.zeros((cap, YOUNG)), np.zeros((cap, YOUNG)), np.zeros(cap, np.int64)
        if old:
            cur[:old], minkey[:old], kn[:old], ka[:old] = self.bucket_now, self.slack_key, self.kv_alive, self.kv_intercept
            yg[:old], yt[:old], yT[:old], ypos[:old] = (self.young_start_step, self.young_start_time, self.young_atgt,
                                                        self.young_next)
        self.bucket_now, self.slack_key, self.kv_alive, self.kv_intercept = cur, minkey, kn, ka
        # risk mode: (g0, t0, ATGT target) of each worker's most recently started decodes (target 0: empty)
        self.young_start_step, self.young_start_time, self.young_atgt, self.young_next = yg, yt, yT, ypos
        self.cap = cap

    def _new_row(self, worker_id: str, profile: str) -> int:
        r = len(self.rows)
        if r >= self.cap:
            self._grow(self.cap * 2)
        self.rows.append(WorkerRow(r, worker_id, profile))
        self.index[worker_id] = r
        self.apply_model(r, self.model_for(profile))
        return r

    def apply_model(self, r: int, m: PerfModel) -> None:
        t = self.atgt_s
        self.k1[r], self.c1[r], self.k2[r], self.c2[r], self.c3[r] = m.k1, m.c1, m.k2, m.c2, m.c3
        self.kv_per_token[r], self.kv_per_request[r], self.kv_capacity[r], self.max_batch[r] = (
            m.h, m.j, m.kv_capacity, m.max_batch)
        self.k1q[r], self.prefill_floor[r], self.chunk[r] = m.k1q, m.pf, m.chunk_tokens
        self.rmse_prefill[r] = m.fit[PREFILL].rmse if PREFILL in m.fit else 0.0
        self.rmse_decode[r] = m.fit[DECODE].rmse if DECODE in m.fit else 0.0
        # capacity_norm scales (deviation: normalised so heterogeneous workers compare).
        self.batch_scale[r] = max(m.batch_limit(t), 1.0)
        self.context_scale[r] = max(m.context_limit(1, t), 1.0)

    def model_for(self, profile: str) -> PerfModel:
        return self.models.get(profile, self.default_model)

    def set_model(self, profile: str, m: PerfModel) -> None:
        """Install a model for a profile; its workers use it from now on and earn their trust afresh."""
        self.models[profile] = m
        for row in self.rows:
            if row.profile == profile:
                self.apply_model(row.idx, m)
                self.miss_rate[row.idx] = 0.0

    def row_for_id(self, worker_id: str) -> int:
        r = self.index.get(worker_id)
        return self._new_row(worker_id, "") if r is None else r

    def rows_for_views(self, workers: Sequence[WorkerView]) -> np.ndarray:
        """Ledger rows of the candidates, with their engine-reported batch and KV usage recorded."""
        index, rows_ = self.index, self.rows
        rows: list[int] = []
        vb: list[float] = []
        vfull: list[float] = []
        vkv: list[float] = []
        for v in workers:
            r = index.get(v.id)
            if r is None or rows_[r].profile != v.profile:
                r = self._row_for_view(v)
            rows.append(r)
            vb.append(max(v.running + v.waiting, v.inflight))
            vfull.append(engine_full(v))
            vkv.append(v.kv_usage)
        idx = np.array(rows, dtype=np.intp)
        self.engine_batch[idx] = vb
        self.engine_full[idx] = vfull
        self._engine_kv(idx, np.array(vkv, dtype=float))
        return idx

    def _engine_kv(self, idx: np.ndarray, usage: np.ndarray) -> None:
        """Record the engines' reported KV usage; where it changed (a new scrape), the ledger's level at that
        moment is what the report is compared with (`kv_correction`)."""
        fresh = usage != self.engine_kv_usage[idx]
        if fresh.any():
            r = idx[fresh]
            s = self.bucket_now[r] % self.H
            self.kv_at_scrape[r] = self.kv_per_token[r] * self.step_clock[r] * self.kv_alive[r, s] + self.kv_intercept[r, s]
            self.engine_kv_usage[r] = usage[fresh]

    def kv_correction(self, rows: np.ndarray) -> np.ndarray:
        """Blocks to add to the ledger's KV demand of each row (negative: to take off), from the engine's report.

        The ledger counts every placed request's whole context; the engine holds a prefix that running requests
        share (a system prompt, vLLM's prefix caching) once, and holds what other gateway replicas placed. The
        difference between the engine's last report and the ledger's level at the moment of that report is
        both (principle 2 of docs/design.md: scraped metrics correct drift); placements since the report are in
        the ledger and not compared. No report (0: idle or not scraped): no correction downwards."""
        eng = self.engine_kv_usage[rows]
        diff = eng * self.kv_capacity[rows] - self.kv_at_scrape[rows]
        return np.where(eng > 0, diff, np.maximum(diff, 0.0))

    def _row_for_view(self, v: WorkerView) -> int:
        r = self.index.get(v.id)
        if r is None:
            r = self._new_row(v.id, v.profile)
        elif self.rows[r].profile != v.profile:
            self.rows[r].profile = v.profile
            self.apply_model(r, self.model_for(v.profile))
        self.engine_batch[r] = max(v.running + v.waiting, v.inflight)
        self.engine_full[r] = engine_full(v)
        self._engine_kv(np.array([r], dtype=np.intp), np.array([v.kv_usage], dtype=float))
        return r

    def group(self, t_dec: float) -> int:
        """The slack group of an ATGT target (at most MAX_SLO_GROUPS of them)."""
        try:
            return self.groups.index(t_dec)
        except ValueError:
            pass
        if len(self.groups) < MAX_SLO_GROUPS:
            self.groups.append(t_dec)
            self.group_atgt[len(self.groups) - 1] = t_dec
            return len(self.groups) - 1
        # Full: share the slack group of the closest stricter target (conservative), else the strictest.
        stricter = [(t, i) for i, t in enumerate(self.groups) if t <= t_dec]
        return max(stricter)[1] if stricter else min((t, i) for i, t in enumerate(self.groups))[1]

    # --- the clock -------------------------------------------------------------------------------
    def advance(self, rows: np.ndarray, now: float, repredict: bool = True) -> None:
        """Bring the workers' ledgers to `now`: the queued prefill runs first (it preempts decode), the
        requests whose prefill completed join the batch, then the decode clock runs for the rest."""
        t_prev = self.t_last[rows]
        dt = now - t_prev
        if not (dt > 0).any():
            return
        dt = np.where(dt > 0, np.minimum(dt, 1e9), 0.0)
        self.t_last[rows] = np.maximum(t_prev, now)
        k1 = self.k1[rows]
        c_prev = self.prefill_done[rows]
        consume = np.minimum(dt, np.maximum(self.prefill_queued[rows] - c_prev, 0.0) * k1)  # at 1/k1 tokens/s (eq. 2)
        c_new = c_prev + consume / k1
        self.prefill_done[rows] = c_new
        for i in np.nonzero(self.next_prefill_end[rows] <= c_new + 1e-9)[0]:
            t0 = float(t_prev[i]) if math.isfinite(t_prev[i]) else now
            self.start_prefilled(int(rows[i]), now, t0, float(c_prev[i]))
        n_dec = self.n_decoding[rows]
        g_prev = self.step_clock[rows]
        # eq. 3 in total-context form: k2·Σctx + c2·b + c3, with Σctx = Σl_in + Σ(G − g0 + 1)
        step = (self.k2[rows] * (self.sum_prompt_decoding[rows] + n_dec * (g_prev + 1.0) - self.sum_start_step[rows])
                + self.c2[rows] * n_dec + self.c3[rows])
        g_new = g_prev + np.where(n_dec > 0, (dt - consume) / step, 0.0)
        self.step_clock[rows] = g_new
        cur_old = self.bucket_now[rows]
        cur_new = np.floor(g_new / self.bucket).astype(np.int64)
        moved = np.nonzero(cur_new > cur_old)[0]
        if len(moved):
            self.bucket_now[rows] = cur_new
            for i in moved:
                self._clear_buckets(int(rows[i]), int(cur_old[i]), int(cur_new[i]))
        if repredict:
            for i in np.nonzero(self.next_predicted_end[rows] < g_new)[0]:
                self.repredict_due(int(rows[i]))

    def advance_one(self, r: int, now: float, repredict: bool = True) -> None:
        """`advance` for one worker, in scalar arithmetic (the per-event path: numpy's per-call overhead
        would dominate on arrays of one)."""
        t_prev = float(self.t_last[r])
        dt = now - t_prev
        if not dt > 0:
            return
        dt = min(dt, 1e9)
        self.t_last[r] = now
        k1 = float(self.k1[r])
        c_prev = float(self.prefill_done[r])
        consume = min(dt, max(float(self.prefill_queued[r]) - c_prev, 0.0) * k1)
        c_new = c_prev + consume / k1
        self.prefill_done[r] = c_new
        if self.next_prefill_end[r] <= c_new + 1e-9:
            self.start_prefilled(r, now, t_prev if math.isfinite(t_prev) else now, c_prev)
        if self.n_decoding[r] > 0:
            g_new = float(self.step_clock[r]) + (dt - consume) / self.step_time(r)
            self.step_clock[r] = g_new
            cur_old, cur_new = int(self.bucket_now[r]), int(g_new // self.bucket)
            if cur_new > cur_old:
                self.bucket_now[r] = cur_new
                self._clear_buckets(r, cur_old, cur_new)
            if repredict and self.next_predicted_end[r] < g_new:
                self.repredict_due(r)

    def _placed_work(self, r: int, work: float, now: float) -> None:
        """`work` prefill units were placed on row r at `now` (`add`)."""
        if not math.isfinite(now):
            return
        decay = math.exp(-max(now - float(self.placed_t[r]), 0.0) / RATE_WINDOW_S) if self.placed_t[r] > -INF else 0.0
        self.placed_rate[r] = float(self.placed_rate[r]) * decay + work / RATE_WINDOW_S
        self.placed_n[r] = float(self.placed_n[r]) * decay + 1.0 / RATE_WINDOW_S
        self.placed_t[r] = now
        self.placed_t0[r] = min(float(self.placed_t0[r]), now)

    def placed_rate_now(self, r: Any, now: float) -> tuple[Any, Any]:
        """The prefill work and the requests placed on row(s) r per second lately, at `now`: EWMAs over RATE_WINDOW_S,
        bias-corrected for a worker asked for less than that long (as Adam's moments are), so the rate is right
        from the first second of a burst, not RATE_WINDOW_S late (at least a tenth of the window counts)."""
        age = np.maximum(now - self.placed_t0[r], 0.1 * RATE_WINDOW_S)
        seen = -np.expm1(-age / RATE_WINDOW_S)
        k = np.exp(-np.maximum(now - self.placed_t[r], 0.0) / RATE_WINDOW_S) / seen
        return self.placed_rate[r] * k, self.placed_n[r] * k

    def step_time(self, r: int) -> float:
        """Eq. 3 at the worker's current batch and context."""
        n = self.n_decoding[r]
        ctx = self.sum_prompt_decoding[r] + n * (self.step_clock[r] + 1.0) - self.sum_start_step[r]
        return float(self.k2[r] * ctx + self.c2[r] * n + self.c3[r])

    def prefill_work(self, rows: np.ndarray | int, l_in: float, cached: np.ndarray | float) -> Any:
        """Prefill work of a prompt of l_in tokens of which `cached` are in the prefix cache, in linear-token
        units (perf_model's k1·l + k1q·l², the quadratic part over the uncached tokens' attention)."""
        return (l_in - cached) + self.k1q[rows] / self.k1[rows] * (l_in * l_in - cached * cached)

    def kv_now(self, r: int) -> float:
        s = int(self.bucket_now[r]) % self.H
        return float(self.kv_per_token[r] * self.step_clock[r] * self.kv_alive[r, s] + self.kv_intercept[r, s])

    # --- the KV ring (eq. 1's vector w over future decode steps) ------------------------------------
    def _clear_buckets(self, r: int, lo: int, hi: int) -> None:
        """Zero the ring slots of the past buckets [lo, hi)."""
        H = self.H
        if hi - lo >= H:
            self.kv_alive[r].fill(0.0)
            self.kv_intercept[r].fill(0.0)
            return
        a, b = lo % H, hi % H
        if a < b:
            self.kv_alive[r, a:b] = 0.0
            self.kv_intercept[r, a:b] = 0.0
        else:
            self.kv_alive[r, a:] = 0.0
            self.kv_intercept[r, a:] = 0.0
            self.kv_alive[r, :b] = 0.0
            self.kv_intercept[r, :b] = 0.0

    def _kv_add(self, r: int, lo: int, hi: int, a: float, sign: float) -> None:
        """Add (sign=+1) or remove (−1) one request's kv line over buckets [lo, hi] (absolute)."""
        if hi < lo:
            return
        H = self.H
        s, e = lo % H, hi % H + 1
        if hi - lo + 1 >= H:
            s, e = 0, H
        if s < e:
            self.kv_alive[r, s:e] += sign
            self.kv_intercept[r, s:e] += sign * a
        else:
            self.kv_alive[r, s:] += sign
            self.kv_intercept[r, s:] += sign * a
            self.kv_alive[r, :e] += sign
            self.kv_intercept[r, :e] += sign * a

    def _extend_kv(self, r: int, req: PlacedRequest) -> None:
        hi = min(int((req.g0 + req.lp - 1.0) // self.bucket), int(self.bucket_now[r]) + self.H - 1)
        if hi > req.kv_hi:
            self._kv_add(r, max(req.kv_hi + 1, int(self.bucket_now[r])), hi, req.a, 1.0)
            req.kv_hi = hi

    def _place_kv(self, r: int, req: PlacedRequest) -> None:
        req.a = self.kv_per_token[r] * (req.l_in - req.g0 + 1.0) + self.kv_per_request[r]  # kv(g) = h·(l_in + g − g0 + 1) + j
        req.kv_lo = int(req.g0 // self.bucket)
        req.kv_hi = req.kv_lo - 1
        self._extend_kv(r, req)

    def _unplace_kv(self, r: int, req: PlacedRequest) -> None:
        self._kv_add(r, max(req.kv_lo, int(self.bucket_now[r])), req.kv_hi, req.a, -1.0)

    # --- request life ------------------------------------------------------------------------------
    def add(self, r: int, req: PlacedRequest, cached: float) -> None:
        """A request dispatched to row r: queued behind the worker's prefill work, its KV placed over its
        predicted life."""
        row = self.rows[r]
        req.g0 = float(self.step_clock[r])
        work = self.prefill_work(r, float(req.l_in), cached)  # prefill work (perf_model)
        self.prefill_queued[r] += work
        self._placed_work(r, float(work), float(self.t_last[r]))   # the caller advanced the row to now
        req.pend_end = float(self.prefill_queued[r])
        row.pending.append(req)
        if len(row.pending) == 1:
            self.next_prefill_end[r] = req.pend_end
        row.reqs[req.rid] = req
        self.req_row[req.rid] = r
        self.n_requests[r] += 1
        self.sum_prompt[r] += req.l_in
        self.sum_predicted[r] += req.lp
        self.sum_variance[r] += req.var
        row.tcount[req.t_dec] = row.tcount.get(req.t_dec, 0) + 1
        self.min_atgt[r] = min(self.min_atgt[r], req.t_dec)
        self._place_kv(r, req)
        end = req.g0 + req.lp - 1.0
        heapq.heappush(row.ends, (end, req.version, req.rid))
        self.next_predicted_end[r] = min(self.next_predicted_end[r], end)

    def report(self, r: int, req: PlacedRequest, generated_tokens: int, now: float) -> None:
        """The caller saw `generated_tokens` of the request (the ledger has been advanced to `now`)."""
        req.reported = int(generated_tokens)
        if generated_tokens < 1:
            return
        g0 = float(self.step_clock[r]) - generated_tokens + 1.0
        if req.state == PENDING:
            self.force_prefilled(r, req, now)
            req.t0 = now - (generated_tokens - 1) * self.step_time(r)  # decoding began that long ago
            self._rekey(r, req, g0)
        elif abs(g0 - req.g0) >= 0.5:
            self._rekey(r, req, g0)
        self.repredict_due(r)

    def force_prefilled(self, r: int, req: PlacedRequest, now: float) -> None:
        """The request's first token exists, so the prefill queue up to it has drained."""
        self.prefill_done[r] = max(self.prefill_done[r], req.pend_end)
        self.start_prefilled(r, now, now, float(self.prefill_done[r]))

    def start_prefilled(self, r: int, now: float, t_prev: float, c_prev: float) -> None:
        """Requests whose place in the prefill queue has been consumed start decoding (at G, unchanged
        while the queue drained)."""
        row = self.rows[r]
        c = self.prefill_done[r]
        while row.pending and row.pending[0].pend_end <= c + 1e-9:
            req = row.pending.popleft()
            t0 = min(t_prev + max(req.pend_end - c_prev, 0.0) * self.k1[r], now)
            self._start_decode(r, req, t0)
        self.next_prefill_end[r] = row.pending[0].pend_end if row.pending else INF

    def _start_decode(self, r: int, req: PlacedRequest, t0: float) -> None:
        row = self.rows[r]
        req.state, req.t0 = DECODING, t0
        self.n_decoding[r] += 1
        self.sum_prompt_decoding[r] += req.l_in
        self.sum_start_step[r] += req.g0
        self._push_slack(row, req)
        if self.risk_mode:
            self._young_add(r, req)

    def _rekey(self, r: int, req: PlacedRequest, g0: float) -> None:
        row = self.rows[r]
        self._unplace_kv(r, req)
        if req.state == DECODING:
            self.sum_start_step[r] += g0 - req.g0
        req.version += 1
        req.g0 = g0
        self._place_kv(r, req)
        heapq.heappush(row.ends, (req.g0 + req.lp - 1.0, req.version, req.rid))
        if req.state == DECODING:
            self._push_slack(row, req)
            self._refresh_slack(row, req.grp)
            if req.yslot >= 0:
                self.young_start_step[r, req.yslot], self.young_start_time[r, req.yslot] = req.g0, req.t0

    def remove(self, r: int, req: PlacedRequest) -> None:
        """The request left the worker (completed, cancelled or moved)."""
        row = self.rows[r]
        if req.state == DECODING:
            self.n_decoding[r] -= 1
            self.sum_prompt_decoding[r] -= req.l_in
            self.sum_start_step[r] -= req.g0
        if req.yslot >= 0:
            self._young_drop(r, req)
        self._unplace_kv(r, req)
        del row.reqs[req.rid]
        self.req_row.pop(req.rid, None)
        req.version += 1
        self.n_requests[r] -= 1
        self.sum_prompt[r] -= req.l_in
        self.sum_predicted[r] -= req.lp
        self.sum_variance[r] -= req.var
        left = row.tcount[req.t_dec] - 1
        if left:
            row.tcount[req.t_dec] = left
        else:
            del row.tcount[req.t_dec]
            self.min_atgt[r] = min(row.tcount) if row.tcount else INF
        if not row.reqs:  # exact zeros: no drift of float sums over long runs
            for arr in (self.n_requests, self.sum_prompt, self.sum_predicted, self.sum_variance, self.n_decoding,
                        self.sum_prompt_decoding, self.sum_start_step):
                arr[r] = 0.0
        if req.state == DECODING:
            self._refresh_slack(row, req.grp)
        self._refresh_ends(r)
        self._compact(row)

    def _compact(self, row: WorkerRow) -> None:
        """Drop stale heap entries (lazy deletion leaves them below the top) once they outnumber the live."""
        live = len(row.reqs)
        if len(row.ends) > 2 * live + 64:
            row.ends = [e for e in row.ends if (q := row.reqs.get(e[2])) is not None and q.version == e[1]]
            heapq.heapify(row.ends)
        for grp, heap in row.heaps.items():
            if len(heap) > 2 * live + 64:
                heap[:] = [e for e in heap if (q := row.reqs.get(e[2])) is not None and q.version == e[1]
                           and q.state == DECODING and q.grp == grp]
                heapq.heapify(heap)

    # --- young decodes (risk mode) -----------------------------------------------------------------
    def _young_add(self, r: int, req: PlacedRequest) -> None:
        """Risk mode: the request takes the oldest of the worker's young slots."""
        row = self.rows[r]
        s = int(self.young_next[r]) % YOUNG
        self.young_next[r] += 1
        prev = row.young[s]
        if prev is not None and (q := row.reqs.get(prev)) is not None:
            q.yslot = -1
        row.young[s] = req.rid
        req.yslot = s
        self.young_start_step[r, s], self.young_start_time[r, s], self.young_atgt[r, s] = req.g0, req.t0, req.t_dec

    def _young_drop(self, r: int, req: PlacedRequest) -> None:
        s = req.yslot
        if s >= 0 and self.rows[r].young[s] == req.rid:
            self.rows[r].young[s] = None
            self.young_atgt[r, s] = 0.0
        req.yslot = -1

    # --- slack keys (constraint (d)) -----------------------------------------------------------------
    def _push_slack(self, row: WorkerRow, req: PlacedRequest) -> None:
        # slack_k(t) = T·l_out − t_dec = T·(G − g0 + 1) − (t − t0) = T·(G + 1) − t + (t0 − T·g0)
        key = req.t0 - self.group_atgt[req.grp] * req.g0
        heapq.heappush(row.heaps.setdefault(req.grp, []), (key, req.version, req.rid))
        if key < self.slack_key[row.idx, req.grp]:
            self.slack_key[row.idx, req.grp] = key

    def _refresh_slack(self, row: WorkerRow, grp: int) -> None:
        heap = row.heaps.get(grp)
        while heap:
            req = row.reqs.get(heap[0][2])
            if req is not None and req.version == heap[0][1] and req.state == DECODING:
                break
            heapq.heappop(heap)
        self.slack_key[row.idx, grp] = heap[0][0] if heap else INF

    # --- re-prediction (appendix C) ----------------------------------------------------------------
    def repredict_due(self, r: int) -> None:
        """Re-predict the requests whose predicted end the decode clock has passed."""
        row = self.rows[r]
        g = self.step_clock[r]
        while row.ends and row.ends[0][0] < g:
            _, ver, rid = heapq.heappop(row.ends)
            req = row.reqs.get(rid)
            if req is not None and req.version == ver and req.state == DECODING and not req.exhausted:
                self._repredict(r, req)
        self._refresh_ends(r)

    def _refresh_ends(self, r: int) -> None:
        row = self.rows[r]
        ends = row.ends
        while ends:
            req = row.reqs.get(ends[0][2])
            if req is not None and req.version == ends[0][1] and not req.exhausted:
                break
            heapq.heappop(ends)
        self.next_predicted_end[r] = ends[0][0] if ends else INF

    def _repredict(self, r: int, req: PlacedRequest) -> None:
        """Appendix C: the request outlived its prediction; predict E[L | L > l_pred] (bounded).

        Conditioned on the moment it outlived the prediction, not on when the ledger noticed, so the
        result does not depend on how often the clock is advanced; `repredict_due` repeats it while the
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
        self.sum_predicted[r] += new - req.lp
        self.sum_variance[r] += var - req.var
        req.lp, req.var = new, var
        self._extend_kv(r, req)
        heapq.heappush(self.rows[r].ends, (req.g0 + req.lp - 1.0, req.version, req.rid))
