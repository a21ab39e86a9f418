"""The calibration and fidelity tools without vLLM: fitting math, workload, statistics, report, streaming client.

The client test streams from a real simulated server over HTTP on 127.0.0.1 (SimFleet with the fitted profile).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random

import numpy as np
import pytest

from bench.fidelity.calibrate import (
    AdmissionSample,
    Calibration,
    DecodeSample,
    HostPathSample,
    PrefillSample,
    decode_step,
    derive_profile,
    fit_admission,
    fit_host_path,
    fit_perf_model,
    fit_prefill_form,
    gateway_overhead,
    probe_host_path,
    profile_yaml,
)
from bench.fidelity.harness import (
    TOKEN_HI,
    TOKEN_LO,
    EngineInfo,
    StreamResult,
    cache_config_info,
    client_session,
    histogram_totals,
    random_prompt,
    scheduler_limits,
    stream_completion,
)
from bench.fidelity.legs import (
    SCALE,
    Cell,
    LegResult,
    compare,
    leg_stats,
    load_lengths,
    make_workload,
    poisson_arrivals,
    pool,
    run_leg,
    run_open_loop,
    scale_lengths,
)
from bench.fidelity.run import LevelResult, engine_view_table, render_report
from simulator import tokenizer
from simulator.engine import EngineCore, SimRequest
from simulator.profiles import load_profile

INFO = EngineInfo(num_gpu_blocks=512, block_size=128, max_num_seqs=128, max_num_batched_tokens=2048,
                  weight_bytes=13_638_856)


# --- workload --------------------------------------------------------------------------------------------
def test_scale_lengths_rounds_clips_and_fits_the_context():
    assert scale_lengths(1730, 415) == (216, 52)            # 1/8, rounded
    assert scale_lengths(1, 2) == (1, 1)                    # never 0 tokens
    assert scale_lengths(9000, 50) == (1023, 1)             # the prompt leaves room for one output token
    p, o = scale_lengths(7000, 2000)                         # prompt + output <= 1024
    assert (p, o) == (875, 149) and p + o <= 1024


def test_workload_is_the_scaled_trace_and_deterministic():
    rows = load_lengths()
    assert len(rows) > 30_000
    a, b = make_workload(200, seed=3), make_workload(200, seed=3)
    assert [(x.prompt, x.max_tokens) for x in a] == [(x.prompt, x.max_tokens) for x in b]
    assert [x.prompt for x in make_workload(5, seed=4)] != [x.prompt for x in a[:5]]
    for item in a:
        assert len(item.prompt) >= 1 and len(item.prompt) + item.max_tokens <= 1024
        assert all(TOKEN_LO <= t < TOKEN_HI for t in item.prompt)
    # the sample's mean output is the trace's scaled mean, within sampling error
    trace_mean = np.mean([d for _, d in rows]) * SCALE
    assert np.mean([x.max_tokens for x in make_workload(1000, seed=5)]) == pytest.approx(trace_mean, rel=0.08)


def test_poisson_arrivals_have_the_asked_rate():
    t = poisson_arrivals(20_000, rate=40.0, seed=1)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:], strict=False))
    assert len(t) / t[-1] == pytest.approx(40.0, rel=0.03)
    gaps = np.diff(t)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)   # exponential gaps: CV 1
    assert poisson_arrivals(10, 5.0, seed=2) == poisson_arrivals(10, 5.0, seed=2)
    with pytest.raises(ValueError):
        poisson_arrivals(10, 0.0, seed=1)


# --- per-request timing ----------------------------------------------------------------------------------------
def test_stream_result_ttft_and_tpot_count_tokens_not_chunks():
    # 10 tokens, 2 ms apart, the 4th and 5th arriving merged in one chunk
    r = StreamResult(prompt_tokens=5, max_tokens=10, sent=1.0, status=200,
                     chunks=[(1.050, 1), (1.052, 2), (1.054, 3), (1.058, 5), (1.060, 6), (1.062, 7), (1.064, 8),
                             (1.066, 9), (1.068, 10)])
    assert r.ok and r.output_tokens == 10
    assert r.ttft == pytest.approx(0.050)
    assert r.tpot == pytest.approx(0.018 / 9)
    one = StreamResult(5, 1, sent=0.0, status=200, chunks=[(0.01, 1)])
    assert one.tpot is None and one.ttft == pytest.approx(0.01)
    assert not StreamResult(5, 1, status=502, error="x").ok


def _stream(prompt: int, t_first: float, step: float, n: int) -> StreamResult:
    return StreamResult(prompt, n, sent=0.0, status=200, chunks=[(t_first + i * step, i + 1) for i in range(n)])


def test_decode_step_uses_the_window_where_every_stream_decodes():
    # 4 streams admitted one step apart (their prefills interleave), then decode together every 10 ms
    streams = [_stream(100, 0.01 * k, 0.010, 40) for k in range(4)]
    step, ctx, steps = decode_step(streams)
    assert step == pytest.approx(0.010)
    assert 100 + 1 < ctx < 100 + 40
    assert steps >= 30
    # no common window: one stream finished before another started
    assert decode_step([_stream(10, 0.0, 0.01, 5), _stream(10, 1.0, 0.01, 5)]) is None
    assert decode_step([]) is None


# --- fitting ---------------------------------------------------------------------------------------------------
K1, C1, K2, C2, C3 = 20e-6, 0.012, 8e-9, 60e-6, 0.004


def _synthetic(noise: float = 0.0, outliers: int = 0, seed: int = 0):
    rng = random.Random(seed)
    prefill = []
    for n in (8, 64, 128, 256, 512, 768, 1000) * 3:
        t = K1 * n + C1
        prefill.append(PrefillSample(n, t * (1 + rng.gauss(0, noise)), t - 0.0015))
    decode = []
    for ctx in (50, 300, 700):
        for b in (1, 2, 4, 8, 16, 32, 64):
            t = (K2 * ctx + C2) * b + C3
            decode.append(DecodeSample(b, ctx - 30, ctx, t * (1 + rng.gauss(0, noise)), 50))
    for i in range(outliers):   # stalls of the host: much slower samples
        prefill[i].ttft_s *= 4
        decode[i].step_s *= 4
    return prefill, decode


def test_fit_recovers_aladdin_coefficients_from_clean_samples():
    prefill, decode = _synthetic()
    m = fit_perf_model(prefill, decode, INFO)
    for got, want in ((m.k1, K1), (m.c1, C1), (m.k2, K2), (m.c2, C2), (m.c3, C3)):
        assert got == pytest.approx(want, rel=1e-3)
    assert m.fit["decode"].rel_err < 1e-3 and m.fit["prefill"].n == len(prefill)
    assert m.kv_capacity == 512 and m.max_batch == 128 and m.h == pytest.approx(1 / 128)


def test_fit_is_robust_to_a_few_stalls():
    prefill, decode = _synthetic(noise=0.02, outliers=3, seed=1)
    m = fit_perf_model(prefill, decode, INFO)
    assert m.k1 == pytest.approx(K1, rel=0.1) and m.c1 == pytest.approx(C1, rel=0.1)
    assert m.c3 == pytest.approx(C3, rel=0.15) and m.c2 == pytest.approx(C2, rel=0.15)


def test_prefill_form_finds_the_attention_term():
    c, kp, ka = 0.010, 15e-6, 20e-9
    samples = [PrefillSample(n, c + kp * n + ka * n * n / 2, None) for n in (8, 64, 128, 256, 512, 768, 1000)]
    f = fit_prefill_form(samples)
    assert f["c"] == pytest.approx(c, rel=1e-3) and f["k_prefill"] == pytest.approx(kp, rel=1e-2)
    assert f["k_attn"] == pytest.approx(ka, rel=1e-2) and f["rel_err"] < 1e-3


def test_gateway_overhead_is_the_median_paired_difference():
    samples = [PrefillSample(8, 0.020 + d, 0.020) for d in (0.001, 0.002, 0.003, 0.050)]
    assert gateway_overhead(samples) == pytest.approx(0.0025)
    assert gateway_overhead([PrefillSample(8, 0.01, 0.02)]) == 0.0       # never negative
    assert gateway_overhead([PrefillSample(8, 0.01, None)]) == 0.0


def test_derived_profile_maps_the_fit_term_by_term_and_loads(tmp_path):
    prefill, decode = _synthetic()
    m = fit_perf_model(prefill, decode, INFO)
    form = {"c": 0.012, "k_prefill": 18e-6, "k_attn": 3e-9, "n": 21, "rmse": 0.0, "rel_err": 0.0}
    prof = derive_profile(m, form, INFO, gw_overhead_s=0.0015, output_mean_tokens=55.0)
    assert prof["c_step_s"] == pytest.approx(C3, rel=1e-3) and prof["c_decode_s"] == pytest.approx(C2, rel=1e-3)
    assert prof["k_ctx_s"] == pytest.approx(K2, rel=1e-3) and prof["t_weights_s"] == 0.0
    assert prof["ttft_overhead_s"] == pytest.approx(0.012 - prof["c_step_s"] - 0.0015)
    assert prof["kv_bytes_per_token"] == 256 * 2**20 // (512 * 128)
    cal = Calibration(aladdin=m.to_dict(), prefill_form=form, gateway_overhead_s=0.0015, engine={}, profile=prof,
                      measured_at="now", load_average=0.5)
    path = tmp_path / "tiny.yaml"
    path.write_text(profile_yaml(cal))
    loaded = load_profile(str(path))
    assert loaded.c_step_s == pytest.approx(prof["c_step_s"], rel=1e-5)
    assert loaded.num_gpu_blocks == 512 and loaded.block_size == 128 and loaded.max_model_len == 1024
    # a lone request's TTFT in the simulator's model = overhead + one prefill step = the fitted curve minus
    # the gateway's share
    n = 500
    ttft = loaded.ttft_overhead_s + loaded.step_time(n, 0, 0, n * n / 2)
    assert ttft == pytest.approx(form["c"] + form["k_prefill"] * n + form["k_attn"] * n * n / 2 - 0.0015, rel=1e-4)
    # overhead never negative even when the gateway's share exceeds the constant
    assert derive_profile(m, {**form, "c": 0.001}, INFO, 0.0015, 55.0)["ttft_overhead_s"] == 0.0


def test_speed_probe_lands_in_the_profile_and_the_report(tmp_path):
    from bench.fidelity.run import calibration_section
    from simulator.speed import fit_speed_drift

    prefill, decode = _synthetic()
    m = fit_perf_model(prefill, decode, INFO)
    form = {"c": 0.012, "k_prefill": 18e-6, "k_attn": 3e-9, "n": 21, "rmse": 0.0, "rel_err": 0.0}
    prof = derive_profile(m, form, INFO, gw_overhead_s=0.0015, output_mean_tokens=55.0)
    assert prof["speed_quantiles"] == []                     # no probe, no drift
    times = [4.5 * i for i in range(40)]
    steps = [0.011 * (1.35 if 10 <= i < 18 else 1.0 + 0.01 * (i % 3)) for i in range(40)]   # one slow stretch
    drift = fit_speed_drift(times, steps)
    prof["speed_quantiles"], prof["speed_tau_s"] = drift["quantiles"], round(drift["tau_s"], 2)
    cal = Calibration(aladdin=m.to_dict(), prefill_form=form, gateway_overhead_s=0.0015, engine=dataclasses.asdict(INFO),
                      profile=prof, speed_fit=drift, speed=list(zip(times, steps, strict=True)), measured_at="now")
    path = tmp_path / "tiny.yaml"
    path.write_text(profile_yaml(cal))
    loaded = load_profile(str(path))
    assert loaded.speed_quantiles == tuple(drift["quantiles"]) and loaded.speed_quantiles[-1] == pytest.approx(1.35 / 1.01, rel=1e-3)
    assert loaded.speed_tau_s == pytest.approx(drift["tau_s"], abs=0.01) and drift["tau_s"] > 10.0   # 8 probes long
    assert "speed probe: step time / its round's median over 40 identical batches" in path.read_text()
    row = calibration_section(dataclasses.asdict(cal))
    assert "speed_quantiles, speed_tau_s | p10 0.99, p50 1.00, p90 1.34, p98 1.34" in row   # over the median 1.01


def test_admission_cost_moves_engine_time_out_of_the_pure_delay(tmp_path):
    prefill, decode = _synthetic()
    m = fit_perf_model(prefill, decode, INFO)
    form = {"c": 0.012, "k_prefill": 18e-6, "k_attn": 3e-9, "n": 21, "rmse": 0.0, "rel_err": 0.0}
    # a 16-request decode batch steps in 4 ms alone; each injected 16-token request costs the window 2 ms
    base, steps, per_req = 0.004, 100, 0.002
    samples = [AdmissionSample(16, 256, base + (k % 3) * 1e-6, steps, 0, 0) for k in range(3)]
    samples += [AdmissionSample(16, 256, base + per_req * m_inj / steps, steps, m_inj, 16) for m_inj in (30, 40, 50)]
    fit = fit_admission(samples, form["k_prefill"], form["k_attn"])
    prefill16 = 18e-6 * 16 + 3e-9 * 128
    assert fit["per_request"] == pytest.approx(per_req, rel=1e-2)
    assert fit["c_admit"] == pytest.approx(per_req - prefill16, rel=1e-2) and fit["n"] == 3
    # longer injected prompts: their modelled prefill is taken off before the median, so c_admit stays put
    c_admit = per_req - prefill16
    for n_tok in (128, 256, 512):
        cost = c_admit + 18e-6 * n_tok + 3e-9 * n_tok * n_tok / 2
        samples.append(AdmissionSample(16, 256, base + cost * 20 / steps, steps, 20, n_tok))
    fit_all = fit_admission(samples, form["k_prefill"], form["k_attn"])
    assert fit_all["c_admit"] == pytest.approx(c_admit, rel=2e-2) and fit_all["lengths"] == [16, 128, 256, 512]
    prof = derive_profile(m, form, INFO, gw_overhead_s=0.0015, output_mean_tokens=55.0, c_admit_s=fit["c_admit"])
    assert prof["c_admit_s"] == pytest.approx(fit["c_admit"])
    cal = Calibration(aladdin=m.to_dict(), prefill_form=form, gateway_overhead_s=0.0015, engine={}, profile=prof,
                      admission_fit=fit, measured_at="now", load_average=0.5)
    path = tmp_path / "tiny.yaml"
    path.write_text(profile_yaml(cal))
    loaded = load_profile(str(path))
    # the lone request's TTFT is unchanged: what moved into the engine left the pure delay
    n = 500
    ttft = loaded.ttft_overhead_s + loaded.step_time(n, 0, 0, n * n / 2, admitted=1)
    assert ttft == pytest.approx(form["c"] + form["k_prefill"] * n + form["k_attn"] * n * n / 2 - 0.0015, rel=1e-4)
    # never more engine time than the constant holds; no injected sample -> nothing moves
    assert derive_profile(m, form, INFO, 0.0015, 55.0, c_admit_s=1.0)["ttft_overhead_s"] == 0.0
    assert fit_admission(samples[:3], 18e-6, 3e-9)["c_admit"] == 0.0


def test_injected_requests_that_stay_have_their_modelled_decode_steps_taken_off():
    """Injected requests decode alongside the batch: what the model charges for their decode steps inside the
    window (c_decode per token + k_ctx × its context) is not the per-request cost the probe looks for."""
    k_prefill, k_attn, c_decode, k_ctx = 18e-6, 3e-9, 80e-6, 3e-7
    base, steps, c_admit = 0.004, 100, 0.0012
    samples = [AdmissionSample(16, 256, base, steps, 0, 0) for _ in range(3)]
    for p, n in ((16, 16), (128, 16), (256, 8)):
        tokens, context = 25 * (n - 1), 25 * sum(p + k - 1 for k in range(2, n + 1))
        model = 25 * (k_prefill * p + k_attn * p * p / 2) + c_decode * tokens + k_ctx * context
        samples.append(AdmissionSample(16, 256, base + (25 * c_admit + model) / steps, steps, 25, p, n, tokens,
                                       context))
    fit = fit_admission(samples, k_prefill, k_attn, c_decode, k_ctx)
    assert fit["c_admit"] == pytest.approx(c_admit, rel=1e-6) and fit["new_tokens"] == [8, 16]
    assert fit["decode_model"] == pytest.approx(15 * (c_decode + k_ctx * (16 + 8)))   # median of the three
    # without the decode model the requests' own decode steps would pass for a per-request cost
    assert fit_admission(samples, k_prefill, k_attn)["c_admit"] > c_admit + 14 * c_decode


def test_decode_inside_counts_the_tokens_after_the_first_that_fell_in_the_window():
    from bench.fidelity.calibrate import decode_inside

    early = StreamResult(100, 6, sent=0.0, status=200, chunks=[(0.5, 1), (1.5, 2), (2.5, 4), (3.5, 5), (4.5, 6)])
    late = StreamResult(10, 3, sent=0.0, status=200, chunks=[(2.2, 1), (2.8, 2), (5.0, 3)])
    failed = StreamResult(10, 3, status=502, error="x")
    tokens, context = decode_inside([early, late, failed], 1.0, 3.0)
    # early: tokens 2 (ctx 101), 3 and 4 (102, 103, one chunk); late: its first token is a prefill, token 2 (ctx 11)
    assert tokens == 4 and context == 101 + 102 + 103 + 11


def test_admission_probe_injects_requests_that_stay_and_counts_those_admitted_in_the_window(sim_fleet):
    from bench.fidelity.calibrate import ADMIT_SHORT_NEW_TOKENS, probe_admission

    url = sim_fleet(1, profile="tiny-cpu", model="tiny", time_scale=1).urls[0]
    got = asyncio.run(probe_admission(url, 1, random.Random(3), batch=4, new_tokens=60, shorts=((16, 40.0),)))
    assert [s.injected > 0 for s in got] == [False, True]
    assert got[1].short_tokens == 16 and got[1].short_new_tokens == ADMIT_SHORT_NEW_TOKENS > 1
    assert got[0].short_new_tokens == 1 and got[0].steps >= 4 and got[1].injected >= 3
    assert got[0].decode_tokens == 0 < got[1].decode_tokens and got[1].decode_context > 16 * got[1].decode_tokens


def test_engine_charges_admission_time_to_the_step_that_admits():
    prof = dataclasses.replace(load_profile("tiny-cpu"), speed_quantiles=())   # one speed: exact step times
    slow = dataclasses.replace(prof, c_admit_s=0.01)
    fast = dataclasses.replace(prof, c_admit_s=0.0)

    def first_step(p) -> float:
        core = EngineCore(p)
        for i in range(3):
            core.add(SimRequest(f"r{i}", 16, [], 4, 4), 0.0)
        return core.plan_step(0.0)

    assert first_step(slow) - first_step(fast) == pytest.approx(3 * 0.01)


def test_host_path_term_is_the_real_slope_minus_the_simulated_one(tmp_path):
    # real: TTFT 13 ms idle, +0.5 ms per running stream, of which 0.4 ms outside the server's own window;
    # simulator: 13.5 ms idle, +0.15 ms per running stream, 0.05 ms of it outside
    real = [HostPathSample(b, 16, 0.013 + 5e-4 * b + e, 0.010 + 1e-4 * b + e) for b in (0, 8, 16, 32) for e in (0, 1e-3)]
    sim = [HostPathSample(b, 16, 0.0135 + 1.5e-4 * b, 0.012 + 1e-4 * b) for b in (0, 8, 16, 32)]
    fit = fit_host_path(real, sim)
    assert fit["real_client_slope"] == pytest.approx(5e-4) and fit["real_client_intercept"] == pytest.approx(0.0135)
    assert fit["real_outside_slope"] == pytest.approx(4e-4) and fit["sim_outside_slope"] == pytest.approx(5e-5)
    assert fit["sim_client_slope"] == pytest.approx(1.5e-4) and fit["per_running"] == pytest.approx(3.5e-4)
    assert fit_host_path(sim, real)["per_running"] == 0.0                  # never negative
    stalled = real + [HostPathSample(0, 16, 0.2, 0.01)]   # one stalled run barely moves a median
    assert fit_host_path(stalled, sim)["per_running"] == pytest.approx(3.5e-4, rel=0.1)
    assert fit_host_path([], [])["per_running"] == 0.0
    prof = load_profile("tiny-cpu")
    with_term = dataclasses.replace(prof, host_delay_per_running_s=fit["per_running"])
    assert with_term.pre_engine_delay(0) == prof.ttft_overhead_s
    assert with_term.pre_engine_delay(20) == pytest.approx(prof.ttft_overhead_s + 20 * 3.5e-4)


def test_histogram_totals_sums_every_label_set():
    text = ('# HELP vllm:time_to_first_token_seconds x\n'
            'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny"} 1.0\n'
            'vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 4.0\n'
            'vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 0.5\n'
            'vllm:time_to_first_token_seconds_count{engine="1",model_name="tiny"} 2.0\n'
            'vllm:time_to_first_token_seconds_sum{engine="1",model_name="tiny"} 0.25\n'
            'vllm:e2e_request_latency_seconds_sum{engine="0",model_name="tiny"} 9.0\n')
    assert histogram_totals(text) == (0.75, 6.0)
    assert histogram_totals(text, "vllm:e2e_request_latency_seconds") == (9.0, 0.0)


def test_simulated_host_path_grows_with_running_streams_by_the_profile_term(sim_fleet, tmp_path):
    """The probe over real HTTP against two simulated servers, one with a 2 ms-per-running-stream host term."""
    import yaml

    base = dataclasses.asdict(load_profile("tiny-cpu"))
    urls = {}
    for name, term in (("none", 0.0), ("term", 0.002)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**base, "name": name, "host_delay_per_running_s": term}))
        urls[name] = sim_fleet(1, profile=str(path), model="tiny", time_scale=1).urls[0]

    def probe(url):
        return asyncio.run(probe_host_path(url, 1, random.Random(4), running=(0, 8), inject=8))

    none, term = probe(urls["none"]), probe(urls["term"])
    assert [s.running for s in none] == [8, 0] and all(s.injected == 8 for s in none + term)
    growth = {name: got[0].client_s - got[1].client_s for name, got in (("none", none), ("term", term))}
    # 8 running streams x 2 ms: the term's server answers ~16 ms later than the other under the same batch
    assert growth["term"] - growth["none"] > 0.010, growth
    assert all(s.server_s > 0 and s.client_s >= s.server_s for s in none + term)


def test_shipped_tiny_cpu_profile_is_valid():
    prof = load_profile("tiny-cpu")
    assert prof.model == "tiny" and prof.max_model_len == 1024 and prof.block_size >= 16
    assert prof.max_model_len <= prof.kv_capacity_tokens and prof.c_step_s > 0 and prof.k_prefill_s > 0


def test_engine_facts_from_metrics_and_server_info():
    text = ('# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="128",engine="0",'
            'num_gpu_blocks="512",prefix_caching_hash_algo="sha256"} 1.0\n')
    labels = cache_config_info(text)
    assert labels["block_size"] == "128" and labels["num_gpu_blocks"] == "512"
    with pytest.raises(ValueError):
        cache_config_info("vllm:num_requests_running 0\n")
    info = {"vllm_config": {"scheduler_config": {"max_num_seqs": 64, "max_num_batched_tokens": 4096}}}
    assert scheduler_limits(info) == (64, 4096)
    assert scheduler_limits(None) == (128, 2048)       # vLLM CPU API-server defaults


def test_prefix_cache_hits_whole_engine_blocks_only():
    """The tiny-cpu profile has vLLM-CPU's 128-token blocks: 16-token hashes name whole 128-token blocks."""
    core = EngineCore("tiny-cpu")
    assert core.block_size == 128

    def run(rid: str, tokens: list[int]) -> int:
        core.add(SimRequest(rid, len(tokens), tokenizer.block_hashes(tokens), 2, 2), 0.0)
        rec = None
        t = 0.0
        while core.has_work():
            t += core.plan_step(t)
            rec = next((e.record for e in core.finish_step(t) if e.record), rec)
        return rec.num_cached_tokens

    base = list(range(100, 400))
    assert run("a", base) == 0
    assert run("b", base[:64] + list(range(1000, 1236))) == 0      # 64 shared tokens: no whole block
    assert run("c", base[:200] + list(range(2000, 2100))) == 128    # one whole block shared
    assert run("d", base) == 256                                    # (300 - 1) // 128 full blocks


