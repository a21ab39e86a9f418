"""`hetero`: workload-balancing placement for heterogeneous workers (heterogeneous-cluster paper, section 4.1).

Per candidate instance s and request r (input I, predicted output O):
  eq. 5  b_r^s = KVTotal_s / KVSize(r)              identical copies of r that fit in s's KV cache
  eq. 6  T_r^s = (T_prefill(s, B_r) + T_decode(s, B_r)) / b_r^s     (eq. 3-4 of the fitted profile)
  eq. 8  kv_usage(s) = KV of (Σ I + Σ Õ) of s's unfinished requests / KVTotal_s
  eq. 7  w_r^s = T_r^s · exp(θ · kv_usage(s))
kv_usage is capped at 1 (deviation, `kv_cap`): under overload the unfinished requests beyond a full
cache wait in the engine's queue, where they cost time (already in the load Σ w) but no memory. Uncapped,
exp(θ · kv_usage) grows with the backlog and, on workers of equal KV size, drowns the speed term T_r^s:
the split drifts to 50/50 whatever the speeds (bench/results/hetero_pair.md).
Algorithm 2 (the mapper): send r to the instance that minimises max_s(load_s), adding w_r^s to the
chosen instance's load, and subtract it again in the completion hook.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from policies.base import Policy, register
from policies.length_predictor import DEFAULT_OUTPUT_TOKENS
from policies.perf_model import PerfModel
from policies.types import Decision, RequestFeatures, WorkerView


def ideal_batch(model: PerfModel, input_len: float, output_len: float) -> float:
    """Eq. 5: how many copies of the request fit in the KV cache (at least 1, at most max_batch)."""
    per = model.kv_blocks(input_len + output_len)
    return float(min(max(np.floor(model.kv_capacity / per), 1.0), model.max_batch))


def request_time(model: PerfModel, input_len: float, output_len: float) -> float:
    """Eq. 6: T_r^s, the time request r costs instance s when batched with its ideal batch of copies."""
    b = ideal_batch(model, input_len, output_len)
    return (model.hetero_prefill(b, input_len) + model.hetero_decode(b, input_len, output_len)) / b


def workload(t_rs: float, kv_usage: float, theta: float) -> float:
    """Eq. 7: w_r^s = T_r^s · exp(θ · kv_usage(s))."""
    return t_rs * float(np.exp(theta * kv_usage))


def min_max_choice(loads: np.ndarray, w: np.ndarray) -> int:
    """Algorithm 2 lines 10-16: the index s minimising max(load_1, .., load_s + w_s, .., load_n).

    Ties (several s keep the maximum where it is) go to the smallest load_s + w_s, then to the
    first index, instead of the paper's first-index rule, so light load still follows speed.
    """
    n = len(loads)
    if n == 1:
        return 0
    top = int(np.argmax(loads))
    rest = np.delete(loads, top)
    others = np.full(n, loads[top])
    others[top] = rest.max()
    after = loads + w
    peak = np.maximum(after, others)
    cands = np.flatnonzero(peak <= peak.min() * (1 + 1e-12) + 1e-15)
    return int(cands[np.argmin(after[cands])])


@register("hetero")
class HeteroPolicy(Policy):
    """Min-max assignment of predicted per-request workloads over heterogeneous instances."""

    name = "hetero"
    needs_perf_models = True

    def __init__(
        self,
        perf_models: Mapping[str, PerfModel | Mapping[str, Any]] | None = None,
        default_perf_model: PerfModel | Mapping[str, Any] | None = None,
        theta: float = 2.0,
        memory_only: bool = False,
        use_engine_kv: bool = True,
        kv_cap: float | None = 1.0,
    ) -> None:
        if theta < 0:
            raise ValueError(f"theta must be >= 0, got {theta}")
        self.theta = float(theta)          # the paper's experiments use θ = 2
        self.memory_only = memory_only     # the paper's "MB" baseline: T_r^s = 1
        self.use_engine_kv = use_engine_kv  # also count the engine-reported KV usage (other replicas' load)
        if kv_cap is not None and not kv_cap > 0:
            raise ValueError(f"kv_cap must be > 0 or None, got {kv_cap}")
        self.kv_cap = kv_cap               # None: eq. 8 uncapped, as printed
        self._default = _as_model(default_perf_model) if default_perf_model is not None else PerfModel()
        self._models: dict[str, PerfModel] = {k: _as_model(v) for k, v in (perf_models or {}).items()}
        self._index: dict[str, int] = {}
        self._profile: list[str] = []
        self._load = np.zeros(0)       # Σ w of unfinished requests (Algorithm 2 instLoads)
        self._tokens = np.zeros(0)     # Σ (I + Õ) of unfinished requests (instRunningReqLen)
        self._reqs = np.zeros(0)       # unfinished requests
        self._coef = np.zeros((0, 13))  # p1..p8, h, j, M, max_batch, k1q
        self._placed: dict[str, tuple[int, float, float]] = {}  # request -> (row, w, I + Õ)
        self._last: tuple[str, np.ndarray, np.ndarray] | None = None  # (request, rows, w) of the last choose

    def model_for(self, profile: str) -> PerfModel:
        return self._models.get(profile, self._default)

    def set_perf_model(self, profile: str, model: PerfModel | Mapping[str, Any]) -> None:
        self._models[profile] = _as_model(model)
        for r, p in enumerate(self._profile):
            if p == profile:
                self._coef[r] = _coef_row(self._models[profile])

    def _row(self, worker_id: str, profile: str | None) -> int:
        r = self._index.get(worker_id)
        if r is None:
            r = len(self._profile)
            self._index[worker_id] = r
            self._profile.append(profile or "")
            self._load = np.append(self._load, 0.0)
            self._tokens = np.append(self._tokens, 0.0)
            self._reqs = np.append(self._reqs, 0.0)
            self._coef = np.vstack([self._coef, _coef_row(self.model_for(profile or ""))])
        elif profile is not None and self._profile[r] != profile:
            self._profile[r] = profile
            self._coef[r] = _coef_row(self.model_for(profile))
        return r

    def workloads(self, request: RequestFeatures, rows: np.ndarray, engine_kv: np.ndarray | None) -> np.ndarray:
        """w_r^s for every row at once (eq. 5-8)."""
        i = float(max(request.prompt_tokens, 0))
        o = _output_len(request)
        c = self._coef[rows]
        p1, p2, p3, p4, p5, p6, p7, p8, h, j, M, bmax, k1q = c.T
        kv_usage = (h * self._tokens[rows] + j * self._reqs[rows]) / M          # eq. 8
        if engine_kv is not None:
            kv_usage = np.maximum(kv_usage, engine_kv)
        if self.kv_cap is not None:
            kv_usage = np.minimum(kv_usage, self.kv_cap)
        if self.memory_only:
            t = np.ones(len(rows))
        else:
            b = np.clip(np.floor(M / (h * (i + o) + j)), 1.0, bmax)           # eq. 5
            prefill = p1 * b * i + p2 * b + p3 * i + p4 + k1q * b * i * i       # eq. 3 + attention (perf_model)
            ctx_sum = o * i + o * (o + 1) / 2.0                                 # Σ_{k=1..O} (I + k)
            decode = (p5 * b + p7) * ctx_sum + (p6 * b + p8) * o                # eq. 4
            t = (prefill + decode) / b                                          # eq. 6
        return t * np.exp(self.theta * kv_usage)                                # eq. 7

    def choose(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float) -> Decision:
        if not workers:
            return Decision(None, "no_workers")
        rows = np.fromiter((self._row(v.id, v.profile) for v in workers), dtype=np.intp, count=len(workers))
        engine_kv = np.fromiter((v.kv_usage for v in workers), dtype=float, count=len(workers)) if self.use_engine_kv else None
        w = self.workloads(request, rows, engine_kv)
        best = min_max_choice(self._load[rows], w)
        self._last = (request.request_id, rows, w)
        return Decision(workers[best].id, "min_max")

    def on_dispatch(self, request: RequestFeatures, worker_id: str, now: float) -> None:
        if request.request_id in self._placed:
            return
        r = self._row(worker_id, None)
        w = None
        if self._last is not None and self._last[0] == request.request_id:
            hit = np.flatnonzero(self._last[1] == r)
            if len(hit):
                w = float(self._last[2][hit[0]])
        if w is None:
            w = float(self.workloads(request, np.array([r]), None)[0])
        size = float(max(request.prompt_tokens, 0)) + _output_len(request)
        self._load[r] += w
        self._tokens[r] += size
        self._reqs[r] += 1
        self._placed[request.request_id] = (r, w, size)

    def on_complete(self, request: RequestFeatures, worker_id: str, now: float) -> None:
        """The completion hook of Algorithm 2: take the request's workload off its instance."""
        placed = self._placed.pop(request.request_id, None)
        if placed is None:
            return
        r, w, size = placed
        self._reqs[r] -= 1
        if self._reqs[r] <= 0:  # exact zeros: no float drift over long runs
            self._load[r] = self._tokens[r] = self._reqs[r] = 0.0
        else:
            self._load[r] = max(self._load[r] - w, 0.0)
            self._tokens[r] = max(self._tokens[r] - size, 0.0)

    def load(self, worker_id: str) -> float:
        r = self._index.get(worker_id)
        return 0.0 if r is None else float(self._load[r])


def _output_len(request: RequestFeatures) -> float:
    """Õ_r: the predicted output, at least 1, at most max_tokens (a non-finite value counts as 128)."""
    o = float(request.predicted_output_tokens)
    if not math.isfinite(o):
        o = DEFAULT_OUTPUT_TOKENS
    if request.max_tokens is not None:
        o = min(o, float(request.max_tokens))
    return max(o, 1.0)


def _coef_row(m: PerfModel) -> np.ndarray:
    return np.array([*m.hetero_coeffs(), m.h, m.j, m.kv_capacity, float(m.max_batch), m.k1q])


def _as_model(m: PerfModel | Mapping[str, Any]) -> PerfModel:
    return m if isinstance(m, PerfModel) else PerfModel.from_prior(m)
