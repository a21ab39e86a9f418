"""P/D pairing (policies/pd.py) and the virtual-time cluster running it (simulator/cluster.py P/D pools)."""

from __future__ import annotations

import json

import pytest

from policies.aladdin import AladdinPolicy
from policies.baselines import LeastRequests
from policies.pd import (
    DISAGGREGATED,
    LOCAL_CACHED,
    LOCAL_NO_PREFILL,
    LOCAL_OVERFLOW,
    LOCAL_SHORT,
    NO_DECODE,
    AladdinDecodePolicy,
    PdPolicy,
    make_decode_policy,
    parse_pd_split,
    prefill_time,
    split_phase_model,
)
from policies.perf_model import PerfModel
from policies.types import ROLE_DECODE, ROLE_MIXED, ROLE_PREFILL, RequestFeatures, WorkerView
from simulator.cluster import ClusterSim
from simulator.profiles import load_profile
from simulator.simulate import SimSpec, run_simulate_cli
from simulator.workload import WorkloadRequest, synthetic_workload

FAST = PerfModel(k1=1e-4, c1=0.02)
SLOW = PerfModel(k1=4e-4, c1=0.02)


def req(prompt: int, rid: str = "r", prefix: tuple[int, ...] = (), **kw) -> RequestFeatures:
    return RequestFeatures(request_id=rid, model="m", prompt_tokens=prompt, prefix_hashes=prefix, **kw)


def view(wid: str, role: str, inflight: int = 0, tokens: int = 0, profile: str = "", kv: float = 0.0) -> WorkerView:
    return WorkerView(wid, role, inflight=inflight, inflight_tokens=tokens, profile=profile, kv_usage=kv)


# --- unit: the math and the choices -------------------------------------------------------------------------

def test_prefill_time_is_aladdin_eq2_over_queued_plus_new() -> None:
    assert prefill_time(FAST, 3000, 1000) == pytest.approx(1e-4 * 4000 + 0.02)
    assert prefill_time(FAST, -5, 1000) == pytest.approx(1e-4 * 1000 + 0.02)   # no negative backlog


def test_prefill_worker_with_the_earliest_predicted_completion() -> None:
    pol = PdPolicy(prefill_perf_models={"fast": FAST, "slow": SLOW})
    r = req(2000)
    # fast with 3000 queued: 1e-4 x 5000 = 0.5 s; slow with 500 queued: 4e-4 x 2500 = 1.0 s
    wid, t = pol.choose_prefill(r, [view("slow", ROLE_PREFILL, 1, 500, "slow"), view("fast", ROLE_PREFILL, 3, 3000, "fast")])
    assert wid == "fast" and t == pytest.approx(prefill_time(FAST, 3000, 2000))
    # fast with 9000 queued: 1.12 s loses to slow's 1.02 s
    wid, _ = pol.choose_prefill(r, [view("slow", ROLE_PREFILL, 1, 550, "slow"), view("fast", ROLE_PREFILL, 9, 9000, "fast")])
    assert wid == "slow"
    # a worker whose KV is full of pinned hand-offs goes last, whatever its queue
    wid, _ = pol.choose_prefill(r, [view("a", ROLE_PREFILL, 0, 0, "fast", kv=0.99), view("b", ROLE_PREFILL, 5, 5000, "fast")])
    assert wid == "b"
    wid, _ = pol.choose_prefill(r, [view("a", ROLE_PREFILL, 0, 0, "fast", kv=0.99)])
    assert wid == "a"


def test_plan_splits_long_prompts_and_keeps_short_ones_local() -> None:
    pol = PdPolicy(local_prefill_tokens=256, default_prefill_model=FAST, slo_ttft_s=0.6)
    fleet = [view("p0", ROLE_PREFILL, 2, 4000), view("p1", ROLE_PREFILL, 0, 0), view("d0", ROLE_DECODE, 3),
             view("d1", ROLE_DECODE, 1), view("m0", ROLE_MIXED, 5)]
    plan = pol.plan(req(2000), fleet, 0.0)
    assert (plan.decision, plan.prefill_worker_id, plan.decode_worker_id) == (DISAGGREGATED, "p1", "d1")
    assert plan.predicted_prefill_s == pytest.approx(prefill_time(FAST, 0, 2000)) and plan.ttft_ok
    assert plan.as_decision().prefill_worker_id == "p1" and plan.as_decision().worker_id == "d1"
    short = pol.plan(req(256), fleet, 0.0)
    assert (short.decision, short.prefill_worker_id, short.decode_worker_id) == (LOCAL_SHORT, None, "d1")
    # prefill workers excluded (failed): the decode worker prefills itself
    alone = pol.plan(req(2000), fleet, 0.0, exclude_prefill={"p0", "p1"})
    assert (alone.decision, alone.prefill_worker_id, alone.decode_worker_id) == (LOCAL_NO_PREFILL, None, "d1")
    nothing = pol.plan(req(2000), [view("p0", ROLE_PREFILL)], 0.0)
    assert nothing.decision == NO_DECODE and nothing.decode_worker_id is None
    # a prompt whose prefill cannot meet the TTFT SLO anywhere is still split, flagged
    late = pol.plan(req(20000, slo_ttft_s=0.5), fleet, 0.0)
    assert late.decision == DISAGGREGATED and not late.ttft_ok
    assert pol.decisions == {DISAGGREGATED: 2, LOCAL_SHORT: 1, LOCAL_NO_PREFILL: 1, NO_DECODE: 1}


