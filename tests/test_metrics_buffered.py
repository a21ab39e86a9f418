"""The buffered per-request series of gateway/ops/metrics.py export exactly what direct prometheus updates would."""

from __future__ import annotations

import math
import random
import re

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gateway.ops.metrics import E2E_BUCKETS, FLUSH_EVERY, ROUTING_BUCKETS, GatewayMetrics


def series(text: str, name: str) -> dict[str, float]:
    """Sample line (name + labels) -> value, for the samples of `name` (without the _created ones)."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(\S+?(\{.*\})?) (\S+)$", line)
        if m and line.startswith(name) and "_created" not in line:
            out[m.group(1)] = float(m.group(3))
    return out


def test_buffered_histograms_match_direct_observation() -> None:
    rng = random.Random(7)
    durations = [rng.choice(E2E_BUCKETS) for _ in range(300)]  # exactly on the bounds: le is inclusive
    durations += [rng.uniform(0, 9000) for _ in range(FLUSH_EVERY + 100)] + [0.0, 1e9]  # past a bulk flush
    routing = [rng.uniform(0, 0.2) for _ in range(50)] + list(ROUTING_BUCKETS)

    m = GatewayMetrics()
    ref = CollectorRegistry()
    h_dur = Histogram("fleetgate_request_duration_seconds", "x", ["model"], buckets=E2E_BUCKETS, registry=ref)
    h_rt = Histogram("fleetgate_routing_seconds", "x", ["model"], buckets=ROUTING_BUCKETS, registry=ref)
    for i, v in enumerate(durations):
        model = "a" if i % 3 else "b"
        m.observe_duration(model, v)
        h_dur.labels(model).observe(v)
    for v in routing:
        m.observe_routing("a", v)
        h_rt.labels("a").observe(v)

    got, want = m.render().decode(), generate_latest(ref).decode()
    for name in ("fleetgate_request_duration_seconds", "fleetgate_routing_seconds"):
        g, w = series(got, name), series(want, name)
        assert g.keys() == w.keys() and g
        for key, value in w.items():
            if key.split("{")[0].endswith("_sum"):  # summed in another order: equal up to rounding
                assert math.isclose(g[key], value, rel_tol=1e-12)
            else:
                assert g[key] == value, key


def test_counts_are_visible_to_any_collection_without_a_flush_call() -> None:
    m = GatewayMetrics()
    for _ in range(3):
        m.count_request("a", "round_robin", 200)
    m.count_request("a", "round_robin", 429)
    m.observe_ttft("a", 0.02)
    r = m.registry
    assert r.get_sample_value("fleetgate_requests_total", {"model": "a", "policy": "round_robin", "status": "200"}) == 3
    assert r.get_sample_value("fleetgate_requests_total", {"model": "a", "policy": "round_robin", "status": "429"}) == 1
    assert r.get_sample_value("fleetgate_time_to_first_token_seconds_count", {"model": "a"}) == 1
    for _ in range(FLUSH_EVERY + 5):
        m.count_request("a", "round_robin", 200)
    assert r.get_sample_value("fleetgate_requests_total",
                              {"model": "a", "policy": "round_robin", "status": "200"}) == FLUSH_EVERY + 8
