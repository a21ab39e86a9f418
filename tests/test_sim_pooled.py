"""Pooled serving in the virtual-time simulator (simulator/pooled.py, simulator/pooled_workload.py)."""

from __future__ import annotations

import json
import math

import pytest

from policies.pooling.aegaeon import decode_quotas
from policies.pooling.costs import switch_time_s
from simulator.pooled import PooledSim, PooledSpec, simulate_pooled
from simulator.pooled_workload import (
    ModelMix,
    ModelRequest,
    MultiModelWorkload,
    multi_model_workload,
    parse_skew,
    zipf_rates,
)
from simulator.profiles import load_profile
from tests.helpers import run_cli as fleetgate

PROFILE = load_profile("llama2-13b-a100")
SWAP_S = switch_time_s(PROFILE.weight_bytes, PROFILE.host_link_bytes_per_s)   # eq. 4: 0.65 s


def test_zipf_rates_and_skew_parsing():
    rates = zipf_rates(3.0, 4, 1.0)
    assert sum(rates) == pytest.approx(3.0)
    assert rates[0] / rates[1] == pytest.approx(2.0) and rates[0] / rates[3] == pytest.approx(4.0)
    assert zipf_rates(2.0, 4, 0.0) == pytest.approx([0.5] * 4)
    assert parse_skew("zipf:1.5") == 1.5 and parse_skew("uniform") == 0.0
    for bad in ("zipf", "zipf:-1", "pareto:1", "zipf:x"):
        with pytest.raises(ValueError):
            parse_skew(bad)


def test_multi_model_workload_rates_lengths_and_slo():
    wl = multi_model_workload(ModelMix(4, 4.0, skew=1.0, max_model_len=4096), duration=500, seed=3)
    counts = {m: 0 for m in wl.rates}
    for r in wl.requests:
        counts[r.model] += 1
        assert r.prompt_tokens + r.output_tokens < 4096
        assert (r.slo_ttft_s, r.slo_tpot_s) == (10.0, 0.1)
    for m, rate in wl.rates.items():       # Poisson counts within 4 standard deviations of rate x duration
        assert abs(counts[m] - rate * 500) < 4 * math.sqrt(rate * 500)
    assert [r.arrival for r in wl.requests] == sorted(r.arrival for r in wl.requests)
    assert multi_model_workload(ModelMix(4, 4.0), 100, seed=3).requests != multi_model_workload(
        ModelMix(4, 4.0), 100, seed=4).requests


def _two_models(pooling: str, workers: int, **opts: object) -> tuple[PooledSim, dict]:
    """Model A gets a long request at t=0; model B a short one at t=1: the head-of-line case of section 3.1."""
    reqs = [ModelRequest("a", 0.0, 500, 800, max_tokens=800, slo_ttft_s=10.0, slo_tpot_s=0.1, model="model-00"),
            ModelRequest("b", 1.0, 200, 20, max_tokens=20, slo_ttft_s=10.0, slo_tpot_s=0.1, model="model-01")]
    wl = MultiModelWorkload(reqs, {"model-00": 0.1, "model-01": 0.1}, {"model-00": "x", "model-01": "x"},
                            {"model-00": 300.0, "model-01": 300.0})
    sim = PooledSim(PooledSpec(num_models=2, workers=workers, pooling=pooling, duration=2.0, **opts), wl)
    res = sim.run()
    return sim, {r.request_id: r for r in res.sim.results} | {"_res": res}


def test_request_level_swapping_blocks_the_second_model_until_the_first_is_done():
    sim, rs = _two_models("request", workers=1, prefetch=False)
    a, b = rs["a"], rs["b"]
    assert a.completed and b.completed
    assert rs["_res"].swaps == 2                                   # A in, then B in (only once A finished)
    assert b.first_token >= a.finished + SWAP_S - 1e-9             # head-of-line blocking
    assert rs["_res"].swap_seconds == pytest.approx(2 * SWAP_S)
    # Per-token deadlines (section 2.1): B's first token comes after its 10 s TTFT target, so all 20 of its
    # tokens are late; A's 800 are on time.
    assert rs["_res"].token_slo_attainment == pytest.approx(800 / 820)