def test_a_saturated_prefill_pool_overflows_to_local_prefill() -> None:
    backlog = [view("p0", ROLE_PREFILL, 5, 10_000), view("d0", ROLE_DECODE)]
    # remote: 1e-4 x 12000 + 0.02 = 1.22 s > 0.6 s; an idle prefill: 0.22 s
    plan = PdPolicy(default_prefill_model=FAST, slo_ttft_s=0.6).plan(req(2000), backlog, 0.0)
    assert (plan.decision, plan.prefill_worker_id, plan.decode_worker_id) == (LOCAL_OVERFLOW, None, "d0")
    assert plan.predicted_prefill_s == pytest.approx(prefill_time(FAST, 0, 2000))
    strict = PdPolicy(default_prefill_model=FAST, slo_ttft_s=0.6, prefill_overflow=False).plan(req(2000), backlog, 0.0)
    assert (strict.decision, strict.prefill_worker_id, strict.ttft_ok) == (DISAGGREGATED, "p0", False)
    light = [view("p0", ROLE_PREFILL, 1, 2000), view("d0", ROLE_DECODE)]
    assert PdPolicy(default_prefill_model=FAST, slo_ttft_s=0.6).plan(req(2000), light, 0.0).decision == DISAGGREGATED


def test_mostly_cached_prompt_stays_on_the_worker_that_caches_it() -> None:
    pol = PdPolicy(local_prefill_tokens=256, prefix_chunk_tokens=32)
    heads = tuple(range(1, 41))  # 40 chunks x 32 tokens = 1280 tokens of prefix
    fleet = [view("p0", ROLE_PREFILL), view("d0", ROLE_DECODE), view("d1", ROLE_DECODE)]
    first = pol.plan(req(1400, "a", heads), fleet, 0.0)
    assert first.decision == DISAGGREGATED
    pol.on_dispatch(req(1400, "a", heads), "d1", 0.0)
    again = pol.plan(req(1400, "b", heads), fleet, 1.0)   # 120 uncached tokens left on d1
    assert (again.decision, again.decode_worker_id, again.prefill_worker_id) == (LOCAL_CACHED, "d1", None)
    assert again.cached_tokens == 1280
    longer = pol.plan(req(1600, "c", heads), fleet, 1.0)  # 320 uncached > 256: split after all
    assert longer.decision == DISAGGREGATED
    busy = [view("p0", ROLE_PREFILL), view("d0", ROLE_DECODE, 0), view("d1", ROLE_DECODE, 40)]
    guarded = pol.plan(req(1400, "d", heads), busy, 1.0)  # load guard: d1 far above the least loaded
    assert guarded.decision == DISAGGREGATED and guarded.decode_worker_id == "d0"


def test_split_phase_aladdin_models_the_transfer_not_a_local_prefill() -> None:
    base = PerfModel.from_step_profile(load_profile("llama3-8b-h100"))
    m = split_phase_model(base, 3.2768e-6, 0.001)
    assert (m.k1, m.c1) == (3.2768e-6, 0.001)
    assert (m.k2, m.c2, m.c3, m.h, m.j, m.kv_capacity) == (base.k2, base.c2, base.c3, base.h, base.j, base.kv_capacity)
    with pytest.raises(ValueError):
        split_phase_model(base, 0.0, 0.001)
    assert isinstance(make_decode_policy("aladdin", {}), AladdinDecodePolicy)
    assert type(make_decode_policy("aladdin", {}, split_phase=False)) is AladdinPolicy
    assert isinstance(make_decode_policy("least_requests"), LeastRequests)
    slow_prefill = PerfModel(k1=2e-4, c1=0.02)  # 8000 tokens: 1.62 s of local prefill > 0.6 s TTFT
    ws = [view("d0", ROLE_DECODE, profile="x"), view("d1", ROLE_DECODE, profile="x")]
    plain = AladdinPolicy(perf_models={"x": slow_prefill}, slo_ttft_s=0.6)
    split = AladdinDecodePolicy(perf_models={"x": slow_prefill}, slo_ttft_s=0.6, fit="best")
    long_prompt = req(8000, "long", predicted_output_tokens=100)
    assert plain.choose(long_prompt, ws, 0.0).reason == "best_effort"   # its TTFT constraint cannot hold
    first = split.choose(long_prompt, ws, 0.0)
    assert first.reason == "best_fit"
    split.on_dispatch(long_prompt, first.worker_id, 0.0)
    nxt = split.choose(req(2000, "next", predicted_output_tokens=100), ws, 0.01)
    assert nxt.worker_id == first.worker_id                              # best fit: the fuller bin first


