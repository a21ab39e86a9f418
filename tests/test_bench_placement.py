"""Smoke versions of the placement experiments (bench/placement.py, bench/hetero_pair.py), so they do not rot,
plus the pieces they added: the simulator's feedback hooks, admission-queue polling and look-ahead, worker
weights, `weighted_round_robin`, and `aladdin`'s risk mode of constraint (d)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence

import numpy as np
import pytest

import bench.hetero_pair as hp
import bench.placement as bp
from policies.aladdin import AladdinPolicy
from policies.aladdin.constraints import cond_cdf
from policies.base import Policy, make_policy
from policies.baselines import LeastRequests
from policies.length_predictor import LengthPredictor
from policies.perf_model import PerfModel
from policies.types import Decision, RequestFeatures, WorkerView
from simulator.cluster import ClusterSim
from simulator.simulate import simulate
from simulator.workload import WorkloadRequest, synthetic_workload

# Decode step 10 ms whatever the batch, prefill 1 ms per prompt token, KV never binding.
CLOCK = PerfModel(k1=1e-3, c1=0.0, k2=1e-9, c2=0.0, c3=0.01, h=1.0, j=0.0, kv_capacity=1e6, max_batch=256)


# --- the experiments, tiny ---------------------------------------------------------------------------
def test_min_workers_search_is_consistent():
    spec = bp.point_spec("sharegpt", 1.0, 0, 30.0)
    for policy in ("least_requests", "aladdin"):
        s = bp.min_workers(bp.with_policy(spec, policy), policy, "sharegpt", 1.0, bp.TARGET, start=3, cap=12)
        assert s.needed is not None and s.needed >= 1, s.probes
        assert s.probes[s.needed].attainment >= bp.TARGET and not s.probes[s.needed].stopped_early
        if s.needed - 1 in s.probes:                      # the bisection's lower neighbour failed
            assert s.probes[s.needed - 1].attainment < bp.TARGET
        assert all(p.servable == s.probes[s.needed].servable > 0 for p in s.probes.values())


def test_the_benchmark_runs_what_fleetgate_simulate_runs(tmp_path):
    """Same spec, same seed: the bench's probe and the CLI's JSON give the same numbers (and the CLI's defaults
    are the parameters the study's protocol chose)."""
    spec = bp.with_policy(bp.point_spec("sharegpt_cv4", 2.0, 1, 60.0), "aladdin", bp.CANDIDATES["spread_lookahead"],
                          workers=3)
    got = bp.probe(spec, stop_early=False)
    p = subprocess.run([sys.executable, "-m", "gateway.cli", "simulate", "--trace", "sharegpt", "--rate", "2",
                        "--arrival", "gamma", "--cv", "4", "--duration", "60", "--seed", "1", "--workers", "3",
                        "--profile", "llama2-13b-a100", "--policy", "aladdin", "--json"], capture_output=True, text=True, timeout=300, env={**os.environ,
                                                                                      "FLEETGATE_PROGRESS": "0"})
    assert p.returncode == 0, p.stderr
    cli = json.loads(p.stdout)
    assert cli["slo_attainment"] == got.attainment and cli["servable"] == got.servable
    direct = simulate(spec).to_dict()
    assert direct["slo_attainment"] == cli["slo_attainment"] and direct["ttft_p99"] == cli["ttft_p99"]


def test_leave_one_trace_out_never_chooses_on_the_reported_trace():
    st = bp.Study(argparse.Namespace(seeds=[0], target=bp.TARGET, traces=["a", "b"]))
    for t in ("a", "b"):
        bp.TRACES[t] = ({"trace": "sharegpt"}, (1.0, 2.0))
    try:
        def add(label: str, trace: str, n: int) -> None:
            st.searches.append(bp.Search(label, trace, 2.0, 0, n))
        for t in ("a", "b"):
            for b in bp.BASELINES:
                add(b, t, 10)
        # "paper" is best on a (8 workers), "spread" on b (7); each trace gets the one that won on the other
        for name in bp.CANDIDATES:
            add(f"cand:{name}", "a", {"paper": 8}.get(name, 12))
            add(f"cand:{name}", "b", {"spread": 7}.get(name, 12))
        assert bp.choose(st, ["b"]) == "spread" and bp.choose(st, ["a"]) == "paper"
    finally:
        for t in ("a", "b"):
            bp.TRACES.pop(t)


def test_placement_main_writes_report_and_plot(tmp_path, monkeypatch):
    monkeypatch.setattr(bp, "BASELINES", ("round_robin", "least_requests"))
    monkeypatch.setattr(bp, "CANDIDATES", {"paper": {}, "spread": {"fit": "worst"}})
    out = tmp_path / "placement.md"
    bp.main(["--traces", "sharegpt,arxiv", "--seeds", "0", "--duration", "15", "--out", str(out)])
    text = out.read_text()
    assert "## Parameters chosen by leave-one-trace-out" in text and "| sharegpt | " in text
    assert "## Against the targets" in text and "N=" in text and "best baseline" in text
    assert out.with_suffix(".png").stat().st_size > 1000
    data = json.loads(out.with_suffix(".json").read_text())
    assert set(data["chosen"]) == {"sharegpt", "arxiv"}


def test_hetero_pair_main_writes_report_and_plot(tmp_path):
    out = tmp_path / "pair.md"
    hp.main(["--requests", "40", "--seeds", "0", "--out", str(out)])
    text = out.read_text()
    for p in hp.POLICIES:
        assert f"| {p} |" in text
    assert "Target: `hetero` >= 1.5x the throughput of round robin at 24 req/s (seed 0)" in text and "all at once" in text
    assert out.with_suffix(".png").stat().st_size > 1000


def test_hetero_pair_weights_reach_the_policy():
    r = hp.run_pair("weighted_round_robin", None, 50, seed=0)
    assert r.requests == 50 and r.strong_share == pytest.approx(0.8)   # 4:1
    assert r.throughput_rps > 0 and r.strong_done_s > 0 and r.weak_done_s > 0


# --- weighted_round_robin ----------------------------------------------------------------------------
def test_weighted_round_robin_is_smooth_and_proportional():
    p = make_policy("weighted_round_robin")
    r = RequestFeatures("x", "m", 10)
    ws = [WorkerView("a", weight=4.0), WorkerView("b", weight=1.0)]
    assert "".join(p.choose(r, ws, 0.0).worker_id for _ in range(10)) == "aabaaaabaa"
    ws3 = [WorkerView("a", weight=2.0), WorkerView("b", weight=1.0), WorkerView("c", weight=1.0)]
    picks = [p.choose(r, ws3, 0.0).worker_id for _ in range(400)]
    assert picks.count("a") == 200 and picks.count("b") == picks.count("c") == 100
    zero = [WorkerView("a", weight=0.0), WorkerView("b", weight=0.0)]   # no usable weights: plain rotation
    assert {p.choose(r, zero, 0.0).worker_id for _ in range(2)} == {"a", "b"}
    assert p.choose(r, [], 0.0).worker_id is None


# --- simulator additions ------------------------------------------------------------------------------
class Recorder(LeastRequests):
    """least_requests that records the optional feedback the simulator gives."""

    def __init__(self) -> None:
        super().__init__()
        self.progress: dict[str, int] = {}
        self.completions: dict[str, int] = {}

    def report_progress(self, request_id: str, generated_tokens: int, now: float) -> None:
        self.progress[request_id] = generated_tokens

    def observe_completion(self, request: RequestFeatures, output_tokens: int, now: float) -> None:
        self.completions[request.request_id] = output_tokens


def test_cluster_feeds_progress_completions_and_an_online_predictor():
    pol = Recorder()
    pred = LengthPredictor()
    wl = synthetic_workload(60, 20.0, (50, 300), (1, 40), seed=4)
    sim = ClusterSim("llama3-8b-a100", 2, pol, predicted_output_tokens=pred)
    res = sim.run(wl)
    done = {r.request_id: r.output_tokens for r in res.results if r.completed}
    assert len(done) == 60 and pol.completions == done
    assert pol.progress == {rid: 1 for rid, n in done.items() if n > 1}   # first token of multi-token answers
    assert pred.count(sim.profiles[0].model) == 60
    assert sim.features(wl[0]).predicted_output_tokens == pytest.approx(
        pred.predict(sim.profiles[0].model, wl[0].prompt_tokens))


class HoldBig(Policy):
    """Refuses prompts over 100 tokens before t = 1 s; places everything else on w0."""

    name = "hold_big"

    def choose(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float) -> Decision:
        if request.prompt_tokens > 100 and now < 1.0:
            return Decision(None, "no_fit")
        return Decision(workers[0].id, "ok")


def test_queue_poll_and_lookahead():
    wl = [WorkloadRequest("big", 0.0, 500, 2)] + [WorkloadRequest(f"s{i}", 0.1 * (i + 1), 20, 2) for i in range(5)]
    slo = {"slo_ttft_s": 30.0}   # no TTFT deadline within the test: the queue timeout (5 s) is the budget
    # Head-only queue without polling: the small ones wait behind the big one until something completes or,
    # here, until the big one's budget runs out (refused with 429 at 5 s).
    res = {r.request_id: r for r in ClusterSim("llama3-8b-a100", 1, HoldBig(), **slo).run(wl).results}
    assert res["big"].finish_reason == "refused" and res["big"].status == 429 and res["big"].dispatched is None
    assert res["s0"].dispatched == pytest.approx(5.0)
    # Polling: the head goes at the first poll after t = 1 s; the small ones follow right behind it.
    res = {r.request_id: r for r in ClusterSim("llama3-8b-a100", 1, HoldBig(), queue_poll_s=0.05, **slo).run(wl).results}
    assert 1.0 <= res["big"].dispatched < 1.0 + 0.05 + 1e-9
    assert all(res[f"s{i}"].dispatched >= res["big"].dispatched for i in range(5))
    # Look-ahead: the small ones overtake the waiting head.
    sim = ClusterSim("llama3-8b-a100", 1, HoldBig(), queue_poll_s=0.05, queue_lookahead=4, **slo)
    res = {r.request_id: r for r in sim.run(wl).results}
    assert all(res[f"s{i}"].dispatched == pytest.approx(0.1 * (i + 1)) for i in range(5))
    assert res["big"].completed and res["big"].dispatched >= 1.0
    for bad in ({"queue_poll_s": 0.0}, {"queue_lookahead": 0}):
        with pytest.raises(ValueError):
            ClusterSim("llama3-8b-a100", 1, "round_robin", **bad)


# --- aladdin: risk mode of (d) -----------------------------------------------------------------------
def test_cond_cdf_by_hand():
    s = np.array([1.0, 2.0, 5.0, 10.0, 50.0])
    # P(L < 2 + 4 | L >= 2) = #{2, 5} / #{2, 5, 10, 50} = 0.5
    assert cond_cdf(s, np.array([2.0]), np.array([4.0]))[0] == pytest.approx(0.5)
    assert cond_cdf(s, np.array([2.0]), np.array([-3.0]))[0] == 0.0          # no deficit
    assert cond_cdf(s, np.array([2.0]), np.array([1e30]))[0] == 1.0          # never recovers
    assert cond_cdf(s, np.array([60.0]), np.array([5.0]))[0] == 0.0          # older than every sample


def risk_policy(output_length: int) -> AladdinPolicy:
    pred = LengthPredictor()
    for _ in range(64):
        pred.observe("m", 10, output_length)
    return AladdinPolicy(perf_models={"p": CLOCK}, predictor=pred, theta=1.0, slack="risk")


def young_worker(p: AladdinPolicy) -> list[WorkerView]:
    """One worker with one request that started decoding at t = 1.01 s (2 tokens by 1.02 s)."""
    ws = [WorkerView(id="w0", profile="p")]
    r0 = RequestFeatures("r0", "m", 10, predicted_output_tokens=40, arrival=1.0)
    assert p.choose(r0, ws, 1.0).worker_id == "w0"
    p.on_dispatch(r0, "w0", 1.0)
    p.report_progress("r0", 1, 1.01)
    return ws


def test_risk_mode_waits_while_a_young_request_would_likely_miss():
    # A 400-token prompt stalls r0 by 0.4 s; r0 saved 2·30 − 10 = 50 ms and saves ~20 ms per further
    # token, so it needs >= 18 more tokens to absorb the stall.
    newcomer = RequestFeatures("new", "m", 400, predicted_output_tokens=40, arrival=1.02)
    short = risk_policy(5)        # every answer is 5 tokens: r0 surely misses -> wait
    ws = young_worker(short)
    d = short.choose(newcomer, ws, 1.02)
    assert (d.worker_id, d.reason) == (None, "no_fit") and short.last_rejections["prefill_slack"] == 1
    # Ask again when waiting longer would cost its TTFT: 0.6 − 0.05 margin − (0.4 s prefill + the decode step in
    # flight; the decodes batched with its one chunk add k2·ctx + c2·b ≈ 0, the chunk's own pass holds c3).
    assert d.retry_at == pytest.approx(1.02 + 0.6 - 0.05 - 0.41)
    long = risk_policy(1000)      # every answer is 1000 tokens: r0 recovers -> place now
    ws = young_worker(long)
    assert long.choose(newcomer, ws, 1.02) == Decision("w0", "best_fit")


def test_risk_mode_places_at_the_ttft_deadline_and_when_late():
    p = risk_policy(5)
    ws = young_worker(p)
    # TTFT estimate 0.4 s of prefill + the decode step in flight + what it waited: with 0.15 s waited it still fits,
    # but not after another deadline margin (50 ms): waiting longer would cost its TTFT -> placed now.
    at_deadline = RequestFeatures("dl", "m", 400, predicted_output_tokens=40, arrival=1.02 - 0.16)
    assert p.choose(at_deadline, ws, 1.02) == Decision("w0", "deadline")
    early = RequestFeatures("early", "m", 400, predicted_output_tokens=40, arrival=1.02 - 0.05)
    assert p.choose(early, ws, 1.02).worker_id is None
    late = RequestFeatures("late", "m", 400, predicted_output_tokens=40, arrival=1.02 - 0.5)
    assert p.choose(late, ws, 1.02) == Decision("w0", "late")       # its TTFT is lost: waiting helps nobody
