"""vLLM 0.11's Prometheus exposition for one simulated engine (names, HELP, labels and buckets).

Source: vllm/v1/metrics/loggers.py (0.11) `PrometheusStatLogger`; docs/reference/vllm-interface.md §3.2. Every metric
carries `model_name` and `engine="0"`. Each simulated server owns its own `CollectorRegistry`, so many
servers can share a process. Histograms hold model time (seconds of simulated GPU time).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

ENGINE_INDEX = "0"
FINISH_REASONS = ("stop", "length", "abort")  # vllm.v1.engine.FinishReason order

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
N_BUCKETS = [1, 2, 5, 10, 20]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vllm/v1/metrics/loggers.py::build_1_2_5_buckets)."""
    out: list[int] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


@dataclass(slots=True)
class FinishedRequestTimes:
    """Per-request numbers vLLM records when a request finishes (vllm/v1/metrics/stats.py)."""

    e2e: float
    queued: float
    prefill: float
    decode: float
    inference: float
    prompt_tokens: int
    generation_tokens: int
    max_tokens: int


class VllmMetrics:
    """The metric objects of one engine plus the glue that keeps them in step with EngineCore."""

    def __init__(self, model_name: str, max_model_len: int, cache_config: Mapping[str, object],
                 max_lora: int | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        names = ["model_name", "engine"]
        lv = (model_name, ENGINE_INDEX)

        def gauge(name: str, doc: str):
            return Gauge(name, doc, names, registry=r).labels(*lv)

        def counter(name: str, doc: str):
            return Counter(name, doc, names, registry=r).labels(*lv)

        def histogram(name: str, doc: str, buckets: list[float]):
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(*lv)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        # as vLLM 0.32 CPU exports it (docs/reference/vllm-cpu.md "Sleep / wake"): no series for a level-0 pause,
        # whose engine reads awake 0 with every other state 0
        sleep_state = Gauge("vllm:engine_sleep_state", "Engine sleep state: 1 for the current one (vLLM 0.33).",
                            names + ["sleep_state"], registry=r)
        self.sleep_states = {st: sleep_state.labels(*lv, st) for st in ("awake", "weights_offloaded", "discard_all")}
        self.sleep_states["awake"].set(1)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          names + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(*lv, reason) for reason in FINISH_REASONS}

        len_buckets = build_1_2_5_buckets(max_model_len)
        self.req_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", len_buckets)
        self.req_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", len_buckets)
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            ITERATION_TOKEN_BUCKETS)
        self.req_max_gen_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", len_buckets)
        self.req_params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.req_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", len_buckets)
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        # Deprecated in 0.11 and observed with the same values as the inter-token latency.
        self.tpot_deprecated = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
            ITL_BUCKETS)
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.req_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS)

        # An info metric emulated as a gauge set to 1; no model_name label (loggers.py::log_metrics_info).
        info = {k: str(v) for k, v in cache_config.items()}
        info["engine"] = ENGINE_INDEX
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
              registry=r).labels(**info).set(1)

        # Only with --enable-lora (loggers.py): labels max_lora, waiting and running adapter names (comma-separated),
        # no model_name; the value is the time of the step that saw this label set (set_to_current_time), and label
        # sets seen earlier stay exported with their last time.
        self.max_lora = max_lora
        self.lora_info = None if max_lora is None else Gauge(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)
        self._lora_labels: tuple[str, str] | None = None
        self._lora_child = None

        self._synced = {"prompt": 0, "generation": 0, "queries": 0, "hits": 0, "preemptions": 0}
        self._synced_finished = dict.fromkeys(FINISH_REASONS, 0)

    # --- hot path: called by the driver as the engine produces tokens ---------------------------
    def observe_first_token(self, ttft: float) -> None:
        self.ttft.observe(ttft)

    def observe_inter_token(self, itl: float, count: int = 1) -> None:
        """`count` tokens that each waited `itl` seconds since the previous token of their request."""
        _observe_n(self.itl, itl, count)
        _observe_n(self.tpot_deprecated, itl, count)

    def observe_iteration(self, tokens: int) -> None:
        self.iteration_tokens.observe(tokens)

    def observe_finished(self, t: FinishedRequestTimes) -> None:
        self.e2e.observe(t.e2e)
        self.queue_time.observe(t.queued)
        self.prefill_time.observe(t.prefill)
        self.inference_time.observe(t.inference)
        self.decode_time.observe(t.decode)
        self.req_prompt_tokens.observe(t.prompt_tokens)
        self.req_generation_tokens.observe(t.generation_tokens)
        self.req_max_gen_tokens.observe(t.max_tokens)
        self.req_params_n.observe(1)
        if t.max_tokens:
            self.req_params_max_tokens.observe(t.max_tokens)
        if t.generation_tokens > 1:
            self.req_tpot.observe(t.decode / (t.generation_tokens - 1))

    def observe_loras(self, running: list[str], waiting: list[str]) -> None:
        """One step's adapter states (vllm:lora_requests_info)."""
        if self.lora_info is None:
            return
        labels = (",".join(waiting), ",".join(running))
        if labels != self._lora_labels:
            self._lora_labels = labels
            self._lora_child = self.lora_info.labels(str(self.max_lora), *labels)
        self._lora_child.set_to_current_time()

    # --- scrape time ---------------------------------------------------------------------------
    def sync(self, stats, running: int, waiting: int, kv_usage: float, extra_aborts: int = 0) -> None:
        """Bring gauges and counters up to date with the engine's monotonic `EngineStats`."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        for key, value, child in (
            ("prompt", stats.prompt_tokens, self.prompt_tokens),
            ("generation", stats.generation_tokens, self.generation_tokens),
            ("queries", stats.prefix_cache_queries, self.prefix_queries),
            ("hits", stats.prefix_cache_hits, self.prefix_hits),
            ("preemptions", stats.preemptions, self.preemptions),
        ):
            delta = value - self._synced[key]
            if delta > 0:
                child.inc(delta)
                self._synced[key] = value
        for reason in FINISH_REASONS:
            value = stats.finished.get(reason, 0) + (extra_aborts if reason == "abort" else 0)
            delta = value - self._synced_finished[reason]
            if delta > 0:
                self.success[reason].inc(delta)
                self._synced_finished[reason] = value

    def set_sleep_state(self, state: str) -> None:
        """1 for the state's series, 0 for the others (`paused`, level 0, has none: all read 0)."""
        for name, child in self.sleep_states.items():
            child.set(1 if name == state else 0)

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition body and its content type (OpenMetrics when the Accept header asks for it)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


def _observe_n(child: Histogram, value: float, count: int) -> None:
    """Histogram.observe repeated `count` times in O(log buckets): one bucket and the sum move."""
    try:
        bounds, buckets, total = child._upper_bounds, child._buckets, child._sum
    except AttributeError:  # a prometheus_client without these internals: the slow, public way
        for _ in range(count):
            child.observe(value)
        return
    total.inc(value * count)
    buckets[bisect_left(bounds, value)].inc(count)