# --- statistics and report ---------------------------------------------------------------------------------------
def test_leg_stats_and_pass_miss():
    results = [_stream(10, 0.1 + 0.01 * i, 0.005, 20) for i in range(10)]
    results.append(StreamResult(10, 20, status=502, error="boom"))
    s = leg_stats(results, start=0.0)
    assert s.n == 11 and s.failed == 1
    assert s.ttft_p50 == pytest.approx(np.percentile([0.1 + 0.01 * i for i in range(10)], 50))
    assert s.tpot_p50 == pytest.approx(0.005) and s.tpot_p90 == pytest.approx(0.005)
    last = 0.1 + 0.09 + 19 * 0.005
    assert s.tokens_per_s == pytest.approx(200 / last) and s.requests_per_s == pytest.approx(10 / last)
    assert Cell("ttft_p50", "x", 100.0, 119.0, 0.2).passed
    assert not Cell("ttft_p50", "x", 100.0, 79.0, 0.2).passed
    assert Cell("ttft_p90", "x", 100.0, 129.0, 0.3).passed and not Cell("ttft_p90", "x", 100.0, 131.0, 0.3).passed
    assert not Cell("ttft_p50", "x", 0.0, 1.0, 0.2).passed


def test_pooled_halves_keep_per_request_timings_and_add_durations():
    a = LegResult([_stream(10, 0.1, 0.01, 11)], start=100.0, max_send_lag_s=0.001, load_before=0.5)
    for r in a.results:
        r.sent, r.chunks = 100.0, [(100.0 + t, n) for t, n in r.chunks]
    b = LegResult([_stream(10, 0.2, 0.01, 11)], start=500.0, max_send_lag_s=0.003, load_before=0.9)
    for r in b.results:
        r.sent, r.chunks = 500.0, [(500.0 + t, n) for t, n in r.chunks]
    both = pool(a, b)
    assert [r.ttft for r in both.results] == pytest.approx([0.1, 0.2])
    assert [r.tpot for r in both.results] == pytest.approx([0.01, 0.01])
    st = leg_stats(both.results, both.start)
    assert st.duration_s == pytest.approx(0.2 + 0.3)          # a's span, then b's span right after it
    assert both.max_send_lag_s == 0.003 and both.load_before == 0.9


