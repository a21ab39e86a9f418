"""Prefill/decode pairing: which prefill worker, which decode worker, and whether to split at all.

A request in split-phase serving (Aladdin appendix E, "split-phase inference"; Aegaeon 4.1) runs its
prompt on a prefill worker, moves its KV to a decode worker, and decodes there. `PdPolicy.plan` answers,
for one request and the current worker views (any roles mixed):

1. Conditional disaggregation (docs/reference/peer-routers.md §8.4: llm-d `prefix-based-pd-decider`, vLLM Router
   `pd_uncached_token_threshold` 256, Dynamo `isl_bounding`): the prompt tokens a decode-capable worker
   would still have to compute are its length minus what that worker likely caches (the approximate
   prefix index of what was sent where, policies/prefix.py). When they are at most
   `local_prefill_tokens`, a split costs more than it saves: the decode worker prefills locally.
   Decode-capable means role decode or mixed.
   With `prefill_overflow`, a prompt whose best prefill worker is predicted to miss the TTFT SLO while
   an idle prefill would not is prefilled by its decode worker instead (Dynamo's `prefill_load`
   conditional disaggregation, docs/reference/peer-routers.md §4.2): TTFT over TPOT when the prefill pool is saturated.
2. Prefill worker: the smallest predicted prefill completion (Aegaeon 4.2: the least loaded job queue,
   load = time to finish what is queued), predicted with Aladdin eq. 2 over the prompt tokens already
   queued there plus this prompt, t = k1·(queued + l_in) + c1, and checked against the TTFT SLO. Queued
   tokens are the reservations' `inflight_tokens` (the gateway reserves a prefill leg's prompt tokens);
   a worker whose KV is nearly full of pinned hand-offs (`kv_full`) is used only when no other is left.
3. Decode worker: any placement policy by name over the decode pool. With `split_phase` (the default),
   `aladdin` becomes `AladdinDecodePolicy`: the prompt arrives as KV, so the prefill term of its models
   is the KV transfer (setup + tokens x bytes per token / link bandwidth, docs/reference/vllm-interface.md §8.5) and the
   packing is driven by decode (ATGT) and KV constraints, as in Aladdin's decode-instance
   simulation (appendix I, figure 12).

`choose` wraps `plan` in the ordinary Policy interface (`Decision.worker_id` is the decode worker,
`Decision.prefill_worker_id` the prefill worker or None for a local prefill), so the virtual-time
cluster simulator and the gateway run this same code.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from policies.aladdin import AladdinPolicy
from policies.base import Policy, make_policy
from policies.perf_model import PerfModel
from policies.prefix import PrefixIndex
from policies.slo_targets import DEFAULT_TTFT_S
from policies.types import ROLE_DECODE, ROLE_MIXED, ROLE_PREFILL, Decision, RequestFeatures, WorkerView

# Decisions (also the values of fleetgate_pd_decisions_total{decision}).
DISAGGREGATED = "disaggregated"          # prefill worker + decode worker
LOCAL_SHORT = "local_short"              # short prompt: the decode worker prefills itself
LOCAL_CACHED = "local_cached"            # mostly cached on a decode/mixed worker: it prefills the rest
LOCAL_NO_PREFILL = "local_no_prefill"    # no prefill worker available
LOCAL_OVERFLOW = "local_overflow"        # the prefill pool's backlog would miss the TTFT SLO: prefill locally
NO_DECODE = "no_decode_worker"           # nothing can decode: the caller queues or refuses

# KV transfer defaults: 128 KiB per token (Llama-3-8B BF16) over ~40 GB/s, 1 ms setup (docs/reference/vllm-interface.md §8.5).
DEFAULT_TRANSFER_S_PER_TOKEN = 131072 / 40e9
DEFAULT_TRANSFER_SETUP_S = 0.001


@dataclass(frozen=True, slots=True)
class PdPlan:
    """Where one request runs: `prefill_worker_id` None means the decode worker prefills locally."""

    decode_worker_id: str | None
    prefill_worker_id: str | None
    decision: str
    predicted_prefill_s: float | None = None
    cached_tokens: int = 0
    ttft_ok: bool = True            # the predicted prefill completion is within the request's TTFT SLO

    @property
    def disaggregated(self) -> bool:
        return self.prefill_worker_id is not None

    def as_decision(self) -> Decision:
        return Decision(self.decode_worker_id, self.decision, self.prefill_worker_id)


def prefill_time(model: PerfModel, queued_tokens: float, prompt_tokens: float) -> float:
    """Predicted completion of a prompt behind `queued_tokens` queued ones: Aladdin eq. 2 with the attention
    term (policies/perf_model.py), c1 + max(pf, k1·(queued + work(l_in))); the queued prompts' own attention
    is not known from their token sum and counts as linear."""
    work = max(queued_tokens, 0.0) + model.prefill_work(max(prompt_tokens, 0.0))
    return model.c1 + max(model.pf, model.k1 * work)


def split_phase_model(model: PerfModel, s_per_token: float = DEFAULT_TRANSFER_S_PER_TOKEN,
                      setup_s: float = DEFAULT_TRANSFER_SETUP_S) -> PerfModel:
    """A decode instance's model: its "prefill" is the KV transfer (docs/reference/vllm-interface.md §8.5), decode/KV unchanged."""
    if not (s_per_token > 0 and setup_s >= 0):
        raise ValueError("transfer time per token must be > 0 and setup >= 0")
    return replace(model, k1=s_per_token, c1=setup_s)


