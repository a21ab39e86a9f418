"""The status page's live numbers and their history, from this replica's own counters (no other service).

Every `status.sample_s` a task reads the cumulative series the gateway keeps anyway (requests by model and
status, the TTFT and TPOT histograms of gateway/ops/metrics.py, each worker's scraped generated-token counter) and
appends what changed since the previous sample to a ring buffer of `history_s / sample_s` points: memory is
bounded and a request costs nothing more than the counters it already moves. The current figures compare the
series now with the sample about `window_s` ago. Percentiles are interpolated within histogram buckets, as
Prometheus' histogram_quantile does, so they are as fine as the buckets (vLLM's, gateway/ops/metrics.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.ops.metrics import STATUS_CLIENT_GONE, TPOT_BUCKETS, TTFT_BUCKETS, GatewayMetrics
from gateway.state.outage import stop_task

if TYPE_CHECKING:
    from gateway.config import StatusConfig
    from gateway.fleet.registry import Registry

log = logging.getLogger("fleetgate.status")

MODEL_KEYS = ("request_rate", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "errors_429",
              "errors_5xx", "client_gone", "queue", "errors_4xx")
WORKER_KEYS = ("throughput_tokens_s", "inflight")


@dataclass(slots=True)
class Totals:
    """The cumulative series at one moment."""

    t: float                                    # unix time
    mono: float                                 # monotonic clock, for the differences
    requests: dict[tuple[str, int], float]      # (model, status) -> requests answered
    ttft: dict[str, tuple[float, ...]]          # model -> observations per TTFT bucket
    tpot: dict[str, tuple[float, ...]]
    tokens: dict[str, tuple[float, float]]      # worker -> (engine's generated tokens, its scrape time)
    responses: dict[tuple[str, int, str], float] = field(default_factory=dict)  # (model, status, reason) -> answers


@dataclass(slots=True)
class Point:
    """One history sample: what happened between two Totals, per model and per worker (values in MODEL_KEYS /
    WORKER_KEYS order)."""

    t: float
    models: dict[str, tuple[float | None, ...]]
    workers: dict[str, tuple[float | None, ...]]


def quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float | None:
    """The q-quantile of observations counted per bucket (`bounds` ascending, the last +Inf), interpolated
    linearly within its bucket; in the +Inf bucket, the largest finite bound. None without observations."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    below = 0.0
    for i, c in enumerate(counts):
        if c > 0 and below + c >= rank:
            if math.isinf(bounds[i]):
                return bounds[i - 1] if i > 0 else None
            lo = bounds[i - 1] if i > 0 else 0.0
            return lo + (bounds[i] - lo) * (rank - below) / c
        below += c
    return bounds[-2] if len(bounds) > 1 else None


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 3)


def _delta(new: tuple[float, ...] | None, old: tuple[float, ...] | None) -> tuple[float, ...]:
    if new is None:
        return ()
    if old is None or len(old) != len(new):
        return new
    return tuple(max(0.0, a - b) for a, b in zip(new, old, strict=True))


def model_figures(new: Totals, old: Totals, model: str) -> dict[str, float | None]:
    """Request rate, TTFT / TPOT p50 and p99 (ms) and error counts of one model between two Totals."""
    dt = new.mono - old.mono
    by_status: dict[int, float] = {}
    for (m, status), n in new.requests.items():
        if m == model:
            by_status[status] = n - old.requests.get((m, status), 0.0)
    ttft = _delta(new.ttft.get(model), old.ttft.get(model))
    tpot = _delta(new.tpot.get(model), old.tpot.get(model))
    bounds_ttft, bounds_tpot = (*TTFT_BUCKETS, math.inf), (*TPOT_BUCKETS, math.inf)
    return {
        "request_rate": round(sum(by_status.values()) / dt, 3) if dt > 0 else None,
        "ttft_p50_ms": _ms(quantile(0.5, bounds_ttft, ttft)), "ttft_p99_ms": _ms(quantile(0.99, bounds_ttft, ttft)),
        "tpot_p50_ms": _ms(quantile(0.5, bounds_tpot, tpot)), "tpot_p99_ms": _ms(quantile(0.99, bounds_tpot, tpot)),
        "errors_429": int(by_status.get(429, 0)),
        "errors_5xx": int(sum(n for s, n in by_status.items() if 500 <= s < 600)),
        "client_gone": int(by_status.get(STATUS_CLIENT_GONE, 0)),
        "errors_4xx": int(sum(n - old.responses.get((m, status, reason), 0.0)
                              for (m, status, reason), n in new.responses.items()
                              if m == model and 400 <= status < 500 and status not in (429, STATUS_CLIENT_GONE))),
    }