def test_raw_dump_keeps_each_legs_requests_and_wall_clock_windows(tmp_path):
    """--raw: per side and leg, the requests relative to the leg's start and the windows that find its steps in
    a step trace."""
    import json

    from bench.fidelity.legs import LEVELS
    from bench.fidelity.run import Series, dump_raw

    def leg(start: float, wall: float) -> LegResult:
        r = _stream(10, 0.1, 0.01, 3)
        r.sent, r.chunks = start, [(start + t, n) for t, n in r.chunks]
        return LegResult([r], start, 0.0, 0.0, windows=[(wall, wall + 30.0)])

    real = Series(leg(5.0, 1000.0), [leg(10.0 * i, 2000.0 + 100 * i) for i in range(len(LEVELS))])
    sim = Series(leg(7.0, 9000.0), [leg(10.0 * i, 9100.0 + 100 * i) for i in range(len(LEVELS))])
    dump_raw(tmp_path / "raw.json", real, sim)
    got = json.loads((tmp_path / "raw.json").read_text())
    names = ["burst", *(name for name, _ in LEVELS)]
    assert list(got["real"]) == names and list(got["windows"]["sim"]) == names
    assert got["windows"]["real"]["burst"] == [[1000.0, 1030.0]]
    assert got["windows"]["sim"][names[1]] == [[9100.0, 9130.0]]
    first = got["real"]["burst"][0]
    assert first["sent"] == 0.0 and first["ttft"] == pytest.approx(0.1) and first["chunks"][0][0] == pytest.approx(0.1)