class AladdinDecodePolicy(AladdinPolicy):
    """`aladdin` for the decode pool of split-phase serving (Aladdin appendix E, I): prompts arrive as KV."""

    name = "aladdin_decode"

    def __init__(self, perf_models: Mapping[str, PerfModel | Mapping[str, Any]] | None = None,
                 default_perf_model: PerfModel | Mapping[str, Any] | None = None,
                 transfer_s_per_token: float = DEFAULT_TRANSFER_S_PER_TOKEN,
                 transfer_setup_s: float = DEFAULT_TRANSFER_SETUP_S, **params: Any) -> None:
        self._transfer = (float(transfer_s_per_token), float(transfer_setup_s))
        models = {k: self._split(v) for k, v in (perf_models or {}).items()}
        super().__init__(perf_models=models, default_perf_model=self._split(default_perf_model or PerfModel()),
                         **params)

    def _split(self, m: PerfModel | Mapping[str, Any]) -> PerfModel:
        base = m if isinstance(m, PerfModel) else PerfModel.from_prior(m)
        return split_phase_model(base, *self._transfer)

    def set_perf_model(self, profile: str, model: PerfModel | Mapping[str, Any]) -> None:
        super().set_perf_model(profile, self._split(model))


def make_decode_policy(name: str | Policy, params: Mapping[str, Any] | None = None,
                       split_phase: bool = True) -> Policy:
    """The decode pool's placement policy by name; `aladdin` in split-phase mode when asked."""
    if isinstance(name, Policy):
        return name
    if split_phase and name == "aladdin":
        return AladdinDecodePolicy(**dict(params or {}))
    return make_policy(name, **dict(params or {}))


