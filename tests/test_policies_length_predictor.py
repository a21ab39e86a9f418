"""Output-length predictor: buckets, unbiasedness, max_tokens bound, conditional-mean re-prediction, persistence."""

from __future__ import annotations

import json

import numpy as np
import pytest

from policies.length_predictor import LengthPredictor, length_bucket


def test_log2_buckets():
    assert [length_bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 1023, 1024)] == [0, 0, 1, 1, 2, 2, 3, 9, 10]


def _true_mean(prompt: int) -> float:
    return 40.0 + 30.0 * length_bucket(prompt)  # the output length depends on the prompt's bucket


def test_unbiased_on_synthetic_data():
    rng = np.random.default_rng(0)
    p = LengthPredictor()
    for _ in range(20_000):
        prompt = int(rng.integers(1, 4000))
        p.observe("m", prompt, int(rng.exponential(_true_mean(prompt))))
    # Fresh requests: the mean prediction error is ~0 overall and per bucket.
    errors: dict[int, list[float]] = {}
    actuals = []
    for _ in range(20_000):
        prompt = int(rng.integers(1, 4000))
        actual = int(rng.exponential(_true_mean(prompt)))
        actuals.append(actual)
        errors.setdefault(length_bucket(prompt), []).append(p.predict("m", prompt) - actual)
    overall = np.concatenate([np.array(v) for v in errors.values()])
    # Sampling noise of two 20 000-sample means of an exponential is ~1 %; allow 3 %.
    assert abs(overall.mean()) < 0.03 * np.mean(actuals)
    for b, errs in errors.items():
        if len(errs) > 2000:
            assert abs(np.mean(errs)) < 0.1 * _true_mean(2**b), b


def test_defaults_and_shrinkage_towards_model_mean():
    p = LengthPredictor(default_output=100, shrink=8)
    assert p.predict("m", 50) == 100  # nothing learned yet
    for _ in range(8):
        p.observe("m", 1000, 300)  # bucket 9
    for _ in range(24):
        p.observe("m", 10, 100)    # bucket 3
    model_mean = (8 * 300 + 24 * 100) / 32
    assert p.predict("m", 1000) == pytest.approx((8 * 300 + 8 * model_mean) / 16)
    assert p.predict("m", 100_000) == pytest.approx(model_mean)  # unseen bucket: model mean
    assert p.predict("other", 10) == 100                           # unseen model: default


def test_max_tokens_bounds_prediction_as_truncated_mean():
    p = LengthPredictor(shrink=0)
    for x in (10, 20, 30, 200):
        p.observe("m", 100, x)
    assert p.predict("m", 100) == pytest.approx(65.0)
    # E[min(L, 50)] = (10 + 20 + 30 + 50) / 4, not min(mean, 50).
    assert p.predict("m", 100, max_tokens=50) == pytest.approx(27.5)
    assert p.predict("m", 100, max_tokens=5) == 5


def test_conditional_mean_repredicts_long_requests():
    p = LengthPredictor(min_conditional=2)
    for x in (5, 5, 5, 5, 50, 60, 400):
        p.observe("m", 100, x)
    # E[L | L > 10] over the samples longer than 10
    assert p.conditional_mean("m", 100, 10) == pytest.approx((50 + 60 + 400) / 3)
    assert p.conditional_mean("m", 100, 10, max_tokens=100) == pytest.approx((50 + 60 + 100) / 3)
    assert p.conditional_std("m", 100, 10) == pytest.approx(np.std([50, 60, 400], ddof=1))
    # Too few longer samples: memoryless fallback g + E[L].
    mean = p.predict("m", 100)
    assert p.conditional_mean("m", 100, 1000) == pytest.approx(1000 + mean)
    assert p.conditional_mean("m", 100, 1000, max_tokens=1050) == 1050
    assert p.conditional_mean("m", 100, 2000, max_tokens=1200) == 1200


def test_conditional_mean_is_unbiased_for_survivors():
    rng = np.random.default_rng(1)
    p = LengthPredictor(ring_size=4096)
    data = rng.lognormal(5, 1, 4000).astype(int)
    for x in data:
        p.observe("m", 500, int(x))
    test = rng.lognormal(5, 1, 40_000).astype(int)
    survivors = test[test > 300]
    assert p.conditional_mean("m", 500, 300) == pytest.approx(survivors.mean(), rel=0.1)


def test_bad_input_and_persistence():
    p = LengthPredictor()
    with pytest.raises(ValueError):
        p.observe("m", 10, -1)
    with pytest.raises(ValueError):
        LengthPredictor(default_output=0)
    for i in range(700):  # more than the ring holds
        p.observe("m", 10 + i, i % 97)
    back = LengthPredictor.from_dict(json.loads(json.dumps(p.to_dict())))
    for prompt in (10, 100, 600):
        assert back.predict("m", prompt) == p.predict("m", prompt)
        assert back.conditional_mean("m", prompt, 50) == p.conditional_mean("m", prompt, 50)
        assert back.predict_std("m", prompt) == p.predict_std("m", prompt)
    back.observe("m", 10, 3)  # the restored ring keeps working
    assert back.count("m") == 701
