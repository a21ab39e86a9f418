"""Pooling policies (policies/pooling): expected values from the Aegaeon paper's own worked examples."""

from __future__ import annotations

import math

import pytest

from policies.pooling.aegaeon import (
    MAX_GPSIZE,
    DecodeWorkLists,
    GroupedPrefill,
    PrefillJob,
    decode_alpha,
    decode_quotas,
)
from policies.pooling.baselines import (
    RoundRobin,
    resident_capacity,
    shared_kv_capacity,
    static_placement,
)
from policies.pooling.costs import expected_active_models, kv_copy_time_s, swap_cost, switch_time_s
from policies.pooling.swapping import EngineView, HostView, RequestLevelSwaps, SwapStep


def test_switch_time_eq4_and_section_4_2_example():
    # Section 4.2: a 13B model over PCIe 4.0 takes at least 26 GB / 32 GB/s = 0.8125 s; eq. 4 scales by beta.
    assert switch_time_s(26e9, 32e9, beta=1.0) == pytest.approx(0.8125)
    assert switch_time_s(26e9, 32e9) == pytest.approx(0.8125 * 0.625)
    sleep = swap_cost(26e9, 32e9, "sleep", wake_overhead_s=1.5)
    assert sleep.load_s == pytest.approx(0.8125 + 1.5) and sleep.offload_s == pytest.approx(0.8125)
    assert swap_cost(26e9, 32e9).offload_s == 0.0
    with pytest.raises(ValueError):
        swap_cost(26e9, 32e9, "cold")
    assert kv_copy_time_s(1000, 819200, 25e9) == pytest.approx(0.032768)


def test_theorem_3_1_figure_4_value():
    # Figure 4: M = 100, lambda = 0.037, T = 16.79 s; the paper prints E[m] = 46.55, eq. 1 gives 46.27 (the
    # paper's lambda is rounded: 0.0373 gives its figure).
    assert expected_active_models([0.037] * 100, 16.79) == pytest.approx(100 * (1 - math.exp(-0.037 * 16.79)))
    assert expected_active_models([0.037] * 100, 16.79) == pytest.approx(46.55, abs=0.3)
    assert expected_active_models([0.0373] * 100, 16.79) == pytest.approx(46.55, abs=0.05)
    assert expected_active_models([], 5.0) == 0.0


def test_decode_quotas_section_4_3_example():
    # Three batches, d = 0.1, t = 0.025, c = 3, Q_MAX = 3: n = 4, alpha = 1, q = 3 s each; 120 tokens a turn,
    # the round (9 s of turns + 3 s of switching) takes 12 s = 120 tokens x 0.1 s: every deadline is met.
    q = decode_quotas([0.025] * 3, 0.1, 3.0, q_max_s=3.0)
    assert q == pytest.approx([3.0, 3.0, 3.0])
    round_s = sum(q) + 3.0
    assert q[0] / 0.025 * 0.1 == pytest.approx(round_s)


def test_decode_quotas_floor_and_no_switching():
    # Cheap switching: alpha hits its 0.5 floor, quotas shrink (turns stay short) and stay <= Q_MAX.
    q = decode_quotas([0.02, 0.04], 0.1, 0.2)
    n = [5.0, 2.5]
    inv = 1 / 5 + 1 / 2.5
    alpha = max(0.2 / (2.5 * 4.0) + inv, 0.5)
    assert alpha > 0.5 and q == pytest.approx([0.2 / (x * (alpha - inv)) for x in n])
    assert all(0 < x <= 4.0 for x in q)
    q2 = decode_quotas([0.02], 0.1, 0.05)          # sum 1/n = 0.2 < 0.5: the floor binds
    assert q2 == pytest.approx([0.05 / (5 * (0.5 - 0.2))])
    assert decode_quotas([0.02, 0.03], 0.1, 0.0) == [4.0, 4.0]
    with pytest.raises(ValueError):
        decode_quotas([0.0], 0.1, 1.0)


def _prefill(instances=("p0", "p1"), switch=1.0, per_token=0.001):
    return GroupedPrefill(list(instances), exec_time=lambda j: j.prompt_tokens * per_token,
                          switch_time=lambda m: switch)


