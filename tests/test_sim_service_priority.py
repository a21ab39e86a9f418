"""Services sharing engines in the simulator: multi-service workloads (simulator/services.py), the engine's
simulator-only re-prioritising preemption (EngineCore.reprioritize) and a service priority driving ClusterSim
(simulator/service_sim.py): the admission queue's order, vLLM's `priority` field, normalized latency."""

from __future__ import annotations

import json
import statistics

import pytest

from policies.admission import AdmissionQueue
from policies.types import RequestFeatures
from simulator.cluster import ClusterSim
from simulator.engine import EngineConfig, EngineCore, SimRequest
from simulator.services import ServiceSpec, parse_services, service_workload
from simulator.workload import WorkloadRequest
from tests.helpers import run_cli as fleetgate
from tests.test_sim_engine import drive

PROFILE = "llama3-8b-h100"


def test_parse_services():
    svcs = parse_services("sharegpt, chat=azure_conv:2,code:0.5")
    assert svcs == [ServiceSpec("sharegpt", "sharegpt", 1.0), ServiceSpec("chat", "azure_conv", 2.0),
                    ServiceSpec("code", "code", 0.5)]
    for bad, msg in [("nope", "unknown lengths"), ("code:x", "not a number"), ("code:0", "> 0"),
                     ("code,code", "twice"), (" , ", "no services")]:
        with pytest.raises(ValueError, match=msg):
            parse_services(bad)


def test_service_workload_rates_lengths_and_independent_streams():
    svcs = parse_services("sharegpt,arxiv:2,code")
    wl = service_workload(svcs, rate=40.0, duration=200.0, seed=3)
    assert [r.arrival for r in wl] == sorted(r.arrival for r in wl)
    by = {s.name: [r for r in wl if r.service == s.name] for s in svcs}
    # Shares 1:2:1 of 40 req/s for 200 s: 2000, 4000, 2000 expected (Poisson: within ~4 standard deviations).
    for name, expected in [("sharegpt", 2000), ("arxiv", 4000), ("code", 2000)]:
        assert abs(len(by[name]) - expected) < 4 * expected ** 0.5
    # The code-like service has Splitwise's medians (1500 prompt, 13 output tokens).
    assert statistics.median(r.prompt_tokens for r in by["code"]) == pytest.approx(1500, rel=0.08)
    assert statistics.median(r.output_tokens for r in by["code"]) == pytest.approx(13, rel=0.15)
    assert len({r.request_id for r in wl}) == len(wl)
    # Adding a service leaves the others' requests as they were; the same seed gives the same workload.
    more = service_workload([*svcs, ServiceSpec("chat", "azure_conv")], rate=50.0, duration=200.0, seed=3)
    assert [(r.arrival, r.prompt_tokens) for r in more if r.service == "code"] == \
        [(r.arrival, r.prompt_tokens) for r in by["code"]]
    assert service_workload(svcs, rate=40.0, duration=200.0, seed=3) == wl
    with pytest.raises(ValueError):
        service_workload(svcs, rate=0.0, duration=10.0)


def req(rid: str, prompt: int, out: int, arrival: float = 0.0, priority: int = 0) -> SimRequest:
    return SimRequest(rid, prompt, [], 4096, out, priority=priority, arrival=arrival)


