"""The planner's closed forms (policies/planning.py): instance capacity, Aladdin eq. 6-7 sizing, the heterogeneous
paper's mixed-type search and Algorithm 1, SeaLLM's allocation by unserved index."""

from __future__ import annotations

import pytest

from policies.hardware import derive_profile, gpu_spec
from policies.planning import (
    COST,
    THROUGHPUT,
    Candidate,
    GpuStock,
    InstanceGroup,
    ServiceDemand,
    Slo,
    algorithm1_throughput,
    best_tp,
    candidates,
    grow,
    homogeneous_count,
    instance_capacity,
    instance_options,
    mixed_types,
    seallm_allocation,
)

SLO = Slo(0.6, 0.03)
CHAT = ServiceDemand("llama3-8b", 20.0, 600.0, 250.0)


def test_capacity_follows_the_slo_the_gpu_and_the_lengths() -> None:
    a100 = derive_profile("llama3-8b", "a100", 1)
    h100 = derive_profile("llama3-8b", "h100", 1)
    base = instance_capacity(a100, CHAT, SLO)
    assert base > 0
    assert instance_capacity(h100, CHAT, SLO) > 1.5 * base            # 1.64x the bandwidth, 2.9x the compute
    assert instance_capacity(a100, CHAT, Slo(0.6, 0.06)) > base        # a looser TPOT allows bigger batches
    longer = ServiceDemand("llama3-8b", 20.0, 600.0, 1000.0)
    assert instance_capacity(a100, longer, SLO) < base                # longer answers: fewer requests per second
    # A TPOT target below one lone decode step (A100 8B: ~12 ms) cannot be met at any rate.
    assert instance_capacity(a100, CHAT, Slo(0.6, 0.01)) == 0.0
    # Nor a TTFT target below a lone prompt's prefill (4000 tokens x 0.07 ms = 280 ms).
    assert instance_capacity(a100, ServiceDemand("llama3-8b", 1.0, 4000.0, 100.0), Slo(0.2, 0.05)) == 0.0


def test_capacity_at_its_rate_keeps_the_engine_within_its_time_budget() -> None:
    """At the returned rate, decode steps at 0.8 x TPOT plus the prefills fill the engine's second (not more)."""
    p = derive_profile("llama3-8b", "a100", 1)
    cap = instance_capacity(p, CHAT, SLO)
    pace = 0.8 * SLO.tpot_s
    batch = cap * CHAT.mean_output * pace
    ctx = CHAT.mean_input + CHAT.mean_output / 2
    step = p["c_step_s"] + max(p["t_weights_s"], p["c_decode_s"] * batch) + p["k_ctx_s"] * batch * ctx
    prefill = p["k_prefill_s"] * CHAT.mean_input + p["k_attn_s"] * CHAT.mean_input**2 / 2
    busy = step / pace + cap * prefill
    assert busy == pytest.approx(1.0, abs=1e-3) or batch == pytest.approx(p["max_num_seqs"], rel=1e-3)


def test_aladdin_sizing_picks_the_best_per_gpu_tp_and_enough_workers() -> None:
    opts = instance_options(ServiceDemand("llama2-70b", 5.0, 600.0, 250.0), [gpu_spec("a100")], Slo(1.0, 0.05))
    assert {o.tp for o in opts} <= {2, 4, 8} and opts                 # 138 GB of weights: not on one 80 GB GPU
    best = best_tp(opts)
    assert best is not None and all(best.capacity / best.tp >= o.capacity / o.tp for o in opts)
    n = homogeneous_count(best, 5.0)
    assert n * best.capacity >= 5.0 > (n - 1) * best.capacity