def error_table(new: Totals, old: Totals) -> list[dict[str, Any]]:
    """Every error answered between two Totals, per (model, status, reason), most frequent first."""
    rows = []
    for (model, status, reason), n in new.responses.items():
        count = int(n - old.responses.get((model, status, reason), 0.0))
        if status >= 400 and count > 0:
            rows.append({"model": model, "status": status, "reason": reason, "count": count})
    return sorted(rows, key=lambda r: (-r["count"], r["status"], r["model"], r["reason"]))


def worker_throughput(new: Totals, old: Totals, worker: str) -> float | None:
    """Output tokens per second the worker's engine generated between two Totals, by its counter as last
    scraped (None: not scraped in one of them, or the counter went back: the engine restarted)."""
    a, b = new.tokens.get(worker), old.tokens.get(worker)
    dt = new.mono - old.mono
    if a is None or b is None or dt <= 0 or a[0] < b[0]:
        return None
    return round((a[0] - b[0]) / dt, 2)


class StatusHistory:
    """The sampler and its ring buffer; `current()` and `describe()` feed `GET /ui/status.json`."""

    def __init__(self, config: StatusConfig, metrics: GatewayMetrics, registry: Registry,
                 queue_depth: Callable[[], Mapping[str, int]] = dict) -> None:
        self.config = config
        self.metrics = metrics
        self.registry = registry
        self.queue_depth = queue_depth      # model -> requests waiting in this replica's admission queue
        self.points: deque[Point] = deque(maxlen=max(1, math.ceil(config.history_s / config.sample_s)))
        self.recent: deque[Totals] = deque(maxlen=max(2, math.ceil(config.window_s / config.sample_s) + 1))
        self._task: asyncio.Task | None = None

    def totals(self) -> Totals:
        m = self.metrics
        tokens = {ws.id: (ws.metrics.generation_tokens, ws.metrics.scraped_at)
                  for ws in self.registry.workers.values() if ws.metrics.scraped_at > 0}
        return Totals(t=time.time(), mono=time.monotonic(), requests=m.requests_by_status(),
                      ttft=m.bucket_counts(m.ttft), tpot=m.bucket_counts(m.tpot), tokens=tokens,
                      responses=m.responses_by_reason())

    def sample(self) -> None:
        """Take one sample: a history point against the previous one (none for the very first)."""
        now = self.totals()
        if self.recent:
            prev = self.recent[-1]
            queues = self.queue_depth()
            inflight = self.registry.store.inflight()
            models = {m for m, _ in now.requests} | {m for m, _, _ in now.responses} | set(now.ttft) | set(queues)
            point_models = {}
            for model in sorted(models):
                f = model_figures(now, prev, model)
                f["queue"] = queues.get(model, 0)
                point_models[model] = tuple(f[k] for k in MODEL_KEYS)
            point_workers = {}
            for wid in sorted(self.registry.workers):
                f_in = inflight.get(wid)
                point_workers[wid] = (worker_throughput(now, prev, wid), f_in.requests if f_in else 0)
            self.points.append(Point(now.t, point_models, point_workers))
        self.recent.append(now)

    def current(self) -> tuple[float, dict[str, dict[str, float | None]], dict[str, float | None]]:
        """(seconds covered, per-model figures, per-worker tokens/s) from the oldest recent sample to now."""
        window_s, figures, throughput, _ = self.current_with_errors()
        return window_s, figures, throughput

    def current_with_errors(self) -> tuple[float, dict[str, dict[str, float | None]], dict[str, float | None],
                                           list[dict[str, Any]]]:
        """current(), and the errors over the same window (error_table)."""
        now = self.totals()
        old = self.recent[0] if self.recent else now
        models = {m for m, _ in now.requests} | {m for m, _, _ in now.responses} | set(now.ttft)
        figures = {m: model_figures(now, old, m) for m in models}
        throughput = {}
        for w in self.registry.workers:  # from the oldest sample that saw the worker scraped
            seen = next((t for t in self.recent if w in t.tokens), None)
            throughput[w] = worker_throughput(now, seen, w) if seen is not None else None
        return round(now.mono - old.mono, 3), figures, throughput, error_table(now, old)

    def describe(self) -> dict[str, Any]:
        """The ring buffer, one list per series (oldest first; None where there was nothing to measure)."""
        points = list(self.points)
        models = sorted({m for p in points for m in p.models})
        workers = sorted({w for p in points for w in p.workers})
        none_m, none_w = (None,) * len(MODEL_KEYS), (None,) * len(WORKER_KEYS)
        return {
            "sample_s": self.config.sample_s, "history_s": self.config.history_s, "t": [p.t for p in points],
            "models": {m: {k: [p.models.get(m, none_m)[i] for p in points] for i, k in enumerate(MODEL_KEYS)}
                       for m in models},
            "workers": {w: {k: [p.workers.get(w, none_w)[i] for p in points] for i, k in enumerate(WORKER_KEYS)}
                        for w in workers},
        }

    # --- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self.sample()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="fg-status-history")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.sample_s)
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - the status page's history must never stop the gateway
                log.exception("status history sample failed")
