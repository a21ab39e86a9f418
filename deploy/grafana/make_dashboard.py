"""Writes deploy/grafana/dashboards/fleetgate.json. Edit the panel list here, not the JSON."""

from __future__ import annotations

import json
from pathlib import Path


def vllm(name: str) -> str:
    """A vLLM series under both of the names it is stored as. prometheus_client 0.26 (vLLM's) writes `vllm:x` in
    # HELP/# TYPE but `vllm_x` on the sample lines when the scraper negotiates OpenMetrics, as Prometheus does by
    default (an open prometheus/client_python bug, github.com/prometheus/client_python/issues/1177); Prometheus then stores `vllm_x`. Plain-text scrapes
    (scrape_protocols: [PrometheusText0.0.4], Prometheus >= 2.49) keep `vllm:x`."""
    return f'{{__name__=~"vllm[:_]{name}"}}'


# (title, unit, [(promql, legend)])
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Requests/s by status", "reqps",
     [("sum by (status) (rate(fleetgate_requests_total[1m]))", "{{status}}")]),
    # SLOs (gateway/pipeline/slo.py): the ratio is each replica's sliding window, so take the worst replica.
    ("SLO attainment (sliding window)", "percentunit",
     [("min by (model, class) (fleetgate_slo_attainment_ratio)", "{{model}} {{class}}")]),
    ("SLO-judged requests/s: met vs missed", "reqps",
     [("sum by (model, class, result) (rate(fleetgate_slo_requests_total[1m]))", "{{model}} {{class}} {{result}}")]),
    ("Time to first token (client view)", "s",
     [("histogram_quantile(0.5, sum by (le) (rate(fleetgate_time_to_first_token_seconds_bucket[1m])))", "p50"),
      ("histogram_quantile(0.99, sum by (le) (rate(fleetgate_time_to_first_token_seconds_bucket[1m])))", "p99")]),
    ("Time per output token", "s",
     [("histogram_quantile(0.5, sum by (le) (rate(fleetgate_time_per_output_token_seconds_bucket[1m])))", "p50"),
      ("histogram_quantile(0.99, sum by (le) (rate(fleetgate_time_per_output_token_seconds_bucket[1m])))", "p99")]),
    ("Request duration", "s",
     [("histogram_quantile(0.5, sum by (le) (rate(fleetgate_request_duration_seconds_bucket[1m])))", "p50"),
      ("histogram_quantile(0.99, sum by (le) (rate(fleetgate_request_duration_seconds_bucket[1m])))", "p99")]),
    ("Routing decision time", "s",
     [("histogram_quantile(0.99, sum by (le) (rate(fleetgate_routing_seconds_bucket[1m])))", "p99")]),
    ("In-flight requests per worker (gateway view)", "short",
     [("sum by (worker) (fleetgate_worker_inflight)", "{{worker}}")]),
    ("Worker health", "short",
     [("fleetgate_worker_healthy", "{{worker}}")]),
    ("Upstream errors/s", "short",
     [("sum by (worker, kind) (rate(fleetgate_upstream_errors_total[1m]))", "{{worker}} {{kind}}")]),
    ("Retries/s (re-sent to another worker before any byte)", "short",
     [("sum by (model) (rate(fleetgate_retries_total[1m]))", "{{model}}")]),
    ("Broken streams/s by outcome (resumed on another worker, or not)", "short",
     [("sum by (model, outcome) (rate(fleetgate_stream_breaks_total[1m]))", "{{model}} {{outcome}}")]),
    ("Admission queue wait (requests that waited)", "s",
     [("histogram_quantile(0.5, sum by (le) (rate(fleetgate_queue_wait_seconds_bucket[1m])))", "p50"),
      ("histogram_quantile(0.99, sum by (le) (rate(fleetgate_queue_wait_seconds_bucket[1m])))", "p99")]),
    # Prefill/decode disaggregation (gateway/pipeline/pd_legs.py).
    ("P/D decisions/s", "short",
     [("sum by (model, decision) (rate(fleetgate_pd_decisions_total[1m]))", "{{model}} {{decision}}")]),
    ("P/D phase time p99", "s",
     [("histogram_quantile(0.99, sum by (le, phase) (rate(fleetgate_pd_phase_seconds_bucket[1m])))", "{{phase}}")]),
    ("State store reachable (Redis)", "short",
     [("min by (store) (fleetgate_state_store_up)", "{{store}}")]),
    ("Engine running / waiting (vLLM /metrics)", "short",
     [(f"sum by (instance) ({vllm('num_requests_running')})", "running {{instance}}"),
      (f"sum by (instance) ({vllm('num_requests_waiting')})", "waiting {{instance}}")]),
    ("Engine KV-cache usage", "percentunit",
     [(f"max by (instance) ({vllm('kv_cache_usage_perc')})", "{{instance}}")]),
    ("Prefix-cache hit rate", "percentunit",
     [(f"sum(rate({vllm('prefix_cache_hits_total')}[1m])) / sum(rate({vllm('prefix_cache_queries_total')}[1m]))",
       "hit rate")]),
    # Backpressure and autoscaling (gateway/control/autoscaler.py). Every replica exports the leader's numbers: take
    # max over replicas, not sum. The interactive admission queue is per replica: that one is summed.
    ("Workers per pool: desired vs current", "short",
     [("max by (pool) (fleetgate_desired_workers)", "desired {{pool}}"),
      ("max by (pool) (fleetgate_current_workers)", "current {{pool}}")]),
    ("Backpressure (Chiron: lbp, tbp, ibp, bbp)", "short",
     [("max by (kind, pool) (fleetgate_backpressure)", "{{kind}} {{pool}}")]),
    ("Scale actions (last 5 min)", "short",
     [("max by (pool, direction, reason) (increase(fleetgate_scale_actions_total[5m]))",
       "{{pool}} {{direction}} {{reason}}")]),
    ("Queue depth", "short",
     [("sum(fleetgate_queue_depth{class=\"interactive\"})", "interactive (admission, all replicas)"),
      ("max by (model) (fleetgate_queue_depth{class=\"batch\"})", "batch {{model}}")]),
    ("Queue wait estimate", "s",
     [("max by (class) (fleetgate_queue_wait_estimate_seconds)", "{{class}}")]),
    ("Per-worker cap (Chiron Algorithm 1)", "short",
     [("max by (worker) (fleetgate_worker_batch_cap)", "{{worker}}")]),
    ("Autoscaler leader", "short",
     [("fleetgate_autoscaler_leader", "{{instance}}")]),
    # Pooled serving (shared hosts): engines asleep or paused take no requests (gateway/fleet/registry.py).
    ("Engines by sleep state (awake, paused, weights_offloaded, discard_all)", "short",
     [("sum by (state) (max by (worker, model, state) (fleetgate_engine_state))", "{{state}}")]),
]

