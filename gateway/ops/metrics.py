"""The gateway's Prometheus series, on a registry of its own (several gateways can live in one process).

Bucket boundaries follow vLLM 0.11 where a vLLM series exists (docs/reference/vllm-interface.md §3.2), so
gateway and engine histograms line up in Grafana. Label children are cached: the hot path does a
dict lookup, never `labels(...)`. The per-request series (requests, duration, routing, TTFT, TPOT,
queue wait) are buffered: the hot path appends a number to a list, and the buffers are added to the
prometheus objects in bulk whenever the registry is collected (a scrape) and every FLUSH_EVERY
observations, so a scrape always sees every request that finished before it.

No `*_created` series: prometheus_client's creation timestamps are switched off for the whole process when this
module is imported, so for every registry in a gateway process (this one, the series other modules add to it,
and simulated workers the sim actuator starts in-process). `fleetgate sim` (the demos' workers) runs without
the gateway and keeps them, as vLLM does.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.metrics import disable_created_metrics

from engine_adapters.types import SLEEP_STATES as ENGINE_STATES

disable_created_metrics()

SWAP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# vllm:e2e_request_latency_seconds (docs/reference/vllm-interface.md §3.2)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vllm:time_to_first_token_seconds (docs/reference/vllm-interface.md §3.2)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vllm:time_per_output_token_seconds / inter_token_latency_seconds (docs/reference/vllm-interface.md §3.2)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
# Routing decisions take microseconds; start at 10 us.
ROUTING_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


RECENT_UNKNOWN = 10  # unknown model names kept for the status page
FLUSH_EVERY = 512  # buffered observations per series before they are added without waiting for a scrape


class _HistogramBuffer:
    """Observations of one labelled histogram child not yet added to it."""

    __slots__ = ("child", "values", "_bulk")

    def __init__(self, child) -> None:  # noqa: ANN001 - a prometheus Histogram child
        self.child = child
        self.values: list[float] = []
        # Bulk update through the child's own value cells when this prometheus_client has them, else one
        # observe() per value (same result, just slower).
        self._bulk = all(hasattr(child, a) for a in ("_upper_bounds", "_buckets", "_sum"))

    def add(self, value: float) -> None:
        values = self.values
        values.append(value)
        if len(values) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        values, self.values = self.values, []
        if not values:
            return
        child = self.child
        if not self._bulk:
            for v in values:
                child.observe(v)
            return
        bounds = child._upper_bounds
        counts = [0] * len(bounds)
        for v in values:
            if v == v:  # prometheus puts a NaN in no bucket (its sum still takes it)
                counts[bisect.bisect_left(bounds, v)] += 1  # the first bucket with v <= le, as observe()
        child._sum.inc(sum(values))
        buckets = child._buckets
        for i, c in enumerate(counts):
            if c:
                buckets[i].inc(c)


class _CounterBuffer:
    __slots__ = ("child", "n")

    def __init__(self, child) -> None:  # noqa: ANN001 - a prometheus Counter child
        self.child = child
        self.n = 0

    def add(self) -> None:
        self.n += 1
        if self.n >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        n, self.n = self.n, 0
        if n:
            self.child.inc(n)


class RecentNames:
    """The last `size` model names clients asked for that the gateway does not serve, with how often and when
    (the status page lists them; the metrics count them all under one label, so their number is bounded)."""

    def __init__(self, size: int = RECENT_UNKNOWN, max_len: int = 128) -> None:
        self.size, self.max_len = size, max_len
        self._names: dict[str, tuple[int, float]] = {}   # name -> (count, last seen, unix time); oldest first

    def add(self, name: str, now: float) -> None:
        name = name[: self.max_len]
        count, _ = self._names.pop(name, (0, 0.0))
        self._names[name] = (count + 1, now)
        while len(self._names) > self.size:
            del self._names[next(iter(self._names))]

    def describe(self) -> list[dict[str, object]]:
        """Latest first."""
        return [{"model": n, "count": c, "last_seen": t} for n, (c, t) in reversed(self._names.items())]


class _Flusher:
    """Registered first, so collecting the registry adds every buffered observation before any series is read."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        self.metrics.flush()
        return iter(())


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self._histograms: dict[tuple[int, str], _HistogramBuffer] = {}
        self._counters: dict[tuple[str, str, int], _CounterBuffer] = {}
        self._responses: dict[tuple[str, int, str], _CounterBuffer] = {}
        self.unknown_models = RecentNames()
        r.register(_Flusher(self))
        self.requests = Counter("fleetgate_requests", "Requests answered, by model, policy and HTTP status.",
                                ["model", "policy", "status"], registry=r)
        self.responses = Counter(
            "fleetgate_responses", "Answers by model, HTTP status, its class (2xx, 4xx, 5xx) and reason: the error "
            "code the client got (model_not_found, invalid_api_key, rate_limit_exceeded, capacity_exceeded, "
            "slo_unattainable, request_too_large, no_route, ...), `worker` for a worker's own status relayed, `client_gone` (499), "
            "`stream_broken`, `ok`. Also the gateway's answers outside the proxy routes (no route, other APIs' "
            "errors). A model the gateway does not serve is `_unknown`.", ["model", "status", "class", "reason"],
            registry=r)
        self.duration = Histogram("fleetgate_request_duration_seconds",
                                  "Time from request arrival to the last byte sent.", ["model"],
                                  buckets=E2E_BUCKETS, registry=r)
        self.ttft = Histogram("fleetgate_time_to_first_token_seconds",
                              "Time from request arrival to the first output token relayed (streams).",
                              ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("fleetgate_time_per_output_token_seconds",
                              "Mean time per output token after the first, per streamed request.",
                              ["model"], buckets=TPOT_BUCKETS, registry=r)
        self.routing = Histogram("fleetgate_routing_seconds",
                                 "Time to pick a worker: candidates, policy, reservation.", ["model"],
                                 buckets=ROUTING_BUCKETS, registry=r)
        self.queue_wait = Histogram("fleetgate_queue_wait_seconds",
                                    "Time spent in the admission queue by requests that had to wait.",
                                    ["model"], buckets=QUEUE_BUCKETS, registry=r)
        self.queue_depth = Gauge("fleetgate_queue_depth",
                                 "Requests waiting: class interactive in this replica's admission queue, class "
                                 "batch in the shared batch queue.", ["model", "class"], registry=r)
        self.worker_inflight = Gauge("fleetgate_worker_inflight",
                                     "Requests reserved on the worker (all gateway replicas).", ["worker"],
                                     registry=r)
        self.worker_healthy = Gauge("fleetgate_worker_healthy", "1 if the worker is in rotation, else 0.",
                                    ["worker"], registry=r)
        self._engine_models: dict[str, tuple[str, ...]] = {}
        self.engine_state = Gauge("fleetgate_engine_state",
                                  "1 for the worker engine's sleep state per served model (awake, paused, "
                                  "weights_offloaded, discard_all), from its vllm:engine_sleep_state.",
                                  ["worker", "model", "state"], registry=r)
        # Shared hosts (gateway/control/pooling.py): model swaps and how long one took (sleep of the engine swapped out, if
        # any, plus the wake-up of the one swapped in).
        self.model_swaps = Counter("fleetgate_model_swaps", "Engines swapped on shared hosts: direction in (woken) "
                                   "or out (put to sleep).", ["model", "direction"], registry=r)
        self.swap_seconds = Histogram("fleetgate_swap_seconds", "Time a model swap on a shared host took (the "
                                      "engine put to sleep, if any, and the one woken).", ["host"],
                                      buckets=SWAP_BUCKETS, registry=r)
        self.turns = Counter("fleetgate_turns", "Decode turns started on shared hosts with scheduling: turns "
                             "(Aegaeon section 4.3; gateway/control/turns.py), per host and model.", ["host", "model"],
                             registry=r)
        self.upstream_errors = Counter("fleetgate_upstream_errors", "Failures talking to a worker, by kind.",
                                       ["worker", "kind"], registry=r)
        self.retries = Counter("fleetgate_retries", "Requests re-sent to another worker after a failure.",
                               ["model"], registry=r)
        self.fallbacks = Counter("fleetgate_fallbacks", "Requests moved to a fallback model before their first "
                                 "byte: from `model` to `to`, and why (no_worker, refused, error, timeout, "
                                 "context_window).", ["model", "to", "reason"], registry=r)
        self.stream_breaks = Counter(
            "fleetgate_stream_breaks", "Streams whose worker failed after the client got bytes, by what happened "
            "next: resumed (continued on another worker), completed (only the end was missing), ended (an error "
            "event: no worker or no attempt left), not_resumable (n > 1, logprobs, structured output, ...).",
            ["model", "outcome"], registry=r)
        # Backpressure and autoscaling (gateway/control/autoscaler.py); every replica exports the leader's numbers.
        self.queue_wait_estimate = Gauge("fleetgate_queue_wait_estimate_seconds",
                                         "Estimated wait of a request joining the queue now (batch: Chiron eq. 1).",
                                         ["class"], registry=r)
        self.backpressure = Gauge("fleetgate_backpressure",
                                  "Chiron backpressure: lbp / tbp (max over the pool's workers), ibp, bbp.",
                                  ["kind", "pool"], registry=r)
        self.desired_workers = Gauge("fleetgate_desired_workers", "Workers the autoscaler wants per pool.",
                                     ["pool"], registry=r)
        self.current_workers = Gauge("fleetgate_current_workers",
                                     "Workers per pool: taking traffic plus starting (not draining).", ["pool"],
                                     registry=r)
        self.scale_actions = Counter("fleetgate_scale_actions", "Scale actions (workers added or removed).",
                                     ["pool", "direction", "reason"], registry=r)
        self.worker_batch_cap = Gauge("fleetgate_worker_batch_cap",
                                      "Per-worker cap on concurrent requests (Chiron Algorithm 1).", ["worker"],
                                      registry=r)
        self.state_store_up = Gauge("fleetgate_state_store_up",
                                    "1 while the state store (Redis when shared) answers, else 0 (local accounting).",
                                    ["store"], registry=r)
        self.autoscaler_leader = Gauge("fleetgate_autoscaler_leader",
                                       "1 on the replica holding the autoscaler lease, else 0.", registry=r)
        self._children: dict[tuple, object] = {}

    # --- cached label children ---------------------------------------------------------------
    def _child(self, metric, *labels: str):  # noqa: ANN001, ANN202 - metric family -> its child
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    # --- buffered per-request series ---------------------------------------------------------------
    def _histogram(self, metric: Histogram, model: str) -> _HistogramBuffer:
        key = (id(metric), model)
        buf = self._histograms.get(key)
        if buf is None:
            buf = self._histograms[key] = _HistogramBuffer(self._child(metric, model))
        return buf

    def flush(self) -> None:
        """Add every buffered observation to its series (runs when the registry is collected)."""
        for buf in [*self._histograms.values(), *self._counters.values(), *self._responses.values()]:
            buf.flush()

    def count_request(self, model: str, policy: str, status: int) -> None:
        key = (model, policy, status)
        buf = self._counters.get(key)
        if buf is None:
            buf = self._counters[key] = _CounterBuffer(self._child(self.requests, model, policy, str(status)))
        buf.add()

    def count_response(self, model: str, status: int, reason: str) -> None:
        key = (model, status, reason)
        buf = self._responses.get(key)
        if buf is None:
            child = self._child(self.responses, model, str(status), f"{status // 100}xx", reason)
            buf = self._responses[key] = _CounterBuffer(child)
        buf.add()

    def responses_by_reason(self) -> dict[tuple[str, int, str], float]:
        """Answers so far per (model, HTTP status, reason) (the status page's error table)."""
        return {k: buf.child._value.get() + buf.n for k, buf in self._responses.items()}  # noqa: SLF001

    def requests_by_model(self) -> dict[str, float]:
        """Requests answered so far per model, any status (what the re-planner reads as arrivals)."""
        out: dict[str, float] = {}
        for (model, _policy, _status), buf in self._counters.items():
            out[model] = out.get(model, 0.0) + buf.child._value.get() + buf.n  # noqa: SLF001 - the child's count
        return out

    def requests_by_status(self) -> dict[tuple[str, int], float]:
        """Requests answered so far per (model, HTTP status), any policy (the status page's history)."""
        out: dict[tuple[str, int], float] = {}
        for (model, _policy, status), buf in self._counters.items():
            key = (model, status)
            out[key] = out.get(key, 0.0) + buf.child._value.get() + buf.n  # noqa: SLF001 - the child's count
        return out

    def bucket_counts(self, metric: Histogram) -> dict[str, tuple[float, ...]]:
        """Per model, the observations of one per-model histogram in each bucket (not cumulative; the last is
        +Inf), buffered ones included."""
        self.flush()
        cumulative: dict[str, list[float]] = {}
        for family in metric.collect():
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    cumulative.setdefault(s.labels["model"], []).append(s.value)
        return {m: tuple(c - p for c, p in zip(cum, [0.0, *cum[:-1]], strict=True)) for m, cum in cumulative.items()}

    def observe_duration(self, model: str, seconds: float) -> None:
        self._histogram(self.duration, model).add(seconds)

    def observe_ttft(self, model: str, seconds: float) -> None:
        self._histogram(self.ttft, model).add(seconds)

    def observe_tpot(self, model: str, seconds: float) -> None:
        self._histogram(self.tpot, model).add(seconds)

    def observe_routing(self, model: str, seconds: float) -> None:
        self._histogram(self.routing, model).add(seconds)

    def observe_queue_wait(self, model: str, seconds: float) -> None:
        self._histogram(self.queue_wait, model).add(seconds)

    def set_queue_depth(self, model: str, depth: int) -> None:
        self._child(self.queue_depth, model, "interactive").set(depth)

    def set_batch_queue_depth(self, depth: dict[str, int]) -> None:
        """Batch queue depth per model (all replicas); models no longer queued drop to 0."""
        depth = {m or "_default": n for m, n in depth.items()}
        for (mid, *labels), child in list(self._children.items()):
            if mid == id(self.queue_depth) and labels[1] == "batch" and labels[0] not in depth:
                child.set(0)
        for model, n in depth.items():
            self._child(self.queue_depth, model, "batch").set(n)

    def upstream_error(self, worker: str, kind: str) -> None:
        self._child(self.upstream_errors, worker, kind).inc()

    def count_retry(self, model: str) -> None:
        self._child(self.retries, model).inc()

    def count_fallback(self, model: str, to: str, reason: str) -> None:
        self._child(self.fallbacks, model, to, reason).inc()

    def count_stream_break(self, model: str, outcome: str) -> None:
        self._child(self.stream_breaks, model, outcome).inc()

    def set_worker(self, worker: str, healthy: bool, inflight: int) -> None:
        self._child(self.worker_healthy, worker).set(1 if healthy else 0)
        self._child(self.worker_inflight, worker).set(inflight)

    def set_engine_state(self, worker: str, models: Iterable[str], state: str) -> None:
        models = tuple(models)
        self._engine_models[worker] = models
        for model in models:
            for name in ENGINE_STATES:
                self.engine_state.labels(worker, model, name).set(1 if name == state else 0)

    def forget_worker(self, worker: str) -> None:
        for model in self._engine_models.pop(worker, ()):
            for name in ENGINE_STATES:
                with contextlib.suppress(KeyError):
                    self.engine_state.remove(worker, model, name)
        for metric in (self.worker_healthy, self.worker_inflight, self.worker_batch_cap):
            self._children.pop((id(metric), worker), None)
            with contextlib.suppress(KeyError):
                metric.remove(worker)

    def render(self) -> bytes:
        return generate_latest(self.registry)


STATUS_CLIENT_GONE = 499  # nginx's convention for "client closed the request"
