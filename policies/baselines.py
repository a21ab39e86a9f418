"""Baseline routing policies: what users of other routers expect (docs/design.md, "Policies").

Each `choose` looks only at the candidates it is given (already healthy, serving the model and under
cap), is O(candidates), never reads a clock and is deterministic for a given seed.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence

from policies.base import Policy, register
from policies.prefix import PrefixIndex
from policies.types import Decision, RequestFeatures, WorkerView

NO_CANDIDATES = Decision(None, "no_candidates")
_M64 = (1 << 64) - 1
_TWO64 = float(1 << 64)


def _rotating_min(workers: Sequence[WorkerView], key, last_id: str | None) -> WorkerView:
    """The worker with the smallest key; among equals, the first id after `last_id` (cyclic by id).

    Without the rotation, equal loads would always send a burst to the same worker.
    """
    best_key = None
    after: WorkerView | None = None  # smallest tied id > last_id
    first: WorkerView | None = None  # smallest tied id overall (wrap-around)
    for w in workers:
        k = key(w)
        if best_key is None or k < best_key:
            best_key, first, after = k, w, None
            if last_id is not None and w.id > last_id:
                after = w
        elif k == best_key:
            if w.id < first.id:
                first = w
            if last_id is not None and w.id > last_id and (after is None or w.id < after.id):
                after = w
    return after or first  # type: ignore[return-value]


def _load(w: WorkerView) -> int:
    return w.load


def _zero(w: WorkerView) -> int:
    return 0


class _RotatingMinPolicy(Policy):
    """The candidate with the smallest `key`, equals rotating by id (`_rotating_min`); the reason is the name."""

    key = staticmethod(_zero)

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float) -> Decision:
        if not workers:
            return NO_CANDIDATES
        w = _rotating_min(workers, self.key, self._last)
        self._last = w.id
        return Decision(w.id, self.name)


@register("round_robin")
class RoundRobin(_RotatingMinPolicy):
    """Cycle through candidate ids in sorted order; robust to candidates joining or leaving."""

    name = "round_robin"


@register("weighted_round_robin")
class WeightedRoundRobin(Policy):
    """Round robin in proportion to `WorkerView.weight`: smooth weighted round robin (nginx's upstream
    algorithm): every candidate gains its weight, the one with the most credit is chosen and pays the
    candidates' total weight. Weights 4:1 give A A B A A, A A B A A, ...; a worker leaving or rejoining
    the candidates keeps its credit, so the proportions hold when the candidate set changes."""

    name = "weighted_round_robin"

    def __init__(self) -> None:
        self._credit: dict[str, float] = {}

    def choose(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float) -> Decision:
        if not workers:
            return NO_CANDIDATES
        credit = self._credit
        total = 0.0
        best: WorkerView | None = None
        best_credit = -math.inf
        uniform = not any(w.weight > 0 and math.isfinite(w.weight) for w in workers)  # no usable weights
        for w in workers:
            weight = 1.0 if uniform else w.weight if w.weight > 0 and math.isfinite(w.weight) else 0.0
            total += weight
            c = credit.get(w.id, 0.0) + weight
            credit[w.id] = c
            if c > best_credit or (c == best_credit and best is not None and w.id < best.id):
                best, best_credit = w, c
        credit[best.id] = best_credit - total  # type: ignore[union-attr]
        if len(credit) > 4 * len(workers) + 64:  # forget workers that left long ago
            live = {w.id for w in workers}
            self._credit = {k: v for k, v in credit.items() if k in live}
        return Decision(best.id, "weighted_round_robin")  # type: ignore[union-attr]


@register("random")
class RandomChoice(Policy):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float) -> Decision:
        if not workers:
            return NO_CANDIDATES
        return Decision(workers[self._rng.randrange(len(workers))].id, "random")


@register("least_requests")
class LeastRequests(_RotatingMinPolicy):
    """Join the shortest queue on `WorkerView.load`; equal loads rotate by id."""

    name = "least_requests"
    key = staticmethod(_load)


def _tokens_then_load(w: WorkerView) -> tuple[int, int]:
    return (w.inflight_tokens, w.load)


@register("least_tokens")
class LeastTokens(_RotatingMinPolicy):
    """Fewest tokens in flight (`WorkerView.inflight_tokens`: the prompt and predicted output of every request
    reserved on the worker), then fewest requests, then rotation by id: the default.

    Counting requests treats a 123k-token prompt like a 1k one, so on long-context traffic least_requests piles
    long prefills onto one worker and the decodes running there miss their TPOT; tokens in flight weigh each
    request by the prefill and KV memory it costs.
    """

    name = "least_tokens"
    key = staticmethod(_tokens_then_load)


@register("power_of_two")
class PowerOfTwo(Policy):
    """Sample two distinct candidates, take the less loaded (Mitzenmacher's power of two choices)."""

    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float) -> Decision:
        n = len(workers)
        if n == 0:
            return NO_CANDIDATES
        if n == 1:
            return Decision(workers[0].id, "power_of_two")
        i = self._rng.randrange(n)
        j = self._rng.randrange(n - 1)
        if j >= i:
            j += 1
        a, b = workers[i], workers[j]
        return Decision((b if b.load < a.load else a).id, "power_of_two")


