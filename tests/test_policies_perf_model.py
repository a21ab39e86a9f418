"""Performance models: Aladdin eq. 1-4 and hetero eq. 3-4 by hand, the robust online fitter, persistence."""

from __future__ import annotations

import json

import numpy as np
import pytest

from policies.perf_model import DECODE, KV, PREFILL, PerfModel, PerfModelFitter, robust_linear_fit

M = PerfModel(k1=2e-4, c1=0.01, k2=1e-6, c2=1e-3, c3=0.02, h=0.0625, j=1.0, kv_capacity=1000, max_batch=64,
              k1q=0.0, pf=0.0)


def test_aladdin_equations_by_hand():
    assert M.prefill_time(1000) == pytest.approx(2e-4 * 1000 + 0.01)               # eq. 2: 0.21 s
    assert M.decode_step(10, 500) == pytest.approx((1e-6 * 500 + 1e-3) * 10 + 0.02)  # eq. 3: 0.035 s
    assert M.kv_blocks(160) == pytest.approx(160 / 16 + 1)                          # eq. 1: 11 blocks
    assert M.kv_blocks(320, requests=2) == pytest.approx(22)
    # eq. 4: (T − c2·b − c3)/k2 = (0.05 − 0.01 − 0.02)/1e-6 = 20 000 tokens for b = 10, T = 50 ms
    assert M.context_limit(10, 0.05) == pytest.approx(20_000)
    # At exactly that total context the decode step equals T.
    assert M.decode_step(10, 20_000 / 10) == pytest.approx(0.05)
    # Largest batch with any context left: (T − c3)/c2 = 30, under max_batch.
    assert M.batch_limit(0.05) == pytest.approx(30)
    assert PerfModel(c2=1e-5, c3=0.02, max_batch=64).batch_limit(0.05) == 64


def test_prefill_attention_term_and_floor_by_hand():
    m = PerfModel(k1=1e-4, c1=0.02, k1q=2e-9, pf=0.015)
    # c1 + max(pf, k1·l + k1q·l²): 8000 tokens -> 0.02 + 0.8 + 0.128; 50 tokens -> the floor.
    assert m.prefill_time(8000) == pytest.approx(0.02 + 0.8 + 0.128)
    assert m.prefill_time(50) == pytest.approx(0.02 + 0.015)
    # Two prompts of 4000: Σl² = 2·4000², half the quadratic cost of one 8000-token prompt.
    assert m.prefill_time(8000, 2 * 4000**2) == pytest.approx(0.02 + 0.8 + 0.064)
    # Work in linear-token equivalents: l + (k1q/k1)·l² = 8000 + 1280.
    assert m.prefill_work(8000) == pytest.approx(9280)
    assert m.c1 + m.k1 * m.prefill_work(8000) == pytest.approx(m.prefill_time(8000))


def test_hetero_equations_by_hand():
    m = PerfModel(p=(1.0, 2.0, 3.0, 4.0, 0.1, 0.2, 0.3, 0.4), k1q=0.0)
    # eq. 3: p1·b·I + p2·b + p3·I + p4 with b=2, I=10: 20 + 4 + 30 + 4
    assert m.hetero_prefill(2, 10) == pytest.approx(58.0)
    # eq. 4: Σ_{k=1..3} [0.1·2·(10+k) + 0.2·2 + 0.3·(10+k) + 0.4]
    direct = sum(0.1 * 2 * (10 + k) + 0.2 * 2 + 0.3 * (10 + k) + 0.4 for k in range(1, 4))
    assert m.hetero_decode(2, 10, 3) == pytest.approx(direct)


def test_aladdin_form_maps_onto_hetero_form():
    # b identical requests: Σl_in = b·I, Σctx = b·(I + k): eq. 3-4 of hetero equal eq. 2-3 of Aladdin.
    b, i, o = 8, 300, 50
    assert M.hetero_prefill(b, i) == pytest.approx(M.prefill_time(b * i))
    assert M.hetero_decode(b, i, o) == pytest.approx(sum(M.decode_step(b, i + k) for k in range(1, o + 1)))


def test_from_prior_and_step_profile():
    m = PerfModel.from_prior({"k1": 3e-4, "num_gpu_blocks": 500, "block_size": 32, "max_num_seqs": 8, "name": "x"})
    assert (m.k1, m.kv_capacity, m.h, m.max_batch) == (3e-4, 500, 1 / 32, 8)
    assert m.c3 == PerfModel().c3  # unset coefficients keep the defaults
    prof = {"c_step_s": 0.003, "t_weights_s": 0.014, "k_prefill_s": 1e-4, "c_decode_s": 1e-4, "k_ctx_s": 4e-7,
            "k_attn_s": 4e-9, "max_num_batched_tokens": 2048, "max_num_seqs": 256, "block_size": 16,
            "num_gpu_blocks": 3000, "ttft_overhead_s": 0.015}
    s = PerfModel.from_step_profile(prof)
    # Chunked prefill of 2048-token chunks: every further chunk adds c_step; l²/2 attention pairs.
    assert s.k1 == pytest.approx(1e-4 + 0.003 / 2048) and s.k1q == pytest.approx(2e-9)
    assert s.c1 == pytest.approx(0.018) and s.pf == pytest.approx(0.014)
    assert s.c3 == pytest.approx(0.017) and s.k2 == pytest.approx(4e-7)
    # The chord bounds max(t_w, c_decode·B) from above on [0, max_num_seqs].
    for b in (1, 50, 140, 256):
        assert s.c2 * b + 0.014 >= max(0.014, 1e-4 * b) - 1e-12