def test_mixed_types_cheapest_mix_covers_the_rate_and_respects_stock() -> None:
    stocks = [GpuStock(gpu_spec("a100"), 4), GpuStock(gpu_spec("h100"), 2), GpuStock(gpu_spec("l4"), 8)]
    opts = instance_options(CHAT, [s.gpu for s in stocks], SLO)
    mixes = mixed_types(opts, stocks, CHAT, COST)
    assert mixes
    costs = [m.cost_per_hour for m in mixes]
    assert costs == sorted(costs)
    for m in mixes:
        assert m.capacity[CHAT.model] >= CHAT.rate
        for s in stocks:
            assert sum(g.gpus for g in m.groups if g.gpu == s.gpu.name) <= s.count
            assert len({g.tp for g in m.groups if g.gpu == s.gpu.name}) <= 1   # one TP degree per GPU type
    # Brute force over the same options: nothing cheaper covers the rate.
    cheapest = min(
        (na * a.cost_per_hour + nh * h.cost_per_hour)
        for a in [o for o in opts if o.gpu.name == "a100"] for h in [o for o in opts if o.gpu.name == "h100"]
        for na in range(4 // a.tp + 1) for nh in range(2 // h.tp + 1)
        if na * a.capacity + nh * h.capacity >= CHAT.rate
    )
    assert mixes[0].cost_per_hour <= cheapest + 1e-9


def test_throughput_objective_uses_the_budget_and_no_more() -> None:
    stocks = [GpuStock(gpu_spec("a100"), 8), GpuStock(gpu_spec("l4"), 16)]
    opts = instance_options(CHAT, [s.gpu for s in stocks], SLO)
    mixes = mixed_types(opts, stocks, CHAT, THROUGHPUT, budget=10.0)
    assert mixes and all(m.cost_per_hour <= 10.0 for m in mixes)
    caps = [m.capacity[CHAT.model] for m in mixes]
    assert caps == sorted(caps, reverse=True)


def test_seallm_allocation_serves_every_service_and_gives_the_short_one_first() -> None:
    stocks = [GpuStock(gpu_spec("a100"), 16)]
    demands = [ServiceDemand("llama3-8b", 12.0, 600, 250), ServiceDemand("llama2-13b", 4.0, 600, 250),
               ServiceDemand("llama2-70b", 1.0, 600, 250)]
    opts = {d.model: instance_options(d, [s.gpu for s in stocks], SLO) for d in demands}
    c = seallm_allocation(opts, stocks, demands, 1, COST)
    assert c is not None
    for d in demands:
        assert c.capacity[d.model] >= d.rate
    # The 70B model does not fit a group of one GPU: its instance merges groups (TP 2 at least).
    assert all(g.tp >= 2 for g in c.groups if g.model == "llama2-70b")
    assert c.gpus <= 16
    # Throughput: all groups are handed out.
    t = seallm_allocation(opts, stocks, demands, 2, THROUGHPUT)
    assert t is not None and t.gpus == 16


def test_candidates_rank_and_refuse_what_cannot_be_served() -> None:
    stocks = [GpuStock(gpu_spec("a100"), 8), GpuStock(gpu_spec("h100"), 8)]
    found = candidates([CHAT], stocks, SLO, COST)
    assert found and found[0].scale([CHAT]) >= 1.0
    costs = [c.cost_per_hour for c in found if c.scale([CHAT]) >= 1.0]
    assert costs == sorted(costs)
    assert len({c.key() for c in found}) == len(found)
    with pytest.raises(ValueError, match="none of the GPU types"):
        candidates([ServiceDemand("llama2-70b", 1.0, 600, 250)], [GpuStock(gpu_spec("l4"), 1)], SLO)
    with pytest.raises(ValueError, match="objective"):
        candidates([CHAT], stocks, SLO, "speed")


def test_grow_adds_the_best_value_instance_within_stock_and_budget() -> None:
    stocks = [GpuStock(gpu_spec("a100"), 2)]
    opts = instance_options(CHAT, [s.gpu for s in stocks], SLO)
    c = Candidate((InstanceGroup("llama3-8b", "a100", 1, 1, price_per_gpu_hour=1.8),), {"llama3-8b": 1.0}, "t")
    bigger = grow(c, CHAT, opts, stocks)
    assert bigger is not None and bigger.gpus == 2
    assert grow(bigger, CHAT, opts, stocks) is None                   # the stock is used up
    assert grow(c, CHAT, opts, stocks, budget=2.0) is None             # and a second A100 is over this budget


def test_algorithm1_ranks_by_static_batches_of_the_kv_cache() -> None:
    """More KV per instance (TP2 vs TP1 on 32 GB) helps when the cache bounds the batch: long outputs."""
    lengths = [(200, 1500)] * 200
    tp1 = algorithm1_throughput(derive_profile("llama3-8b", "v100", 1), lengths, 1, 8)
    tp2 = algorithm1_throughput(derive_profile("llama3-8b", "v100", 2), lengths, 2, 8)
    assert tp1 > 0 and tp2 > 0
    short = [(200, 20)] * 200                                          # prefill-bound: TP only adds all-reduces
    assert algorithm1_throughput(derive_profile("llama3-8b", "v100", 1), short, 1, 8) > \
        algorithm1_throughput(derive_profile("llama3-8b", "v100", 8), short, 8, 8)


def test_prefill_decode_split_sizes_each_phase_and_grows_the_phase_asked() -> None:
    from policies.planning import disaggregated
    from policies.types import ROLE_DECODE, ROLE_MIXED, ROLE_PREFILL

    prof = derive_profile("llama3-8b", "h100", 1)
    mixed = instance_capacity(prof, CHAT, SLO)
    prefill = instance_capacity(prof, CHAT, SLO, role=ROLE_PREFILL)
    decode = instance_capacity(prof, CHAT, SLO, role=ROLE_DECODE)
    assert decode > mixed and prefill > mixed        # each phase alone goes further than both on one instance
    # A prefill instance is planned 70 % busy: 0.7 / (c_step + k_prefill x 600 + attention) per second.
    alone = prof["c_step_s"] + max(prof["t_weights_s"], prof["k_prefill_s"] * 600 + prof["k_attn_s"] * 600**2 / 2)
    assert prefill == pytest.approx(0.7 / alone)
    stocks = [GpuStock(gpu_spec("h100"), 16)]
    opts = instance_options(CHAT, [s.gpu for s in stocks], SLO)
    (split,) = disaggregated(opts, stocks, CHAT, SLO, COST)
    roles = {g.role: g.count for g in split.groups}
    assert set(roles) == {ROLE_PREFILL, ROLE_DECODE} and ROLE_MIXED not in roles
    assert split.capacity[CHAT.model] >= CHAT.rate
    assert "pd-split" in {c.method for c in candidates([CHAT], stocks, SLO, COST, keep=20)}
    more = grow(split, CHAT, opts, stocks, phase=ROLE_PREFILL)
    assert more is not None
    assert {g.role: g.count for g in more.groups} == {**roles, ROLE_PREFILL: roles[ROLE_PREFILL] + 1}


def test_a_candidate_that_leaves_a_model_without_instances_is_no_candidate() -> None:
    demands = [ServiceDemand("llama3-8b", 2.0, 600, 250), ServiceDemand("llama2-13b", 2.0, 600, 250)]
    assert candidates(demands, [GpuStock(gpu_spec("a100"), 1)], SLO) == []     # one GPU: one of the two at most
    both = candidates(demands, [GpuStock(gpu_spec("a100"), 2)], SLO)
    assert both and all({g.model for g in c.groups} == {"llama3-8b", "llama2-13b"} for c in both)
