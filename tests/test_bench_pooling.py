"""bench/pooling.py's search: the fewest workers it reports pass the 99% target and one fewer does not."""

from __future__ import annotations

from bench.pooling import TARGET, _run, fewest_workers


def test_fewest_workers_is_the_boundary():
    p = fewest_workers("llama3-8b-h100", 0.5, 6, "request", duration=60, seed=2, cap=12)
    assert p.n_request is not None and p.n_token is not None and p.n_token <= p.n_request
    assert p.at_best["slo_attainment"] >= TARGET
    if p.n_request > 1:
        below = _run("llama3-8b-h100", 0.5, 6, "request", p.n_request - 1, 60, 2).to_dict()
        assert below["slo_attainment"] < TARGET


def test_static_modes_start_at_their_room():
    # dedicated needs a worker per model, multiplex one per two 8B models (the rest would be refused)
    d = fewest_workers("llama3-8b-h100", 0.1, 4, "dedicated", duration=60, seed=2, cap=8)
    m = fewest_workers("llama3-8b-h100", 0.1, 4, "multiplex", duration=60, seed=2, cap=8)
    assert d.n_request == 4 and m.n_request == 2


def test_seeds_report_lists_every_seed_and_the_ratio_spread():
    from bench.pooling import Point, seeds_report

    def pt(mode: str, seed: int, n_req: int | None, n_tok: int) -> Point:
        best = {"hidden_swaps": 3, "swaps": 10, "decode_round_s_mean": 2.0 if mode == "aegaeon" else None,
                "decode_alpha_mean": 0.5 if mode == "aegaeon" else None}
        return Point("p", 0.5, 16, mode, n_req, n_tok, best, 5, seed)

    points = [pt("request", 1, 16, 16), pt("request", 2, None, 15), pt("aegaeon", 1, 8, 6), pt("aegaeon", 2, 10, 5)]
    text = seeds_report(points, {("p", 0.5, 16): 32}, [1, 2])
    assert "| p | 0.5 | 16 | request | 16 / > 32 | 16 / 15 | 3/10 / 3/10 | - / - | - / - |" in text
    assert "| p | 0.5 | 16 | aegaeon | 8 / 10 | 6 / 5 | 3/10 / 3/10 | 2 / 2 | 0.5 / 0.5 |" in text
    # per seed request N / aegaeon N; a request search that never passed counts as the cap (a lower bound)
    assert "| p | 0.5 | 16 | aegaeon | 2.00x / > 3.20x | 2.67x / 3.00x | 2.00-3.20x | 2.67-3.00x |" in text


def test_fewest_workers_passes_the_mechanism_switches():
    on = fewest_workers("llama3-8b-h100", 0.5, 6, "request", duration=60, seed=2, cap=12)
    off = fewest_workers("llama3-8b-h100", 0.5, 6, "request", duration=60, seed=2, cap=12, prefetch=False)
    assert on.at_best["prefetch"] is True and off.at_best["prefetch"] is False
    assert off.at_best["hidden_swaps"] == 0


def test_quota_check_accounts_for_the_misses():
    from bench.pooling import quota_check, quota_report

    p = fewest_workers("llama3-8b-h100", 0.5, 8, "aegaeon", duration=60, seed=2, cap=16)
    q = p.at_best
    assert q["quota_alpha_max"] >= 0.5 and q["quota_wait_s"] > 0 and q["short_tokens"] > 0
    assert 0 <= q["short_misses"] <= q["misses"] and 0 <= q["ttft_misses"] <= q["misses"]
    assert "| llama3-8b-h100 | 0.5 | 8 |" in quota_report([p])
    assert quota_check(_run("llama3-8b-h100", 0.5, 4, "request", 2, 30, 2)) == {}