class PdPolicy(Policy):
    """Pairs a prefill worker with a decode worker, or keeps the prefill on the decode worker."""

    name = "pd"
    needs_prefix_hashes = True

    def __init__(
        self,
        decode_policy: str | Policy = "least_requests",
        decode_params: Mapping[str, Any] | None = None,
        *,
        split_phase: bool = True,
        local_prefill_tokens: int = 256,
        prefix_chunk_tokens: float = 32.0,
        prefill_perf_models: Mapping[str, PerfModel | Mapping[str, Any]] | None = None,
        default_prefill_model: PerfModel | Mapping[str, Any] | None = None,
        slo_ttft_s: float = DEFAULT_TTFT_S,
        kv_full: float = 0.95,
        affinity_guard: float = 2.0,
        affinity_slack: float = 4.0,
        prefill_overflow: bool = True,
    ) -> None:
        if local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be >= 0, got {local_prefill_tokens}")
        if not prefix_chunk_tokens > 0:
            raise ValueError(f"prefix_chunk_tokens must be > 0, got {prefix_chunk_tokens}")
        if not 0 < kv_full <= 1:
            raise ValueError(f"kv_full must be in (0, 1], got {kv_full}")
        self.decode_policy = make_decode_policy(decode_policy, decode_params, split_phase)
        self.decode_policy_name = getattr(self.decode_policy, "name", str(decode_policy))
        self.local_prefill_tokens = int(local_prefill_tokens)
        self.prefix_chunk_tokens = float(prefix_chunk_tokens)
        self.slo_ttft_s = float(slo_ttft_s)
        self.kv_full = float(kv_full)
        self.affinity_guard, self.affinity_slack = float(affinity_guard), float(affinity_slack)
        self.prefill_overflow = bool(prefill_overflow)
        self._prefill_models = {k: _as_model(v) for k, v in (prefill_perf_models or {}).items()}
        self._default_prefill = _as_model(default_prefill_model) if default_prefill_model is not None else PerfModel()
        self.index = PrefixIndex()
        self.decisions: dict[str, int] = {}

    # --- the pair ---------------------------------------------------------------------------------
    def plan(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float,
             exclude_prefill: Collection[str] = (), exclude_decode: Collection[str] = ()) -> PdPlan:
        prefill_pool = [w for w in workers if w.role == ROLE_PREFILL and w.id not in exclude_prefill]
        decode_pool = [w for w in workers if w.role in (ROLE_DECODE, ROLE_MIXED) and w.id not in exclude_decode]
        plan = self._plan(request, prefill_pool, decode_pool, now)
        self.decisions[plan.decision] = self.decisions.get(plan.decision, 0) + 1
        return plan

    def _plan(self, request: RequestFeatures, prefill_pool: list[WorkerView], decode_pool: list[WorkerView],
              now: float) -> PdPlan:
        if not decode_pool:
            return PdPlan(None, None, NO_DECODE)
        cached_on, cached = self._best_cached(request, decode_pool)
        if cached_on is not None and request.prompt_tokens - cached <= self.local_prefill_tokens:
            return PdPlan(cached_on.id, None, LOCAL_CACHED, cached_tokens=cached)
        if request.prompt_tokens <= self.local_prefill_tokens:
            return PdPlan(self.choose_decode(request, decode_pool, now).worker_id, None, LOCAL_SHORT)
        if not prefill_pool:
            return PdPlan(self.choose_decode(request, decode_pool, now).worker_id, None, LOCAL_NO_PREFILL)
        decode = self.choose_decode(request, decode_pool, now).worker_id
        if decode is None:
            return PdPlan(None, None, NO_DECODE)
        prefill, predicted = self.choose_prefill(request, prefill_pool)
        ttft_ok = self.meets_ttft(request, predicted)
        if not ttft_ok and self.prefill_overflow:
            idle = prefill_time(self.prefill_model_for(_profile_of(decode, decode_pool)), 0, request.prompt_tokens)
            if self.meets_ttft(request, idle):
                return PdPlan(decode, None, LOCAL_OVERFLOW, idle)
        return PdPlan(decode, prefill, DISAGGREGATED, predicted, ttft_ok=ttft_ok)

    def choose_decode(self, request: RequestFeatures, decode_pool: Sequence[WorkerView], now: float) -> Decision:
        return self.decode_policy.choose(request, decode_pool, now)

    def choose_prefill(self, request: RequestFeatures, prefill_pool: Sequence[WorkerView]) -> tuple[str | None, float | None]:
        """The prefill worker with the earliest predicted completion (and that prediction, seconds)."""
        best: tuple[bool, float, str] | None = None
        for w in prefill_pool:
            t = prefill_time(self.prefill_model_for(w.profile), w.inflight_tokens, request.prompt_tokens)
            key = (w.kv_usage >= self.kv_full, t, w.id)
            if best is None or key < best:
                best = key
        if best is None:
            return None, None
        return best[2], best[1]

    def meets_ttft(self, request: RequestFeatures, predicted_prefill_s: float | None) -> bool:
        slo = request.slo_ttft_s if request.slo_ttft_s and request.slo_ttft_s > 0 else self.slo_ttft_s
        return predicted_prefill_s is not None and predicted_prefill_s <= slo

    def prefill_model_for(self, profile: str) -> PerfModel:
        return self._prefill_models.get(profile, self._default_prefill)

    def set_perf_model(self, profile: str, model: PerfModel | Mapping[str, Any]) -> None:
        """A profile's current performance model (the gateway's learner pushes each fit, starting from the
        profile's prior): its prefill times. The decode policy hears its own models. Without it the gateway's
        prefill estimates used a default model while the simulator's used the profile's, so the two could
        choose prefill workers and overflow to local prefill differently."""
        self._prefill_models[profile] = _as_model(model)

    def _best_cached(self, request: RequestFeatures, pool: Sequence[WorkerView]) -> tuple[WorkerView | None, int]:
        """The decode-capable worker most likely to cache the prompt's head, under a load guard, and how
        many prompt tokens it caches (estimated: matched prefix chunks x tokens per chunk)."""
        hashes = request.prefix_hashes
        if not hashes:
            return None, 0
        best: WorkerView | None = None
        best_len = 0
        min_load = math.inf
        for w in pool:
            min_load = min(min_load, w.load)
            m = self.index.match_len(w.id, hashes)
            if m > best_len or (m and m == best_len and best is not None and w.load < best.load):
                best, best_len = w, m
        if best is None or best.load > self.affinity_guard * (min_load + 1) + self.affinity_slack:
            return None, 0
        return best, int(min(best_len * self.prefix_chunk_tokens, request.prompt_tokens))

    # --- Policy interface ---------------------------------------------------------------------------
    def choose(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float) -> Decision:
        return self.plan(request, workers, now).as_decision()

    def on_dispatch(self, request: RequestFeatures, worker_id: str, now: float) -> None:
        """`worker_id` is the decode worker; after the request it holds the prompt's KV in its cache."""
        if request.prefix_hashes:
            self.index.record(worker_id, request.prefix_hashes)
        self.decode_policy.on_dispatch(request, worker_id, now)

    def on_complete(self, request: RequestFeatures, worker_id: str, now: float) -> None:
        self.decode_policy.on_complete(request, worker_id, now)

    def report_progress(self, request_id: str, generated_tokens: int, now: float) -> None:
        """Forwarded to a decode policy that keeps a ledger (aladdin)."""
        hook = getattr(self.decode_policy, "report_progress", None)
        if hook is not None:
            hook(request_id, generated_tokens, now)

    def observe_completion(self, request: RequestFeatures, output_tokens: int, now: float) -> None:
        hook = getattr(self.decode_policy, "observe_completion", None)
        if hook is not None:
            hook(request, output_tokens, now)

    def observe_outcome(self, request: RequestFeatures, worker_id: str, slo_met: bool, now: float) -> None:
        hook = getattr(self.decode_policy, "observe_outcome", None)
        if hook is not None:
            hook(request, worker_id, slo_met, now)

    def forget_worker(self, worker_id: str) -> None:
        self.index.forget_worker(worker_id)


