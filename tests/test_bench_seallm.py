"""bench/seallm.py: the load search and the comparison it reports."""

from __future__ import annotations

import pytest

from bench.seallm import ORDERS, find_load, ratio, spec


def falling(knee: float):
    """An attainment curve: 1 up to `knee` req/s, then down 10 points per req/s."""
    return lambda rate: 1.0 if rate <= knee else max(0.0, 1.0 - 0.1 * (rate - knee))


def test_find_load_doubles_then_bisects_into_the_band():
    rate, att, tried = find_load(falling(10.0), start=2.0)
    assert 0.90 <= att <= 0.95 and 10.5 <= rate <= 11.0
    assert [r for r, _ in tried[:4]] == [2.0, 4.0, 8.0, 16.0]     # doubled until below the band
    assert all(a == falling(10.0)(r) for r, a in tried)


def test_find_load_in_band_at_once_and_when_steps_run_out():
    rate, att, tried = find_load(lambda r: 0.93, start=5.0)
    assert (rate, att, len(tried)) == (5.0, 0.93, 1)
    # A cliff from 1.0 to 0.5: no rate in the band; the closest tried to 92.5% is returned.
    rate, att, tried = find_load(lambda r: 1.0 if r < 7.3 else 0.5, start=4.0, steps=6)
    assert len(tried) == 6 and att in (1.0, 0.5)
    assert (rate, att) in tried


def test_ratio_and_specs():
    assert ratio(0.04, 0.02) == 2.0 and ratio(1.0, 0.0) == float("inf")
    s = spec(12.0, "seallm+preempt", 1, 100.0, "gamma", 3.0)
    assert (s.service_priority, s.service_preempt, s.cv, s.max_num_seqs) == ("seallm", True, 3.0, 32)
    assert [spec(1.0, o, 0, 10.0, "poisson", 1.0).service_priority for o in ORDERS] == \
        ["fcfs", "round_robin", "seallm", "seallm"]
    with pytest.raises(ValueError):
        spec(1.0, "lottery", 0, 10.0, "poisson", 1.0)


def test_pooled_spec_is_seallms_setting():
    from bench.seallm import POOLED_WORKERS, SERVICES, pooled_spec

    s = pooled_spec(2.0, "seallm", 1, 100.0, (10.0, 0.1))
    r = pooled_spec(1.0, "fcfs", 0, 10.0, (10.0, 0.1), "request", 6)
    assert (r.pooling, r.num_models, r.shared_kv) == ("request", 6, False)
    assert (s.pooling, s.shared_kv, s.service_priority, s.workers) == ("multiplex", True, "seallm", POOLED_WORKERS)
    assert s.num_models == len(SERVICES.split(",")) and s.traces == SERVICES and (s.slo_ttft_s, s.slo_tpot_s) == (10.0, 0.1)


def test_write_section_replaces_its_own_section_only(tmp_path):
    from bench.report import write_section

    path = tmp_path / "r.md"
    path.write_text("# Title\n\nfirst run's body\n")
    write_section(path, "Second", "python -m x --b", "body one", commit="abc")
    write_section(path, "Second", "python -m x --b", "body two", commit="def")
    text = path.read_text()
    assert text.startswith("# Title\n\nfirst run's body\n\n## Second\n")
    assert "body two" in text and "body one" not in text and text.count("## Second") == 1
    assert "- command: `python -m x --b`" in text and "- commit: `def`" in text and "- machine: " in text
