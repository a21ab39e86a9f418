"""The scale signal: how many more (empty) workers the requests that found no fit need.

Aladdin section 4.1 and appendix E.2 size the fleet by packing the demand into workers under the same
constraints as placement; here only the requests no current worker takes are packed, first-fit into fresh
bins under constraints (b), (c) and, conservatively, (e) on their final sizes.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from policies.perf_model import PerfModel
from policies.slo_targets import SloTarget


@dataclass(slots=True, frozen=True)
class Unplaced:
    """A request that found no fit: when, its prompt and predicted output, its SLO and its workers' model."""

    since: float
    l_in: int
    lp: float
    slo: SloTarget
    model: PerfModel


class FreshBin:
    """Aggregates of requests that would start together on an empty worker."""

    __slots__ = ("n", "s_in", "s_sq", "s_ctx", "s_tok", "t_dec", "t_pre")

    def __init__(self) -> None:
        self.n, self.s_in, self.s_sq, self.s_ctx, self.s_tok = 0, 0.0, 0.0, 0.0, 0.0
        self.t_dec, self.t_pre = math.inf, math.inf

    def add(self, l_in: int, lp: float, slo: SloTarget, m: PerfModel, gamma: float, theta: float,
            force: bool = False) -> bool:
        n, s_in, s_ctx, s_tok = self.n + 1, self.s_in + l_in, self.s_ctx + l_in + gamma * lp, self.s_tok + l_in + lp
        s_sq = self.s_sq + float(l_in) * l_in
        t_dec, t_pre = min(self.t_dec, slo.atgt_s), min(self.t_pre, slo.ttft_s)
        fits = (n <= m.max_batch and s_ctx <= theta * m.context_limit(n, t_dec)   # (b), eq. 4
                and m.prefill_time(s_in, s_sq) <= t_pre                             # (c), eq. 2
                and m.kv_blocks(s_tok, n) <= m.kv_capacity)                         # (e) at final sizes
        if fits or force:
            self.n, self.s_in, self.s_sq, self.s_ctx, self.s_tok = n, s_in, s_sq, s_ctx, s_tok
            self.t_dec, self.t_pre = t_dec, t_pre
        return fits


class UnplacedSet:
    """The requests that found no fit in the last `ttl_s` (oldest first) and the workers they need."""

    def __init__(self, ttl_s: float, gamma: float, theta: float) -> None:
        self.ttl_s, self.gamma, self.theta = ttl_s, gamma, theta
        self._items: OrderedDict[str, Unplaced] = OrderedDict()
        self._count: int | None = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._items

    def note(self, request_id: str, item: Unplaced, now: float) -> None:
        """The request found no fit at `now`; entries older than `ttl_s` leave first."""
        while self._items:
            first = next(iter(self._items.values()))
            if now - first.since <= self.ttl_s:
                break
            self._items.popitem(last=False)
        self._items.pop(request_id, None)
        self._items[request_id] = item
        self._count = None

    def placed(self, request_id: str) -> None:
        """The request was placed: it leaves the set and the count is redone."""
        if request_id in self._items:
            del self._items[request_id]
            self._count = None

    def drop(self, request_id: str) -> None:
        """The request was placed by a best effort or the fallback: it leaves the set; the count stays as it
        was until the next change (as the policy has always done)."""
        self._items.pop(request_id, None)

    @property
    def shortfall(self) -> int:
        if self._count is None:
            bins: list[FreshBin] = []
            for u in self._items.values():
                for b in bins:
                    if b.add(u.l_in, u.lp, u.slo, u.model, self.gamma, self.theta):
                        break
                else:
                    b = FreshBin()
                    b.add(u.l_in, u.lp, u.slo, u.model, self.gamma, self.theta, force=True)
                    bins.append(b)
            self._count = len(bins)
        return self._count
