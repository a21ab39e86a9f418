"""Autoscaling experiments in virtual time: Chiron-style vs a utilization band vs static provisioning.

    .venv/bin/python -m bench.autoscale                 # writes bench/results/autoscale.md and autoscale_*.png
    .venv/bin/python -m bench.autoscale --only W_A --no-write

Workloads (simulator/autoscale_sim.py): Chiron's W_A (interactive only: the rate steps 1 -> 3 -> 1 req/s,
Poisson, and Gamma bursts with CV 4, two seeds) and W_B (the Azure conversation trace at half rate plus
a batch job submitted at t=300 s with a one-hour deadline: 6000 ShareGPT requests, and as a second
workload 4000 arXiv-summarisation requests with another seed). Llama-2-70B on 2x A100 (TP2), worker cold
start uniform in 30-60 s, at most 16 workers. Every arm runs the same simulator, routing and drain code;
only the controller differs.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

from bench.report import write_report
from simulator.autoscale_sim import Arm, ArmResult, Scenario, run_arm, scenario_wa, scenario_wb

RESULTS = Path(__file__).parent / "results"


def scenarios(only: str | None) -> list[Scenario]:
    out = [
        scenario_wa("poisson", 0),
        scenario_wa("gamma", 0),
        scenario_wa("gamma", 1),
        scenario_wb(0, batch_trace="sharegpt", batch_requests=6000),
        scenario_wb(1, batch_trace="arxiv", batch_requests=4000),
    ]
    return [s for s in out if only is None or s.name.startswith(only)]


def run_scenario(sc: Scenario, log: Any) -> list[ArmResult]:
    chiron = run_arm(sc, Arm("chiron"))
    log(chiron)
    mean_workers = chiron.gpu_seconds / (sc.horizon_s * _gpus(sc))
    arms = [
        Arm("utilization", label="utilization 0.3-0.7"),
        Arm("utilization", util_low=0.1, util_high=0.3, label="utilization 0.1-0.3"),
        Arm("utilization_local", label="utilization+local"),
        Arm("static", static_workers=math.ceil(mean_workers), label=f"static {math.ceil(mean_workers)}"),
    ]
    out = [chiron]
    for arm in arms:
        res = run_arm(sc, arm)
        log(res)
        out.append(res)
    return out


def _gpus(sc: Scenario) -> int:
    from simulator.profiles import load_profile

    return load_profile(sc.profile).gpus_per_worker


def _f(v: Any, fmt: str = "{:.3f}") -> str:
    if v is None:
        return "-"
    return fmt.format(v) if isinstance(v, float) else str(v)


def table(results: list[ArmResult]) -> str:
    base = next(r for r in results if r.arm == "utilization 0.3-0.7")
    rows = ["| arm | GPU-s | vs util 0.3-0.7 | interactive SLO | TTFT p99 s | TPOT p99 s | batch on time | "
            "batch done s | peak workers | scale-ups | hysteresis | evictions | wall s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        s = r.summary()
        rows.append(
            f"| {r.arm} | {s['gpu_seconds']:,} | {(r.gpu_seconds / base.gpu_seconds - 1) * 100:+.1f}% | "
            f"{_f(s['interactive_slo'])} | {_f(s['ttft_p99'], '{:.1f}')} | {_f(s['tpot_p99'])} | "
            f"{_f(s['batch_on_time'])} | {_f(s['batch_done_at'], '{:.0f}')} | {s['peak_workers']} | {s['scale_ups']} | "
            f"{_f(s['hysteresis'], '{:.2f}')} | {s['evictions']} | {s['wall_s']} |")
    return "\n".join(rows)


def plot(all_results: dict[str, tuple[Scenario, list[ArmResult]]], path_workers: Path, path_slo: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(all_results)
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 2.6 * len(names)), sharex=False, squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        sc, results = all_results[name]
        for r in results:
            ts = [row["t"] / 60 for row in r.timeline]
            ax.step(ts, [row["workers"] for row in r.timeline], where="post", label=r.arm, linewidth=1.2)
        if sc.batch:
            for job in sc.batch:
                ax.axvline(job.submit_at / 60, color="grey", linestyle=":", linewidth=1)
                ax.axvline((job.submit_at + job.deadline_s) / 60, color="red", linestyle=":", linewidth=1)
        ax.set_title(f"{name}: workers (provisioned, incl. cold start)", fontsize=9)
        ax.set_ylabel("workers")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7, ncol=3)
    axes[-1, 0].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path_workers, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(len(names), 2, figsize=(12, 2.6 * len(names)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1.3]})
    for (ax, bar), name in zip(axes, names, strict=True):
        _, results = all_results[name]
        for r in results:
            pm = r.interactive["per_minute"]
            ax.plot([m for m, _, _ in pm], [met / n if n else None for _, n, met in pm], label=r.arm, linewidth=1)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{name}: interactive SLO attainment per minute of arrival", fontsize=9)
        ax.grid(alpha=0.3)
        labels = [r.arm.replace("utilization", "util") for r in results]
        bar.barh(labels, [r.gpu_seconds / 3600 for r in results], color="tab:blue")
        for y, r in enumerate(results):
            slo = r.interactive["slo_attainment"]
            bar.text(r.gpu_seconds / 3600, y, f" SLO {slo:.3f}", va="center", fontsize=7)
        bar.set_title("GPU-hours", fontsize=9)
        bar.tick_params(labelsize=7)
    axes[0, 0].legend(fontsize=7, ncol=3)
    axes[-1, 0].set_xlabel("minute")
    fig.tight_layout()
    fig.savefig(path_slo, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", help="run scenarios whose name starts with this (W_A, W_B, W_B-arxiv, ...)")
    p.add_argument("--no-write", action="store_true", help="print only, do not write bench/results")
    args = p.parse_args(argv)
    t0 = time.perf_counter()

    def log(r: ArmResult) -> None:
        s = r.summary()
        print(f"{r.scenario:<18} {r.arm:<22} GPU-s {s['gpu_seconds']:>8,} SLO {_f(s['interactive_slo'])} "
              f"batch {_f(s['batch_on_time'])} ({s['wall_s']} s)", flush=True)

    all_results: dict[str, tuple[Scenario, list[ArmResult]]] = {}
    for sc in scenarios(args.only):
        all_results[sc.name] = (sc, run_scenario(sc, log))
    wall = time.perf_counter() - t0
    print(f"total wall {wall:.0f} s")
    if args.no_write:
        return
    body = [_intro(all_results, wall)]
    for name, (sc, results) in all_results.items():
        body.append(f"## {name}\n\n{sc.description}; theta {sc.theta:.3f} (Chiron section 5.2, from the tail "
                    f"arrival spike of {'an independent draw of the same process' if name.startswith('W_A') else 'the trace'} "
                    f"in 45 s windows).\n\n{table(results)}\n")
    body.append(_notes())
    plot(all_results, RESULTS / "autoscale_workers.png", RESULTS / "autoscale_slo.png")
    cmd = "python -m bench.autoscale" + (f" --only {args.only}" if args.only else "")
    write_report(RESULTS / "autoscale.md", "Autoscaling: Chiron-style vs utilization band vs static (virtual time)",
                 cmd, "\n".join(body))
    print(f"wrote {RESULTS / 'autoscale.md'}")


def _headline(all_results: dict[str, tuple[Scenario, list[ArmResult]]]) -> list[str]:
    lines = []
    for name, (_, results) in all_results.items():
        if not name.startswith("W_B"):
            continue
        by = {r.arm: r for r in results}
        c = by["chiron"]
        for base in ("utilization 0.3-0.7", "utilization 0.1-0.3"):
            u = by[base]
            lines.append(f"- {name}: Chiron {c.gpu_seconds:,.0f} GPU-s, interactive SLO "
                         f"{c.interactive['slo_attainment']:.3f}, batch on time {c.batch['on_time']:.3f}; "
                         f"{base}: {u.gpu_seconds:,.0f} GPU-s ({(c.gpu_seconds / u.gpu_seconds - 1) * 100:+.1f}% for "
                         f"Chiron), SLO {u.interactive['slo_attainment']:.3f}, batch on time {u.batch['on_time']:.3f}.")
    return lines


def _intro(all_results: dict[str, tuple[Scenario, list[ArmResult]]], wall: float) -> str:
    head = "\n".join(_headline(all_results))
    return f"""Virtual-time runs of `simulator/autoscale_sim.py` on the cluster simulator (`simulator/cluster.py`,
engine model `simulator/engine.py`), profile `llama2-70b-tp2-a100` (2 GPUs per worker; GPU-seconds count
both), worker cold start uniform in [30, 60] s, at most 16 workers, 2 warm workers at t=0. Interactive
SLO (Chiron section 6): TTFT <= 10 s and TPOT <= 200 ms; a request still unfinished at the horizon
misses it. Batch: ITL SLO 2 s, counted on time if it finished by its deadline (submission + 1 h).
Whole bench: {wall:.0f} s wall on one core.