# A row of its own: models sharing hosts, swapped by the gateway's swap controller (gateway/control/pooling.py).
POOLED_ROW = "Pooled serving (shared hosts)"
POOLED_PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Model swaps/s (in: woken, out: put to sleep)", "ops",
     [("sum by (model, direction) (rate(fleetgate_model_swaps_total[1m]))", "{{model}} {{direction}}")]),
    ("Swap time (sleep of the engine swapped out + wake-up)", "s",
     [("histogram_quantile(0.5, sum by (le) (rate(fleetgate_swap_seconds_bucket[1m])))", "p50"),
      ("histogram_quantile(0.99, sum by (le) (rate(fleetgate_swap_seconds_bucket[1m])))", "p99")]),
    ("Engines awake per model", "short",
     [('sum by (model) (max by (worker, model) (fleetgate_engine_state{state="awake"}))', "{{model}}")]),
    # `scheduling: turns` hosts (gateway/control/turns.py, Aegaeon section 4.3): decode turns started per host and model.
    # Only the replica driving a host counts its turns: max over replicas, not sum.
    ("Decode turns/s (scheduling: turns hosts)", "ops",
     [("max by (host, model) (rate(fleetgate_turns_total[1m]))", "{{host}} {{model}}")]),
]


def _panel(pid: int, title: str, unit: str, targets: list[tuple[str, str]], x: int, y: int) -> dict:
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "prometheus"},
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend}
            for j, (expr, legend) in enumerate(targets)
        ],
    }


def build() -> dict:
    panels = [_panel(i + 1, title, unit, targets, 12 * (i % 2), 8 * (i // 2))
              for i, (title, unit, targets) in enumerate(PANELS)]
    y = 8 * ((len(PANELS) + 1) // 2)
    panels.append({"id": len(panels) + 1, "type": "row", "title": POOLED_ROW, "collapsed": False,
                   "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
    for i, (title, unit, targets) in enumerate(POOLED_PANELS):
        panels.append(_panel(len(panels) + 1, title, unit, targets, 12 * (i % 2), y + 1 + 8 * (i // 2)))
    return {
        "uid": "fleetgate",
        "title": "fleetgate",
        "schemaVersion": 39,
        "time": {"from": "now-30m", "to": "now"},
        "refresh": "5s",
        "panels": panels,
    }


if __name__ == "__main__":
    out = Path(__file__).parent / "dashboards" / "fleetgate.json"
    out.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {out}")
