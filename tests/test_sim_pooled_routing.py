"""The pooled simulator routes by the gateway's placement step (simulator/pooled_routing.py), not its own rule."""

from __future__ import annotations

import pytest

from policies.placement import ModelPlacement
from simulator.pooled import PooledSpec, simulate_pooled
from simulator.pooled_routing import EngineRouter
from simulator.workload import WorkloadRequest


def test_router_weighs_tokens_in_flight_as_least_tokens_does() -> None:
    """One long prompt on h0 against two short ones on h1: fewest requests would pick h0, the gateway's default
    policy (least_tokens) picks h1; a finished request gives its reservation back."""
    router = EngineRouter()
    router.hold("m", "h0", WorkloadRequest("a", 0.0, 30000, 10, max_tokens=10), 0.0)
    router.hold("m", "h1", WorkloadRequest("b", 0.0, 100, 10, max_tokens=10), 0.0)
    router.hold("m", "h1", WorkloadRequest("c", 0.0, 100, 10, max_tokens=10), 0.0)
    assert router.place("m", WorkloadRequest("d", 1.0, 100, 10, max_tokens=10), ["h0", "h1"], 1.0) == "h1"
    assert (router.view("m", "h1").inflight, router.view("m", "h0").inflight) == (3, 1)
    router.finished("m", "h0", "a", 10, 2.0)
    assert router.view("m", "h0").inflight_tokens == 0
    assert router.place("m", WorkloadRequest("e", 2.0, 100, 10, max_tokens=10), ["h0", "h1"], 2.0) == "h0"


def test_router_applies_the_cap_filter() -> None:
    router = EngineRouter(cap=1)
    assert router.place("m", WorkloadRequest("a", 0.0, 10, 1), ["h0"], 0.0) == "h0"
    assert router.place("m", WorkloadRequest("b", 0.0, 10, 1), ["h0"], 0.0) is None


@pytest.mark.parametrize("spec", [dict(pooling="aegaeon", prefill_fraction=0.0), dict(pooling="request"),
                                  dict(pooling="dedicated")], ids=["turns", "request", "dedicated"])
def test_every_routed_request_goes_through_the_placement_step(monkeypatch: pytest.MonkeyPatch, spec: dict) -> None:
    calls: list[str] = []
    place = ModelPlacement.place

    def counted(self: ModelPlacement, feats, views, now):  # noqa: ANN001, ANN202
        d = place(self, feats, views, now)
        calls.append(d.worker_id)
        return d

    monkeypatch.setattr(ModelPlacement, "place", counted)
    res = simulate_pooled(PooledSpec(num_models=4, model_skew="zipf:1", rate=2.0, workers=4, duration=30.0, **spec))
    out = res.to_dict()
    assert out["requests"] > 20
    assert calls and None not in calls
    if spec["pooling"] != "request":         # request-level: some wait for a swap and are held, not routed
        assert len(calls) == out["requests"]