def test_report_lists_every_cell_with_its_verdict():
    real = leg_stats([_stream(10, 0.1, 0.005, 20)], 0.0)
    sim = leg_stats([_stream(10, 0.2, 0.005, 20)], 0.0)
    cells = compare(real, sim)
    assert [c.metric for c in cells] == ["ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "tokens_per_s"]
    lv = LevelResult("light", 0.25, 3.0, 1, real, sim, 0.4, 0.5, 0.0, 0.0, cells)
    setup = {"cpu": 0, "profile": "p.yaml", "n": 1, "seed": 1, "saturation_rps": 12.0, "max_load": 1.5,
             "prompt_mean": 10, "prompt_p50": 10, "prompt_max": 10, "output_mean": 20, "output_p50": 20,
             "output_max": 20}
    text = render_report([lv], None, None, setup, notes="because")
    assert "| light | 3.0 | TTFT p50 (ms) | 100.0 | 200.0 | 2.00 | ±20% | **MISS** |" in text
    assert "| TPOT p50 (ms) | 5.0 | 5.0 | 1.00 | ±20% | PASS |" in text
    assert "2 of 5 cells within target" in text and "because" in text   # both TTFTs and throughput miss


def test_report_sets_the_real_server_against_itself_beside_the_simulator():
    real = leg_stats([_stream(10, 0.1, 0.005, 20)], 0.0)
    sim = leg_stats([_stream(10, 0.2, 0.005, 20)], 0.0)
    again = leg_stats([_stream(10, 0.15, 0.005, 20)], 0.0)
    lv = LevelResult("light", 0.25, 3.0, 1, real, sim, 0.4, 0.5, 0.0, 0.0, compare(real, sim),
                     again=again, again_cells=compare(real, again))
    setup = {"cpu": 0, "profile": "p.yaml", "n": 1, "seed": 1, "saturation_rps": 12.0, "max_load": 1.5,
             "prompt_mean": 10, "prompt_p50": 10, "prompt_max": 10, "output_mean": 20, "output_p50": 20,
             "output_max": 20}
    text = render_report([lv], None, None, setup)
    # the later first token: TTFT p50 100 -> 150 ms misses ±20 %, TTFT p90 ±30 %, throughput (same tokens over a
    # longer leg) 0.80 misses ±20 % by a hair; both TPOTs are equal
    assert "re-run on the same requests and arrivals after the other legs: 2 of 5 cells" in text
    assert "| light | TTFT p50 (ms) | 100.0 | 150.0 | 1.50 | 2.00 | ±20% | **no** |" in text
    assert "|  | TPOT p50 (ms) | 5.0 | 5.0 | 1.00 | 1.00 | ±20% | yes |" in text


# --- the client over real HTTP ------------------------------------------------------------------------------------
def test_client_times_every_token_of_a_simulated_server(sim_fleet):
    fleet = sim_fleet(1, profile="tiny-cpu", model="tiny", time_scale=5)
    url = fleet.urls[0]

    async def go():
        async with client_session() as session:
            one = await stream_completion(session, url, random_prompt(random.Random(1), 100), 12)
            bad = await stream_completion(session, url, [5] * 2000, 4)   # longer than the 1024 context
            leg = await run_open_loop(url, make_workload(6, seed=2), poisson_arrivals(6, 50.0, seed=3))
        return one, bad, leg

    one, bad, leg = asyncio.run(go())
    assert one.ok and one.output_tokens == 12 and len(one.chunks) == 12 and one.prompt_tokens == 100
    assert 0 < one.ttft < 5 and one.tpot is not None and one.tpot > 0
    assert not bad.ok and bad.status == 400 and "context" in bad.error
    assert len(leg.results) == 6 and all(r.ok for r in leg.results)
    assert [r.output_tokens for r in leg.results] == [w.max_tokens for w in make_workload(6, seed=2)]
    assert math.isfinite(leg_stats(leg.results, leg.start).ttft_p50)


def test_decode_probes_run_in_shuffled_order_so_drift_is_not_read_as_context_cost(sim_fleet):
    from bench.fidelity.calibrate import probe_decode

    fleet = sim_fleet(1, profile="tiny-cpu", model="tiny", time_scale=5)
    samples = asyncio.run(probe_decode(fleet.urls[0], (1, 2), (16, 256), 12, 2, INFO, random.Random(4)))
    order = [(x.prompt_tokens, x.batch) for x in samples]
    assert sorted(order) == sorted([(p, b) for p in (16, 256) for b in (1, 2)] * 2)   # every probe, each twice
    assert order != sorted(order)                             # not in blocks of one prompt length
    assert all(x.step_s > 0 and x.mean_context > x.prompt_tokens for x in samples)


def test_speed_probe_repeats_one_batch_and_times_each(sim_fleet):
    from bench.fidelity.calibrate import probe_speed

    fleet = sim_fleet(1, profile="tiny-cpu", model="tiny", time_scale=5)
    got = asyncio.run(probe_speed(fleet.urls[0], 1.0, random.Random(5)))
    assert len(got) >= 1 and all(step > 0 for _, step in got)
    assert [t for t, _ in got] == sorted(t for t, _ in got) and got[0][0] > 0


def test_leg_reads_the_servers_own_histograms_beside_the_client(sim_fleet):
    """A leg over real HTTP scrapes the server's /metrics before and after: its counts are this leg's requests only
    (a request before the leg does not leak in), and the report sets them beside the client's means."""
    fleet = sim_fleet(1, profile="tiny-cpu", model="tiny", time_scale=5)
    url = fleet.urls[0]
    items = make_workload(8, seed=4)

    async def go():
        async with client_session() as session:   # traffic before the leg: not counted in it
            await stream_completion(session, url, random_prompt(random.Random(2), 50), 5)
        return await run_leg(url, url, items, poisson_arrivals(8, 40.0, seed=5), "test leg")

    leg = asyncio.run(go())
    eng = leg.engine
    assert all(r.ok for r in leg.results)
    assert eng["ttft_count"] == 8 and eng["queue_count"] == 8
    multi = sum(1 for w in items if w.max_tokens >= 2)
    assert eng["tpot_count"] == multi
    assert eng["itl_count"] == sum(w.max_tokens - 1 for w in items)
    # vLLM's IterationStats count per step the prompt tokens prefilled and the tokens generated
    assert eng["step_tokens_sum"] == sum(len(w.prompt) + w.max_tokens for w in items)
    both = pool(leg, leg)
    assert both.engine["ttft_count"] == 16
    st = leg_stats(leg.results, leg.start)
    lv = LevelResult("light", 0.25, 40.0, 8, st, st, 0.0, 0.0, cells=compare(st, st), real_engine=eng, sim_engine=eng)
    table = engine_view_table([lv])
    assert table.count("\n") == 4 and "| light | real |" in table and "|  | sim |" in table


def test_scaled_profile_slows_every_step_coefficient_and_nothing_else(tmp_path):
    from bench.fidelity.legs import STEP_KEYS, scaled_profile
    from simulator.package_data import builtin_profile

    base = load_profile("tiny-cpu")
    slow = load_profile(scaled_profile(builtin_profile("tiny-cpu"), 1.1, tmp_path / "slow.yaml"))
    for f in dataclasses.fields(base):
        a, b = getattr(base, f.name), getattr(slow, f.name)
        if f.name in STEP_KEYS:
            assert b == pytest.approx(a * 1.1)
        elif f.name != "name":
            assert a == b, f.name
    assert slow.step_time(300, 20, 6000, 45000.0, 1) == pytest.approx(base.step_time(300, 20, 6000, 45000.0, 1) * 1.1)
    steady = load_profile(scaled_profile(builtin_profile("tiny-cpu"), 1.0, tmp_path / "steady.yaml", drift=False))
    assert steady.speed_quantiles == () and steady.c_step_s == base.c_step_s


def test_report_shows_the_step_time_sensitivity_of_the_last_level():
    real = leg_stats([_stream(10, 0.1, 0.040, 20)], 0.0)
    sim = leg_stats([_stream(10, 0.09, 0.030, 20)], 0.0)
    lv = LevelResult("near saturation", 0.85, 12.0, 1, real, sim, 0.4, 0.5, 0.0, 0.0, compare(real, sim))
    setup = {"cpu": 0, "profile": "p.yaml", "n": 1, "seed": 1, "saturation_rps": 12.0, "max_load": 1.5,
             "prompt_mean": 10, "prompt_p50": 10, "prompt_max": 10, "output_mean": 20, "output_p50": 20,
             "output_max": 20,
             "sensitivity": [{"factor": 1.0, "drift": False, "ttft_p50": 0.08, "tpot_p50": 0.02, "tpot_p90": 0.03},
                             {"factor": 1.1, "drift": True, "ttft_p50": 0.1, "tpot_p50": 0.04, "tpot_p90": 0.05}]}
    text = render_report([lv], None, None, setup)
    assert "Sensitivity at near saturation" in text and "x1.10: 100.0 / 40.0 ms" in text
    assert "x1.00 at one constant speed (no drift): 80.0 / 20.0 ms" in text


def test_report_replays_each_level_at_the_real_engines_speed_in_its_minutes():
    """With a step trace, the report sets the simulator re-run at each level's measured engine speed beside the
    real server, and counts those cells apart from the verdict's."""
    real = leg_stats([_stream(10, 0.1, 0.050, 20)], 0.0)
    sim = leg_stats([_stream(10, 0.07, 0.035, 20)], 0.0)      # as fitted: 0.70 of the real TTFT and TPOT
    fast = leg_stats([_stream(10, 0.095, 0.048, 20)], 0.0)    # at the leg's speed: within target
    lv = LevelResult("near saturation", 0.85, 12.0, 1, real, sim, 0.4, 0.5, 0.0, 0.0, compare(real, sim),
                     speed=1.16, matched=fast, matched_cells=compare(real, fast))
    plain = LevelResult("light", 0.25, 3.0, 1, real, real, 0.4, 0.5, 0.0, 0.0, compare(real, real))
    setup = {"cpu": 0, "profile": "p.yaml", "n": 1, "seed": 1, "saturation_rps": 12.0, "max_load": 1.5,
             "prompt_mean": 10, "prompt_p50": 10, "prompt_max": 10, "output_mean": 20, "output_p50": 20,
             "output_max": 20}
    text = render_report([plain, lv], None, None, setup)
    assert "7 of 10 cells within target" in text      # the verdict counts the fitted profile only
    assert "at the host's speed of each level's minutes" in text and "5 of 5 cells within target." in text
    assert "| near saturation | x1.16 | TTFT p50 (ms) | 100.0 | 95.0 | 0.95 | 0.70 | ±20% | PASS |" in text
    assert "| light | x" not in text                   # a level without a replay has no rows
    assert "at the host's speed" not in render_report([plain], None, None, setup)


def test_calibration_rounds_accumulate_and_fit_one_profile_over_all_of_them(tmp_path, monkeypatch):
    """bench.fidelity spreads the calibration over its real legs as rounds: every round adds one repetition of each
    probe, its speed probes keep their time since the first round and their round, and the fit pools them all."""
    import types

    import bench.fidelity.calibrate as cal_mod
    from bench.fidelity.run import _round_speed_line

    prefill, decode = _synthetic()
    host = [HostPathSample(b, 16, 0.013 + 5e-4 * b, 0.010 + 1e-4 * b) for b in (0, 8, 16, 32)]
    slow = {"round": 0}

    async def fake_prefill(*a, **k):
        return prefill[:7]

    async def fake_decode(*a, **k):
        return decode[:21] if slow["round"] == 0 else decode[21:]

    async def fake_admission(*a, **k):
        return [AdmissionSample(16, 256, 0.004, 100, 0, 0), AdmissionSample(16, 256, 0.0046, 100, 30, 16)]

    async def fake_host(*a, **k):
        return host

    async def fake_speed(url, duration, rng):   # the second round runs 20 % slower: the host moved
        await asyncio.sleep(0.02)               # six batches within the probe's own 20 ms
        return [(0.001 + 0.003 * i, 0.005 * (1.2 if slow["round"] else 1.0) * (1 + 0.01 * (i % 3))) for i in range(6)]

    for name, fake in (("probe_prefill", fake_prefill), ("probe_decode", fake_decode),
                       ("probe_admission", fake_admission), ("probe_host_path", fake_host),
                       ("probe_speed", fake_speed)):
        monkeypatch.setattr(cal_mod, name, fake)
    monkeypatch.setattr(cal_mod, "wait_for_quiet", lambda *a, **k: 0.4)
    monkeypatch.setattr(cal_mod, "load_average", lambda: 0.6)
    monkeypatch.setattr(cal_mod, "simulated_host_path", lambda profile, reps, seed: [
        HostPathSample(b, 16, 0.0135 + 1.5e-4 * b, 0.012 + 1e-4 * b) for b in (0, 8, 16, 32)])
    samples = cal_mod.ProbeSamples()
    server = types.SimpleNamespace(url="http://direct")
    for r in range(2):
        slow["round"] = r
        asyncio.run(cal_mod.probe_round(samples, server, "http://gw", INFO, random.Random(r), 6.0, 1.5, 1.0))
    assert samples.rounds == 2 and len(samples.prefill) == 14 and len(samples.decode) == 21 + len(decode) - 21
    assert len(samples.admission) == 4 and len(samples.host) == 8 and samples.loads == [0.4, 0.6, 0.4, 0.6]
    assert samples.speed_round == [0] * 6 + [1] * 6
    times = [t for t, _ in samples.speed]
    assert times == sorted(times) and times[6] > times[5]          # the second round's clock continues the first's
    cal = cal_mod.fit_calibration(samples, INFO)
    assert cal.rounds == 2 and cal.speed_round == samples.speed_round and cal.load_average == 0.6
    assert cal.aladdin["c3"] == pytest.approx(C3, rel=1e-3)        # every decode sample of both rounds in one fit
    assert cal.speed_fit["spacing_s"] == pytest.approx(0.003)       # lag-1 pairs within a round only
    q = cal.profile["speed_quantiles"]
    assert q[-1] / q[0] < 1.03                                      # the slower round is a level, not drift:
    assert cal.speed_fit["segment_levels"] == pytest.approx([1 / 1.1, 1.2 / 1.1], abs=1e-4)   # beside it
    assert cal.profile["host_delay_per_running_s"] == pytest.approx(3.5e-4)
    out, js = tmp_path / "p.yaml", tmp_path / "c.json"
    cal_mod.write_calibration(cal, out, js)
    assert load_profile(str(out)).c_step_s == pytest.approx(cal.profile["c_step_s"], rel=1e-4)
    assert '"rounds": 2' in js.read_text()
    line = _round_speed_line(dataclasses.asdict(cal))[1]
    assert "median step per round in order: 5.05, 6.06 ms; slowest / fastest round 1.20" in line


def test_level_lasts_long_enough_to_average_the_hosts_speed():
    from bench.fidelity.legs import LEG_MIN_S, level_size

    assert level_size(400, 4.0) == 400                               # 200 per half already span 50 s
    assert level_size(400, 31.0) == 2 * math.ceil(LEG_MIN_S * 31.0)  # each half sends arrivals for 30 s
    assert level_size(400, 31.0) % 2 == 0 and level_size(120, 31.0, min_s=0.0) == 120


def test_step_trace_sets_each_step_beside_the_profile(tmp_path):
    """bench.fidelity.step_trace: periods from one schedule() to the next, idle gaps left out, decode-only and mixed steps
    measured against the profile's step time for the same batch."""
    import json

    from bench.fidelity.step_trace import load_gc, load_steps, step_ratios

    prof = dataclasses.replace(load_profile("tiny-cpu"), speed_quantiles=())
    decode = {"dec": 8, "ctx": 2000, "pre_n": 0, "pre_tok": 0, "pairs": 0.0}
    mixed = {"dec": 8, "ctx": 2000, "pre_n": 1, "pre_tok": 300, "pairs": 300 * 300 / 2}
    t, rows = 100.0, []
    for i in range(20):                       # decode-only steps 1.3x the model, every 5th one mixed at 1.5x
        kind, factor = (mixed, 1.5) if i % 5 == 4 else (decode, 1.3)
        rows.append({"t0": t, **kind})
        t += factor * prof.step_time(kind["pre_tok"], kind["dec"], kind["ctx"], kind["pairs"], admitted=kind["pre_n"])
    t += 5.0                                  # the engine idles, then one lone step
    rows.append({"t0": t, **decode})
    (tmp_path / "steps-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[::2]))   # two processes
    (tmp_path / "steps-2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[1::2]))
    steps = load_steps(tmp_path)
    assert [s.t0 for s in steps] == [r["t0"] for r in rows] and steps[-1].period_s == 0.0
    r = step_ratios(steps, prof)
    assert (r.decode_steps, r.mixed_steps) == (16, 3)           # the mixed step before the idle gap is left out
    assert r.decode_ratio == pytest.approx(1.3) and r.mixed_ratio == pytest.approx(1.5)
    counted = [s for s in steps if 0 < s.period_s < 0.5]     # both kinds: weighted by their modelled time
    assert r.all_ratio == pytest.approx(sum(s.period_s for s in counted) / sum(s.modelled_s(prof) for s in counted))
    assert 1.3 < r.all_ratio < 1.5
    late = step_ratios(steps, prof, [(rows[10]["t0"], t)])
    assert late.decode_steps + late.mixed_steps == 9
    two = step_ratios(steps, prof, [(rows[0]["t0"], rows[1]["t0"]), (rows[4]["t0"], rows[4]["t0"])])
    assert (two.decode_steps, two.mixed_steps) == (2, 1)
    # garbage collection on the engine's core: the Worker's counts; the API server, moved to core 1, does not;
    # nor does a collection while the engine idles
    assert math.isnan(r.gc_share)

    def gc_log(*batches: tuple[list[int], list[tuple[float, float]]]) -> str:
        return "".join(json.dumps({"pid": 0, "comm": "x", "cpus": cpus, "frozen": 0}) + "\n"
                       + "".join(json.dumps({"t": t, "d": d, "g": 0, "n": 0}) + "\n" for t, d in pauses)
                       for cpus, pauses in batches)
    (tmp_path / "gc-1.jsonl").write_text(gc_log(([0], [(rows[3]["t0"] + 1e-4, 0.0005)])))    # the EngineCore
    (tmp_path / "gc-3.jsonl").write_text(gc_log(([0], [(rows[0]["t0"] + 1e-4, 0.001), (rows[-1]["t0"] - 1, 0.01)])))
    (tmp_path / "gc-4.jsonl").write_text(gc_log(([0], []), ([1], [(rows[2]["t0"] + 1e-4, 0.002)])))
    gc = load_gc(tmp_path)
    assert [d for _, d in gc] == [0.001, 0.0005, 0.01]
    busy = [s.period_s for s in steps if 0 < s.period_s < 0.5]
    assert step_ratios(steps, prof, gc=gc).gc_share == pytest.approx(0.0015 / sum(busy))
    # with the hook's update timestamps, an idle wait after a step (light load) is cut from its period
    timed, t = [], 200.0
    for i in range(4):
        step = prof.step_time(0, 8, 2000, 0.0)
        timed.append({"t0": t, **decode, "t_sched": 1e-4, "t_upd_start": t + step - 2e-4, "t_upd": 1e-4})
        t += step + (0.3 if i == 1 else 0.0)   # the engine waits 0.3 s for the next request after the second step
    (tmp_path / "steps-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in timed))
    (tmp_path / "steps-2.jsonl").unlink()
    idle = step_ratios(load_steps(tmp_path), prof)
    assert idle.decode_steps == 3 and idle.decode_ratio == pytest.approx(1.0, abs=0.01)
    (tmp_path / "steps-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[::2]))
    (tmp_path / "steps-2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[1::2]))
    # bench.fidelity --step-trace: per level, its legs' wall-clock windows, first run and again, in the report
    from bench.fidelity.legs import LEVELS
    from bench.fidelity.run import _step_trace_rows
    from simulator.package_data import builtin_profile

    legs = [LegResult([], 0.0, 0.0, 0.0, windows=[(rows[0]["t0"], t)]) for _ in LEVELS]
    trace = _step_trace_rows(tmp_path, builtin_profile("tiny-cpu"), legs, legs)
    assert [row["level"] for row in trace] == [name for name, _ in LEVELS]
    assert trace[0]["first"]["decode_ratio"] == pytest.approx(1.3) and trace[2]["again"]["mixed_steps"] == 3
    real = leg_stats([_stream(10, 0.1, 0.005, 20)], 0.0)
    lv = LevelResult("light", 0.25, 3.0, 1, real, real, 0.4, 0.5, 0.0, 0.0, compare(real, real))
    setup = {"cpu": 0, "profile": "p.yaml", "n": 1, "seed": 1, "saturation_rps": 12.0, "max_load": 1.5,
             "prompt_mean": 10, "prompt_p50": 10, "prompt_max": 10, "output_mean": 20, "output_p50": 20,
             "output_max": 20, "step_trace": trace[:1]}
    text = render_report([lv], None, None, setup)
    share = f"{100 * trace[0]['first']['gc_share']:.1f} %"    # the GC pauses over the busy steps, as above
    assert trace[0]["first"]["gc_share"] == pytest.approx(0.0015 / sum(busy))
    assert f"| light | first | 16 | 1.30 | 3 | 1.50 | {share} |" in text
    assert f"|  | again | 16 | 1.30 | 3 | 1.50 | {share} |" in text


def test_report_header_records_the_whole_command_and_the_commit_the_run_started_at(tmp_path):
    from bench.report import write_report

    write_report(tmp_path / "r.md", "Fidelity", "python -m bench.fidelity --cpu 0 --max-load 3", "body\n",
                 commit="9a59221")
    head = (tmp_path / "r.md").read_text().splitlines()
    assert head[2] == "- command: `python -m bench.fidelity --cpu 0 --max-load 3`" and head[3] == "- commit: `9a59221`"


def test_at_speed_rebuilds_a_runs_levels_from_its_raw_dump():
    """bench.fidelity.at_speed: a finished run's raw.json gives back every level's requests and arrivals exactly as
    bench.fidelity made them (rate from the real burst's throughput, same seeds and variants)."""
    import json

    from bench.fidelity.at_speed import plans_from_raw, results
    from bench.fidelity.legs import LEVELS, level_size, make_workload, poisson_arrivals

    def record(finished: float) -> dict:
        return {"prompt": 10, "max_tokens": 2, "sent": 0.0, "ttft": 0.1, "tpot": 0.1, "status": 200, "error": "",
                "chunks": [(finished - 0.1, 1), (finished, 2)]}

    burst = [record(20.0 * (i + 1) / 400) for i in range(400)]    # 400 requests done in 20 s: 20 req/s
    raw = json.loads(json.dumps({"real": {"burst": burst}}))      # as read back from the file: lists, not tuples
    assert leg_stats(results(raw["real"]["burst"]), 0.0).requests_per_s == pytest.approx(20.0)
    sizes = [level_size(400, frac * 20.0) for _, frac in LEVELS]
    for (name, _), size in zip(LEVELS, sizes, strict=True):
        raw["real"][name] = [record(1.0)] * size
    plans = plans_from_raw(raw, seed=1)
    assert [p.rate for p in plans] == pytest.approx([frac * 20.0 for _, frac in LEVELS])
    assert [len(p.items) for p in plans] == sizes == [400, 660, 1020]
    near = plans[2]
    assert [w.prompt for w in near.items] == [w.prompt for w in make_workload(1020, 1, variant=4)]
    assert near.a_arrivals == poisson_arrivals(510, 17.0, 1 + 20 + 1)
    assert near.b_arrivals == poisson_arrivals(510, 17.0, 1 + 20 + 2)
    raw["real"]["medium"] = raw["real"]["medium"][:-2]
    with pytest.raises(ValueError, match="medium: the run sent 658 requests, rebuilt 660"):
        plans_from_raw(raw, seed=1)