def _profile_of(worker_id: str, pool: Sequence[WorkerView]) -> str:
    return next((w.profile for w in pool if w.id == worker_id), "")


def _as_model(m: PerfModel | Mapping[str, Any]) -> PerfModel:
    return m if isinstance(m, PerfModel) else PerfModel.from_prior(m)


def pd_policy_for_profiles(decode_policy: str | Policy, decode_params: Mapping[str, Any] | None,
                           profiles: Sequence[Any], *, slo_ttft_s: float, slo_tpot_s: float,
                           **options: Any) -> PdPolicy:
    """A PdPolicy whose models come from worker profiles (simulator.profiles.Profile or any object with
    its step-time fields): prefill models per profile (PerfModel.from_step_profile) and, for `aladdin`,
    decode models with the profiles' KV link (kv_bytes_per_token / pd_link_bytes_per_s, pd_setup_s)."""
    models = {p.name: PerfModel.from_step_profile(p) for p in profiles}
    params = dict(decode_params or {})
    if decode_policy == "aladdin":
        params.setdefault("perf_models", models)
        params.setdefault("slo_ttft_s", slo_ttft_s)
        params.setdefault("slo_atgt_s", slo_tpot_s)
        if options.get("split_phase", True) and profiles:
            link = profiles[0]
            params.setdefault("transfer_s_per_token", link.kv_bytes_per_token / link.pd_link_bytes_per_s)
            params.setdefault("transfer_setup_s", link.pd_setup_s)
    options.setdefault("prefill_perf_models", models)
    return PdPolicy(decode_policy, params, slo_ttft_s=slo_ttft_s, **options)


def parse_pd_split(text: str) -> tuple[int, int]:
    """`P:D` (e.g. "2:6") -> (prefill workers, decode workers); both must be >= 1."""
    parts = text.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        p, d = int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(f"expected P:D with two whole numbers, such as 2:6; got {text!r}") from None
    if p < 1 or d < 1:
        raise ValueError(f"P:D needs at least one prefill and one decode worker; got {text!r}")
    return p, d
