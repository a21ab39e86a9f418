"""Aegaeon's token-level scheduling (Aegaeon, SOSP 2025, section 4), pure: the caller passes every time and
tells the scheduler what ran.

Prefill (section 4.2, Algorithm 1, `GroupedPrefill`): each prefill instance keeps a job queue of groups, a
group holding up to MAX_GPSIZE (8) requests of one model. A new request joins an existing group of its model
that has room (the group's size counts every request it ever took, so executing one does not reopen it:
this keeps the order close to FCFS); otherwise it starts a new group at the end of the least loaded queue,
the load being the time to run all pending groups, execution plus model switches (appendix A.2 estimates,
passed in). Instances execute one request at a time from the front group.

Decode (section 4.3, Algorithm 2, `DecodeWorkLists`): each decode instance keeps a work list of batches,
one model per batch, a batch's size bounded by the KV cache the instance's GPU holds. A new decode request
joins a batch of its model with room, else opens a batch on the instance with the shortest work list. Work
runs in rounds: at a round's start the list is reordered so batches of one model are adjacent, and batch i
gets the time quota of eq. 2-3 (`decode_quotas`); then each batch decodes for its quota (a turn), the host
switching models between turns.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

MAX_GPSIZE = 8        # section 4.2: grid-searched; larger groups seldom form
Q_MAX_S = 4.0         # section 4.3: the largest time quota of one turn
MIN_ALPHA = 0.5       # eq. 3's floor: an estimated SLO attainment of at most 200% per round


@dataclass(frozen=True, slots=True)
class PrefillJob:
    request_id: str
    model: str
    prompt_tokens: int


@dataclass(slots=True)
class PrefillGroup:
    """Requests of one model queued together; `size` counts every request the group ever took."""

    model: str
    jobs: deque[PrefillJob] = field(default_factory=deque)
    size: int = 0


class GroupedPrefill:
    """Algorithm 1 over the prefill instances. `exec_time(job)` estimates a prefill's seconds, `switch_time(model)`
    the seconds to bring `model` onto an instance (appendix A.2, eq. 4-5); `loaded(instance, model)` tells the
    scheduler which model an instance holds now (the load estimate charges a switch where the model changes)."""

    def __init__(self, instances: Sequence[str], exec_time: Callable[[PrefillJob], float],
                 switch_time: Callable[[str], float], max_group_size: int = MAX_GPSIZE) -> None:
        if not instances:
            raise ValueError("grouped prefill needs at least one prefill instance")
        if max_group_size < 1:
            raise ValueError("max_group_size must be >= 1")
        self.instances = list(instances)
        self.exec_time = exec_time
        self.switch_time = switch_time
        self.max_group_size = max_group_size
        self.queues: dict[str, deque[PrefillGroup]] = {i: deque() for i in self.instances}
        self.resident: dict[str, str | None] = dict.fromkeys(self.instances)

    def loaded(self, instance: str, model: str | None) -> None:
        self.resident[instance] = model

    def load(self, instance: str) -> float:
        """Seconds to run every pending group of the instance, switches included (Algorithm 1 line 9)."""
        total = 0.0
        current = self.resident[instance]
        for g in self.queues[instance]:
            if g.model != current:
                total += self.switch_time(g.model)
                current = g.model
            total += sum(self.exec_time(j) for j in g.jobs)
        return total

    def place(self, job: PrefillJob) -> str:
        """Algorithm 1 lines 1-13: the instance whose queue now holds the job."""
        for inst in self.instances:
            for g in self.queues[inst]:
                if g.model == job.model and g.size < self.max_group_size:
                    g.jobs.append(job)
                    g.size += 1
                    return inst
        best = min(self.instances, key=self.load)     # first of the least loaded on ties, as line 10's `<`
        self.queues[best].append(PrefillGroup(job.model, deque([job]), 1))
        return best

    def next_job(self, instance: str) -> PrefillJob | None:
        """Line 15: the next request to prefill on the instance (batch size one), from its front group."""
        queue = self.queues[instance]
        while queue and not queue[0].jobs:
            queue.popleft()
        if not queue:
            return None
        job = queue[0].jobs.popleft()
        if not queue[0].jobs:
            queue.popleft()
        return job

    def peek_model(self, instance: str) -> str | None:
        """The model of the next job `next_job` would return (what a prefetch should bring; section 5.2)."""
        return next((g.model for g in self.queues[instance] if g.jobs), None)

    def remove(self, request_id: str) -> bool:
        """Drop a queued job (its client went away); True if it was queued."""
        for queue in self.queues.values():
            for g in queue:
                for j in g.jobs:
                    if j.request_id == request_id:
                        g.jobs.remove(j)
                        return True
        return False

    def pending(self, instance: str) -> int:
        return sum(len(g.jobs) for g in self.queues[instance])


def decode_alpha(step_times: Sequence[float], tbt_s: float, switch_total_s: float, q_max_s: float = Q_MAX_S) -> float:
    """Eq. 3: alpha = max(c / (min_k n_k * Q_MAX) + sum_k 1/n_k, 0.5), n_k = d / t_k.

    What it means for a request's mean TPOT (our derivation from eq. 2, used to check the quota against a
    per-request TPOT SLO): batch i decodes q_i / t_i = c / (d (alpha - S)) tokens per round (S = sum_k 1/n_k),
    the round lasts R = c + sum_k q_k = c alpha / (alpha - S), so over whole rounds every batch's mean time per
    output token is R / (q_i / t_i) = alpha x d. The mean TPOT of a long request meets the TBT target iff
    alpha <= 1; a request of L tokens that waits W for its batch's turn (up to R - q_i) meets it only if
    W <= L (d - t_i), which short answers cannot when rounds are long."""
    if not step_times:
        return MIN_ALPHA
    if tbt_s <= 0 or q_max_s <= 0 or switch_total_s < 0 or any(t <= 0 for t in step_times):
        raise ValueError("tbt_s, q_max_s and step times must be > 0, switch_total_s >= 0")
    n = [tbt_s / t for t in step_times]
    return max(switch_total_s / (min(n) * q_max_s) + sum(1.0 / x for x in n), MIN_ALPHA)


def decode_quotas(step_times: Sequence[float], tbt_s: float, switch_total_s: float,
                  q_max_s: float = Q_MAX_S) -> list[float]:
    """Eq. 2-3 of section 4.3: the time quota of each batch of a round.

    n_k = d / t_k (d the TBT target, t_k batch k's step time) is how many steps of slack one step earns;
    alpha (`decode_alpha`, eq. 3) is the reciprocal of the round's estimated SLO attainment (c: the round's
    total switching time), and q_i = c / (n_i (alpha - sum_k 1/n_k)).
    With nothing to switch (c = 0) every batch gets Q_MAX: the round is all execution.
    """
    if not step_times:
        return []
    alpha = decode_alpha(step_times, tbt_s, switch_total_s, q_max_s)
    if switch_total_s == 0:
        return [q_max_s] * len(step_times)
    n = [tbt_s / t for t in step_times]
    inv = sum(1.0 / x for x in n)
    return [switch_total_s / (x * (alpha - inv)) for x in n]


@dataclass(slots=True)
class DecodeBatch:
    """Requests of one model decoding together on one instance; `requests`: id -> KV tokens it may need."""

    batch_id: str
    model: str
    instance: str
    capacity_tokens: int
    requests: dict[str, int] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(self.requests.values())


@dataclass(frozen=True, slots=True)
class Turn:
    batch_id: str
    model: str
    quota_s: float


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """What `DecodeWorkLists.round` planned last: the round's switching time c, eq. 3's alpha, the batches' step
    times and quotas (for reports: R = c + sum q, each batch's wait R - q_i)."""

    switch_s: float
    alpha: float
    step_times: tuple[float, ...]
    quotas: tuple[float, ...]

    @property
    def round_s(self) -> float:
        return self.switch_s + sum(self.quotas)


class DecodeWorkLists:
    """Algorithm 2 over the decode instances. `capacity_tokens(model)` is the KV a batch of that model may hold
    (the GPU's KV cache when the model runs alone)."""

    def __init__(self, instances: Sequence[str], capacity_tokens: Callable[[str], int], q_max_s: float = Q_MAX_S) -> None:
        if not instances:
            raise ValueError("decode work lists need at least one decode instance")
        self.instances = list(instances)
        self.capacity_tokens = capacity_tokens
        self.q_max_s = q_max_s
        self.work: dict[str, list[DecodeBatch]] = {i: [] for i in self.instances}
        self.batches: dict[str, DecodeBatch] = {}
        self._batch_of: dict[str, DecodeBatch] = {}
        self._ids = itertools.count()
        self.last_round: RoundPlan | None = None

    def place(self, request_id: str, model: str, tokens: int) -> DecodeBatch:
        """Algorithm 2 line 2: a batch of the model with KV room, else a new batch on the shortest work list."""
        for inst in self.instances:
            for b in self.work[inst]:
                if b.model == model and b.tokens + tokens <= b.capacity_tokens:
                    return self._join(b, request_id, tokens)
        best = min(self.instances, key=lambda i: len(self.work[i]))
        b = DecodeBatch(f"{best}/b{next(self._ids)}", model, best, max(self.capacity_tokens(model), tokens))
        self.work[best].append(b)
        self.batches[b.batch_id] = b
        return self._join(b, request_id, tokens)

    def _join(self, b: DecodeBatch, request_id: str, tokens: int) -> DecodeBatch:
        b.requests[request_id] = tokens
        self._batch_of[request_id] = b
        return b

    def batch_of(self, request_id: str) -> DecodeBatch | None:
        return self._batch_of.get(request_id)

    def remove(self, request_id: str) -> DecodeBatch | None:
        """The request finished (or went away); an emptied batch leaves its work list. Returns its batch."""
        b = self._batch_of.pop(request_id, None)
        if b is None:
            return None
        del b.requests[request_id]
        if not b.requests:
            self.work[b.instance].remove(b)
            del self.batches[b.batch_id]
        return b

    def following(self, instance: str, batch_id: str | None) -> DecodeBatch | None:
        """The batch after `batch_id` in the instance's work list, cyclically: the next round's first turn when a
        round ends (rounds continue the round robin), what a prefetch during the last turn should bring."""
        batches = self.work[instance]
        if not batches:
            return None
        i = next((k for k, b in enumerate(batches) if b.batch_id == batch_id), -1)
        return batches[(i + 1) % len(batches)]

    def round(self, instance: str, step_time: Callable[[DecodeBatch], float], tbt_s: float,
              switch_cost: Callable[[DecodeBatch, DecodeBatch], float], last_batch_id: str | None = None) -> list[Turn]:
        """Lines 5-8: reorder the work list so one model's batches are adjacent (first-seen order), and give each
        batch its quota. `switch_cost(prev, nxt)` is the time to go from batch prev to batch nxt (weights when
        the model changes, the KV of nxt coming back); c sums it around the round. Rounds continue the round
        robin: with `last_batch_id` (the batch that ran last), the round starts with the model after it."""
        batches = self.work[instance]
        if not batches:
            return []
        order: dict[str, list[DecodeBatch]] = {}
        for b in batches:
            order.setdefault(b.model, []).append(b)
        batches[:] = [b for group in order.values() for b in group]
        last = next((i for i, b in enumerate(batches) if b.batch_id == last_batch_id), None)
        if last is not None:
            batches[:] = batches[last + 1:] + batches[:last + 1]
        c = sum(switch_cost(batches[i - 1], b) for i, b in enumerate(batches)) if len(batches) > 1 else 0.0
        steps = [step_time(b) for b in batches]
        quotas = decode_quotas(steps, tbt_s, c, self.q_max_s)
        self.last_round = RoundPlan(c, decode_alpha(steps, tbt_s, c, self.q_max_s), tuple(steps), tuple(quotas))
        return [Turn(b.batch_id, b.model, q) for b, q in zip(batches, quotas, strict=True)]
