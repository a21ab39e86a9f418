"""Machine-speed drift (simulator/speed.py): the process, its fit from probes, and its use by the engine."""

from __future__ import annotations

import dataclasses
import math
import statistics

import numpy as np
import pytest

from simulator.engine import EngineCore, SimRequest
from simulator.profiles import load_profile, profile_from_dict
from simulator.speed import QUANTILE_PROBS, SpeedDrift, fit_speed_drift, quantile_at

# A right-skewed marginal like the calibration host's: mostly near the median, slow stretches up to 1.45x.
SKEWED = (0.86, 0.87, 0.88, 0.90, 0.91, 0.92, 0.93, 0.95, 0.96, 0.97, 0.98, 0.99, 1.00, 1.01, 1.02, 1.04, 1.06,
          1.09, 1.12, 1.15, 1.19, 1.24, 1.29, 1.35, 1.45)


def series(drift: SpeedDrift, n: int, dt: float) -> np.ndarray:
    return np.array([drift.factor(i * dt) for i in range(n)])


def test_quantile_function_interpolates_between_knots_and_clamps_outside():
    assert quantile_at(SKEWED, 0.5) == pytest.approx(1.0)
    assert quantile_at(SKEWED, 0.54) == pytest.approx(1.01)           # QUANTILE_PROBS: 0.02, 0.06, ..., 0.98
    assert quantile_at(SKEWED, 0.52) == pytest.approx(1.005)          # halfway between the knots 0.50 and 0.54
    assert quantile_at(SKEWED, 0.0) == SKEWED[0] and quantile_at(SKEWED, 1.0) == SKEWED[-1]


def test_drift_has_the_given_marginal_and_a_median_of_one():
    f = series(SpeedDrift(SKEWED, tau_s=5.0, seed=1), 100_000, 1.0)
    assert np.median(f) == pytest.approx(1.0, abs=0.01)
    assert f.mean() == pytest.approx(statistics.fmean(SKEWED), abs=0.01)   # one-sided: mean above the median
    for p, q in ((0.1, 0.88), (0.9, 1.29)):
        assert np.quantile(f, p) == pytest.approx(q, abs=0.02)


def test_drift_remembers_for_about_tau():
    tau = 20.0
    f = series(SpeedDrift(SKEWED, tau_s=tau, seed=2), 60_000, 2.0)
    z = np.log(f)
    lag = int(tau / 2.0)                     # one tau apart
    rho = np.corrcoef(z[:-lag], z[lag:])[0, 1]
    assert 0.25 < rho < 0.5                  # exp(-1) = 0.37 for the Gaussian; the copula keeps it close
    assert np.corrcoef(z[:-1], z[1:])[0, 1] > 0.85     # 0.1 tau apart: nearly the same speed


def test_drift_is_deterministic_per_seed_and_constant_within_an_instant():
    a, b, c = (SpeedDrift(SKEWED, 10.0, s) for s in (7, 7, 8))
    ta = [a.factor(t * 0.7) for t in range(50)]
    assert ta == [b.factor(t * 0.7) for t in range(50)]
    assert ta != [c.factor(t * 0.7) for t in range(50)]
    assert a.factor(34.3) == a.factor(34.3) == a.factor(30.0)   # no time passes backwards