def _kv_then_load(w: WorkerView) -> tuple[float, int]:
    return (w.kv_usage, w.load)


@register("least_kv")
class LeastKV(_RotatingMinPolicy):
    """Lowest scraped KV-cache usage; ties by load, then rotation."""

    name = "least_kv"
    key = staticmethod(_kv_then_load)


def _overloaded(w: WorkerView, min_load: int, guard_factor: float, slack: float) -> bool:
    """Load guard shared by the affinity policies: affinity yields when the target is far above the minimum."""
    return w.load > guard_factor * (min_load + 1) + slack


def _stable_hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


def _mix64(x: int) -> int:
    # splitmix64 finalizer (Steele et al., "Fast splittable pseudorandom number generators", 2014)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


@register("session_affinity")
class SessionAffinity(Policy):
    """Same session -> same worker, by weighted rendezvous (highest-random-weight) hashing.

    Rendezvous hashing is consistent hashing without a ring: each candidate scores
    -weight / ln(u(session, worker)) and the highest wins (Thaler & Ravishankar 1998; weighted form:
    Schindelhauer & Schomaker 2005). Removing a worker moves only its own sessions (~1/N), adding one
    takes ~1/N, and it needs no per-candidate-set ring, which matters because the candidate set changes
    whenever a worker reaches its cap. No session id -> least_requests. Load guard: if the hashed
    worker's load exceeds guard_factor x (min load + 1) + slack, the least loaded worker is used.
    """

    name = "session_affinity"

    def __init__(self, guard_factor: float = 2.0, slack: float = 4.0) -> None:
        self.guard_factor = guard_factor
        self.slack = slack
        self._fallback = LeastRequests()
        self._worker_hash: dict[str, int] = {}

    def _whash(self, worker_id: str) -> int:
        h = self._worker_hash.get(worker_id)
        if h is None:
            if len(self._worker_hash) > 100_000:
                self._worker_hash.clear()
            h = self._worker_hash[worker_id] = _stable_hash64(worker_id)
        return h

    def target(self, session_id: str, workers: Sequence[WorkerView]) -> WorkerView:
        """The worker the session hashes to, ignoring load."""
        s = _stable_hash64(session_id)
        best, best_score = workers[0], -math.inf
        for w in workers:
            u = (_mix64(s ^ self._whash(w.id)) + 0.5) / _TWO64
            score = -w.weight / math.log(u) if w.weight > 0 else -math.inf
            if score > best_score:
                best, best_score = w, score
        return best

    def choose(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float) -> Decision:
        if not workers:
            return NO_CANDIDATES
        if not request.session_id:
            return Decision(self._fallback.choose(request, workers, now).worker_id, "no_session")
        w = self.target(request.session_id, workers)
        min_load = min(x.load for x in workers)
        if _overloaded(w, min_load, self.guard_factor, self.slack):
            return Decision(self._fallback.choose(request, workers, now).worker_id, "session_load_guard")
        return Decision(w.id, "session_hash")


@register("prefix_affinity")
class PrefixAffinity(Policy):
    """Longest matching prompt prefix, from an approximate per-worker index of what was sent where.

    As production-stack `prefixaware` / llm-d's approximate prefix scorer (docs/reference/peer-routers.md §1.1, §2.1),
    plus a load guard: below `min_match_chunks`, or when the best match is overloaded (load >
    guard_factor x (min load + 1) + slack), fall back to least_requests. Among equally long matches the
    least loaded wins. The chosen worker's index learns the request's chunks in `on_dispatch`.
    """

    name = "prefix_affinity"
    needs_prefix_hashes = True   # the caller fills RequestFeatures.prefix_hashes for it

    def __init__(
        self,
        min_match_chunks: int = 2,
        guard_factor: float = 2.0,
        slack: float = 4.0,
        max_entries_per_worker: int = 20_000,
    ) -> None:
        self.min_match_chunks = max(1, min_match_chunks)
        self.guard_factor = guard_factor
        self.slack = slack
        self.index = PrefixIndex(max_entries_per_worker)
        self._fallback = LeastRequests()

    def choose(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float) -> Decision:
        if not workers:
            return NO_CANDIDATES
        hashes = request.prefix_hashes
        best: WorkerView | None = None
        best_len = 0
        min_load = None
        if hashes:
            match_len = self.index.match_len
            for w in workers:
                load = w.load
                if min_load is None or load < min_load:
                    min_load = load
                m = match_len(w.id, hashes)
                if m > best_len or (m == best_len and m and load < best.load):  # type: ignore[union-attr]
                    best, best_len = w, m
        if best is None or best_len < self.min_match_chunks:
            return Decision(self._fallback.choose(request, workers, now).worker_id, "prefix_miss")
        if _overloaded(best, min_load, self.guard_factor, self.slack):  # type: ignore[arg-type]
            return Decision(self._fallback.choose(request, workers, now).worker_id, "prefix_load_guard")
        return Decision(best.id, "prefix_hit")

    def on_dispatch(self, request: RequestFeatures, worker_id: str, now: float) -> None:
        if request.prefix_hashes and worker_id:
            self.index.record(worker_id, request.prefix_hashes)
