"""Decode turns on one shared host (Aegaeon, SOSP 2025, section 4.3), pure: which model's engine runs now and
until when. The callers (the gateway's turn loop, gateway/control/turns.py, and the simulator's colocated turns,
simulator/pooled.py `_next_turns`) pass their clock, the models with requests in flight on the host, the
batches' step times and the switch costs; they carry the switches out and say when a new turn's engine runs
(`switched`).

One batch per model (instance = the host): the work list is `aegaeon.DecodeWorkLists` and a round's quotas are
its `round` (eq. 2-3 through `decode_quotas`). The turn-boundary rules, ours where the paper is silent:

- a model alone with work runs without a quota (no round, no switch) for as long as it is alone;
- when a second model gets work, a round starts with the running model's turn, its quota counted from when it
  began running alone: a model that ran alone for longer than its quota yields at once to the models that just
  got work (Aegaeon section 1: "preemptively scaling down active models and scaling up pending models for newly
  arrived requests": it decoded ahead of its TBT deadlines, their first tokens wait), one just switched in
  runs out its quota first (its switch is not wasted);
- a turn ends when its quota is spent (counted from the end of the switch that started it) or when its model
  has nothing in flight; the next turn of the round whose model still has work follows (empty batches are
  skipped);
- a model that gets work during a round joins the next one; the next round starts with the model after the
  one that ran last (round robin across rounds);
- with no work at all nothing switches: the engine that ran last stays awake.

How a pause between turns ended (`pause_outcome`), which decides whether the next engine may wake: at most one
engine of the host may be awake at once (on a host sized for one, two would run out of GPU memory), so the next
one wakes only after the old one paused, or when the old one is taken for dead (not answering at all: a dead
engine must not hold the other models back forever).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from policies.pooling.aegaeon import Q_MAX_S, DecodeBatch, DecodeWorkLists, RoundPlan, Turn

PAUSED, REFUSED, LOST = "paused", "refused", "lost"   # how a pause ended: the next may wake / may not / may

# Why the stock rule (eq. 2-3's quota with the switch alone in c) is refused over engines that drop the KV on
# sleep: the gateway's `shared_hosts[].recompute_quota: false` and `fleetgate simulate --no-recompute-quota` say it.
RECOMPUTE_OFF_REMOVED = (
    "recompute_quota false is not supported: stock vLLM drops a sleeping engine's KV, so a turn first "
    "recomputes it; a quota that does not count that recomputation can end before a token is decoded, and the "
    "turns starve as workers are added (16 Zipf models at 2 req/s: 17% of requests within their SLOs at 4 "
    "workers, 9% at 7; bench/results/pooling.md). The recomputation always counts as switching now: drop the key")


def pause_outcome(status: int | None, asleep: bool | None) -> str:
    """How a pause ended, from its HTTP status (None: no answer within its timeout) and, when it had none, the
    engine's own /is_sleeping asked afterwards (None: no answer either).

    200 is PAUSED. Any other answer is REFUSED: the engine answered, so it runs on (its turn goes on). A pause
    unanswered is not taken for a dead engine on its own: on a loaded machine a live engine answers late, and
    waking the next one while it is still awake puts two engines on the host at once. So the engine is asked:
    asleep is PAUSED (its pause went through, the answer was slow), awake is REFUSED (alive, still running: the
    switch is retried), and only no answer to that either is LOST (dead or hung: it loses its turn and the next
    engine wakes)."""
    if status == 200:
        return PAUSED
    if status is not None:
        return REFUSED
    if asleep is None:
        return LOST
    return PAUSED if asleep else REFUSED


@dataclass(frozen=True, slots=True)
class TurnDecision:
    """`model`: the model whose engine should run now (None: none yet); `quota_s`: its turn's quota (None: it
    runs alone, or nothing has work); `new_turn`: a turn starts with this decision (count it)."""

    model: str | None
    quota_s: float | None
    new_turn: bool = False


class HostTurns:
    """The turn keeper of one host (module docstring). `tbt_s`: the TBT target d of eq. 2-3."""

    def __init__(self, host: str, tbt_s: float, q_max_s: float = Q_MAX_S) -> None:
        if tbt_s <= 0 or q_max_s <= 0:
            raise ValueError("tbt_s and q_max_s must be > 0")
        self.host = host
        self.tbt_s = tbt_s
        self.lists = DecodeWorkLists([host], lambda model: 1, q_max_s)   # KV room for one entry: a batch per model
        self.current: str | None = None
        self.quota_s: float | None = None
        self.turn_end: float | None = None
        self.alone_since: float | None = None   # when the model running alone started running
        self.pending: deque[Turn] = deque()
        self.order: list[str] = []          # the models of the last round, in turn order
        self.rounds = 0

    @property
    def last_round(self) -> RoundPlan | None:
        return self.lists.last_round

    def decide(self, now: float, work: Mapping[str, int], step_time: Callable[[str, int], float],
               switch_cost: Callable[[str, str], float]) -> TurnDecision:
        """The model to run now. `work`: requests in flight per model (models not usable left out);
        `step_time(model, n)`: one decode step of the model's batch of n; `switch_cost(a, b)`: seconds from
        a's engine running to b's."""
        active = {m for m, n in work.items() if n > 0}
        self._sync(active)
        if not active:
            self.pending.clear()
            self.quota_s = self.turn_end = None
            return TurnDecision(self.current, None)
        if len(active) == 1:
            (model,) = active
            self.pending.clear()
            new = model != self.current
            if new or self.quota_s is not None:                   # an alone run starts (`switched` says when)
                self.alone_since = None if new else now
            self.current, self.quota_s, self.turn_end = model, None, None
            return TurnDecision(model, None, new)
        if self.current in active:
            if self.quota_s is None:        # it ran alone: the round starts with its turn, counted from then
                turns = self._round(step_time, work, switch_cost, first=self.current)
                turn = turns.popleft()
                self.pending, self.quota_s = turns, turn.quota_s
                self.turn_end = (self.alone_since if self.alone_since is not None else now) + turn.quota_s
            if self.turn_end is None or now < self.turn_end:      # its switch is under way, or quota left
                return TurnDecision(self.current, self.quota_s)
        while self.pending and self.pending[0].model not in active:
            self.pending.popleft()                                # skip batches emptied meanwhile
        if not self.pending:
            self.pending = deque(self._round(step_time, work, switch_cost, first=self._next_model(active)))
        return self._start(now, self.pending)

    def switched(self, now: float) -> None:
        """The new turn's engine runs (the switch to it is done, or none was needed): its quota counts from now.
        The caller says so after every decision with `new_turn`."""
        if self.quota_s is not None:
            self.turn_end = now + self.quota_s
        else:
            self.alone_since = now

    def _start(self, now: float, turns: deque[Turn]) -> TurnDecision:
        turn = turns.popleft()
        self.pending = turns
        self.current, self.quota_s, self.turn_end = turn.model, turn.quota_s, None   # `switched` starts the clock
        return TurnDecision(turn.model, turn.quota_s, True)

    def _sync(self, active: set[str]) -> None:
        """One batch per model with work in the work list, none for the others."""
        for b in list(self.lists.work[self.host]):
            if b.model not in active:
                self.lists.remove(b.model)
        for m in sorted(active):
            if self.lists.batch_of(m) is None:
                self.lists.place(m, m, 1)

    def _round(self, step_time: Callable[[str, int], float], work: Mapping[str, int],
               switch_cost: Callable[[str, str], float], first: str) -> deque[Turn]:
        """Algorithm 2 lines 5-8 over the models with work (eq. 2-3 quotas), rotated to start with `first`."""
        self.rounds += 1

        def step(b: DecodeBatch) -> float:
            return step_time(b.model, work[b.model])

        turns = self.lists.round(self.host, step, self.tbt_s, lambda a, b: switch_cost(a.model, b.model))
        i = next(k for k, t in enumerate(turns) if t.model == first)
        turns = turns[i:] + turns[:i]
        self.order = [t.model for t in turns]
        return deque(turns)

    def _next_model(self, active: set[str]) -> str:
        """The model after the one that ran last, in the last round's order (new models after those)."""
        order = [m for m in self.order if m in active or m == self.current]
        order += [b.model for b in self.lists.work[self.host] if b.model not in order]
        if self.current in order:
            i = order.index(self.current)
            order = order[i + 1:] + order[:i + 1]
        return next(m for m in order if m in active)
