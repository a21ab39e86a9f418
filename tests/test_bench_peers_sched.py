"""bench/peers_sched.py: the prompts it replays share exactly the prefixes the trace's block keys share, and a
request meets its SLO only when it completed within both targets."""

from __future__ import annotations

from bench.peers_sched import Outcome, meets, prompt_text, trace_window
from simulator.tokenizer import BLOCK_SIZE, count_tokens, encode
from simulator.workload import WorkloadRequest


def test_prompts_have_the_traces_token_counts_and_share_its_prefixes():
    a = WorkloadRequest("a", 0.0, 100, 4, prefix_blocks=(1, 2, 3, 4, 5, 6))
    b = WorkloadRequest("b", 0.0, 70, 4, prefix_blocks=(1, 2, 3, 9))
    c = WorkloadRequest("c", 0.0, 40, 4, prefix_blocks=(7, 8))
    cache: dict[int, str] = {}
    ta, tb, tc = (prompt_text(r, cache) for r in (a, b, c))
    assert [count_tokens(t) for t in (ta, tb, tc)] == [100, 70, 40]
    ea, eb, ec = encode(ta), encode(tb), encode(tc)
    assert ea[: 3 * BLOCK_SIZE] == eb[: 3 * BLOCK_SIZE]          # blocks 1, 2, 3 shared token for token
    assert ea[3 * BLOCK_SIZE: 4 * BLOCK_SIZE] != eb[3 * BLOCK_SIZE: 4 * BLOCK_SIZE]   # then 4 vs 9
    assert ea[:BLOCK_SIZE] != ec[:BLOCK_SIZE]
    assert ta[96 * 4:] != prompt_text(WorkloadRequest("z", 0.0, 100, 4, prefix_blocks=a.prefix_blocks), cache)[96 * 4:]


def test_a_request_meets_its_slo_only_when_done_within_both_targets():
    r = WorkloadRequest("r", 0.0, 100, 8, slo_ttft_s=1.0, slo_tpot_s=0.1)
    assert meets(Outcome(0.9, 0.05, ok=True, status=200), r)
    assert not meets(Outcome(1.1, 0.05, ok=True, status=200), r)
    assert not meets(Outcome(0.9, 0.2, ok=True, status=200), r)
    assert not meets(Outcome(0.9, 0.05, ok=False, status=429), r)
    assert meets(Outcome(0.5, None, ok=True, status=200), WorkloadRequest("one", 0.0, 100, 1, slo_ttft_s=1.0))


def test_the_trace_window_starts_at_zero_with_per_request_slos():
    reqs = trace_window(3000, 50)
    assert len(reqs) == 50 and reqs[0].arrival == 0.0
    assert all(b.arrival >= a.arrival for a, b in zip(reqs, reqs[1:], strict=False))
    assert all(r.slo_ttft_s and r.slo_ttft_s > 0.5 and r.slo_tpot_s == 0.1 for r in reqs)


def test_the_headline_compares_fleetgates_best_arm_with_the_best_peer_by_goodput():
    from bench.peers_sched import ArmRun, headline

    reqs = [WorkloadRequest(str(i), 0.0, 10, 2, slo_ttft_s=1.0, slo_tpot_s=0.1) for i in range(4)]
    good, bad = Outcome(0.5, 0.05, ok=True, status=200), Outcome()
    runs = [ArmRun("fleetgate a", [good, good, bad, bad], 2.0), ArmRun("fleetgate b", [good] * 3 + [bad], 2.0),
            ArmRun("vllm-router c", [good] * 4, 4.0), ArmRun("sglang-router d", [good, bad, bad, bad], 1.0)]
    line = headline(runs, reqs)
    assert line.startswith("Best fleetgate arm by goodput: fleetgate b, 1.500 met req/s = 1.50x")
    assert "(vllm-router c, 1.000)" in line and "75.0% vs 100.0%" in line