def test_bad_models_rejected():
    with pytest.raises(ValueError, match="k1"):
        PerfModel.from_prior({"k1": -1})
    with pytest.raises(ValueError, match="unknown"):
        PerfModel.from_dict({"k9": 1})
    with pytest.raises(ValueError, match="8 coefficients"):
        PerfModel.from_dict({"p": [1, 2]})


def _noisy(true: PerfModel, rng: np.random.Generator, n: int, outliers: float, fitter: PerfModelFitter) -> None:
    for _ in range(n):
        bad = rng.random() < outliers
        tot = int(rng.integers(200, 30_000))
        fitter.add_prefill(tot, true.prefill_time(tot) * (1 + 0.02 * rng.standard_normal()) * (6 if bad else 1))
        b, ctx = int(rng.integers(1, 64)), float(rng.uniform(100, 3000))
        fitter.add_decode(b, ctx, true.decode_step(b, ctx) * (1 + 0.02 * rng.standard_normal()) * (4 if bad else 1))
        tok, reqs = int(rng.integers(10, 40_000)), int(rng.integers(1, 40))
        fitter.add_kv(tok, true.kv_blocks(tok, reqs) + rng.normal(0, 1) + (500 if bad else 0), reqs)


@pytest.mark.parametrize("outliers", [0.0, 0.1])
def test_fitter_recovers_known_coefficients(outliers):
    true = PerfModel(k1=2e-4, c1=0.02, k2=6e-7, c2=2e-4, c3=0.03, h=1 / 16, j=0.5, k1q=4e-9, pf=0.01)
    fitter = PerfModelFitter(prior=PerfModel(), prior_weight=5)
    _noisy(true, np.random.default_rng(1), 500, outliers, fitter)
    m = fitter.refit()
    for name in ("k1", "k1q", "c1", "k2", "c2", "c3", "h", "j"):
        assert getattr(m, name) == pytest.approx(getattr(true, name), rel=0.08), name
    for comp in (PREFILL, DECODE, KV):
        assert m.fit[comp].n == 500
        assert m.fit[comp].rel_err < 0.03  # median relative error: about the 2 % noise


def test_ordinary_least_squares_is_pulled_by_outliers_robust_is_not():
    rng = np.random.default_rng(2)
    x = np.column_stack([rng.uniform(0, 1000, 300), np.ones(300)])
    y = x @ np.array([2e-4, 0.02]) * (1 + 0.01 * rng.standard_normal(300))
    y[::10] *= 8  # 10 % gross outliers
    ols = np.linalg.lstsq(x, y, rcond=None)[0]
    robust = robust_linear_fit(x, y, np.array([1e-4, 0.01]))
    assert abs(ols[0] / 2e-4 - 1) > 0.3
    assert robust[0] == pytest.approx(2e-4, rel=0.05)


def test_prior_dominates_with_few_samples():
    prior = PerfModel(k1=1e-4, c1=0.01, k1q=0.0, pf=0.0)
    fitter = PerfModelFitter(prior=prior, prior_weight=20)
    for tot in (100, 1000, 2000, 3000, 4000):
        fitter.add_prefill(tot, 3e-4 * tot + 0.01)  # the truth has 3x the prior's k1
    m = fitter.refit()
    w = 5 / (5 + 20)  # θ = w·θ_fit + (1 − w)·θ_prior
    assert m.k1 == pytest.approx(w * 3e-4 + (1 - w) * 1e-4, rel=0.02)
    assert m.k2 == prior.k2  # no decode samples: prior kept


def test_periodic_refit_and_bounded_memory():
    fitter = PerfModelFitter(capacity=16, refit_interval_s=10, refit_min_new=4)
    assert not fitter.maybe_refit(0.0)  # nothing new
    for i in range(40):
        fitter.add_decode(4, 100 + i, 0.03)
    assert fitter.sample_counts[DECODE] == 16  # ring buffer keeps the newest 16
    assert fitter.maybe_refit(100.0)
    assert not fitter.maybe_refit(105.0)  # interval not over, nothing new
    fitter.add_decode(1, 1, float("nan"))
    fitter.add_decode(-1, 1, 0.1)
    assert fitter.rejected == 2


def test_persistence_round_trip_through_json():
    fitter = PerfModelFitter(prior_weight=1)
    _noisy(PerfModel(k1=3e-4), np.random.default_rng(3), 50, 0.0, fitter)
    m = fitter.refit()
    data = json.loads(json.dumps(fitter.to_dict()))
    back = PerfModelFitter.from_dict(data)
    assert back.model.to_dict() == m.to_dict()
    assert back.model.fit[PREFILL].rmse == m.fit[PREFILL].rmse
    assert PerfModel.from_dict(m.to_dict()).hetero_coeffs() == m.hetero_coeffs()