def test_grouped_prefill_groups_by_model_and_caps_group_size():
    gp = _prefill()
    placed = [gp.place(PrefillJob(f"a{i}", "A", 100)) for i in range(MAX_GPSIZE)]
    assert set(placed) == {"p0"}                        # all join the first A group
    assert len(gp.queues["p0"]) == 1 and gp.queues["p0"][0].size == MAX_GPSIZE
    # The group is full: the 9th A request opens a new group on the least loaded instance (p1, empty).
    assert gp.place(PrefillJob("a8", "A", 100)) == "p1"
    # Executing a request does not reopen the group (its size is cumulative).
    assert gp.next_job("p0").request_id == "a0"
    assert gp.place(PrefillJob("a9", "A", 100)) == "p1"
    assert gp.queues["p1"][0].size == 2


def test_grouped_prefill_load_counts_switches():
    gp = _prefill(switch=2.0)
    gp.loaded("p0", "A")
    gp.loaded("p1", "B")
    gp.place(PrefillJob("a0", "A", 1000))               # p0 (tie on load 0: the first)
    assert gp.load("p0") == pytest.approx(1.0)          # no switch: A is resident
    gp.place(PrefillJob("b0", "B", 1000))               # p1: load 0 < 1
    assert gp.load("p1") == pytest.approx(1.0)
    gp.place(PrefillJob("c0", "C", 100))                # both at 1.0 -> p0; a switch to C is charged
    assert gp.load("p0") == pytest.approx(1.0 + 2.0 + 0.1)
    assert gp.place(PrefillJob("d0", "D", 100)) == "p1"
    # FCFS within an instance: the front group first, one request at a time.
    assert [gp.next_job("p0").request_id, gp.next_job("p0").request_id, gp.next_job("p0")] == ["a0", "c0", None]
    assert gp.remove("d0") and not gp.remove("d0") and gp.pending("p1") == 1


def test_decode_work_lists_batches_by_kv_room_and_list_length():
    wl = DecodeWorkLists(["d0", "d1"], capacity_tokens=lambda m: 1000)
    b1 = wl.place("r1", "A", 600)
    assert b1.instance == "d0"
    assert wl.place("r2", "A", 300) is b1               # room left in A's batch
    b3 = wl.place("r3", "A", 300)                       # 1200 > 1000: a new batch, on the shorter list
    assert b3 is not b1 and b3.instance == "d1"
    b4 = wl.place("r4", "B", 100)
    assert b4.instance == "d0"                           # tie (1 batch each): the first instance
    wl.place("r5", "A", 50)                              # fits b1 (950)
    assert wl.batch_of("r5") is b1
    # Round: A's batches adjacent; switching costs 1 s per model change, nothing between batches of A.
    assert wl.place("r6", "A", 900).instance == "d1"     # no room anywhere: d1's list is shorter (1 < 2)
    assert wl.place("r7", "A", 900).instance == "d0"     # 2 batches each: the first instance
    assert [b.model for b in wl.work["d0"]] == ["A", "B", "A"]
    turns = wl.round("d0", step_time=lambda b: 0.025, tbt_s=0.1,
                     switch_cost=lambda p, n: 0.0 if p.model == n.model else 1.0)
    assert [t.model for t in turns] == ["A", "A", "B"]
    assert all(t.quota_s > 0 for t in turns)
    # Round robin across rounds: after the first A batch ran, the next round starts with the batch after it.
    again = wl.round("d0", step_time=lambda b: 0.025, tbt_s=0.1,
                     switch_cost=lambda p, n: 0.0 if p.model == n.model else 1.0, last_batch_id=turns[0].batch_id)
    assert [t.batch_id for t in again] == [turns[1].batch_id, turns[2].batch_id, turns[0].batch_id]
    assert wl.remove("r4") is b4 and "B" not in [b.model for b in wl.work["d0"]]
    assert wl.remove("r4") is None


def test_resident_capacity_two_13b_models_per_a100():
    # Section 2.3: at most two 13-14B BF16 models fit an 80 GB A100. Llama-2-13B: 26.03 GB of weights; the
    # profile's memory for weights + KV is 26.03 GB + 3682 blocks x 16 x 800 KiB.
    memory = 26.03e9 + 3682 * 16 * 819200
    assert resident_capacity(memory, 26.03e9, 819200, 4096) == 2
    assert resident_capacity(memory, 26.03e9, 819200, 40000) == 1
    assert resident_capacity(1e9, 26.03e9, 819200, 4096) == 0