def test_engine_reprioritize_preempts_a_running_request_that_fell_behind():
    """One batch slot. A long request runs; a better one arrives. vLLM (fixed priorities) lets the newcomer wait;
    with `reprioritize` (simulator only) the running one, once it may be preempted, gives way, keeping its KV
    unless the blocks are needed."""
    def run(reprioritize, short_prompt=200, **config):
        core = EngineCore(PROFILE, EngineConfig(scheduling_policy="priority", max_num_seqs=1, **config))
        core.reprioritize = reprioritize
        return core, drive(core, [req("long", 200, 400, 0.0, priority=5),
                                  req("short", short_prompt, 10, 0.5, priority=1)])

    fixed_core, fixed = run(None)
    assert fixed["short"].first_scheduled >= fixed["long"].finished
    # Priorities as given; the long request may be preempted once it has generated 20 tokens.
    core, pre = run(lambda r, generated, now: (r.priority, r.request_id == "long" and generated >= 20))
    assert pre["long"].num_preemptions == 1 and core.stats.preemptions == 1
    assert pre["short"].finished < pre["long"].finished
    assert pre["short"].finished < 0.5 * fixed["short"].finished
    assert pre["long"].num_output == 400
    # It kept its KV while set aside: both prompts were computed once.
    assert core.stats.prompt_tokens == 400
    # 40 blocks: the long one holds ~17 when the short one (400 prompt tokens: 26 blocks) arrives, so its KV goes
    # and it recomputes its prompt and what it had generated.
    core, short_kv = run(lambda r, generated, now: (r.priority, r.request_id == "long" and generated >= 20),
                         short_prompt=400, num_gpu_blocks=40)
    assert short_kv["short"].finished < short_kv["long"].finished and short_kv["long"].num_output == 400
    assert core.stats.prompt_tokens == 200 + 400 + 200     # the long prompt twice (vLLM counts prompt tokens only)
    # Not preemptible: nothing happens however bad its priority.
    core, kept = run(lambda r, generated, now: (r.priority, False))
    assert core.stats.preemptions == 0 and kept["short"].first_scheduled >= kept["long"].finished
    with pytest.raises(RuntimeError, match="priority"):
        c = EngineCore(PROFILE, EngineConfig(max_num_seqs=1))
        c.reprioritize = lambda r, g, n: (0, True)
        drive(c, [req("a", 10, 10), req("b", 10, 10)])


def hol_workload() -> list[WorkloadRequest]:
    """Two services on one engine with one batch slot: first one request of each alone (the profiles learn their
    lengths), then at t=100 three long requests and right after them three short ones."""
    wl = [WorkloadRequest("warm-long", 0.0, 100, 300, service="long"),
          WorkloadRequest("warm-short", 30.0, 100, 5, service="short")]
    wl += [WorkloadRequest(f"long-{i}", 100.0 + 0.001 * i, 100, 300, service="long") for i in range(3)]
    wl += [WorkloadRequest(f"short-{i}", 100.01 + 0.001 * i, 100, 5, service="short") for i in range(3)]
    return wl


def run_hol(priority: str | None, **kw) -> dict:
    sim = ClusterSim(PROFILE, 1, "least_requests", engine_config=EngineConfig(max_num_seqs=1),
                     service_priority=priority, **kw)
    return sim.run(hol_workload())


def test_seallm_lets_short_services_past_long_ones_through_vllm_priority():
    fcfs, seallm, rr = run_hol("fcfs"), run_hol("seallm"), run_hol("round_robin")
    res = {name: {r.request_id: r for r in out.results} for name, out in
           [("fcfs", fcfs), ("seallm", seallm), ("rr", rr)]}
    # FCFS: the shorts wait for all three longs. SeaLLM: long-0 is running; the shorts go next (their priority
    # O = Q·L̂ is far smaller). Round robin: a short between consecutive longs.
    assert res["fcfs"]["short-0"].first_scheduled > res["fcfs"]["long-2"].finished - 1e-9
    assert all(res["seallm"][f"short-{i}"].finished <= res["seallm"]["long-1"].first_scheduled for i in range(3))
    assert res["rr"]["short-0"].finished <= res["rr"]["long-1"].first_scheduled < res["rr"]["short-1"].first_scheduled
    d_fcfs, d_seallm = fcfs.to_dict(), seallm.to_dict()
    # A long request takes ~2.2 s here. FCFS: each short waits for three longs (~6.7 s / 5 tokens); SeaLLM: for the
    # one running (~2.2 s / 5 tokens); the other requests add little: a ratio of about 1/3 over the 8 requests.
    assert d_seallm["norm_latency_mean"] < 0.4 * d_fcfs["norm_latency_mean"]
    assert set(d_seallm["services"]) == {"long", "short"}
    assert d_seallm["services"]["short"]["requests"] == 4
    # Normalized latency is e2e / output tokens of each request.
    r = res["seallm"]["short-0"]
    assert r.normalized_latency == pytest.approx((r.finished - r.arrival) / 5)
    assert r.service == "short"