def test_parse_pd_split() -> None:
    assert parse_pd_split("2:6") == (2, 6)
    for bad in ("2", "2:x", "0:3", "3:0", "1:2:3", ""):
        with pytest.raises(ValueError, match="P:D"):
            parse_pd_split(bad)
    with pytest.raises(ValueError):
        PdPolicy(local_prefill_tokens=-1)


# --- the cluster simulator with P/D pools ---------------------------------------------------------------------

def _workload() -> list[WorkloadRequest]:
    return synthetic_workload(300, rate=20.0, prompt_tokens=(64, 3000), output_tokens=(2, 200), seed=3)


def test_cluster_prefills_on_prefill_workers_and_decodes_on_decode_workers() -> None:
    wl = _workload()
    sim = ClusterSim("llama3-8b-h100", 4, "least_requests", prefill_workers=1)
    res = sim.run(wl)
    prefill = [w for w in sim.workers.values() if w.role == ROLE_PREFILL]
    decode = [w for w in sim.workers.values() if w.role == ROLE_DECODE]
    assert len(prefill) == 1 and len(decode) == 3
    by_id = {r.request_id: r for r in wl}
    split = [r for r in res.results if r.prefill_worker_id is not None]
    local = [r for r in res.results if r.prefill_worker_id is None]
    assert all(r.completed for r in res.results) and split and local
    assert {r.pd_decision for r in split} == {DISAGGREGATED} and {r.pd_decision for r in local} == {LOCAL_SHORT}
    assert all(r.prompt_tokens <= 256 for r in local) and all(r.prompt_tokens > 256 for r in split)
    # prompt tokens: split ones on the prefill worker, local ones on decode workers; the producer's one token
    # per split request is the only generation on the prefill worker
    assert prefill[0].engine.stats.prompt_tokens == sum(r.prompt_tokens for r in split)
    assert sum(w.engine.stats.prompt_tokens for w in decode) == sum(r.prompt_tokens for r in local)
    assert prefill[0].engine.stats.generation_tokens == len(split)
    assert sum(w.engine.stats.generation_tokens for w in decode) == sum(by_id[r.request_id].output_tokens
                                                                        for r in res.results)
    assert prefill[0].engine.num_held == 0 and prefill[0].inflight == 0 and all(w.inflight == 0 for w in decode)
    prof = load_profile("llama3-8b-h100")
    for r in split:  # TTFT = prefill leg + API overhead + KV transfer + the decode worker's first step
        assert r.first_token >= r.prefill_done + prof.ttft_overhead_s + prof.kv_transfer_s(r.prompt_tokens) - 1e-9
        assert r.queue_s == pytest.approx(r.prefill_scheduled - r.arrival)
    summary = res.to_dict()
    assert summary["pd_decisions"] == {DISAGGREGATED: len(split), LOCAL_SHORT: len(local)}
    assert summary["pd_prefill_p50"] > 0 and summary["pd_handoff_p50"] > prof.ttft_overhead_s


def test_cluster_pd_macro_steps_match_single_iterations() -> None:
    wl = _workload()[:150]
    runs = [ClusterSim("llama3-8b-h100", 3, "least_requests", prefill_workers=1, max_iterations=k).run(wl)
            for k in (1, 1 << 30)]
    a, b = ({r.request_id: (r.first_token, r.finished, r.output_tokens) for r in x.results} for x in runs)
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid][2] == b[rid][2]
        assert a[rid][0] == pytest.approx(b[rid][0], abs=1e-9) and a[rid][1] == pytest.approx(b[rid][1], abs=1e-9)


def test_cluster_rejects_what_vllm_refuses_on_either_leg() -> None:
    too_long = WorkloadRequest("big", 0.1, 200_000, 10)
    fine = WorkloadRequest("ok", 0.2, 1000, 10)
    sim = ClusterSim("llama3-8b-h100", 2, "least_requests", prefill_workers=1)
    res = {r.request_id: r for r in sim.run([too_long, fine]).results}
    assert res["big"].finish_reason == "rejected_too_long" and "maximum context length" in res["big"].error
    assert res["ok"].completed and all(w.inflight == 0 and w.inflight_tokens == 0 for w in sim.workers.values())
    with pytest.raises(ValueError, match="prefill_workers"):
        ClusterSim("llama3-8b-h100", 2, "least_requests", prefill_workers=2)


def test_simulate_cli_pd(capsys: pytest.CaptureFixture[str]) -> None:
    run_simulate_cli(SimSpec(trace="sharegpt", workers=8, profile="llama3-8b-h100", policy="aladdin", rate=10.0,
                             duration=20.0, seed=0, pd="1:2"), as_json=True)
    out = json.loads(capsys.readouterr().out)
    assert out["workers"] == 3 and out["policy"] == "pd/aladdin" and out["completed"] == out["requests"] > 0
    assert out["pd_decisions"].get(DISAGGREGATED, 0) > 0