def test_static_placement_by_popularity():
    rates = {"a": 4.0, "b": 2.0, "c": 1.0, "d": 0.5, "e": 0.1}
    two = static_placement(rates, ["h0", "h1"], per_host=2)
    assert set(two) == {"a", "b", "c", "d"}              # 4 slots: the least requested model is left out
    hosts = [h for hs in two.values() for h in hs]
    assert sorted(hosts) == ["h0", "h0", "h1", "h1"]
    assert two["a"] != two["b"]                          # the two busiest go to different hosts
    spare = static_placement({"a": 4.0, "b": 1.0}, ["h0", "h1", "h2"], per_host=1)
    assert len(spare["a"]) == 2 and len(spare["b"]) == 1  # the spare host gets a second copy of the busiest
    assert static_placement(rates, [], 1) == {}


def test_round_robin_skips_models_without_work():
    rr = RoundRobin(["a", "b", "c"])
    assert [rr.next({"a", "c"}), rr.next({"a", "c"}), rr.next({"a", "b", "c"}), rr.next(set())] == ["a", "c", "a", None]


@pytest.mark.parametrize("steps, c", [((0.025, 0.025, 0.025), 3.0), ((0.02, 0.05), 1.3), ((0.017, 0.03, 0.06), 0.2),
                                      ((0.09, 0.09), 2.0)])
def test_quota_mean_tpot_is_alpha_times_tbt(steps, c):
    # Our check of eq. 2-3 against a per-request TPOT: over a whole round every batch decodes q_i / t_i tokens in
    # R = c + sum q, i.e. one token per alpha x d on average, whatever alpha eq. 3 picked (floor 0.5 or not).
    d = 0.1
    q = decode_quotas(steps, d, c)
    alpha = decode_alpha(steps, d, c)
    rnd = c + sum(q)
    for qi, t in zip(q, steps, strict=True):
        assert rnd / (qi / t) == pytest.approx(alpha * d)
    assert decode_alpha((0.025,) * 3, 0.1, 3.0, q_max_s=3.0) == pytest.approx(1.0)     # section 4.3's example
    assert decode_alpha((0.01,), 0.1, 0.0) == 0.5


def test_prefetch_targets_next_group_and_following_batch():
    gp = GroupedPrefill(["p0"], lambda j: 0.1, lambda m: 0.5)
    assert gp.peek_model("p0") is None
    for i, m in enumerate(("A", "B", "A")):
        gp.place(PrefillJob(f"r{i}", m, 10))
    assert gp.peek_model("p0") == "A"
    gp.next_job("p0"), gp.next_job("p0")          # both A jobs (one group)
    assert gp.peek_model("p0") == "B"
    wl = DecodeWorkLists(["d0"], lambda m: 100)
    a = wl.place("x", "A", 80)
    b = wl.place("y", "B", 80)
    assert wl.following("d0", a.batch_id) is b and wl.following("d0", b.batch_id) is a
    assert wl.following("d0", None) is a
    assert DecodeWorkLists(["d1"], lambda m: 1).following("d1", None) is None
    turns = wl.round("d0", lambda bt: 0.02, 0.1, lambda p, n: 0.5)
    plan = wl.last_round
    assert plan is not None and plan.quotas == tuple(t.quota_s for t in turns)
    assert plan.round_s == pytest.approx(1.0 + sum(plan.quotas))


def test_shared_kv_capacity_fits_three_8b_models_per_h100():
    # SeaLLM's unified KV cache (section 4.4): 73.2 GB for weights and KV, 16.06 GB per 8B model, one 128k context
    # of 17.2 GB in all -> 3 models; separate caches (one 128k context each) -> 2.
    mem, w, kv = 73.2e9, 16.06e9, 131072
    assert shared_kv_capacity(mem, w, kv, 131072) == 3
    assert resident_capacity(mem, w, kv, 131072) == 2
    with pytest.raises(ValueError):
        shared_kv_capacity(mem, 0, kv, 1)


def test_request_level_swaps_serve_demand_first_come_or_by_an_order():
    """One planner for the gateway and the simulator: the oldest demand first, or the one a service order ranks
    first (the simulator's --service-priority); the host's idle engine goes to sleep for it."""
    host = {"h": HostView(1, {"A": EngineView(False), "B": EngineView(False), "C": EngineView(True)})}
    fcfs = RequestLevelSwaps()
    fcfs.want("A", 0.0)
    fcfs.want("B", 1.0)
    assert fcfs.plan(host, now=2.0) == [SwapStep("h", "A", ("C",))]
    ranked = RequestLevelSwaps()
    ranked.want("A", 0.0)
    ranked.want("B", 1.0)
    assert ranked.plan(host, now=2.0, order=lambda m: m != "B") == [SwapStep("h", "B", ("C",))]