def test_sleep_reinit_costs_offload_reload_and_wake():
    # vLLM sleep level 1 (docs/reference/vllm-interface.md §6.1): the first load has nothing to offload; the
    # switch to B offloads A's weights over the link, reloads B's and pays the profile's wake overhead.
    reqs = [ModelRequest("a", 0.0, 100, 10, max_tokens=10, slo_ttft_s=10.0, slo_tpot_s=0.1, model="model-00"),
            ModelRequest("b", 0.5, 100, 10, max_tokens=10, slo_ttft_s=10.0, slo_tpot_s=0.1, model="model-01")]
    wl = MultiModelWorkload(reqs, {"model-00": 0.1, "model-01": 0.1}, {}, {})
    res = PooledSim(PooledSpec(num_models=2, workers=1, pooling="request", duration=1.0, reinit="sleep"), wl).run()
    copy = PROFILE.weight_bytes / PROFILE.host_link_bytes_per_s
    assert res.swaps == 2
    assert res.swap_seconds == pytest.approx(2 * (copy + PROFILE.wake_up_s) + copy)


def test_aegaeon_serves_the_second_model_at_token_level():
    sim, rs = _two_models("aegaeon", workers=2)
    a, b = rs["a"], rs["b"]
    assert a.completed and b.completed and a.output_tokens == 800 and b.output_tokens == 20
    assert a.prefill_worker_id == b.prefill_worker_id == "p0"
    assert b.first_token < a.finished                               # B's prefill does not wait for A's decode
    assert b.finished < a.finished                                  # nor its decode (turns of the work list)
    assert b.slo_met
    assert rs["_res"].token_slo_attainment == 1.0                  # A's stalls hide behind its buffered tokens
    assert rs["_res"].swaps >= 3                                    # prefill A, B; decode A, B, A ...


def test_dedicated_and_multiplex_capacity():
    # Two 13B models fit one A100 awake (section 2.3), three do not.
    res = simulate_pooled(PooledSpec(num_models=3, rate=0.3, workers=1, pooling="multiplex", duration=60, seed=1))
    d = res.to_dict()
    assert d["unserved_models"] == 1 and d["swaps"] == 0
    assert d["refused"] > 0 and d["refused"] + d["completed"] == d["requests"]
    res = simulate_pooled(PooledSpec(num_models=2, rate=0.2, workers=2, pooling="dedicated", duration=120, seed=1))
    d = res.to_dict()
    assert d["unserved_models"] == 0 and d["swaps"] == 0 and d["slo_attainment"] == 1.0
    assert d["models_per_worker"] == 1.0


def test_active_model_count_follows_theorem_3_1():
    # Dedicated hosts with light load: a request's time in system is its service time, and the measured mean
    # active-model count matches M (1 - e^{-lambda T}) for the measured T.
    res = simulate_pooled(PooledSpec(num_models=6, rate=0.6, workers=6, pooling="dedicated", duration=1500, seed=2))
    assert res.active_models_mean == pytest.approx(res.expected_active_models, rel=0.15)
    assert 0 < res.active_models_mean < 6


def test_spec_validation():
    for bad in (dict(pooling="mux"), dict(num_models=0), dict(workers=0), dict(pooling="aegaeon", workers=1),
                dict(model_skew="zipf:-2"), dict(rate=0)):
        with pytest.raises(ValueError):
            PooledSpec(**bad)