def test_fit_recovers_marginal_and_correlation_time_from_repeated_probes():
    tau, spacing = 20.0, 4.0
    drift = SpeedDrift(SKEWED, tau_s=tau, seed=3)
    times = [i * spacing for i in range(5000)]
    steps = [0.011 * drift.factor(t) for t in times]          # a probe's step time at the drifting speed
    fit = fit_speed_drift(times, steps)
    assert fit["spacing_s"] == pytest.approx(spacing) and fit["n"] == 5000
    assert fit["tau_s"] == pytest.approx(tau, rel=0.2)
    assert fit["quantiles"][len(QUANTILE_PROBS) // 2] == pytest.approx(1.0, abs=0.001)   # normalised to the median
    assert np.allclose(fit["quantiles"], SKEWED, atol=0.03)
    assert fit["mean_factor"] == pytest.approx(statistics.fmean(SKEWED), abs=0.01)


def test_fit_of_a_steady_machine_is_no_drift_and_needs_enough_probes():
    fit = fit_speed_drift([float(i) for i in range(10)], [0.01] * 10)
    assert fit["quantiles"] == [1.0] * len(QUANTILE_PROBS) and fit["mean_factor"] == 1.0
    with pytest.raises(ValueError):
        fit_speed_drift([0.0, 1.0, 2.0], [0.01, 0.01, 0.01])


def test_profile_validates_speed_quantiles_and_defaults_to_one_speed():
    base = dataclasses.asdict(load_profile("llama3-8b-a100"))
    assert load_profile("llama3-8b-a100").speed_quantiles == ()
    assert profile_from_dict({**base, "speed_quantiles": list(SKEWED)}).speed_quantiles == SKEWED
    assert profile_from_dict({**base, "speed_quantiles": []}).speed_quantiles == ()
    for bad in ([1.0, 1.1], list(reversed(SKEWED)), [0.0] + list(SKEWED[1:]), ["fast"] * 25):
        with pytest.raises(ValueError, match="speed"):
            profile_from_dict({**base, "speed_quantiles": bad}, "my.yaml")


def test_engine_multiplies_each_step_by_the_factor_at_its_start():
    steady = dataclasses.replace(load_profile("tiny-cpu"), speed_quantiles=())
    drifting = dataclasses.replace(steady, speed_quantiles=SKEWED, speed_tau_s=10.0)
    probe = SpeedDrift(SKEWED, 10.0, seed=5)               # the engine's own process: same profile, same seed

    def step_at(profile, t: float, seed: int = 5) -> float:
        core = EngineCore(profile, seed=seed)
        for i in range(4):
            core.add(SimRequest(f"r{i}", 64, [], 8, 8), t)
        return core.plan_step(t)

    base = step_at(steady, 0.0)
    assert step_at(steady, 50.0) == base                    # no drift: one speed
    got = [step_at(drifting, 0.0)]
    assert got[0] == pytest.approx(base * probe.factor(0.0))
    core = EngineCore(drifting, seed=9)
    durations = []
    t = 0.0
    for i in range(300):                                    # one engine over 300 s: its speed changes
        core.add(SimRequest(f"q{i}", 64, [], 1, 1), t)
        d = core.plan_step(t)
        core.finish_step(t + d)
        durations.append(d)
        t += 1.0
    assert max(durations) / min(durations) > 1.1
    assert all(not math.isnan(d) and d > 0 for d in durations)


def test_fit_over_rounds_pairs_only_probes_of_one_round():
    """Probes in rounds with other work between them: a pair across the gap is not a lag-1 pair (its spacing and its
    correlation would both be wrong). Rounds much longer than tau hold the whole marginal."""
    tau, spacing = 20.0, 4.0
    drift = SpeedDrift(SKEWED, tau_s=tau, seed=5)
    times, steps, rounds = [], [], []
    for r in range(10):                       # 10 rounds of 200 probes (40 tau), 1200 s apart
        for i in range(200):
            t = 1200.0 * r + spacing * i
            times.append(t)
            steps.append(0.011 * drift.factor(t))
            rounds.append(r)
    fit = fit_speed_drift(times, steps, rounds)
    assert fit["spacing_s"] == pytest.approx(spacing) and fit["n"] == 2000
    assert fit["tau_s"] == pytest.approx(tau, rel=0.25)
    assert np.allclose(fit["quantiles"], SKEWED, atol=0.06)
    unsegmented = fit_speed_drift(times, steps)
    assert unsegmented["spacing_s"] > 1.3 * spacing    # the gaps inflate the spacing, hence tau, without segments
    with pytest.raises(ValueError):
        fit_speed_drift(times, steps, list(range(len(times))))   # no two probes in one round
    with pytest.raises(ValueError):
        fit_speed_drift(times, steps, rounds[:-1])


def test_fit_over_rounds_keeps_the_slow_level_change_between_rounds_out_of_the_marginal():
    """The host's two time scales: a level that moves between rounds minutes apart (here 0.7-1.4x) and a fast
    drift within them. The simulator's drift is the fast one (a leg is about as long as a round); the levels are
    reported beside it."""
    fast = SpeedDrift(SKEWED, tau_s=2.0, seed=9)
    levels = [1.0, 1.4, 0.7, 1.2, 0.9, 1.1, 0.8] * 4
    times, steps, rounds = [], [], []
    for r, level in enumerate(levels):
        for i in range(60):                   # 60 s of probes 1 s apart, rounds 240 s apart
            t = 240.0 * r + 1.0 * i
            times.append(t)
            steps.append(0.005 * level * fast.factor(t))
            rounds.append(r)
    fit = fit_speed_drift(times, steps, rounds)
    assert np.allclose(fit["quantiles"], SKEWED, atol=0.06)
    assert fit["tau_s"] == pytest.approx(2.0, rel=0.3)
    assert np.allclose(fit["segment_levels"], np.array(levels) / np.median(levels), rtol=0.1)
    assert fit["between_sigma_log"] == pytest.approx(float(np.std(np.log(levels))), rel=0.1)
    pooled = fit_speed_drift(times, steps)    # one segment: the level change is read as a huge, slow drift
    spread = [q[22] / q[2] for q in (pooled["quantiles"], fit["quantiles"])]   # p90 / p10
    assert spread[0] > 1.3 * spread[1] and pooled["segment_levels"] == [1.0]