def test_without_services_the_summary_has_no_service_fields():
    d = run_hol(None).to_dict()
    assert "norm_latency_mean" not in d and "services" not in d


def test_gateway_queue_order_follows_the_service_priority():
    """cap=1: the admission queue (not the engine) holds the waiting requests; seallm drains the shorts first."""
    kw = {"cap": 1, "slo_ttft_s": 60.0, "queue_timeout_s": 60.0}     # nobody gives up while queued here
    fcfs = {r.request_id: r for r in run_hol("fcfs", **kw).results}
    seallm = {r.request_id: r for r in run_hol("seallm", **kw).results}
    assert all(r.completed for r in [*fcfs.values(), *seallm.values()])
    assert fcfs["short-0"].dispatched > fcfs["long-2"].dispatched
    assert max(seallm[f"short-{i}"].dispatched for i in range(3)) < seallm["long-1"].dispatched


def test_admission_queue_candidates_in_a_given_order():
    q = AdmissionQueue(lookahead=3)
    for i, prio in enumerate([5, 1, 3]):
        q.enter(RequestFeatures(request_id=f"r{i}", model="m", prompt_tokens=1, priority=prio), 0.0)
    assert [w.features.request_id for w in q.candidates()] == ["r0", "r1", "r2"]
    assert [w.features.request_id for w in q.candidates(lambda w: w.features.priority)] == ["r1", "r2", "r0"]


def test_preempting_sim_reprioritises_running_requests():
    """SeaLLM with preemption (simulator only): a long request that outran its budget gives way to shorts."""
    wl = [WorkloadRequest("warm-long", 0.0, 100, 50, service="long"),
          WorkloadRequest("warm-short", 30.0, 100, 5, service="short"),
          WorkloadRequest("long-x", 100.0, 100, 2000, service="long"),       # 40x its service's profile
          WorkloadRequest("short-x", 110.0, 100, 5, service="short")]

    def run(preempt: bool) -> dict:
        sim = ClusterSim(PROFILE, 1, "least_requests", engine_config=EngineConfig(max_num_seqs=1),
                         service_priority="seallm", service_preempt=preempt)
        return {r.request_id: r for r in sim.run(wl).results}

    fixed, pre = run(False), run(True)
    assert fixed["short-x"].first_scheduled >= fixed["long-x"].finished
    assert pre["long-x"].preemptions == 1 and pre["short-x"].preemptions == 0
    assert pre["short-x"].finished < pre["long-x"].finished
    assert pre["short-x"].e2e < 0.2 * fixed["short-x"].e2e
    assert ClusterSim(PROFILE, 1, service_priority="seallm", service_preempt=True).services.name == "seallm+preempt"
    with pytest.raises(ValueError, match="P/D"):
        ClusterSim(PROFILE, 2, prefill_workers=1, service_priority="seallm")


def test_cli_services_and_service_priority():
    args = ("simulate", "--services", "sharegpt,code", "--rate", "4", "--duration", "30", "--workers", "1",
            "--max-num-seqs", "16", "--json")
    runs = {}
    for prio in ("fcfs", "seallm"):
        p = fleetgate(*args, "--service-priority", prio)
        assert p.returncode == 0, p.stderr
        runs[prio] = json.loads(p.stdout)
    out = runs["seallm"]
    assert out["service_priority"] == "seallm" and out["trace"] == "sharegpt,code"
    assert set(out["services"]) == {"sharegpt", "code"}
    assert out["requests"] == runs["fcfs"]["requests"] == sum(s["requests"] for s in out["services"].values())
    assert 0 < out["norm_latency_mean"] <= out["norm_latency_p99"]
    p = fleetgate(*args, "--service-priority", "seallm", "--service-preempt")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["service_priority"] == "seallm+preempt"
    for bad, msg in [(("--service-priority", "lottery"), "service priority must be one of"),
                     (("--service-preempt",), "needs a service priority"),
                     (("--services", "nope"), "unknown lengths")]:
        p = fleetgate("simulate", "--rate", "4", "--duration", "5", *bad)
        assert p.returncode == 2 and msg in p.stderr, p.stderr
    p = fleetgate("simulate", "--services", "code", "--duration", "5")
    assert p.returncode == 2 and "need an arrival rate" in p.stderr
