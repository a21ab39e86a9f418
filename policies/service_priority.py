"""Service-aware request priority for several services sharing engines: SeaLLM's doubling-budget (DB) order and
the two baselines it is measured against, FCFS and round robin over services. Pure: the caller passes its clock;
the gateway (admission-queue order and vLLM's `priority` field) and the simulator run this same code.

SeaLLM (Service-aware and latency-optimized LLM sharing; docs/reference/seallm-scheduling.md §3 has the rules in our
words):

- Each service s keeps a profile of its requests' execution cost, learned online: the mean L̂_s and the spread
  Var_s (the paper's "standard variance": the standard deviation) (section 4.2).
- A request r of service s starts with the budget Q = L̂_s + Var_s. Its priority is O_r = Q_r · L̂_s, Q_r the
  budget left; the smallest O_r runs first (section 4.2, from the c-mu rule of appendix A.2, eq. 13).
- The budget shrinks as the request executes. When it is used up, the budget doubles, Q' = 2(L̂_s + Var_s), and
  the priority is reset to Q'·L̂_s; again at 4(L̂_s + Var_s), and so on until the request finishes (section 4.2;
  Algorithm 2, UpdateBudget / UpdatePriority).
- Each service has a starvation threshold; requests of a starved service are served first (section 4.2;
  Algorithm 2, GetHighestPriorityOrStarvedRequest). Here a request is starved when it has made no progress for
  its service's threshold (seconds on the caller's clock): it then goes ahead of all not-starved requests,
  oldest first, until it finishes.

"Execution cost" is in decode-iteration equivalents, the same unit for the profile and the budget, so the order
does not depend on how loaded the engines were when the profile was learned: `execution_cost(prompt, generated)`
= generated tokens + prompt tokens x `prompt_token_cost` (one decode iteration of an 8B model on an H100 takes
about as long as prefilling 256 prompt tokens: simulator/profiles/llama3-8b-h100.yaml, 5.3-7.3 ms per step vs
24 us per prompt token).

Virtual Token Counter (`vtc`; Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024): fair sharing
between tenants (here: services) measured in the tokens each has been served; see VirtualTokenCounterScheduler.

Every scheduler answers `key(request_id, now)`: a tuple, smaller first (the admission queue's order), and
`engine_priority(request_id, now)`: vLLM's integer `priority` (smaller first; vLLM fixes it when the request
arrives, so re-prioritising a running request needs the caller's preemption, simulator only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

SERVICE_PRIORITIES = ("fcfs", "round_robin", "seallm", "vtc")
DEFAULT_PROMPT_TOKEN_COST = 1.0 / 256.0   # decode iterations per prompt token (see the module docstring)
DEFAULT_PRIOR_COST = 256.0                # L̂ of a service with no finished request yet (decode iterations)
DEFAULT_STARVATION_S = 10.0               # a service's starvation threshold when none is configured
DEFAULT_MAX_SAMPLES = 1000                # the profile is exact Welford up to here, then an EWMA of that weight


def execution_cost(prompt_tokens: int, generated_tokens: float,
                   prompt_token_cost: float = DEFAULT_PROMPT_TOKEN_COST) -> float:
    """A request's execution in decode-iteration equivalents: its generated tokens plus its prompt's prefill."""
    return float(generated_tokens) + prompt_tokens * prompt_token_cost


@dataclass(slots=True)
class ServiceProfile:
    """Mean and standard deviation of one service's execution cost, learned online.

    Welford's update with weight 1/n up to `max_samples` samples, then with the fixed weight 1/max_samples (an
    exponentially weighted mean and variance, so a service whose lengths drift is followed). The variance is
    the population variance (weight 1/n), so one sample gives a spread of 0."""

    prior: float = DEFAULT_PRIOR_COST
    max_samples: int = DEFAULT_MAX_SAMPLES
    n: int = 0
    mean: float = 0.0
    var: float = 0.0

    def observe(self, cost: float) -> None:
        self.n += 1
        w = 1.0 / min(self.n, self.max_samples)
        delta = cost - self.mean
        self.mean += w * delta
        self.var = (1.0 - w) * (self.var + w * delta * delta)

    @property
    def expected(self) -> float:
        """L̂_s: the learned mean, the prior before any sample."""
        return self.mean if self.n else self.prior

    @property
    def spread(self) -> float:
        """Var_s: the standard deviation; the prior (a coefficient of variation of 1) before any sample."""
        return math.sqrt(self.var) if self.n else self.prior


@dataclass(slots=True)
class _Tracked:
    """One request between its arrival and its finish."""

    service: str
    arrival: float
    seq: int                      # arrival order among all requests (ties)
    last_progress: float          # when it arrived or last executed (starvation clock)
    executed: float = 0.0         # execution cost so far
    rank: float = 0.0             # round robin: its tag; seallm: L̂_s at arrival
    base_budget: float = 0.0      # seallm: Q = L̂_s + Var_s at arrival
    level: int = 0                # seallm: how many times the budget doubled
    level_start: float = 0.0      # seallm: `executed` when the current budget began
    starved: bool = False         # seallm: it went without progress for its service's threshold (sticky)
    prompt_tokens: int = 0        # as the caller told at arrival (vtc charges them when the request starts)
    queued: bool = True           # vtc: arrived, not yet started (its tenant is backlogged)
    charged_output: float = 0.0   # vtc: output tokens already added to its tenant's counter
    charged_at: float | None = None  # vtc: when it started, then when its output was last charged


class ServiceScheduler:
    """FCFS: the order of arrival, whatever the service (the baseline of SeaLLM's section 6; AlpaServe's order)."""

    name = "fcfs"

    def __init__(self, prompt_token_cost: float = DEFAULT_PROMPT_TOKEN_COST, prior_cost: float = DEFAULT_PRIOR_COST,
                 max_samples: int = DEFAULT_MAX_SAMPLES) -> None:
        if prompt_token_cost < 0 or not prior_cost > 0 or max_samples < 1:
            raise ValueError("prompt_token_cost >= 0, prior_cost > 0 and max_samples >= 1 are required")
        self.prompt_token_cost = prompt_token_cost
        self.prior_cost = prior_cost
        self.max_samples = max_samples
        self.profiles: dict[str, ServiceProfile] = {}
        self._reqs: dict[str, _Tracked] = {}
        self._seq = 0

    # ---- what the caller reports -------------------------------------------------------------------
    def arrived(self, request_id: str, service: str, now: float, prompt_tokens: int = 0) -> None:
        """A request of `service` with `prompt_tokens` arrived (before it is queued or sent to an engine)."""
        self._seq += 1
        t = _Tracked(service, now, self._seq, now, prompt_tokens=prompt_tokens)
        self._reqs[request_id] = t
        self._init(t, now)

    def progressed(self, request_id: str, prompt_tokens: int, generated_tokens: float, now: float) -> None:
        """The request has executed its prompt and `generated_tokens` output tokens so far."""
        t = self._reqs.get(request_id)
        if t is None:
            return
        cost = execution_cost(prompt_tokens, generated_tokens, self.prompt_token_cost)
        if cost > t.executed:
            t.executed = cost
            t.last_progress = now
            self._update(t)

    def started(self, request_id: str, now: float) -> None:
        """The request left the queue for an engine (round robin's turn moves on)."""

    def finished(self, request_id: str, prompt_tokens: int, generated_tokens: int, now: float,
                 completed: bool = True) -> None:
        """The request ended; a completed one teaches its service's profile its execution cost."""
        t = self._reqs.pop(request_id, None)
        if t is None or not completed:
            return
        self.profile(t.service).observe(execution_cost(prompt_tokens, generated_tokens, self.prompt_token_cost))

    def forget(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    # ---- what the caller asks ----------------------------------------------------------------------
    def key(self, request_id: str, now: float) -> tuple[float, ...]:
        """Sort key of a request, smaller first (unknown ids last)."""
        t = self._reqs.get(request_id)
        if t is None:
            return (math.inf, math.inf)
        return self._key(t, now)

    def engine_priority(self, request_id: str, now: float) -> int:
        """vLLM's `priority` for the request (smaller first; ties by arrival in the engine)."""
        return 0

    def preemptible(self, request_id: str, now: float) -> bool:
        """May a running request be preempted for a better one? (Only a preemptive engine asks: simulator only.)"""
        return True

    def profile(self, service: str) -> ServiceProfile:
        p = self.profiles.get(service)
        if p is None:
            p = self.profiles[service] = ServiceProfile(self.prior_cost, self.max_samples)
        return p

    def __len__(self) -> int:
        return len(self._reqs)

    def __bool__(self) -> bool:
        """A scheduler is true even when it tracks no request (callers test `if service_priority` for "given")."""
        return True

    # ---- what subclasses change --------------------------------------------------------------------
    def _init(self, t: _Tracked, now: float) -> None:
        pass

    def _update(self, t: _Tracked) -> None:
        pass

    def _key(self, t: _Tracked, now: float) -> tuple[float, ...]:
        return (t.arrival, t.seq)


class RoundRobinScheduler(ServiceScheduler):
    """Round robin over services (MuxServe's order across services, FCFS within one; SeaLLM section 2.2).

    Start-time fair queueing with a unit cost per request: a request's tag is one more than the larger of its
    service's last tag and the tag of the last request sent to an engine, so backlogged services take turns one
    request each and an idle service saves up no turns."""

    name = "round_robin"

    def __init__(self, **params: float) -> None:
        super().__init__(**params)
        self._last_tag: dict[str, float] = {}
        self._virtual = 0.0

    def _init(self, t: _Tracked, now: float) -> None:
        t.rank = max(self._last_tag.get(t.service, 0.0), self._virtual) + 1.0
        self._last_tag[t.service] = t.rank

    def started(self, request_id: str, now: float) -> None:
        t = self._reqs.get(request_id)
        if t is not None:
            self._virtual = max(self._virtual, t.rank - 1.0)

    def _key(self, t: _Tracked, now: float) -> tuple[float, ...]:
        return (t.rank, t.seq)

    def engine_priority(self, request_id: str, now: float) -> int:
        t = self._reqs.get(request_id)
        return int(t.rank) if t is not None else 0


class DoublingBudgetScheduler(ServiceScheduler):
    """SeaLLM's DB order (Algorithm 2 of appendix A.2; see the module docstring for the rules)."""

    name = "seallm"

    def __init__(self, starvation_s: Mapping[str, float] | None = None,
                 default_starvation_s: float = DEFAULT_STARVATION_S, **params: float) -> None:
        super().__init__(**params)
        if not default_starvation_s > 0 or any(not v > 0 for v in (starvation_s or {}).values()):
            raise ValueError("starvation thresholds must be > 0 seconds")
        self.starvation_s = dict(starvation_s or {})
        self.default_starvation_s = default_starvation_s

    def _init(self, t: _Tracked, now: float) -> None:
        p = self.profile(t.service)
        t.rank = p.expected                      # L̂_s
        t.base_budget = p.expected + p.spread    # Q = L̂_s + Var_s (InitBudget)

    def budget(self, request_id: str) -> tuple[float, float]:
        """(the current budget, what is left of it) of a tracked request."""
        t = self._reqs[request_id]
        size = t.base_budget * (1 << t.level)
        return size, size - (t.executed - t.level_start)

    def _update(self, t: _Tracked) -> None:
        # UpdateBudget: a used-up budget doubles (2Q, then 4Q, ...) and starts afresh.
        size = t.base_budget * (1 << t.level)
        while t.executed - t.level_start >= size:
            t.level_start += size
            t.level += 1
            size *= 2.0

    def order(self, request_id: str) -> float:
        """O_r = Q_r · L̂_s of a tracked request (UpdatePriority)."""
        t = self._reqs[request_id]
        return self._order(t)

    @staticmethod
    def _order(t: _Tracked) -> float:
        size = t.base_budget * (1 << t.level)
        return (size - (t.executed - t.level_start)) * t.rank

    def starved(self, request_id: str, now: float) -> bool:
        t = self._reqs.get(request_id)
        return t is not None and self._starved(t, now)

    def _starved(self, t: _Tracked, now: float) -> bool:
        # Sticky: a starved request keeps the lead until it finishes, else it would lose it (and, in a preemptive
        # engine, its KV) at its first step and starve again.
        if not t.starved:
            t.starved = now - t.last_progress >= self.starvation_s.get(t.service, self.default_starvation_s)
        return t.starved

    def preemptible(self, request_id: str, now: float) -> bool:
        """Only a request that outran its first budget, i.e. deviates from its service's profile (the case the
        doubling budget is for, section 4.2), and is not starved: preempting in-profile requests would cost their
        KV for priorities that the profile already ordered at admission."""
        t = self._reqs.get(request_id)
        return t is not None and t.level > 0 and not self._starved(t, now)

    def _key(self, t: _Tracked, now: float) -> tuple[float, ...]:
        if self._starved(t, now):
            return (0.0, t.arrival, t.seq)
        return (1.0, self._order(t), t.seq)

    def engine_priority(self, request_id: str, now: float) -> int:
        t = self._reqs.get(request_id)
        if t is None:
            return 0
        return 0 if self._starved(t, now) else 1 + math.ceil(self._order(t))


class VirtualTokenCounterScheduler(ServiceScheduler):
    """VTC: the waiting request of the tenant (service) with the smallest virtual token counter goes first (Sheng et
    al., "Fairness in Serving Large Language Models", OSDI 2024, arXiv:2401.00588: its VTC algorithm for continuous
    batching and the weighted variant; the rules below follow the authors' public artifact,
    github.com/Ying1123/VTC-artifact, slora/server/router/vtc_req_queue.py, whose section and algorithm numbers in
    the paper we have not re-checked).

    - Counter: a tenant's counter c_u grows by (input tokens x w_in + output tokens x w_out) / weight_u as it is
      served: the prompt when one of its requests leaves the queue for an engine (`started`), the output tokens as
      the caller reports them (`progressed`, once per engine step in the simulator when it re-prioritises) and at
      the latest at `finished` (the live gateway reports output at the finish only). w_in = 1 and w_out = 2 by
      default (the paper's prices); weight_u from `weights`, default `default_weight`.
    - Counter lift (when a request arrives): a tenant with no request queued is not backlogged; when its
      request arrives, c_u = max(c_u, min of the backlogged tenants' counters), or when no tenant is backlogged,
      max(c_u, the counter of the tenant that left the queue last). An idle tenant so banks no credit. (The
      artifact's queue applies the first case only; the second keeps a tenant returning to an empty system from
      undercutting the one served just before it.)
    - Output charged late: the artifact charges each output token at the step that makes it, so a lift takes the
      max over all the service received before it. A caller that reports output later (at the finish, or every
      few steps) would charge the tokens made before a lift on top of it, and a tenant whose earlier request was
      still running when it came back would pay for them twice. So a late charge is spread evenly over the time
      since the request's previous charge (its start at first), and the part that falls before a lift of its
      tenant is absorbed by what that lift added (its slack), as the max would have; what a lift's slack cannot
      absorb carries over to the tenant's next lift. With per-step reports nothing changes.
    - Order: queued requests of one tenant in arrival order; across tenants the smallest counter first. The caller
      sorts its queue once per drain, so a request's key is its tenant's counter plus the input charge of the
      tenant's requests queued ahead of it (what the counter will be when it is its turn): one sort places the
      requests as VTC's repeated argmin would, up to the output charged by finishes during the drain.
    - Non-preemptive (`preemptible` is False) and work-conserving: the order only sorts the queue; whoever is first
      is placed as soon as any worker can take it.
    - It composes with SLO-aware placement: the order decides which waiting request is placed next, the placement
      policy (Aladdin, least-load, ...) decides on which worker, and may still leave it queued when no worker can
      meet its SLO (the next one in VTC order is tried, up to the queue's lookahead).
    - `engine_priority`: the tenant's counter (rounded down) when the request starts, for engines that order their
      own waiting queue by vLLM's `priority`.
    """

    name = "vtc"

    def __init__(self, weights: Mapping[str, float] | None = None, input_weight: float = 1.0,
                 output_weight: float = 2.0, default_weight: float = 1.0, **params: float) -> None:
        super().__init__(**params)
        if input_weight < 0 or output_weight < 0 or not default_weight > 0:
            raise ValueError("vtc needs input_weight >= 0, output_weight >= 0 and default_weight > 0")
        if any(not w > 0 for w in (weights or {}).values()):
            raise ValueError("vtc weights must be > 0")
        self.weights = dict(weights or {})
        self.default_weight = default_weight
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.counters: dict[str, float] = {}
        self._queued: dict[str, int] = {}          # tenant -> its requests arrived and not started
        self._queued_in: dict[str, float] = {}     # tenant -> input charge of all its requests ever queued
        self._left_in: dict[str, float] = {}       # tenant -> input charge of those that left the queue
        self._last_left: str | None = None         # the tenant that stopped being backlogged last
        self._lifts: dict[str, list[list[float]]] = {}   # tenant -> [time, slack left] of its lifts, oldest first

    def weight(self, service: str) -> float:
        return self.weights.get(service, self.default_weight)

    def counter(self, service: str) -> float:
        return self.counters.get(service, 0.0)

    def backlogged(self, service: str) -> bool:
        return self._queued.get(service, 0) > 0

    def _input_charge(self, t: _Tracked) -> float:
        return t.prompt_tokens * self.input_weight / self.weight(t.service)

    def _init(self, t: _Tracked, now: float) -> None:
        u = t.service
        if not self.backlogged(u):   # VTC's counter lift
            others = [self.counters.get(v, 0.0) for v, n in self._queued.items() if n > 0 and v != u]
            if others:
                floor = min(others)
            else:
                floor = self.counters.get(self._last_left, 0.0) if self._last_left is not None else 0.0
            c = self.counters.get(u, 0.0)
            if floor > c:
                self.counters[u] = floor
                if any(r.service == u and r.charged_at is not None for r in self._reqs.values()):
                    self._lifts.setdefault(u, []).append([now, floor - c])   # a running request may owe output
        self._queued[u] = self._queued.get(u, 0) + 1
        t.rank = self._queued_in.get(u, 0.0)       # the input charge queued before it
        self._queued_in[u] = t.rank + self._input_charge(t)

    def _leave(self, t: _Tracked) -> None:
        if not t.queued:
            return
        t.queued = False
        u = t.service
        self._queued[u] -= 1
        self._left_in[u] = self._left_in.get(u, 0.0) + self._input_charge(t)
        if self._queued[u] == 0:
            self._last_left = u

    def _charge_output(self, t: _Tracked, generated: float, now: float) -> None:
        if generated <= t.charged_output:
            return
        u = t.service
        charge = (generated - t.charged_output) * self.output_weight / self.weight(u)
        since = t.charged_at if t.charged_at is not None else now
        self.counters[u] = self.counters.get(u, 0.0) + charge - self._absorbed(u, charge, since, now)
        t.charged_output = generated
        t.charged_at = now

    def _absorbed(self, u: str, charge: float, since: float, now: float) -> float:
        """How much of `charge`, made evenly over [since, now], the lifts of `u` inside that span took already."""
        lifts = self._lifts.get(u)
        if not lifts or now <= since:
            return 0.0
        absorbed, carry, prev = 0.0, 0.0, since
        for lift in lifts:
            at, slack = lift
            if at <= since:
                continue
            if at > now:
                break
            carry += charge * (at - prev) / (now - since)   # made between the previous lift and this one
            prev = at
            took = min(carry, slack)
            lift[1] -= took
            absorbed += took
            carry -= took
        # a lift no later charge can reach (every running request of u was charged after it) is dropped
        oldest = min((r.charged_at for r in self._reqs.values() if r.service == u and r.charged_at is not None),
                     default=now)
        self._lifts[u] = [x for x in lifts if x[1] > 0 and x[0] > oldest]
        return absorbed

    def started(self, request_id: str, now: float) -> None:
        t = self._reqs.get(request_id)
        if t is not None and t.queued:
            self._leave(t)
            self.counters[t.service] = self.counters.get(t.service, 0.0) + self._input_charge(t)
            t.charged_at = now

    def progressed(self, request_id: str, prompt_tokens: int, generated_tokens: float, now: float) -> None:
        t = self._reqs.get(request_id)
        if t is None:
            return
        self.started(request_id, now)
        self._charge_output(t, generated_tokens, now)

    def finished(self, request_id: str, prompt_tokens: int, generated_tokens: int, now: float,
                 completed: bool = True) -> None:
        t = self._reqs.get(request_id)
        if t is not None:
            self.started(request_id, now)          # a caller that never reported the start
            self._charge_output(t, generated_tokens, now)
        super().finished(request_id, prompt_tokens, generated_tokens, now, completed)

    def forget(self, request_id: str) -> None:
        """The request never ran (refused): it leaves the queue without any charge."""
        t = self._reqs.pop(request_id, None)
        if t is not None:
            self._leave(t)

    def preemptible(self, request_id: str, now: float) -> bool:
        return False

    def _key(self, t: _Tracked, now: float) -> tuple[float, ...]:
        c = self.counters.get(t.service, 0.0)
        if t.queued:
            c += max(0.0, t.rank - self._left_in.get(t.service, 0.0))
        return (c, t.seq)

    def engine_priority(self, request_id: str, now: float) -> int:
        t = self._reqs.get(request_id)
        return max(0, math.floor(self.counters.get(t.service, 0.0))) if t is not None else 0


_SCHEDULERS: dict[str, type[ServiceScheduler]] = {
    "fcfs": ServiceScheduler, "round_robin": RoundRobinScheduler, "seallm": DoublingBudgetScheduler,
    "vtc": VirtualTokenCounterScheduler,
}


def make_service_scheduler(name: str, **params: object) -> ServiceScheduler:
    """A scheduler by name (`fcfs`, `round_robin`, `seallm`, `vtc`) with its keyword parameters."""
    cls = _SCHEDULERS.get(name)
    if cls is None:
        raise ValueError(f"unknown service priority {name!r}; use one of {', '.join(SERVICE_PRIORITIES)}")
    return cls(**params)   # type: ignore[arg-type]

