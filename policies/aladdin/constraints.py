"""The constraints of Aladdin's placement MIP (section 4.2) for one request against every candidate worker.

  (b) ATGT   Σ(l_in + γ·l_out) + (l_in_j + γ·l_pred_j) <= θ·l_d(b + 1)           (eq. 4, strictness γ)
  (c) TTFT   t_pre(pending prefill tokens + l_in_j) <= T_pre                       (eq. 2)
  (d) slack  t_pre(pending + l_in_j) <= θ·min_k (T_dec·l_out_k − t_dec_k)          over ongoing decodes
  (e) KV     max over future decode steps of Σ w_k + w_j <= M                      (the vector w, eq. 1)

tail="cantelli"/"normal" replaces the point estimates by μ + γ(τ)·σ with the violation budget δ split over
the busy workers (section 4.3, appendix F). The choices beyond the paper ((d)'s risk mode, (c)'s wait and
chunk terms, cache pricing) are described in the package docstring (policies/aladdin/__init__.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from policies.aladdin.affinity import SessionCache
from policies.aladdin.ledger import INF, Ledger
from policies.perf_model import prefill_free_share
from policies.slo_targets import SloTarget, target_for
from policies.tail import split_budget, tail_factor
from policies.types import NO_CACHED_PREFIX, RequestFeatures, WorkerView

# Constraint (d) modes: "paper" is Aladdin's θ·min(T_dec·l_out − t_dec), the slack saved so far;
# "lifetime" adds a lower bound on the slack still to come (a worker with only young requests is not
# closed to new prompts); "risk" bounds the expected ATGT misses the prefill causes; "off" skips (d).
SLACK_PAPER, SLACK_LIFETIME, SLACK_RISK, SLACK_OFF = "paper", "lifetime", "risk", "off"
SLACK_MODES = (SLACK_PAPER, SLACK_LIFETIME, SLACK_RISK, SLACK_OFF)
MIN_SAMPLES = 32        # risk mode: fewer completed lengths than this -> the lifetime rule
FAR = 1e12              # "never recovers", in tokens

# Constraint names, as counted in `last_rejections`.
C_ATGT, C_TTFT, C_SLACK, C_KV = "atgt", "ttft", "prefill_slack", "kv"


@dataclass(slots=True)
class Feasibility:
    """One request against the candidate rows: the outcome of (b)-(e) and what the choice rules read.

    ok: (b)-(e) hold; norm: capacity_norm (section 4.2, per capacity); head: the smallest relative headroom
    over the constraints after the placement; base: (b) and (c) hold (risk mode's fallback candidates);
    later: (b) holds and the TTFT still would after `deadline_margin_s` more; risk: the expected ATGT misses
    of (d)'s risk mode (0/1 in the other modes); ttft: the predicted TTFT per row; ttft_reachable: some
    row meets the TTFT, or waiting does not count against it; the request's inputs l_in, lp (predicted
    output), var (its variance) and z (the tail factor)."""

    ok: np.ndarray
    norm: np.ndarray
    head: np.ndarray
    rejections: dict[str, int]
    ttft_reachable: bool
    l_in: float
    lp: float
    var: float
    z: float
    base: np.ndarray | None = None
    later: np.ndarray | None = None
    risk: np.ndarray | None = None
    ttft: np.ndarray | None = None
    terms: TtftTerms | None = None


@dataclass(slots=True)
class TtftTerms:
    """(c)'s TTFT estimate per candidate row, term by term (bench/aladdin_estimates.py logs them next to what
    the engine then did): waited + queued_s + own_s + interference_s (+ the tail term). queued_s: the prefill
    work already placed there and not yet done (eq. 2, c1 included); own_s: the request's own (uncached) prefill;
    interference_s: the decode steps batched with its prefill chunks; decode_step_s: eq. 3 at the current batch
    (n_decoding requests); queued_tokens: the queued work in linear-token units; slot_s: the wait for a batch
    slot on a worker already holding max_batch (vLLM's max_num_seqs) requests (`slot_wait`)."""

    waited: float
    queued_s: np.ndarray
    own_s: np.ndarray
    interference_s: np.ndarray
    decode_step_s: np.ndarray
    n_decoding: np.ndarray
    queued_tokens: np.ndarray
    slot_s: np.ndarray


@dataclass(slots=True)
class Constraints:
    """The constraints' parameters (AladdinPolicy's arguments of the same names) over one ledger."""

    ledger: Ledger
    slo: SloTarget
    gamma: float
    theta: float
    tail: str | None
    delta: float
    slack: str
    chunk: int
    count_wait: bool
    stall_risk: float
    deadline_margin_s: float
    use_predictor: bool
    price_cache: bool
    sessions: SessionCache | None = None
    _cdf_cache: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict)

    # --- per-request inputs ----------------------------------------------------------------------
    def predicted(self, request: RequestFeatures) -> tuple[float, float]:
        """The request's predicted output length (bounded by max_tokens and the horizon) and its variance."""
        predictor, horizon = self.ledger.predictor, self.ledger.horizon_steps
        cap = horizon if request.max_tokens is None else min(request.max_tokens, horizon)
        lp = float(request.predicted_output_tokens)
        if self.use_predictor or not math.isfinite(lp) or lp <= 0:  # a bad value must not poison the sums
            lp = predictor.predict(request.model, request.prompt_tokens, request.max_tokens)
        lp = min(max(lp, 1.0), float(max(cap, 1)))
        var = predictor.predict_std(request.model, request.prompt_tokens) ** 2 if self.tail else 0.0
        return lp, var

    def prefix_view(self, request: RequestFeatures) -> Mapping[str, int]:
        """Worker -> prompt tokens its prefix cache holds for the request: the KV-event view where the caller has
        one, else where its conversation's last turn ran (policies/aladdin/affinity.py)."""
        view = request.cached_prefix_tokens
        if view is NO_CACHED_PREFIX and self.sessions is not None:
            return self.sessions.view(request)
        return view

    def cached_for(self, request: RequestFeatures, workers: list[WorkerView] | tuple[WorkerView, ...]
                   ) -> np.ndarray | float:
        """Prompt tokens each candidate's prefix cache holds for the request (0 without cache pricing)."""
        view = self.prefix_view(request) if self.price_cache else None
        if not view:
            return 0.0
        top = max(int(request.prompt_tokens), 0)
        return np.array([min(max(int(view.get(w.id, 0)), 0), top) for w in workers], dtype=float)

    def waited(self, request: RequestFeatures, now: float) -> float:
        """Time the request already spent waiting for a placement (it counts against its TTFT)."""
        if not self.count_wait or not request.arrival > 0:
            return 0.0
        return max(now - request.arrival, 0.0)

    # --- the TTFT estimate ((c), and the admission rule of policies/shedding.py) -------------------------
    def ttft(self, request: RequestFeatures, rows: np.ndarray, now: float, cached: np.ndarray | float = 0.0,
             l_in: float | None = None, b_now: np.ndarray | None = None, slots: bool = True
             ) -> tuple[np.ndarray, TtftTerms, np.ndarray | float, np.ndarray | float]:
        """The request's predicted TTFT on each candidate row (point estimate, no tail term), its terms, its
        prefill work and its uncached prompt tokens per row. The one TTFT estimate of the code base: (c) reads
        it, and so does the admission rule that sheds what will miss (policies/shedding.py) for every policy.

        eq. 2 over the prefill work queued there plus the request's own (its uncached part), plus what it
        waited already, the decode step in flight and, in every prefill chunk, the ongoing decodes (vLLM V1
        batches them with the chunk: (chunks + 1) decode steps of eq. 3), plus the wait for a batch slot when
        the worker's engine runs as many requests as it can at once (`slot_wait`; `slots` False leaves it out:
        aladdin's own (b) and (e) keep a worker it would place on below that point, so (c) does not repeat it).
        `b_now`: the batch the caller counts (ledger or engine report, the larger), default that."""
        led = self.ledger
        if l_in is None:
            l_in = float(max(request.prompt_tokens, 0))
        if b_now is None:
            b_now = np.maximum(led.n_requests[rows], led.engine_batch[rows])
        k1, c1, c3 = led.k1[rows], led.c1[rows], led.c3[rows]
        queued = np.maximum(led.prefill_queued[rows] - led.prefill_done[rows], 0.0)  # prefill work, linear-token units
        work = led.prefill_work(rows, l_in, cached)   # the uncached part (price_cache) or all of it
        l_new = l_in - cached
        pre = c1 + np.maximum(led.prefill_floor[rows], k1 * (queued + work))    # eq. 2 over queued + new
        n_dec = led.n_decoding[rows]
        t_d = np.where(n_dec > 0, led.k2[rows] * (led.sum_prompt_decoding[rows] + n_dec * (led.step_clock[rows] + 1.0)
                                                  - led.sum_start_step[rows]) + led.c2[rows] * n_dec + c3, 0.0)
        waited = self.waited(request, now)
        chunk = self.chunks(rows)
        # A chunk's step streams the weights once for the prefill and the decodes batched with it (eq. 3's c3 is
        # in the prefill's k1 already): each chunk adds the decodes' share, t_d − c3; the step in flight, t_d.
        inter = np.ceil((queued + l_new) / chunk) * np.maximum(t_d - c3, 0.0) + t_d
        slot = self.slot_wait(rows, b_now) if slots else np.zeros(len(rows))
        q_s = c1 + k1 * queued
        return (waited + pre + inter + slot, TtftTerms(waited, q_s, pre - q_s, inter, t_d, n_dec, queued, slot),
                work, l_new)

    def slot_wait(self, rows: np.ndarray, b_now: np.ndarray) -> np.ndarray:
        """How long a request waits for a batch slot on a worker that holds b_now requests when the engine runs
        at most `slots` of them at once (`slots`). The (b_now + 1 − slots) requests ahead of it must complete
        first, and the worker completes one per unit of work: its prefill (eq. 2 at the mean prompt) plus its
        share of the decode steps of a full batch (its predicted output times eq. 3 at `slots` and the mean
        mid-life context, over `slots`). 0 while a slot is free: vLLM schedules it at once."""
        led = self.ledger
        n = led.n_requests[rows]
        nn = np.maximum(n, 1.0)
        l_in, lp = led.sum_prompt[rows] / nn, led.sum_predicted[rows] / nn
        slots = self.slots(rows, n, l_in, lp)
        over = b_now + 1.0 - slots
        if not (over > 0).any():
            return np.zeros(len(rows))
        step = led.k2[rows] * slots * (l_in + lp / 2.0) + led.c2[rows] * slots + led.c3[rows]   # eq. 3, full batch
        work = led.c1[rows] + led.k1[rows] * l_in + lp * step / slots
        return np.where(over > 0, over * work, 0.0)

    def paced_atgt(self, request: RequestFeatures, rows: np.ndarray, now: float, b_now: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The request's predicted ATGT on each row once it joins the batch (b = b_now + 1, at most the slots the
        engine runs at once, `slots`): eq. 3 at that batch and its mean mid-life context, t_d(b), stretched by
        the prefills that keep arriving (the ledger's `placed_rate_now`: ρ prefill work units and λ requests
        placed there per second lately; the request's own prefill comes before its first token).

        Under chunked prefill a step that carries prefill tokens costs their compute, k1 each (eq. 2's slope,
        `stall`), and is compute-bound: the weights' streaming time (eq. 2's prefill floor pf) is hidden under
        the compute, and each decode batched with it costs one token of compute too, k1, not eq. 3's
        memory-bound c2. Such a step costs its decodes t_m = t_d − pf + (k1 − c2)·b. Over a time T with N
        decode steps, of which N_m carry prefill: T = N·t_d − N_m·(t_d − t_m) + k1·ρ·T. When prefills are rarer
        than steps (N_m = λ·T) this is ATGT = T/N = t_d / (1 − k1·ρ + λ·(t_d − t_m)); when every step carries
        one (N_m = N, as soon as λ·ATGT >= 1), t_m / (1 − k1·ρ). No step takes longer than one that carries a
        full chunk (vLLM's max_num_batched_tokens, `chunks`, less the batch's decode tokens): t_m + k1·(chunk − b)
        bounds the ATGT however fast prefills arrive (past that rate they queue and cost TTFTs, not decode steps;
        without the bound a burst's rate, k1·ρ near 1, predicted ATGTs of seconds where a full-chunk step takes
        0.2 s). Returns (ATGT, b, slope, free) with t_d(b) = c3 + b·slope and ATGT = t_d(b) / free: the caller can
        solve for the batch a target allows."""
        led = self.ledger
        if b_now is None:
            b_now = np.maximum(led.n_requests[rows], led.engine_batch[rows])
        lp_new, _ = self.predicted(request)
        n = led.n_requests[rows] + 1.0
        l_in = (led.sum_prompt[rows] + float(max(request.prompt_tokens, 0))) / n
        lp = (led.sum_predicted[rows] + lp_new) / n
        b = np.minimum(b_now + 1.0, self.slots(rows, n, l_in, lp))
        slope = led.k2[rows] * (l_in + lp / 2.0) + led.c2[rows]
        t_d = led.c3[rows] + b * slope
        k1 = led.k1[rows]
        t_m = t_d - np.minimum(led.prefill_floor[rows], led.c3[rows]) + np.maximum(k1 - led.c2[rows], 0.0) * b
        rho, lam = led.placed_rate_now(rows, now)
        busy = prefill_free_share(k1, rho)     # the share of time not spent on prefill compute
        every = t_m / busy
        atgt = np.where(lam * every >= 1.0, every, t_d / np.maximum(busy + lam * (t_d - t_m), 1e-3))
        full = t_m + k1 * np.maximum(self.chunks(rows) - b, 0.0)    # a step with a full chunk of prefill
        atgt = np.maximum(np.minimum(atgt, full), t_d)
        return atgt, b, slope, t_d / atgt

    def slots(self, rows: np.ndarray, n: np.ndarray, l_in: np.ndarray, lp: np.ndarray) -> np.ndarray:
        """How many requests each row's engine runs at once: max_batch (vLLM's max_num_seqs) or as many as its KV
        cache holds at `n` requests' mean size (eq. 1: h·(l_in + l_out) + j blocks each, M in all, less the share
        of prefix blocks the engine's KV report says they hold in common), the fewer.
        An engine that reported requests waiting with its KV cache full holds no more than it ran then
        (`engine_full`: the scrape corrects the predicted sizes, which run short while the length predictor is
        young)."""
        led = self.ledger
        kv_each = led.kv_per_token[rows] * (l_in + lp) + led.kv_per_request[rows]
        # The engine holds a prefix its requests share (a system prompt, a conversation's earlier turns) once: its
        # KV report against the ledger's level (`Ledger.kv_correction`) scales the predicted size down.
        slot = led.bucket_now[rows] % led.H
        level = led.kv_per_token[rows] * led.step_clock[rows] * led.kv_alive[rows, slot] + led.kv_intercept[rows, slot]
        shared = np.divide(level + led.kv_correction(rows), level, out=np.ones(len(rows)), where=level > 0)
        kv_each = kv_each * np.clip(shared, 0.05, 1.0)
        by_kv = np.divide(led.kv_capacity[rows], kv_each, out=np.full(len(rows), INF), where=(n > 0) & (kv_each > 0))
        slots = np.minimum(led.max_batch[rows], by_kv)
        full = led.engine_full[rows]
        return np.maximum(np.where(full > 0, np.minimum(slots, full), slots), 1.0)

    # --- the constraints ---------------------------------------------------------------------------
    def fits_alone(self, request: RequestFeatures, rows: np.ndarray, cached: np.ndarray | float = 0.0) -> np.ndarray:
        """Constraints (b), (c), (e) for the request on an empty worker of each candidate's profile."""
        led = self.ledger
        slo = target_for(request, self.slo)
        l_in = float(max(request.prompt_tokens, 0))
        lp, _ = self.predicted(request)
        k2, c2, c3 = led.k2[rows], led.c2[rows], led.c3[rows]
        ok_b = l_in + self.gamma * lp <= self.theta * (slo.atgt_s - c2 - c3) / k2           # eq. 4, b = 1
        pre = led.c1[rows] + np.maximum(led.prefill_floor[rows], led.k1[rows] * led.prefill_work(rows, l_in, cached))
        ok_c = pre <= slo.ttft_s                                                             # eq. 2
        ok_e = led.kv_per_token[rows] * (l_in + lp) + led.kv_per_request[rows] <= led.kv_capacity[rows]  # eq. 1
        return ok_b & ok_c & ok_e

    def feasible(self, request: RequestFeatures, rows: np.ndarray, now: float, check_ttft: bool = True,
                 cached: np.ndarray | float = 0.0) -> Feasibility:
        """Constraints (b)-(e) for every candidate row at once, and their capacity_norm; `cached`: the prompt
        tokens each row's prefix cache holds (`cached_for`)."""
        led = self.ledger
        g, th = self.gamma, self.theta
        slo = target_for(request, self.slo)
        l_in = float(max(request.prompt_tokens, 0))
        lp, var = self.predicted(request)
        n_all = led.n_requests[rows]
        k2, c2, c3 = led.k2[rows], led.c2[rows], led.c3[rows]
        ctx = led.sum_prompt[rows] + g * led.sum_predicted[rows]
        # capacity_norm (section 4.2): L2 norm of batch size and Σ(l_in + γ·l_out), here per capacity.
        norm = np.hypot(n_all / led.batch_scale[rows], ctx / led.context_scale[rows])

        # Engine-reported load beyond the ledger (other gateway replicas): same mean context each.
        b_now = np.maximum(n_all, led.engine_batch[rows])
        new_ctx = l_in + g * lp
        per = np.where(n_all > 0, ctx / np.maximum(n_all, 1.0), new_ctx)
        ctx_tot = ctx + (b_now - n_all) * per + new_ctx
        b = b_now + 1.0
        t_dec = np.minimum(led.min_atgt[rows], slo.atgt_s)
        limit = th * (t_dec - c2 * b - c3) / k2                       # (b) via eq. 4
        ttft, terms, work, l_new = self.ttft(request, rows, now, cached, l_in, b_now, slots=False)
        queued, t_d, pre = terms.queued_tokens, terms.decode_step_s, terms.queued_s + terms.own_s
        z = 0.0
        if self.tail:                                                  # section 4.3, appendix F
            busy = int(np.count_nonzero(n_all)) + 1
            z = tail_factor(self.tail, split_budget(self.delta, busy))
            ctx_tot = ctx_tot + z * np.sqrt(g * g * (led.sum_variance[rows] + var) + (led.rmse_decode[rows] / k2) ** 2)
            pre = pre + z * led.rmse_prefill[rows]
            ttft = ttft + z * led.rmse_prefill[rows]
        ok_b = (ctx_tot <= limit) & (b <= led.max_batch[rows])
        ok_c = ttft <= slo.ttft_s if check_ttft else np.ones(len(rows), dtype=bool)  # (c)
        # Waiting never helps a TTFT that counts the wait (queued prefill drains at most as fast as it grows).
        reachable = bool(ok_c.any()) or not (self.count_wait and request.arrival > 0)
        if self.slack != SLACK_OFF:                                    # (d)
            G = led.step_clock[rows]
            slack = (led.group_atgt * (G + 1.0)[:, None] - now + led.slack_key[rows]).min(axis=1)
            F = self.length_cdf(request.model) if self.slack == SLACK_RISK else None
            if F is not None:
                risk = self.stall_risk_of(F, rows, now, self.stall(rows, queued, work) / th, queued, t_d, l_in,
                                          slo.atgt_s, l_new)
                ok_d = risk <= self.stall_risk
            else:
                if self.slack in (SLACK_LIFETIME, SLACK_RISK):  # risk mode without length data: lifetime
                    slack = slack + self.future_slack(rows, G)
                else:  # the MIP's ongoing requests include placed ones not decoding yet: l_out = t_dec = 0
                    slack = np.where(queued > 0, np.minimum(slack, 0.0), slack)
                ok_d = self.stall(rows, queued, work) <= th * slack
                risk = np.where(ok_d, 0.0, 1.0)
        else:
            ok_d = np.ones(len(rows), dtype=bool)
        out = Feasibility(ok=ok_b & ok_c & ok_d, norm=norm, head=norm, rejections={}, ttft_reachable=reachable,
                          l_in=l_in, lp=lp, var=var, z=z, terms=terms)
        if self.slack == SLACK_RISK:
            out.base, out.risk, out.ttft = ok_b & ok_c, risk, ttft
            out.later = ok_b & (ttft + self.deadline_margin_s <= slo.ttft_s) if check_ttft else ok_b
        ok = out.ok
        rej = {C_ATGT: int(np.count_nonzero(~ok_b)), C_TTFT: int(np.count_nonzero(~ok_c)),
               C_SLACK: int(np.count_nonzero(~ok_d)), C_KV: 0}
        # Headroom after the placement: the smallest relative slack over (b), (c), (d) and the batch limit.
        head = np.minimum(1.0 - ctx_tot / np.maximum(limit, 1e-9), 1.0 - b / led.max_batch[rows])
        if check_ttft:
            head = np.minimum(head, 1.0 - ttft / slo.ttft_s)
        if self.slack == SLACK_RISK and self.stall_risk > 0:
            head = np.minimum(head, 1.0 - risk / self.stall_risk)
        idx = np.nonzero(ok)[0]
        if len(idx):
            ok_e, kv_head = self.kv_fits(rows[idx], l_in, lp, var, z)
            ok[idx] = ok_e
            rej[C_KV] = int(np.count_nonzero(~ok_e))
            head[idx] = np.minimum(head[idx], kv_head)
        out.head, out.rejections = head, rej
        return out

    def chunks(self, rows: np.ndarray) -> np.ndarray:
        """The prefill chunk of each row's engine (its model's chunk_tokens: vLLM's max_num_batched_tokens), else
        `prefill_chunk_tokens`."""
        c = self.ledger.chunk[rows]
        return np.where(c > 0, c, float(self.chunk))

    def stall(self, rows: np.ndarray, queued: np.ndarray, work: np.ndarray | float) -> np.ndarray:
        """How long the prefills queued on each row plus the new one delay its ongoing decodes: (d)'s t_pre.

        The paper's engine stops decoding for a whole prefill, eq. 2 with its per-request constant c1. vLLM V1
        (chunked prefill) batches the decodes with every chunk instead, so each decode step that carries a
        chunk is longer by the chunk's compute, k1 per token (eq. 2's slope; the weights are streamed for the
        decodes anyway) and c1 (the server's per-request overhead before the engine sees the prompt) stalls
        no decode."""
        return self.ledger.k1[rows] * (queued + work)

    def stall_risk_of(self, F: np.ndarray, rows: np.ndarray, now: float, need: np.ndarray,
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
        led = self.ledger
        n = len(rows)
        n_dec = led.n_decoding[rows]
        step = np.where(n_dec > 0, t_d, led.c3[rows]) + led.k2[rows] * l_in + led.c2[rows]
        gain = np.minimum(led.min_atgt[rows], t_slo) - step
        inv_gain = np.where(gain > 0, 1.0 / np.maximum(gain, 1e-12), FAR)  # no saving: a deficit stays
        risk = np.zeros(n)
        # The young decodes: saved slack S = T·l_out − t_dec; only those short of `need` are at risk.
        T = led.young_atgt[rows]
        gen = led.step_clock[rows][:, None] - led.young_start_step[rows] + 1.0
        deficit = need[:, None] - (T * gen - (now - led.young_start_time[rows]))
        ri, ci = np.nonzero((T > 0) & (deficit > 0))
        if len(ri):
            p = cond_cdf(F, np.maximum(gen[ri, ci], 1.0), deficit[ri, ci] * inv_gain[ri])
            risk += np.bincount(ri, weights=p, minlength=n)
        # The not yet started requests (S = 0, one token): stalled by the prompt beyond their last chunk.
        pend = led.n_requests[rows] - n_dec
        chunk = self.chunks(rows)
        beyond = queued + l_new - np.ceil(queued / chunk) * chunk
        pi = np.nonzero((pend > 0) & (beyond > 0))[0]
        if len(pi):
            x = led.k1[rows[pi]] * beyond[pi] / self.theta * inv_gain[pi]
            risk[pi] += pend[pi] * cond_cdf(F, np.ones(len(pi)), x)
        return risk

    def length_cdf(self, model: str) -> np.ndarray | None:
        """Sorted recent output lengths of `model` (the predictor's model-wide ring), cached."""
        st = getattr(self.ledger.predictor, "_models", {}).get(model)  # LengthPredictor keeps them per model
        if st is None or st.filled < MIN_SAMPLES:
            return None
        cached = self._cdf_cache.get(model)
        if cached is None or st.n - cached[0] >= 64:
            cached = (st.n, np.sort(st.samples()))
            self._cdf_cache[model] = cached
        return cached[1]

    def future_slack(self, rows: np.ndarray, G: np.ndarray) -> np.ndarray:
        """A lower bound on the slack ongoing requests will still save before they end: every one has
        at least min_k(remaining steps) steps left, each saving T_dec − t_d (eq. 3 at the current batch).
        Stalls already suffered are in the saved-so-far part, so the future part is not promised twice."""
        led = self.ledger
        n = led.n_decoding[rows]
        step = (led.k2[rows] * (led.sum_prompt_decoding[rows] + n * (G + 1.0) - led.sum_start_step[rows])
                + led.c2[rows] * n + led.c3[rows])
        gain = np.maximum(led.min_atgt[rows] - step, 0.0)
        remaining = np.maximum(led.next_predicted_end[rows] - G, 0.0)
        return np.where(np.isfinite(remaining) & np.isfinite(gain), remaining * gain, 0.0)

    def kv_fits(self, rs: np.ndarray, l_in: float, lp: float, var: float, z: float) -> tuple[np.ndarray, np.ndarray]:
        """(e): the new request's w added to each worker's future KV demand stays within M at every step;
        also the relative KV headroom (1 − peak / M) per row."""
        led = self.ledger
        B, H = led.bucket, led.H
        G, cur, h, j, M = led.step_clock[rs], led.bucket_now[rs], led.kv_per_token[rs], led.kv_per_request[rs], led.kv_capacity[rs]
        e_new = G + lp - 1.0
        nb = np.clip(np.floor(e_new / B).astype(np.int64) - cur + 1, 1, H)
        offs = np.arange(int(nb.max()))
        babs = cur[:, None] + offs[None, :]
        slot = babs % H
        N = led.kv_alive[rs[:, None], slot]
        A = led.kv_intercept[rs[:, None], slot]
        g_end = ((babs + 1) * B - 1).astype(float)
        hh = h[:, None]
        new = hh * (l_in + np.minimum(g_end, e_new[:, None]) - G[:, None] + 1.0) + j[:, None]
        demand = np.where(offs[None, :] < nb[:, None], hh * g_end * N + A + new, -INF)
        peak = demand.max(axis=1)
        # The engine's own KV usage against the ledger's (traffic the ledger does not see; shared prefixes).
        peak += led.kv_correction(rs)
        if z:
            peak += z * h * np.sqrt(led.sum_variance[rs] + var)
        return peak <= M, 1.0 - peak / M


def cond_cdf(sorted_lengths: np.ndarray, gen: np.ndarray, x: np.ndarray) -> np.ndarray:
    """P(L < g + x | L >= g) from sorted samples of L (0 where x <= 0; 0 for g beyond every sample)."""
    f_g = np.searchsorted(sorted_lengths, gen, side="left")
    f_gx = np.searchsorted(sorted_lengths, gen + np.clip(x, 0.0, FAR), side="left")
    return (f_gx - f_g) / np.maximum(len(sorted_lengths) - f_g, 1)
