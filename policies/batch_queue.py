"""Deadline-ordered batch queue (pure data structure) and Chiron's queue waiting-time estimate.

    q = BatchQueue()
    q.push("b-1", deadline=3600.0, payload=req, prompt_tokens=812)
    item = q.peek(); q.pop()                  # earliest deadline first, FCFS among equal deadlines
    q.requeue(item)                           # an evicted request goes back to its old place
    groups = request_groups(q.deadline_counts(), span_s=300.0)
    w = estimate_wait(q_ahead, mean_out, std_out, tokens_per_s)   # Chiron eq. 1, normal approximation

No clock and no I/O: deadlines are absolute seconds on whatever clock the caller uses. The live gateway
keeps the queue durable in the state store and can rebuild this structure from it; the virtual-time
simulator uses it directly.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

# One-sided normal quantile used for "the queue finishes by its deadline with 95% confidence".
Z_95 = 1.6448536269514722


@dataclass(order=True, slots=True)
class QueuedItem:
    deadline: float
    seq: int
    request_id: str = field(compare=False)
    payload: Any = field(default=None, compare=False)
    prompt_tokens: int = field(default=0, compare=False)


@dataclass(frozen=True, slots=True)
class RequestGroup:
    """Requests with similar deadlines, served together (Chiron section 5.3, Algorithm 2)."""

    deadline: float          # earliest deadline in the group (the binding one)
    latest: float            # latest deadline in the group
    count: int               # requests in this group
    cumulative: int          # requests in this group and every earlier group (all are served first)


class BatchQueue:
    """Earliest deadline first; FCFS among equal deadlines; lazy removal for cancellations."""

    def __init__(self) -> None:
        self._heap: list[QueuedItem] = []
        self._live: dict[str, QueuedItem] = {}
        self._by_deadline: Counter[float] = Counter()
        self._prompt_tokens = 0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def __iter__(self) -> Iterator[QueuedItem]:
        """Live items in service order (sorts a copy: O(n log n), for inspection, not the hot path)."""
        return iter(sorted(self._live.values()))

    @property
    def prompt_tokens(self) -> int:
        """Sum of the queued requests' prompt tokens."""
        return self._prompt_tokens

    def push(self, request_id: str, deadline: float, payload: Any = None, prompt_tokens: int = 0) -> QueuedItem:
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already queued")
        if not math.isfinite(deadline):
            raise ValueError(f"deadline must be a finite number, got {deadline!r}")
        if prompt_tokens < 0:
            raise ValueError("prompt_tokens must be >= 0")
        item = QueuedItem(deadline, next(self._seq), request_id, payload, prompt_tokens)
        self._add(item)
        return item

    def requeue(self, item: QueuedItem) -> None:
        """Put a popped item back with its original deadline and sequence number (its old place)."""
        if item.request_id in self._live:
            raise ValueError(f"request {item.request_id!r} is already queued")
        self._add(item)

    def _add(self, item: QueuedItem) -> None:
        heapq.heappush(self._heap, item)
        self._live[item.request_id] = item
        self._by_deadline[item.deadline] += 1
        self._prompt_tokens += item.prompt_tokens

    def _prune(self) -> None:
        heap = self._heap
        while heap and self._live.get(heap[0].request_id) is not heap[0]:
            heapq.heappop(heap)

    def peek(self) -> QueuedItem | None:
        self._prune()
        return self._heap[0] if self._heap else None

    def pop(self) -> QueuedItem:
        self._prune()
        if not self._heap:
            raise IndexError("pop from an empty batch queue")
        item = heapq.heappop(self._heap)
        self._forget(item)
        return item

    def remove(self, request_id: str) -> QueuedItem | None:
        """Cancel a queued request (lazy: its heap entry is skipped later). None if it is not queued."""
        item = self._live.get(request_id)
        if item is not None:
            self._forget(item)
        return item

    def _forget(self, item: QueuedItem) -> None:
        del self._live[item.request_id]
        n = self._by_deadline[item.deadline] - 1
        if n:
            self._by_deadline[item.deadline] = n
        else:
            del self._by_deadline[item.deadline]
        self._prompt_tokens -= item.prompt_tokens

    def deadline_counts(self) -> list[tuple[float, int]]:
        """(deadline, number of queued requests) for each distinct deadline, earliest first."""
        return sorted(self._by_deadline.items())


# ---- waiting-time estimate ------------------------------------------------------------------------
def estimate_wait(q: int, mean_tokens: float, std_tokens: float, tokens_per_s: float, z: float = Z_95) -> float:
    """Seconds to generate the output of q requests at `tokens_per_s`.

    Chiron eq. 1 (section 5.3, after QLM): W_q = sum_{i<q} O_i / Theta. The O_i are unknown, so their sum
    is taken as normal by the CLT: mean q*mu, std sqrt(q)*sigma; z picks the one-sided quantile (z=0: mean).
    """
    if q <= 0:
        return 0.0
    if tokens_per_s <= 0:
        return math.inf
    return (q * mean_tokens + z * std_tokens * math.sqrt(q)) / tokens_per_s


def request_groups(counts: Sequence[tuple[float, int]], span_s: float, max_groups: int = 16) -> list[RequestGroup]:
    """Cluster queued requests by deadline (Chiron section 5.3: k-means over TTFT deadlines, MacQueen 1967).

    `counts` is (deadline, requests) sorted by deadline (BatchQueue.deadline_counts). The number of groups k
    is the smallest for which 1-D weighted k-means leaves every group's deadline spread <= span_s (at most
    max_groups); in 1-D the clusters are contiguous runs of the sorted deadlines.
    """
    if span_s < 0:
        raise ValueError("span_s must be >= 0")
    pts = [(float(d), int(n)) for d, n in counts if n > 0]
    if not pts:
        return []
    if any(pts[i][0] > pts[i + 1][0] for i in range(len(pts) - 1)):
        pts.sort()
    best: list[list[tuple[float, int]]] = [pts]
    for k in range(1, min(max_groups, len(pts)) + 1):
        best = _kmeans_1d(pts, k)
        if all(g[-1][0] - g[0][0] <= span_s for g in best):
            break
    out: list[RequestGroup] = []
    total = 0
    for g in best:
        n = sum(c for _, c in g)
        total += n
        out.append(RequestGroup(g[0][0], g[-1][0], n, total))
    return out


def _kmeans_1d(pts: list[tuple[float, int]], k: int, iterations: int = 50) -> list[list[tuple[float, int]]]:
    """Weighted Lloyd iterations on sorted 1-D points; centroids start at evenly spaced distinct points."""
    m = len(pts)
    if k >= m:
        return [[p] for p in pts]
    cents = [pts[round(i * (m - 1) / (k - 1))][0] if k > 1 else 0.0 for i in range(k)]
    if k == 1:
        return [pts]
    assign: list[int] = []
    for _ in range(iterations):
        new = []
        j = 0
        for x, _ in pts:     # points and centroids are both sorted: advance a pointer
            while j + 1 < k and abs(cents[j + 1] - x) < abs(cents[j] - x):
                j += 1
            new.append(j)
        if new == assign:
            break
        assign = new
        sums = [0.0] * k
        weights = [0] * k
        for (x, w), a in zip(pts, assign, strict=True):
            sums[a] += x * w
            weights[a] += w
        cents = [sums[i] / weights[i] if weights[i] else cents[i] for i in range(k)]
    groups: list[list[tuple[float, int]]] = [[] for _ in range(k)]
    for p, a in zip(pts, assign, strict=True):
        groups[a].append(p)
    return [g for g in groups if g]