Arms (same routing, gateway queue, drain and cold-start code; only the controller differs):
- **chiron**: local caps (Algorithm 1) on every worker; interactive/mixed/batch pools with the interactive
  band theta +- delta (delta = min(0.1, theta/4)) and Aladdin's N = ceil(k5 rate + c5) forecast; the
  batch pool from Algorithm 2 (groups by deadline, W = sum O_i / Theta with the normal approximation);
  interactive requests evict batch ones from mixed workers; scale-to-zero of the batch pool.
- **utilization a-b**: one pool, mean KV utilisation (plus the KV the queued requests will need) kept in
  [a, b] by +1/-1 worker per 60 s; per-worker cap = vLLM's default max_num_seqs (256). 0.3-0.7 is the
  default; 0.1-0.3 is a more conservative setting, to see what the band needs to get close in SLO.
- **utilization+local**: the 0.3-0.7 band plus Chiron's local caps (Chiron's ablation "global replaced by
  a utilisation autoscaler").
- **static N**: N workers all the time, N = Chiron's mean worker count rounded up (the same GPU budget).

Headline on W_B (target: >= 30% fewer GPU-seconds than the utilization autoscaler at equal or better SLO):

{head}
"""


def _notes() -> str:
    return """## Reading the results, honestly

- **W_B, the target is not met.** Chiron meets every batch deadline and keeps interactive SLO attainment
  at ~0.99 where the default band gets ~0.87-0.91, but it saves only ~8-10% of the band's GPU-seconds,
  not >= 30%. Against the conservative band (0.1-0.3), which costs more and still stays below Chiron's SLO,
  the saving is ~20%. No band setting tried reached Chiron's SLO, so "equal or better SLO" holds only
  for Chiron; the >= 30% figure does not, on either workload.