def test_cli_contract_pooled_json():
    p = fleetgate("simulate", "--num-models", "6", "--model-skew", "zipf:1.2", "--rate", "0.6", "--workers", "3",
                  "--pooling", "aegaeon", "--profile", "llama2-13b-a100", "--duration", "60", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    for key in ("slo_attainment", "goodput_rps", "models_per_worker", "swaps", "ttft_p50", "ttft_p99", "tpot_p50",
                "tpot_p99", "token_slo_attainment", "active_models_mean", "expected_active_models"):
        assert key in out, key
    assert out["models_per_worker"] == 2.0 and out["num_models"] == 6 and out["pooling"] == "aegaeon"
    assert out["prefill_workers"] + out["decode_workers"] == 3
    assert 0 <= out["slo_attainment"] <= 1 and out["swaps"] > 0
    # The same spec through the API gives the same numbers (the CLI is a shim).
    api = simulate_pooled(PooledSpec(num_models=6, model_skew="zipf:1.2", rate=0.6, workers=3, pooling="aegaeon",
                                     duration=60)).to_dict()
    assert (api["slo_met"], api["swaps"]) == (out["slo_met"], out["swaps"])


@pytest.mark.parametrize("args, message", [
    (["--pooling", "mux", "--rate", "1"], "--pooling must be one of"),
    (["--pooling", "request"], "needs --rate"),
    (["--pooling", "aegaeon", "--rate", "1", "--workers", "1"], "at least 2 workers"),
    (["--pooling", "request", "--rate", "1", "--model-skew", "zipf"], "model skew"),
    (["--pooling", "request", "--rate", "1", "--pd", "1:1"], "--pd does not combine"),
])
def test_cli_bad_pooled_input_exits_2(args, message):
    p = fleetgate("simulate", *args)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr


def test_request_level_prefetch_hides_the_switch_behind_the_running_request():
    # Section 5.2's prefetch, given to request-level swapping too: B is queued at t=1 while A decodes, its
    # weights come in beside A's (room on the GPU), so the switch at A's end waits for nothing.
    sim, rs = _two_models("request", workers=1)
    a, b, res = rs["a"], rs["b"], rs["_res"]
    assert res.swaps == 2 and res.hidden_swaps == 1
    assert res.swap_seconds == pytest.approx(SWAP_S)                   # only A's first load
    assert a.finished <= b.first_token < a.finished + SWAP_S


def test_prefetch_needs_room_beside_the_running_batch():
    # Twelve 3000-token prompts of A hold ~30 GB of KV: with A's 26 GB of weights the A100 has no room for B's
    # until most of them are done.
    reqs = [ModelRequest(f"a{i}", 0.0, 3000, 500, max_tokens=500, slo_ttft_s=10.0, slo_tpot_s=0.1, model="model-00")
            for i in range(12)]
    reqs.append(ModelRequest("b", 1.0, 200, 20, max_tokens=20, slo_ttft_s=10.0, slo_tpot_s=0.1, model="model-01"))
    wl = MultiModelWorkload(reqs, {"model-00": 0.1, "model-01": 0.1}, {}, {})
    res = PooledSim(PooledSpec(num_models=2, workers=1, pooling="request", duration=2.0), wl).run()
    assert res.swaps == 2 and res.hidden_swaps == 0
    assert res.swap_seconds > 1.5 * SWAP_S               # B's load mostly not hidden (A's first load is never)


def test_aegaeon_prefetch_and_kv_overlap_shorten_the_switches():
    # The same two-model run with sections 5.2-5.3 off and on: every switch costs the full weights (plus the
    # batch's KV) without them; with them decode switches are (partly) hidden.
    _, off = _two_models("aegaeon", workers=2, prefetch=False, kv_overlap=False)
    _, on = _two_models("aegaeon", workers=2)
    assert off["_res"].hidden_swaps == 0
    assert on["_res"].swaps == off["_res"].swaps and on["_res"].swap_seconds < off["_res"].swap_seconds
    assert on["a"].finished <= off["a"].finished and on["b"].completed
    rounds = on["_res"].decode_rounds
    assert rounds and all(r.alpha >= 0.5 and r.round_s >= sum(r.quotas) for r in rounds)
    d = on["_res"].to_dict()
    assert d["prefetch"] and d["kv_overlap"] and d["decode_round_s_mean"] > 0 and d["decode_alpha_mean"] >= 0.5


def _services_on_one_host(order: str) -> dict:
    """Two 8B services co-resident on one H100 (shared KV, SeaLLM section 4.4): service A a 3000-token answer at
    t=0, service B a 20-token one at t=1. One service per step."""
    reqs = [ModelRequest("a", 0.0, 200, 3000, max_tokens=3000, slo_ttft_s=10.0, slo_tpot_s=0.1, model="model-00"),
            ModelRequest("b", 1.0, 200, 20, max_tokens=20, slo_ttft_s=10.0, slo_tpot_s=0.1, model="model-01")]
    wl = MultiModelWorkload(reqs, {"model-00": 0.1, "model-01": 0.1}, {}, {})
    res = PooledSim(PooledSpec(num_models=2, workers=1, pooling="multiplex", profile="llama3-8b-h100",
                               duration=2.0, service_priority=order, shared_kv=True), wl).run()
    return {r.request_id: r for r in res.sim.results} | {"_res": res}


def test_service_order_on_a_shared_host():
    fcfs, rr, db = (_services_on_one_host(o) for o in ("fcfs", "round_robin", "seallm"))
    # FCFS: B's service runs only once A's request (older) is done: head-of-line blocking across services.
    assert fcfs["b"].first_token >= fcfs["a"].finished
    # Round robin: the services alternate step by step.
    assert rr["b"].finished < rr["b"].arrival + 1.0 < rr["a"].finished
    # Doubling budget: A keeps the GPU while within its first budget (prior L = 256, Q = 512 iterations), then
    # its budget doubles, its priority Q'L drops below B's fresh one, and B runs before A is done.
    assert db["a"].first_token < db["b"].first_token < db["a"].finished and db["b"].finished < db["a"].finished
    assert db["b"].first_token > db["b"].arrival + 1.0          # not at once: A was within its budget
    d = db["_res"].to_dict()
    assert d["service_priority"] == "seallm" and d["norm_latency_mean"] > 0 and d["swaps"] == 0


def test_shared_kv_fits_more_services_per_host():
    # 8B on an H100: two copies with a 128k context each (separate caches), three with one shared pool.
    sep = PooledSim(PooledSpec(num_models=3, workers=1, pooling="multiplex", profile="llama3-8b-h100"),
                    multi_model_workload(ModelMix(3, 0.3, max_model_len=131072), 10, 1))
    shared = PooledSim(PooledSpec(num_models=3, workers=1, pooling="multiplex", profile="llama3-8b-h100",
                                  shared_kv=True), multi_model_workload(ModelMix(3, 0.3, max_model_len=131072), 10, 1))
    assert len(sep.placement) == 2 and len(shared.placement) == 3


@pytest.mark.parametrize("order, first", [("fcfs", "long"), ("seallm", "short")])
def test_request_level_swapping_next_model_by_service_priority(order, first):
    # One host loading model 2 (0.65 s) for a request that keeps it busy ~5 s (under the 10 s starvation threshold);
    # while it loads, a request of model 0 (a service whose requests are long) and then one of model 1 (short) queue,
    # so the planner chooses between them once the host takes part in the plan again (a swap's wake target is fixed
    # when its drain starts: policies/pooling/swapping.py). FCFS brings model 0 next; the doubling budget, whose
    # profiles have learned the two services, brings model 1 (smallest O_r = Q_r L_s).
    reqs = [ModelRequest("busy", 0.0, 100, 250, max_tokens=250, slo_ttft_s=10.0, slo_tpot_s=0.1, model="model-02"),
            ModelRequest("long", 0.1, 100, 400, max_tokens=400, slo_ttft_s=10.0, slo_tpot_s=0.1, model="model-00"),
            ModelRequest("short", 0.2, 100, 20, max_tokens=20, slo_ttft_s=10.0, slo_tpot_s=0.1, model="model-01")]
    rates = {"model-00": 0.1, "model-01": 0.1, "model-02": 0.1}
    sim = PooledSim(PooledSpec(num_models=3, workers=1, pooling="request", duration=3.0, service_priority=order),
                    MultiModelWorkload(reqs, rates, {}, {}))
    for _ in range(20):
        sim.sched.finished("x", 0, 0, 0.0)      # unknown ids teach nothing
        sim.sched.profile("model-00").observe(400.0)
        sim.sched.profile("model-01").observe(20.0)
    res = {r.request_id: r for r in sim.run().sim.results}
    other = "short" if first == "long" else "long"
    assert res["busy"].finished < res[first].first_token < res[other].first_token


def test_cli_pooled_service_priority_and_mechanism_flags():
    p = fleetgate("simulate", "--num-models", "4", "--rate", "1", "--workers", "2", "--pooling", "multiplex",
                  "--shared-kv", "--service-priority", "seallm", "--profile", "llama3-8b-h100",
                  "--trace", "sharegpt,arxiv,azure_conv,code", "--duration", "60", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["service_priority"] == "seallm" and out["swaps"] == 0 and out["norm_latency_mean"] > 0
    assert set(out["services"]) == {"model-00", "model-01", "model-02", "model-03"}
    p = fleetgate("simulate", "--num-models", "6", "--rate", "0.6", "--workers", "3", "--pooling", "aegaeon",
                  "--no-prefetch", "--no-kv-overlap", "--duration", "30", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["prefetch"] is False and out["kv_overlap"] is False and out["hidden_swaps"] == 0
    p = fleetgate("simulate", "--num-models", "4", "--rate", "1", "--workers", "2", "--pooling", "aegaeon",
                  "--service-priority", "seallm")
    assert p.returncode == 2 and "applies to --pooling multiplex or request" in p.stderr
    p = fleetgate("simulate", "--num-models", "4", "--rate", "1", "--pooling", "request", "--service-priority", "lottery")
    assert p.returncode == 2 and "--service-priority must be one of" in p.stderr


# ---- Aegaeon's turns on colocated hosts (--pooling aegaeon --prefill-fraction 0: the gateway's scheduling: turns)

def _turns(reqs: list[ModelRequest], models: int = 3, **opts: object) -> tuple[PooledSim, dict, list]:
    """One host holding `models` 13B engines (three do not fit an A100 awake: sleep level 1, weights swapped);
    returns the sim, the results by id and every switch as (time it starts, model)."""
    names = [f"model-{i:02d}" for i in range(models)]
    wl = MultiModelWorkload(reqs, dict.fromkeys(names, 0.1), dict.fromkeys(names, "x"), dict.fromkeys(names, 300.0))
    sim = PooledSim(PooledSpec(num_models=models, workers=1, pooling="aegaeon", prefill_fraction=0.0,
                               duration=max(r.arrival for r in reqs) + 1, **opts), wl)
    switches: list[tuple[float, str]] = []
    swap_in = sim._swap_in

    def logged(h, model, now, extra_s=0.0):
        switches.append((now, model))
        swap_in(h, model, now, extra_s)

    sim._swap_in = logged
    res = sim.run()
    return sim, {r.request_id: r for r in res.sim.results} | {"_res": res}, switches


def _long(rid: str, t: float, model: str, prompt: int = 500, out: int = 600) -> ModelRequest:
    return ModelRequest(rid, t, prompt, out, max_tokens=out, slo_ttft_s=10.0, slo_tpot_s=0.1, model=model)


def test_colocated_turns_interleave_two_models_with_eq_2_3_quotas():
    sim, rs, switches = _turns([_long("a", 0.0, "model-00"), _long("b", 0.5, "model-01")])
    a, b, res = rs["a"], rs["b"], rs["_res"]
    assert a.completed and b.completed and a.output_tokens == b.output_tokens == 600
    assert a.worker_id == b.worker_id == "w0"
    # Turns, not request-level swapping: B starts while A is still decoding, and A runs again after B's first turn.
    assert a.first_token < b.first_token < a.finished and b.finished > a.finished - 60
    models = [m for _, m in switches]
    assert models[:4] == ["model-00", "model-01", "model-00", "model-01"]
    assert res.swaps == len(switches) >= 6
    # Every round of both batches: c = two weight swaps (KV dropped, nothing copied back) and eq. 2-3's quotas.
    two = [r for r in res.decode_rounds if len(r.quotas) == 2]
    assert len(two) >= 3
    for r in two:
        assert r.switch_s == pytest.approx(2 * SWAP_S)
        assert list(r.quotas) == pytest.approx(decode_quotas(list(r.step_times), 0.1, r.switch_s))
    # A turn lasts its quota: from the end of one switch to the start of the next, within one step's overshoot
    # (the iteration in flight at the quota's end completes; the first step of a turn recomputes the dropped KV).
    q = two[1].quotas[0]
    gaps = [t1 - (t0 + SWAP_S) for (t0, _), (t1, _) in zip(switches[2:-2], switches[3:-1], strict=True)]
    assert gaps and all(q - 0.05 < g < q + 0.15 for g in gaps), (q, gaps)


def test_colocated_turns_drop_the_kv_on_sleep_unless_kept():
    reqs = [_long("a", 0.0, "model-00"), _long("b", 0.5, "model-01")]
    _, dropped, _ = _turns(reqs)
    _, kept, _ = _turns(reqs, kv_kept=True)
    d, k = dropped["_res"], kept["_res"]
    assert k.kv_dropped == 0 and k.prompt_tokens_computed == 1000          # each prompt computed once
    # Stock vLLM: every switch away from a running request drops its KV; it recomputes prompt + output so far.
    assert d.kv_dropped >= 4 and d.prompt_tokens_computed > 1000 + 2 * 500
    assert d.to_dict()["kv_dropped"] == d.kv_dropped and d.to_dict()["mode"] == "aegaeon-coloc"
    # With the KV kept, a switch also copies the incoming batch's KV back over the host link (section 5.3): every
    # round but the first, planned as A's weights arrive with B waiting, before either has any KV.
    two = [r for r in k.decode_rounds if len(r.quotas) == 2]
    assert two[0].switch_s == pytest.approx(2 * SWAP_S)
    assert len(two) >= 3 and all(r.switch_s > 2 * SWAP_S for r in two[1:])
    for rs in (dropped, kept):
        assert rs["a"].completed and rs["b"].completed


def test_colocated_turns_recompute_quota_counts_the_recomputation_as_switching():
    reqs = [_long("a", 0.0, "model-00"), _long("b", 0.5, "model-01")]
    _, plain, _ = _turns(reqs)
    _, rq, _ = _turns(reqs, recompute_quota=True)
    two = [r for r in rq["_res"].decode_rounds if len(r.quotas) == 2]
    # c holds the recompute estimate of every round planned once a batch has started (the first is planned as
    # A's weights arrive, nothing computed yet)
    assert two[0].switch_s == pytest.approx(2 * SWAP_S)
    assert len(two) >= 3 and all(r.switch_s > 2 * SWAP_S for r in two[1:])
    assert rq["a"].completed and rq["b"].completed


def test_colocated_turns_a_model_alone_never_switches():
    reqs = [_long(f"r{i}", 3.0 * i, "model-01", out=300) for i in range(6)]
    _, rs, switches = _turns(reqs)
    res = rs["_res"]
    assert switches == [(pytest.approx(reqs[0].arrival + PROFILE.ttft_overhead_s), "model-01")]   # loaded once
    assert res.swaps == 1 and res.kv_dropped == 0 and res.sim.preemptions == 0
    assert res.decode_rounds == []     # alone, a model runs with no round and no quota (HostTurns, as live)
    assert all(rs[r.request_id].slo_met for r in reqs)


def test_colocated_turns_pause_only_when_the_models_fit_awake():
    # Two 13B models fit one A100 (as multiplex): sleep level 0, a pause costs nothing and keeps the KV.
    _, rs, switches = _turns([_long("a", 0.0, "model-00"), _long("b", 0.5, "model-01")], models=2)
    res = rs["_res"]
    assert switches == [] and res.swaps == 0 and res.swap_seconds == 0 and res.kv_dropped == 0
    assert res.prompt_tokens_computed == 1000
    assert rs["a"].first_token < rs["b"].first_token < rs["a"].finished     # still turns of the work list


def test_colocated_turns_place_models_like_a_shared_hosts_config():
    # ceil(6 / 2) = 3 engines per host (static_placement: one copy each here), a model's requests on its host.
    spec = dict(num_models=6, rate=1.2, workers=2, pooling="aegaeon", prefill_fraction=0, profile="llama3-8b-h100",
                duration=60, seed=1)
    res = simulate_pooled(PooledSpec(**spec, kv_kept=True))
    d = res.to_dict()
    assert d["unserved_models"] == 0 and d["completed"] == d["requests"] and d["models_per_worker"] == 3.0
    model_of = {r.request_id: r.model for r in multi_model_workload(res.spec.mix, 60, 1).requests}
    hosts: dict[str, set[str]] = {}
    for r in res.sim.results:
        hosts.setdefault(model_of[r.request_id], set()).add(r.worker_id)
    assert all(len(h) == 1 for h in hosts.values())
    assert sorted(sum((list(h) for h in hosts.values()), [])).count("w0") == 3
    assert d["swaps"] > 0 and "prefill_workers" not in d


def test_colocated_turns_with_dropped_kv_starve_when_recomputing_exceeds_the_quota():
    # The same load with stock vLLM's sleep: a turn's eq. 2-3 quota (about 0.2 s for two 8B batches at TBT
    # 100 ms) is shorter than recomputing a batch's prompts and outputs (one 8192-token chunk is 0.24 s), so a
    # batch whose context outgrows one chunk loses its KV again before it decodes: most requests never finish.
    # Counting the recomputation as switching (recompute_quota) serves them all.
    spec = dict(num_models=6, rate=1.2, workers=2, pooling="aegaeon", prefill_fraction=0, profile="llama3-8b-h100",
                duration=60, seed=1)
    stock = simulate_pooled(PooledSpec(**spec)).to_dict()
    rq = simulate_pooled(PooledSpec(**spec, recompute_quota=True)).to_dict()
    assert stock["completed"] < stock["requests"] / 2 and stock["kv_dropped"] > 10 * stock["requests"]
    assert rq["completed"] == rq["requests"] and rq["slo_attainment"] > 0.9


def test_colocated_turns_spec_validation():
    assert PooledSpec(pooling="aegaeon", workers=1, prefill_fraction=0).colocated      # no partition: one host is enough
    for bad in (dict(pooling="aegaeon", kv_kept=True), dict(pooling="request", recompute_quota=True),
                dict(pooling="aegaeon", prefill_fraction=0, turns_placement="random"),
                dict(pooling="aegaeon", prefill_fraction=1.0)):
        with pytest.raises(ValueError):
            PooledSpec(**bad)


def test_cli_colocated_turns():
    p = fleetgate("simulate", "--num-models", "3", "--rate", "0.6", "--workers", "1", "--pooling", "aegaeon",
                  "--prefill-fraction", "0", "--kv-kept", "--duration", "30", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["mode"] == "aegaeon-coloc" and out["kv_kept"] is True and out["kv_dropped"] == 0
    assert out["recompute_quota"] is False     # the KV kept: nothing to recompute
    for key in ("slo_attainment", "token_slo_attainment", "goodput_rps", "models_per_worker", "swaps",
                "decode_round_s_mean"):
        assert key in out, key
    p = fleetgate("simulate", "--num-models", "3", "--rate", "0.6", "--workers", "2", "--pooling", "aegaeon",
                  "--prefill-fraction", "0", "--recompute-quota", "--turns-placement", "all", "--duration", "30",
                  "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["kv_kept"] is False and out["workers"] == 2 and out["completed"] == out["requests"]
    # colocated turns that drop the KV count its recomputation by default, as the gateway's shared hosts do
    base = ("simulate", "--num-models", "3", "--rate", "0.6", "--workers", "2", "--pooling", "aegaeon",
            "--prefill-fraction", "0", "--duration", "30", "--json")
    assert json.loads(fleetgate(*base).stdout)["recompute_quota"] is True
    # the stock rule starves the turns as workers are added (bench/results/pooling.md): refused, with the reason
    p = fleetgate(*base, "--no-recompute-quota")
    assert p.returncode == 2 and "recompute_quota false is not supported" in p.stderr and "starve" in p.stderr
    p = fleetgate("simulate", "--num-models", "3", "--rate", "0.6", "--workers", "2", "--pooling", "aegaeon",
                  "--kv-kept")
    assert p.returncode == 2 and "kv_kept and recompute_quota apply to" in p.stderr
