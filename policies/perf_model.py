"""Per-worker-profile performance models and their online, robust fitter.

Aladdin (joint placement and scaling) section 3:
    eq. 1  KV blocks of a request    kv   = h·(l_in + l_out) + j
    eq. 2  prefill iteration time    t_pre = k1·Σl_in + c1
           extended here: t_pre = c1 + max(pf, k1·Σl_in + k1q·Σl_in²)  (see `prefill_time`)
    eq. 3  decode iteration time     t_d  = (k2·l_avg + c2)·b + c3          (= k2·Σctx + c2·b + c3)
    eq. 4  context limit for ATGT T  l_d(b) = (T − c2·b − c3) / k2
Heterogeneous-cluster paper section 3.1.2 (per instance s, batch of b requests, input I, output O):
    eq. 3  T_prefill = p1·b·I + p2·b + p3·I + p4
    eq. 4  T_decode  = Σ_{k=1..O} [p5·b·(I+k) + p6·b + p7·(I+k) + p8]
The Aladdin form maps onto the hetero form with p = (k1, 0, 0, c1, k2, c2, 0, c3), which is what a
model uses until the hetero form has been fitted on its own.

Prefill beyond eq. 2 (linear in the prompt): causal attention makes a prompt of l tokens cost Σ over its
pairs of (query, key) positions, l²/2 pairs, so long prompts grow quadratically (FlashAttention's cost
model; at 64k tokens on Llama-3-8B the quadratic part is ~60% of the prefill). `k1q` is that cost per
token² (= k_attn/2 in the simulator's step model), summed per prompt: a queue of prompts costs
k1·Σl + k1q·Σl². `pf` is the floor of a short prompt's pass: a forward pass streams all weights once,
so a prompt of a few tokens costs what a few hundred do (the memory-bound regime); the prediction is
c1 + max(pf, k1·Σl + k1q·Σl²). The hetero form gains the same term: T_prefill += k1q·b·I².

KV is counted in engine blocks (vLLM `num_gpu_blocks`, 16 tokens each by default), so `kv_capacity`
is the worker's M in Aladdin's constraint (e). All times are seconds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

# Components a model carries, each with its own fit statistics.
PREFILL, DECODE, KV, HETERO_PREFILL, HETERO_DECODE = "prefill", "decode", "kv", "hetero_prefill", "hetero_decode"
COMPONENTS = (PREFILL, DECODE, KV, HETERO_PREFILL, HETERO_DECODE)

_COEF_NAMES = ("k1", "c1", "k2", "c2", "c3", "h", "j", "k1q", "pf")


@dataclass(slots=True)
class ComponentFit:
    """How well one component fits its observations (after blending with the prior)."""

    n: int = 0             # observations used
    rmse: float = 0.0      # root mean square error, in the component's unit (seconds or blocks)
    rel_err: float = 0.0   # median |error| / observed: robust relative error


@dataclass(slots=True)
class PerfModel:
    """Coefficients of one worker profile.

    Defaults: a linear (eq. 2) model of Llama-2-13B BF16 on one A100-80GB (Aladdin table 3's setting), for
    tests and hand-made models; workers use their own profile's model (`from_step_profile`, fitted online),
    never these.
    """

    k1: float = 1.1742e-4   # prefill seconds per prompt token (eq. 2)
    c1: float = 0.032178    # prefill seconds per request, incl. the server's per-request overhead (eq. 2)
    k2: float = 4.462e-7    # decode seconds per context token per request (eq. 3)
    c2: float = 5.76172e-5  # decode seconds per request (eq. 3)
    c3: float = 0.017178    # decode seconds per iteration (eq. 3)
    h: float = 1.0 / 16     # KV blocks per token (eq. 1)
    j: float = 1.0          # KV blocks per request: partial last block (eq. 1)
    kv_capacity: float = 3682.0   # M: KV blocks on the worker
    max_batch: int = 256          # engine's max_num_seqs
    k1q: float = 0.0              # prefill seconds per prompt token squared (causal attention, l²/2 pairs)
    pf: float = 0.0               # prefill floor: the weights' streaming time of one forward pass
    # The tokens one engine step batches (vLLM's max_num_batched_tokens): a prompt is prefilled in chunks of
    # this many, each batched with the running decodes. 0: not known (aladdin's prefill_chunk_tokens then).
    chunk_tokens: int = 0
    # Hetero form p1..p8 when fitted on its own; None: derived from the Aladdin coefficients.
    p: tuple[float, ...] | None = None
    fit: dict[str, ComponentFit] = field(default_factory=dict)

    # --- Aladdin section 3 -----------------------------------------------------------------------
    def prefill_time(self, total_input_tokens: float, sum_sq_tokens: float | None = None) -> float:
        """Aladdin eq. 2 with the attention term: prompts of Σl = `total_input_tokens` tokens (Σl² =
        `sum_sq_tokens`; None: one prompt of that length) take c1 + max(pf, k1·Σl + k1q·Σl²)."""
        sq = total_input_tokens * total_input_tokens if sum_sq_tokens is None else sum_sq_tokens
        return self.c1 + max(self.pf, self.k1 * total_input_tokens + self.k1q * sq)

    def prefill_work(self, prompt_tokens: float) -> float:
        """A prompt's prefill work in linear-token equivalents, l + (k1q/k1)·l²: a queue of prompts drains
        at 1/k1 of these per second (Aladdin's ledger counts queued prefill in them)."""
        return prompt_tokens + self.k1q / self.k1 * prompt_tokens * prompt_tokens

    def decode_step(self, batch: float, mean_context: float) -> float:
        """Aladdin eq. 3: one decode iteration of `batch` requests with mean context `mean_context`."""
        return (self.k2 * mean_context + self.c2) * batch + self.c3

    def kv_blocks(self, tokens: float, requests: float = 1.0) -> float:
        """Aladdin eq. 1 summed over `requests` requests holding `tokens` tokens in total."""
        return self.h * tokens + self.j * requests

    def context_limit(self, batch: float, t_dec: float) -> float:
        """Aladdin eq. 4: the largest total context of `batch` requests whose decode step stays <= t_dec."""
        return (t_dec - self.c2 * batch - self.c3) / self.k2

    def batch_limit(self, t_dec: float) -> float:
        """Largest batch for which eq. 4 leaves any context at all: (t_dec − c3) / c2."""
        return min(float(self.max_batch), (t_dec - self.c3) / self.c2) if self.c2 > 0 else float(self.max_batch)

    # --- heterogeneous paper section 3.1.2 -------------------------------------------------------
    def hetero_coeffs(self) -> tuple[float, ...]:
        """p1..p8 of hetero eq. 3-4 (fitted, or mapped from Aladdin eq. 2-3)."""
        return self.p if self.p is not None else aladdin_to_hetero(self)

    def hetero_prefill(self, batch: float, input_len: float) -> float:
        """Hetero eq. 3: prefill of a batch of `batch` requests of (longest) input `input_len`."""
        p1, p2, p3, p4 = self.hetero_coeffs()[:4]
        return p1 * batch * input_len + p2 * batch + p3 * input_len + p4 + self.k1q * batch * input_len * input_len

    def hetero_decode(self, batch: float, input_len: float, output_len: float) -> float:
        """Hetero eq. 4 in closed form: Σ_{k=1..O} (I+k) = O·I + O(O+1)/2."""
        p5, p6, p7, p8 = self.hetero_coeffs()[4:]
        o = output_len
        ctx_sum = o * input_len + o * (o + 1) / 2.0
        return (p5 * batch + p7) * ctx_sum + (p6 * batch + p8) * o

    # --- persistence -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in _COEF_NAMES}
        out["kv_capacity"] = self.kv_capacity
        out["max_batch"] = self.max_batch
        out["chunk_tokens"] = self.chunk_tokens
        out["p"] = list(self.p) if self.p is not None else None
        out["fit"] = {k: {"n": v.n, "rmse": v.rmse, "rel_err": v.rel_err} for k, v in self.fit.items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PerfModel:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown PerfModel fields: {', '.join(sorted(unknown))}")
        kw: dict[str, Any] = {k: v for k, v in data.items() if k not in ("p", "fit")}
        if data.get("p") is not None:
            kw["p"] = tuple(float(x) for x in data["p"])
            if len(kw["p"]) != 8:
                raise ValueError("PerfModel.p needs 8 coefficients (p1..p8)")
        kw["fit"] = {k: ComponentFit(**v) for k, v in (data.get("fit") or {}).items()}
        model = cls(**kw)
        model.validate()
        return model

    @classmethod
    def from_prior(cls, prior: Mapping[str, Any] | object) -> PerfModel:
        """A model from a declared profile: a mapping or an object with (some of) our field names.

        Also understood, as the simulator and vLLM name them: `num_gpu_blocks` (= kv_capacity),
        `block_size` (h = 1/block_size), `max_num_seqs` (= max_batch). Other keys are ignored, so a
        whole simulator profile can be passed; missing coefficients keep the defaults.
        """
        get = prior.get if isinstance(prior, Mapping) else (lambda k, d=None: getattr(prior, k, d))
        kw: dict[str, Any] = {}
        for name in (*_COEF_NAMES, "kv_capacity", "max_batch", "chunk_tokens", "p"):
            v = get(name, None)
            if v is not None:
                kw[name] = tuple(v) if name == "p" else v
        if "kv_capacity" not in kw and get("num_gpu_blocks", None) is not None:
            kw["kv_capacity"] = get("num_gpu_blocks")
        if "h" not in kw and get("block_size", None):
            kw["h"] = 1.0 / float(get("block_size"))
        if "max_batch" not in kw and get("max_num_seqs", None) is not None:
            kw["max_batch"] = get("max_num_seqs")
        if "chunk_tokens" not in kw and get("max_num_batched_tokens", None) is not None:
            kw["chunk_tokens"] = get("max_num_batched_tokens")
        model = cls(**{k: (float(v) if k not in ("max_batch", "chunk_tokens", "p") else v) for k, v in kw.items()})
        model.max_batch, model.chunk_tokens = int(model.max_batch), int(model.chunk_tokens)
        model.validate()
        return model

    @classmethod
    def from_step_profile(cls, prof: Mapping[str, Any] | object) -> PerfModel:
        """Aladdin coefficients that bound a step-time profile of the simulator's form from above
        (simulator/profiles.py: t = c_step + max(t_weights, k_prefill·P + c_decode·B) + k_ctx·C + k_attn·A).

        Decode (P = 0): the chord of max(t_w, c_decode·B) over B in [0, max_num_seqs] gives c2, with
        c3 = c_step + t_w and k2 = k_ctx. Prefill of a lone prompt of l tokens, chunked by
        max_num_batched_tokens (C): Σ over chunks of c_step + max(t_w, k_prefill·chunk) + k_attn·pairs, with
        l²/2 pairs in all, i.e. c1 = server overhead + c_step, k1 = k_prefill + c_step/C (every further
        chunk's fixed cost), k1q = k_attn/2, pf = t_w (a short prompt's memory-bound pass).
        """
        get = prof.get if isinstance(prof, Mapping) else (lambda k, d=None: getattr(prof, k, d))
        c_step, t_w = float(get("c_step_s")), float(get("t_weights_s"))
        c_dec, bmax = float(get("c_decode_s")), int(get("max_num_seqs"))
        chunk = float(get("max_num_batched_tokens", 2048))
        model = cls(
            k1=float(get("k_prefill_s")) + c_step / chunk,
            c1=c_step + float(get("ttft_overhead_s", 0.0)),
            k1q=float(get("k_attn_s", 0.0)) / 2.0,
            pf=t_w,
            k2=float(get("k_ctx_s")),
            c2=max(c_dec * bmax - t_w, 0.0) / bmax,
            c3=c_step + t_w,
            h=1.0 / float(get("block_size", 16)),
            j=1.0,
            kv_capacity=float(get("num_gpu_blocks")),
            max_batch=bmax,
            chunk_tokens=int(chunk),
        )
        model.validate()
        return model

    def validate(self) -> None:
        for name in (*_COEF_NAMES, "kv_capacity"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"PerfModel.{name} must be a finite number >= 0, got {v!r}")
        if self.k1 <= 0 or self.k2 <= 0 or self.h <= 0 or self.kv_capacity <= 0:
            raise ValueError("PerfModel.k1, k2, h and kv_capacity must be positive")
        if self.max_batch < 1:
            raise ValueError("PerfModel.max_batch must be >= 1")
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 0:
            raise ValueError(f"PerfModel.chunk_tokens must be an integer >= 0, got {self.chunk_tokens!r}")


def prefill_free_share(k1: Any, rho: Any, floor: float = 1e-3) -> Any:
    """The share of a worker's time not spent computing prompts when it takes in ρ prompt work units a second
    under chunked prefill (each costs k1 inside the decode steps it is batched with): 1 − k1·ρ, at least `floor`.
    A decode step stretches by its inverse: the admission rule predicts with it (policies/aladdin/constraints.py
    `paced_atgt`) and the gateway's learner takes it out of what it observed (gateway/pipeline/learning.py
    `decode_share`). Scalars or numpy arrays."""
    return np.maximum(1.0 - k1 * rho, floor)


def aladdin_to_hetero(model: PerfModel) -> tuple[float, ...]:
    """p1..p8 equivalent of the Aladdin coefficients (identical requests: Σl_in = b·I, Σctx = b·(I+k))."""
    return (model.k1, 0.0, 0.0, model.c1, model.k2, model.c2, 0.0, model.c3)


class _Ring:
    """Fixed-capacity ring of observation rows (bounded memory; the newest overwrite the oldest)."""

    __slots__ = ("data", "n", "pos")

    def __init__(self, capacity: int, width: int) -> None:
        self.data = np.zeros((capacity, width))
        self.n = 0
        self.pos = 0

    def add(self, row: tuple[float, ...]) -> None:
        self.data[self.pos] = row
        self.pos = (self.pos + 1) % len(self.data)
        self.n = min(self.n + 1, len(self.data))

    def rows(self) -> np.ndarray:
        return self.data[: self.n]


def robust_linear_fit(
    x: np.ndarray, y: np.ndarray, x0: np.ndarray, loss: str = "soft_l1"
) -> np.ndarray:
    """Fit y ≈ x @ θ, θ >= 0, with a robust loss (scipy least_squares); starts from x0 (the prior).

    The loss scale is the residuals' MAD, re-estimated once from the first robust fit, so points a
    few noise levels off count linearly instead of quadratically (outliers barely pull the fit).
    Directions the data cannot identify (e.g. batch size always 1) stay at x0.
    """
    from scipy.optimize import least_squares  # imported here: scipy costs ~1 s at gateway start-up

    x0 = np.maximum(np.asarray(x0, dtype=float), 0.0)
    floor = 1e-9 + 1e-4 * float(np.median(np.abs(y)))

    def run(start: np.ndarray, scale: float) -> np.ndarray:
        res = least_squares(
            lambda th: x @ th - y, start, jac=lambda th: x, bounds=(0.0, np.inf),
            loss=loss, f_scale=scale, x_scale="jac", method="trf",
        )
        return res.x

    def mad(th: np.ndarray) -> float:
        r = x @ th - y
        return max(1.4826 * float(np.median(np.abs(r - np.median(r)))), floor)

    ols, *_ = np.linalg.lstsq(x, y, rcond=None)
    theta = run(x0, mad(np.maximum(ols, 0.0)))
    return run(theta, mad(theta))


def _component_fit(x: np.ndarray, y: np.ndarray, theta: np.ndarray) -> ComponentFit:
    r = x @ theta - y
    rel = np.abs(r) / np.maximum(np.abs(y), 1e-12)
    return ComponentFit(n=len(y), rmse=float(np.sqrt(np.mean(r * r))), rel_err=float(np.median(rel)))


class PerfModelFitter:
    """Learns one profile's PerfModel online from what the gateway (or the simulator) observes.

    Observations go into bounded rings; `maybe_refit(now)` refits every `refit_interval_s` once
    `refit_min_new` new observations arrived. Each component is fitted by robust least squares and
    blended with the prior, θ = w·θ_fit + (1−w)·θ_prior with w = n / (n + prior_weight), so a handful
    of samples nudge the declared profile and many samples replace it.
    """

    def __init__(
        self,
        prior: PerfModel | Mapping[str, Any] | None = None,
        capacity: int = 512,
        prior_weight: float = 20.0,
        refit_interval_s: float = 10.0,
        refit_min_new: int = 16,
        loss: str = "soft_l1",
    ) -> None:
        if capacity < 8:
            raise ValueError("capacity must be >= 8")
        if prior_weight < 0:
            raise ValueError("prior_weight must be >= 0")
        if loss not in ("linear", "soft_l1", "huber", "cauchy", "arctan"):
            raise ValueError(f"unknown loss {loss!r}")
        if prior is None:
            prior = PerfModel()
        elif not isinstance(prior, PerfModel):
            prior = PerfModel.from_prior(prior)
        self.prior = prior
        self.model = PerfModel.from_dict(prior.to_dict())
        self.prior_weight = prior_weight
        self.refit_interval_s = refit_interval_s
        self.refit_min_new = refit_min_new
        self.loss = loss
        # prefill: (total tokens, Σ tokens², batch, longest input, seconds); decode: (batch, mean ctx, seconds);
        # kv: (tokens, requests, blocks)
        self._prefill = _Ring(capacity, 5)
        self._decode = _Ring(capacity, 3)
        self._kv = _Ring(capacity, 3)
        self._new = 0
        self._last_fit = -math.inf
        self.rejected = 0  # observations dropped as invalid (negative, non-finite)

    # --- observations ----------------------------------------------------------------------------
    def add_prefill(
        self, total_tokens: float, seconds: float, batch: int = 1, max_input: float | None = None,
        sum_sq_tokens: float | None = None,
    ) -> None:
        """Prefill of `batch` prompts of Σl_in = `total_tokens` (Σl_in² = `sum_sq_tokens`; default: equal
        prompts) took `seconds`."""
        longest = total_tokens / max(batch, 1) if max_input is None else max_input
        sq = total_tokens * total_tokens / max(batch, 1) if sum_sq_tokens is None else sum_sq_tokens
        if self._valid(total_tokens, sq, seconds, batch, longest) and batch >= 1 and seconds > 0:
            self._prefill.add((total_tokens, sq, batch, longest, seconds))
            self._new += 1

    def add_decode(self, batch: int, mean_context: float, seconds: float) -> None:
        """One decode iteration of `batch` requests whose mean context is `mean_context` took `seconds`."""
        if self._valid(batch, mean_context, seconds) and batch >= 1 and seconds > 0:
            self._decode.add((batch, mean_context, seconds))
            self._new += 1

    def add_kv(self, tokens: float, blocks: float, requests: int = 1) -> None:
        """`requests` requests holding `tokens` tokens in total occupied `blocks` KV blocks."""
        if self._valid(tokens, blocks, requests) and requests >= 1:
            self._kv.add((tokens, requests, blocks))
            self._new += 1

    def _valid(self, *values: float) -> bool:
        try:
            ok = all(math.isfinite(float(v)) and float(v) >= 0 for v in values)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            self.rejected += 1
        return ok

    @property
    def sample_counts(self) -> dict[str, int]:
        return {PREFILL: self._prefill.n, DECODE: self._decode.n, KV: self._kv.n}

    # --- fitting -----------------------------------------------------------------------------------
    def maybe_refit(self, now: float) -> bool:
        """Refit if the interval passed and enough new observations arrived; True when it refitted."""
        if self._new < self.refit_min_new or now - self._last_fit < self.refit_interval_s:
            return False
        self.refit()
        self._last_fit = now
        return True

    def refit(self) -> PerfModel:
        pr = self.prior
        m = PerfModel.from_dict(pr.to_dict())
        m.fit = {}
        ph = np.array(pr.hetero_coeffs(), dtype=float)
        p = ph.copy()
        pre, dec, kv = self._prefill.rows(), self._decode.rows(), self._kv.rows()
        # Prefill above the floor (pf) is linear in (Σl, Σl², 1); below it the pass costs c1 + pf.
        above = pre[pr.k1 * pre[:, 0] + pr.k1q * pre[:, 1] > pr.pf] if len(pre) else pre
        if len(above) >= 4:
            tot, sq, b, longest, t = above.T
            x = np.column_stack([tot, sq, np.ones_like(tot)])
            m.k1, m.k1q, m.c1 = self._blend(x, t, [pr.k1, pr.k1q, pr.c1], m, PREFILL, relative=True)
            xh = np.column_stack([b * longest, b, longest, np.ones_like(b)])
            p[:4] = self._blend(xh, t - m.k1q * sq, ph[:4], m, HETERO_PREFILL)
        if len(dec) >= 4:
            b, ctx, t = dec[:, 0], dec[:, 1], dec[:, 2]
            x = np.column_stack([b * ctx, b, np.ones_like(b)])
            m.k2, m.c2, m.c3 = self._blend(x, t, [pr.k2, pr.c2, pr.c3], m, DECODE)
            xh = np.column_stack([b * ctx, b, ctx, np.ones_like(b)])
            p[4:] = self._blend(xh, t, ph[4:], m, HETERO_DECODE)
        if len(kv) >= 3:
            tok, req, blocks = kv[:, 0], kv[:, 1], kv[:, 2]
            m.h, m.j = self._blend(np.column_stack([tok, req]), blocks, [pr.h, pr.j], m, KV)
        # Keep the coefficients the policies divide by strictly positive.
        m.k1, m.k2, m.h = max(m.k1, 1e-12), max(m.k2, 1e-15), max(m.h, 1e-9)
        if HETERO_PREFILL in m.fit or HETERO_DECODE in m.fit:
            m.p = tuple(float(v) for v in p)
        self.model = m
        self._new = 0
        return m

    def _blend(self, x: np.ndarray, y: np.ndarray, prior: Any, m: PerfModel, comp: str,
               relative: bool = False) -> list[float]:
        """Robust fit blended with the prior. `relative`: residuals relative to the observation, so a
        component spanning orders of magnitude (prefill: 20 ms to 20 s) is fitted at every size alike."""
        prior = np.asarray(prior, dtype=float)
        if relative:
            inv = 1.0 / np.maximum(y, 1e-12)
            fitted = robust_linear_fit(x * inv[:, None], np.ones_like(y), prior, self.loss)
        else:
            fitted = robust_linear_fit(x, y, prior, self.loss)
        n = len(y)
        w = n / (n + self.prior_weight)
        theta = w * fitted + (1.0 - w) * prior
        m.fit[comp] = _component_fit(x, y, theta)
        return [float(v) for v in theta]

    # --- persistence -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The fitted model and the prior (not the raw samples): what replicas share via the state store."""
        return {"model": self.model.to_dict(), "prior": self.prior.to_dict(), "prior_weight": self.prior_weight}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], **kwargs: Any) -> PerfModelFitter:
        fitter = cls(prior=PerfModel.from_dict(data["prior"]), prior_weight=data.get("prior_weight", 20.0), **kwargs)
        fitter.model = PerfModel.from_dict(data["model"])
        return fitter
