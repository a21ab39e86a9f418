"""Virtual-time cluster simulator, workloads and the `fleetgate simulate` command."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence

import pytest

from policies.base import Policy, make_policy
from policies.types import Decision, RequestFeatures, WorkerView
from simulator.cluster import ClusterSim
from simulator.package_data import builtin_trace
from simulator.workload import (
    WorkloadRequest,
    gamma_arrivals,
    load_workload,
    poisson_arrivals,
    synthetic_workload,
)
from tests.helpers import run_cli as fleetgate

KEYS = {"requests", "completed", "slo_attainment", "goodput_rps", "throughput_rps", "output_tokens_per_s",
        "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p50", "e2e_p99", "gpu_seconds", "preemptions",
        "policy", "workers", "profile", "duration_s", "wall_s"}


def test_cli_json_on_a_slice():
    p = fleetgate("simulate", "--duration", "60", "--workers", "4", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)          # exactly one JSON object on stdout
    assert out.keys() >= KEYS
    assert out["requests"] == len(load_workload("azure_conv", duration=60)) > 100
    assert out["completed"] == out["requests"] and out["workers"] == 4 and out["policy"] == "least_tokens"
    assert 0 < out["ttft_p50"] <= out["ttft_p99"] and 0 < out["tpot_p50"] <= out["tpot_p99"]
    assert out["gpu_seconds"] == pytest.approx(4 * out["duration_s"])


def test_cli_plain_summary_and_bad_input():
    p = fleetgate("simulate", "--trace", "sharegpt", "--rate", "4", "--duration", "20", "--workers", "2",
                  "--policy", "round_robin")
    assert p.returncode == 0, p.stderr
    assert "slo_attainment" in p.stdout and "round_robin" in p.stdout
    p = fleetgate("simulate", "--trace", "sharegpt", "--duration", "5")
    assert p.returncode == 2 and "give an arrival rate" in p.stderr
    p = fleetgate("simulate", "--duration", "5", "--policy", "nope")
    assert p.returncode == 2 and "unknown policy" in p.stderr
    p = fleetgate("simulate", "--duration", "5", "--profile", "no-such-gpu")
    assert p.returncode == 2 and "unknown profile" in p.stderr
    p = fleetgate("simulate", "--trace", "/no/such/file.csv")
    assert p.returncode == 2 and "unknown trace" in p.stderr


def skewed(n: int = 600, rate: float = 20.0) -> list[WorkloadRequest]:
    """Every other request is a long generation: round robin over 2 workers stacks all long ones on one."""
    base = synthetic_workload(n, rate, 200, 20, seed=3)
    for r in base[::2]:
        r.output_tokens = 900
    return base


def test_least_requests_no_worse_than_round_robin_on_skew():
    res = {}
    for name in ("round_robin", "least_requests"):
        # every request placed (shed=False): the comparison is of the placements, not of the admission rule
        res[name] = ClusterSim("llama3-8b-a100", 2, name, slo_ttft_s=0.5, slo_tpot_s=0.025,
                               shed=False).run(skewed()).to_dict()
    rr, lr = res["round_robin"], res["least_requests"]
    assert rr["completed"] == lr["completed"] == 600
    assert lr["slo_attainment"] >= rr["slo_attainment"]
    assert lr["tpot_p99"] < rr["tpot_p99"] and lr["e2e_p99"] < rr["e2e_p99"]


class Recorder(Policy):
    """Wraps a real policy and logs every call."""

    name = "recorder"

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.log: list[tuple[str, str, str | None, float]] = []

    def choose(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float) -> Decision:
        d = self.inner.choose(request, workers, now)
        self.log.append(("choose", request.request_id, d.worker_id, now))
        return d

    def on_dispatch(self, request: RequestFeatures, worker_id: str, now: float) -> None:
        self.inner.on_dispatch(request, worker_id, now)
        self.log.append(("dispatch", request.request_id, worker_id, now))

    def on_complete(self, request: RequestFeatures, worker_id: str, now: float) -> None:
        self.inner.on_complete(request, worker_id, now)
        self.log.append(("complete", request.request_id, worker_id, now))


def test_policy_hook_order_and_features():
    rec = Recorder(make_policy("power_of_two", seed=1))
    wl = load_workload("azure_conv", duration=30)
    sim = ClusterSim("llama3-8b-h100", 3, rec)
    seen_views: list[Sequence[WorkerView]] = []
    orig = rec.inner.choose

    def spy(request, workers, now):
        seen_views.append(workers)
        # The run's own online predictor (fed every completion), never the trace's true lengths.
        assert request.predicted_output_tokens == sim.length_predictor.predict(request.model, request.prompt_tokens,
                                                                              request.max_tokens)
        assert request.slo_ttft_s == 0.6 and request.slo_tpot_s == 0.03
        return orig(request, workers, now)

    rec.inner.choose = spy
    result = sim.run(wl)
    by_req: dict[str, list[tuple[str, str | None, float]]] = {}
    for kind, rid, wid, now in rec.log:
        by_req.setdefault(rid, []).append((kind, wid, now))
    assert len(by_req) == len(wl)
    for calls in by_req.values():
        assert [c[0] for c in calls] == ["choose", "dispatch", "complete"]
        assert calls[0][1] == calls[1][1] == calls[2][1]
        assert calls[0][2] == calls[1][2] <= calls[2][2]
    assert all({v.id for v in views} == {"w0", "w1", "w2"} for views in seen_views)
    assert result.to_dict()["completed"] == len(wl)


class CapTwo(Policy):
    """Least-inflight, but waits (worker None) when every worker already has 2 requests."""

    name = "cap_two"

    def choose(self, request, workers, now):
        best = min(workers, key=lambda w: (w.inflight, w.id))
        return Decision(best.id if best.inflight < 2 else None, "full")


def test_wait_decisions_queue_fifo_and_drain():
    wl = synthetic_workload(60, 50.0, 500, 50, seed=1)
    sim = ClusterSim("llama3-8b-h100", 2, CapTwo(), slo_ttft_s=30.0)  # a TTFT target long enough to wait for
    res = sim.run(wl)
    d = res.to_dict()
    assert d["completed"] == 60 and d["max_admission_queue"] > 10
    dispatched = sorted(res.results, key=lambda r: r.dispatched)
    assert [r.request_id for r in dispatched] == [r.request_id for r in wl]     # FIFO
    assert max(r.dispatched - r.arrival for r in res.results) > 0.1


def test_workers_can_be_added_and_removed_during_a_run():
    wl = synthetic_workload(300, 20.0, 300, 100, seed=2)
    sim = ClusterSim("llama3-8b-h100", 1, "least_requests")
    finished_on: dict[str, str] = {}
    sim.on_finish.append(lambda s, r: finished_on.__setitem__(r.request_id, r.worker_id))

    def scale_up(s: ClusterSim, now: float) -> None:
        s.add_worker("llama3-8b-a100", "extra")

    def scale_down(s: ClusterSim, now: float) -> None:
        s.remove_worker("extra")

    sim.schedule(5.0, scale_up)
    sim.schedule(10.0, scale_down)
    res = sim.run(wl)
    d = res.to_dict()
    assert d["completed"] == 300 and d["workers"] == 2
    on_extra = [r for r in res.results if r.worker_id == "extra"]
    assert on_extra and all(5.0 <= r.dispatched <= 10.0 for r in on_extra)
    assert set(finished_on.values()) == {"w0", "extra"}
    extra = next(w for w in sim.retired if w.id == "extra")
    assert extra.removed_at >= 10.0 and d["gpu_seconds"] < 2 * d["duration_s"]
    assert "llama3-8b-a100" in d["profile"]


def test_macro_and_per_iteration_cluster_runs_agree():
    wl = load_workload("azure_conv", duration=40, rate_scale=6)
    a = ClusterSim("llama3-8b-h100", 3, "least_requests", max_iterations=1).run(wl)
    b = ClusterSim("llama3-8b-h100", 3, "least_requests").run(wl)
    ra = {r.request_id: r for r in a.results}
    for r in b.results:
        assert r.worker_id == ra[r.request_id].worker_id
        assert r.finished == pytest.approx(ra[r.request_id].finished, abs=1e-7)
        assert r.first_token == pytest.approx(ra[r.request_id].first_token, abs=1e-7)


def test_ttft_counts_api_overhead_and_oversized_prompts_are_rejected():
    wl = [WorkloadRequest("ok", 0.0, 100, 5), WorkloadRequest("huge", 0.5, 5000, 5)]
    res = ClusterSim("llama2-13b-a100", 1).run(wl)
    by = {r.request_id: r for r in res.results}
    assert by["ok"].ttft > 0.015 and by["ok"].completed
    assert by["huge"].finish_reason == "rejected_too_long" and by["huge"].status == 400
    assert "maximum context length is 4096 tokens" in by["huge"].error
    d = res.to_dict()
    assert d["rejected_too_long"] == 1 and d["servable"] == 1 and d["slo_attainment"] == by["ok"].slo_met


# ---- workloads ------------------------------------------------------------------------------------
def test_azure_trace_loads_with_relative_seconds():
    wl = load_workload("azure_conv")
    assert len(wl) == 19366
    assert wl[0].arrival == 0.0 and 3400 < wl[-1].arrival < 3700
    assert all(b.arrival >= a.arrival for a, b in zip(wl, wl[1:], strict=False))
    assert statistics.mean(r.output_tokens for r in wl) == pytest.approx(211, abs=1)
    # 7 fractional digits: gaps keep sub-microsecond resolution
    assert wl[1].arrival == pytest.approx(50.9951690 - 46.6805900, abs=1e-9)
    fast = load_workload("azure_conv", rate_scale=2.0, duration=600)
    assert fast[-1].arrival < 600 and len(fast) == sum(1 for r in wl if r.arrival < 1200)


def test_length_traces_need_a_rate_and_get_synthetic_arrivals():
    with pytest.raises(ValueError, match="arrival rate"):
        load_workload("arxiv")
    wl = load_workload("arxiv", rate=5.0, duration=200, seed=1)
    assert 800 < len(wl) < 1200 and wl[-1].arrival < 200
    assert statistics.mean(r.prompt_tokens for r in wl) > 5 * statistics.mean(r.output_tokens for r in wl)
    assert [r.arrival for r in wl] == [r.arrival for r in load_workload("arxiv", rate=5.0, duration=200, seed=1)]
    sg = load_workload("sharegpt", rate=2.0, rate_scale=2.0, duration=100)
    assert 300 < len(sg) < 500


def test_mooncake_prefix_blocks_share_heads():
    wl = load_workload("mooncake", duration=600)
    assert wl and all(len(r.prefix_blocks) == r.prompt_tokens // 16 for r in wl)
    raw = [json.loads(line) for line in builtin_trace("mooncake").open()][: len(wl)]
    pairs = [(a, b) for a, b in zip(raw, raw[1:], strict=False) if a["hash_ids"][:2] == b["hash_ids"][:2]]
    assert pairs, "the trace has shared prefixes"
    idx = {id(r): i for i, r in enumerate(raw)}
    a, b = pairs[0]
    ka, kb = wl[idx[id(a)]].prefix_blocks, wl[idx[id(b)]].prefix_blocks
    assert ka[:64] == kb[:64]                       # two shared 512-token ids = 64 blocks
    first_diff = next(i for i, (x, y) in enumerate(zip(a["hash_ids"], b["hash_ids"], strict=False)) if x != y)
    assert ka[first_diff * 32] != kb[first_diff * 32]


def test_arrival_processes_rates_and_burstiness():
    import random

    def gaps(gen, n=20000):
        ts = [next(gen) for _ in range(n)]
        return [b - a for a, b in zip(ts, ts[1:], strict=False)]

    p = gaps(poisson_arrivals(10.0, random.Random(0)))
    g = gaps(gamma_arrivals(10.0, 3.0, random.Random(0)))
    assert statistics.mean(p) == pytest.approx(0.1, rel=0.05)
    assert statistics.mean(g) == pytest.approx(0.1, rel=0.1)
    assert statistics.stdev(p) / statistics.mean(p) == pytest.approx(1.0, rel=0.1)
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(3.0, rel=0.15)
    with pytest.raises(ValueError):
        load_workload("sharegpt", rate=1.0, arrival="uniform")
