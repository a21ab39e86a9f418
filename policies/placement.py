"""One model's placement step: which worker(s) run a request, and what its policy hears back afterwards.

    candidates (healthy, serving the model, under their cap: the caller builds the views)
      -> servable?            a prompt no candidate's context can hold is refused (vLLM's 400), not placed
      -> class / pool filter  Chiron's worker pools: own pool first, then mixed (policies/autoscale/routing.py)
      -> profile              plain, or P/D when the fleet has prefill or decode workers: then `PdPolicy` plans
                              a prefill worker and a decode worker (or a local prefill) around the same policy
      -> adapter              plain profile, a request naming a LoRA adapter: the policy among the workers
                              serving it, else the cheapest load with its time priced in (policies/adapters.py)
      -> policy               any policy by name (policies/base.py)
      -> shedding             a request whose predicted TTFT there misses its target is refused (policies/shedding.py:
                              the chosen worker, or the best candidate when the policy placed it nowhere)
      -> Decision             worker(s), or None with a reason and maybe a `retry_at` (the admission queue waits);
                              reason WILL_MISS: the caller answers 429 with `last_shed`'s Retry-After

and the feedback, in this order for every request: `dispatched` once it was sent, `first_token`, then
`finished` (with its output length when it completed) or `released` (failed, aborted). The live gateway
(gateway/pipeline/dispatch.py) and the virtual-time simulator (simulator/cluster.py) both drive this object; neither
calls a policy directly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from policies.adapters import choose_for_adapter, lora_costs
from policies.aladdin.rebalancing import slow_workers
from policies.autoscale.routing import pool_filter, pools_in_use
from policies.base import Policy
from policies.pd import DISAGGREGATED, LOCAL_CACHED, LOCAL_NO_PREFILL, LOCAL_OVERFLOW, LOCAL_SHORT, PdPolicy
from policies.shedding import WILL_MISS, Shed, Shedder
from policies.types import ROLE_MIXED, Decision, Move, RequestFeatures, WorkerView

TOO_LONG = "too_long"        # Decision.reason of a request no candidate can hold (the caller answers 400)
NO_WORKERS = "no_workers"


def reserved_tokens(feats: RequestFeatures) -> int:
    """What a placed request reserves on its (decode or mixed) worker: its prompt and its predicted output, in
    tokens (`WorkerView.inflight_tokens` sums these). A P/D prefill leg reserves its prompt only."""
    return feats.prompt_tokens + int(feats.predicted_output_tokens)


def has_room(inflight: int, cap: int | None) -> bool:
    """May a worker holding `inflight` requests take one more: it is under its cap (None: no cap). With
    "available" (healthy or not draining, serving the model: each caller's own registry), this is the candidate
    filter: only candidates are shown to the placement step."""
    return cap is None or inflight < cap


def _off_slow_workers(queued: Mapping[str, tuple[str, RequestFeatures]], views: Sequence[WorkerView],
                      slow: set[str], max_moves: int | None) -> list[Move]:
    """A policy without Algorithm 2: the requests queued on slow workers, in order, each to the least loaded
    worker that is not slow and has room under its cap (counting the moves already proposed). No such worker:
    the request stays where it is queued, since a move nobody can take would turn a slow answer into a refusal
    (found by tests/test_pipeline_parity_moves.py, where such moves were refused on both sides alike)."""
    if not slow:
        return []
    load = {v.id: v.load for v in views if v.id not in slow}
    held = {v.id: v.inflight for v in views}
    caps = {v.id: v.cap for v in views}
    moves: list[Move] = []
    for rid, (src, _) in queued.items():
        if max_moves is not None and len(moves) >= max_moves:
            break
        if src not in slow:
            continue
        room = [w for w in load if has_room(held[w], caps[w])]
        if not room:
            break
        dst = min(room, key=load.__getitem__)
        load[dst] += 1
        held[dst] += 1
        moves.append(Move(rid, src, dst))
    return moves


def context_limit(views: Sequence[WorkerView]) -> int | None:
    """The largest max_model_len among the candidates (None: some candidate's is unknown)."""
    best = 0
    for v in views:
        if v.max_model_len is None:
            return None
        best = max(best, v.max_model_len)
    return best


def servable(feats: RequestFeatures, limit: int | None) -> bool:
    """vLLM refuses a prompt of max_model_len tokens or more, and one whose prompt plus max_tokens exceeds it."""
    if limit is None:
        return True
    return feats.prompt_tokens < limit and (feats.max_tokens is None or feats.prompt_tokens + feats.max_tokens <= limit)


def too_long_message(feats: RequestFeatures, limit: int | None) -> str:
    """vLLM's 400 message for a request over the context (vllm/entrypoints/openai/serving_engine.py)."""
    asked = feats.prompt_tokens + (feats.max_tokens or 0)
    return (f"This model's maximum context length is {limit} tokens. However, you requested {asked} tokens "
            f"({feats.prompt_tokens} in the messages, {feats.max_tokens or 0} in the completion). Please reduce "
            "the length of the messages or completion.")


class ModelPlacement:
    """The placement step of one model (module docstring). `pd_factory` builds the P/D profile's PdPolicy (around
    the model's policy settings) the first time the fleet has prefill or decode workers; `observe_length` hears
    every completed request's (model, prompt tokens, output tokens) for output-length prediction. `shed`: apply
    the admission rule that refuses what will miss its TTFT (policies/shedding.py; `shedder`, None when off).
    Requests placed as P/D are not judged by it (its estimate is of one mixed worker's TTFT)."""

    __slots__ = ("policy", "_pd", "_pd_factory", "_via_pd", "observe_length", "shedder", "last_shed")

    def __init__(self, policy: Policy, pd_factory: Callable[[], PdPolicy] | None = None,
                 observe_length: Callable[[str, int, int], None] | None = None, shed: bool = True) -> None:
        self.policy = policy
        self._pd: PdPolicy | None = None
        self._pd_factory = pd_factory
        self._via_pd: set[str] = set()            # requests the P/D profile placed (its ledger hears about them)
        self.observe_length = observe_length
        self.shedder = Shedder(policy) if shed else None
        self.last_shed: Shed | None = None        # why the latest WILL_MISS decision refused its request

    @property
    def pd(self) -> PdPolicy | None:
        """The P/D profile's policy, once built."""
        return self._pd

    def _pd_policy(self) -> PdPolicy | None:
        if self._pd is None and self._pd_factory is not None:
            self._pd = self._pd_factory()
        return self._pd

    # --- the decision -------------------------------------------------------------------------------
    def place(self, feats: RequestFeatures, views: Sequence[WorkerView], now: float, swap_s: float = 0.0) -> Decision:
        """The placement step (module docstring). `swap_s`: the wake of its model on a shared host the request
        waited for, which the admission rule counts in its TTFT target as the queue budget does."""
        if not views:
            return Decision(None, NO_WORKERS)
        if not servable(feats, context_limit(views)):
            return Decision(None, TOO_LONG)
        if pools_in_use(views):
            views = pool_filter(feats, views)
            if not views:
                return Decision(None, "no_room_in_pool")
        if any(v.role != ROLE_MIXED for v in views):
            pd = self._pd_policy()
            if pd is not None:
                return pd.choose(feats, views, now)
            views = [v for v in views if v.role == ROLE_MIXED]
            if not views:
                return Decision(None, NO_WORKERS)
        if feats.adapter is not None:
            d = choose_for_adapter(self.policy, feats, views, now, self.adapter_load_s(feats))
        else:
            d = self.policy.choose(feats, views, now)
        if self.shedder is not None and d.reason != TOO_LONG:
            shed = self.shedder.check(feats, views, now, d.worker_id, swap_s)
            if shed is not None:
                self.last_shed = shed
                return Decision(None, WILL_MISS)
        return d

    def queue_prefill_s(self, feats: RequestFeatures, views: Sequence[WorkerView]) -> float:
        """The request's predicted prefill (policies/shedding.py `prefill_s`): its queue budget ends that long
        before its TTFT target. 0 when the rule is off."""
        return self.shedder.prefill_s(feats, views) if self.shedder is not None else 0.0

    def drain_s(self, feats: RequestFeatures, now: float, default: float) -> float:
        """Retry-After for a request refused at its queue deadline: the predicted drain time (`default` when
        the rule is off or the request has no TTFT target)."""
        if self.shedder is None or feats.slo_ttft_s is None:
            return default
        return self.shedder.drain_s(feats, now)

    def adapter_load_s(self, feats: RequestFeatures) -> float:
        """Seconds a runtime load of the request's adapter takes (policies/adapters.py)."""
        return lora_costs(feats.model).runtime_load_s

    def rebalance(self, queued: Mapping[str, tuple[str, RequestFeatures]], views: Sequence[WorkerView],
                  now: float, observed: Mapping[str, float] | None = None, bound: float = 2.0,
                  max_moves: int | None = None) -> list[Move]:
        """Aladdin's Algorithm 2 over requests placed but not started (`queued`: request id -> (worker,
        features)): the moves the policy proposes to cancel its workers' prediction errors; [] for requests the
        P/D profile placed. The caller moves each request (it has not started anywhere) and reports it with
        `moved`. `observed`: worker -> its measured decode step over its model's prediction; a worker past
        `bound` is slow and its queued requests move off it (policies/aladdin/rebalancing.py). A policy without
        a `rebalance` (no ledger, so no length errors) still moves requests off slow workers, to the least
        loaded of the others. At most `max_moves` moves."""
        hook = getattr(self.policy, "rebalance", None)
        plain = {rid: v for rid, v in queued.items() if rid not in self._via_pd}
        if not plain or len(views) < 2 or max_moves == 0:
            return []
        if hook is None:
            return _off_slow_workers(plain, views, slow_workers(observed or {}, bound), max_moves)
        if observed is None and max_moves is None:
            return hook(plain, views, now)
        return hook(plain, views, now, observed=observed, bound=bound, max_moves=max_moves)

    def retry_prefill(self, feats: RequestFeatures, views: Sequence[WorkerView]) -> str | None:
        """Another prefill worker for a P/D request whose prefill leg failed (None: prefill locally)."""
        pd = self._pd_policy()
        return pd.choose_prefill(feats, views)[0] if pd is not None else None

    def retry_decode(self, feats: RequestFeatures, views: Sequence[WorkerView], now: float) -> str | None:
        """Another decode-capable worker for a P/D request whose decode leg failed before its first byte."""
        pd = self._pd_policy()
        return pd.choose_decode(feats, views, now).worker_id if pd is not None else None

    # --- feedback -------------------------------------------------------------------------------------
    def _owner(self, request_id: str) -> Policy:
        return self._pd if self._pd is not None and request_id in self._via_pd else self.policy

    def dispatched(self, feats: RequestFeatures, decision: Decision, now: float) -> bool:
        """The request was sent as decided (for P/D, `decision.worker_id` is its decode worker). Returns whether
        the P/D profile placed it (it runs as P/D legs, perhaps with a local prefill): the caller keeps that
        with the request (the gateway's request context)."""
        if self._pd is not None and (decision.prefill_worker_id is not None or decision.reason in _PD_REASONS):
            self._via_pd.add(feats.request_id)
            self._pd.on_dispatch(feats, decision.worker_id, now)
            return True
        self.policy.on_dispatch(feats, decision.worker_id, now)
        if self.shedder is not None:
            self.shedder.dispatched(feats, decision.worker_id, now)
        return False

    def moved(self, feats: RequestFeatures, old_worker: str, new_worker: str, now: float) -> None:
        """The request's (decode) worker changed before its first byte (a retry elsewhere)."""
        owner = self._owner(feats.request_id)
        owner.on_complete(feats, old_worker, now)
        owner.on_dispatch(feats, new_worker, now)
        if self.shedder is not None and owner is self.policy:
            self.shedder.moved(feats, old_worker, new_worker, now)

    def progress(self, feats: RequestFeatures, tokens: int, now: float) -> None:
        """`tokens` output tokens exist so far: 1 at the first token; the gateway's learning loop reports more
        now and then. Only policies that keep a ledger (`report_progress`) listen."""
        owner = self._owner(feats.request_id)
        hook = getattr(owner, "report_progress", None)
        if hook is not None:
            hook(feats.request_id, tokens, now)
        if self.shedder is not None and owner is self.policy:
            self.shedder.progress(feats, tokens, now)

    def finished(self, feats: RequestFeatures, worker_id: str, output_tokens: int, now: float,
                 slo_met: bool | None = None) -> None:
        """The request completed on `worker_id` with `output_tokens` tokens (0 when it failed or was aborted);
        `slo_met`: whether it met its SLO, where the caller judged it (policies that learn from outcomes hear
        it through `observe_outcome`)."""
        owner = self._owner(feats.request_id)
        if slo_met is not None:
            hook = getattr(owner, "observe_outcome", None)
            if hook is not None:
                hook(feats, worker_id, slo_met, now)
        if output_tokens > 0:
            if self.observe_length is not None:
                self.observe_length(feats.model, feats.prompt_tokens, output_tokens)
            hook = getattr(owner, "observe_completion", None)
            if hook is not None:
                hook(feats, output_tokens, now)
        owner.on_complete(feats, worker_id, now)
        if self.shedder is not None and owner is self.policy:
            self.shedder.finished(feats, worker_id, output_tokens, now)
        self._via_pd.discard(feats.request_id)


_PD_REASONS = frozenset({DISAGGREGATED, LOCAL_SHORT, LOCAL_CACHED, LOCAL_NO_PREFILL, LOCAL_OVERFLOW})
