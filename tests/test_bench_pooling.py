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