- Why the saving is small here: (1) in this engine model a 70B/TP2 worker is KV-bound at ~10-20 running
  requests, so the cap that maximises batch throughput is about the cap that meets the interactive ITL
  SLO. Chiron's local autoscaler cannot give batch workers the much larger batches (2-3x throughput per
  GPU) behind most of the paper's savings. (2) All arms share the gateway queue and the "no queueing
  inside an engine" routing. That amounts to Llumnix migrating queued requests to new instances, so every
  arm gets about the same tokens per GPU-second, and the batch work (~2.6M output tokens) costs every
  arm the same. The arms differ only in what they waste. Chiron wastes its interactive
  over-provisioning (1/theta) once the batch is done, plus the work of evicted batch requests (Chiron
  keeps their KV on the CPU; here they restart). The band wastes its scale-down tail from 16 workers and
  its cold starts.
- The ablation `utilization+local` (band plus Chiron's local caps) is within a few percent of Chiron's
  GPU-seconds (below it on the arXiv run) with SLO ~0.93. So the local caps carry part of the SLO gain;
  the rest comes from the pools, the class-aware queue and eviction.
- Static provisioning at Chiron's mean budget does well when the load is flat (W_B ShareGPT). It loses
  SLO on the arXiv run, whose long prompts make the interactive spikes costlier.
- **W_A:** Chiron over-provisions by design (theta from the arrival spikes, >= 1/3) and spends more
  GPU-seconds than the default band. That band runs hot and misses the SLO badly during and after the
  rate step (cold start 30-60 s). The conservative band spends 0.6-1.2x Chiron's GPU-seconds and still
  misses more (0.73-0.95 against Chiron's >= 0.98).
- Evictions restart batch requests from scratch (the prefill is recomputed); the count is in the tables.
- Hysteresis follows Chiron's definition (all scaling actions / scale-ups). The band sits near 2 (every
  worker it adds is removed again); Chiron is lower on W_B because its batch pool rises once and goes to
  zero once.
- Nothing was tuned per trace: theta comes from the arrival spikes, the SLOs are Chiron's, and the
  band's thresholds are the common default plus one conservative setting. The controllers' timing
  constants (tick 15 s, local window 10 s, batch settle 180 s, batch cooldown 300 s, stabilisation
  300 s) were set from the cold start and the measurement windows, not from results. During development
  the driver was corrected three times after looking at W_B-sharegpt-s0: measuring throughput only while
  batch work exists, smoothing the per-worker rate, and the settle/cooldown periods. All three fix
  measurement artefacts, and the arXiv run (seed 1) was not looked at before them.
"""


if __name__ == "__main__":
    main(sys.argv[1:])
