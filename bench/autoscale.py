"""Autoscaling experiments in virtual time: Chiron-style vs a utilization band vs static provisioning.

    .venv/bin/python -m bench.autoscale                 # writes bench/results/autoscale.md and autoscale_*.png
    .venv/bin/python -m bench.autoscale --model 70B --only W_A --no-write
    .venv/bin/python -m bench.autoscale --evict-continue  # its own section: evicted batch work continues vs restarts

Two models, as Chiron section 6 (Llama 8B and 70B on A100-80GB): `llama2-70b-tp2-a100` (2 GPUs per worker)
and `llama3-8b-a100` (1 GPU). For each (simulator/autoscale_sim.py):
- W_A, interactive only: the rate steps low -> high -> low, 10 min each, Poisson and Gamma bursts (CV 4);
  70B at 1 -> 3 -> 1 req/s (seeds 0, and 1 for Gamma), 8B at 5 -> 15 -> 5 req/s (five times the 70B
  rate, the 8B:70B ratio of Chiron section 6.2's interactive rates, 50 vs 10 req/s).
- W_B, interactive plus one batch job submitted at t=300 s with a one-hour deadline. 70B: the Azure
  conversation trace at half rate plus 6000 ShareGPT requests (seed 0) or 4000 arXiv-summarisation
  requests (seed 1). 8B: the Azure trace at 0.75x (the fastest replay that still covers the 75 min
  horizon) plus 20000 ShareGPT requests, seeds 0 and 1: the batch job is 2.2x the interactive output.
Worker cold start uniform in 30-60 s, at most 16 workers, 2 warm at t=0.

The utilization band ("Llumnix" in Chiron section 6) gets, per model:
- one static per-worker cap, chosen the way Chiron's untuned Llumnix is configured ("the configuration
  that maximizes SLO satisfaction across all workloads"): the cap in CAP_GRID whose default band
  (0.3-0.7) has the highest mean interactive SLO attainment over the model's W_A workloads; caps within
  CAP_TIE of the best tie and the largest of them wins (most batch throughput: the tie-break that favours
  the band). The cap is then fixed for W_B.
- on every W_B workload, a sweep of its thresholds (THRESHOLD_GRID, fixed before any W_B run) at that
  cap, plus the default band stepping every FAST_STEP_S instead of 60 s (added after the first full run
  showed the step to be the 8B band's whole extra cost): "Llumnix (tuned)". Chiron is compared with the cheapest setting whose interactive SLO attainment AND
  batch on-time share are both >= Chiron's (`iso_slo_comparator`); when no setting gets there the report
  says so and names the best-SLO setting instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pickle
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.report import write_report, write_section
from simulator.autoscale_sim import Arm, ArmResult, Scenario, run_arm, scenario_wa, scenario_wb
from simulator.profiles import load_profile

RESULTS = Path(__file__).parent / "results"

CAP_GRID = (16, 32, 64, 128, 256, 512, 1024)  # static per-worker caps tried on W_A (256 = vLLM's A100 default)
CAP_TIE = 0.005                               # SLO attainment differences below this are ties
THRESHOLD_GRID = ((0.05, 0.3), (0.05, 0.5), (0.1, 0.3), (0.1, 0.5), (0.3, 0.5), (0.3, 0.7),
                  (0.5, 0.9))                 # (low, high) of the band on W_B ("Llumnix tuned")
FAST_STEP_S = 15.0                            # one extra W_B candidate: the default band stepping every tick
DEFAULT_BAND = (0.3, 0.7)
CONSERVATIVE_BAND = (0.1, 0.3)
NEAR_SLO = 0.005                              # sensitivity: band settings this close to Chiron's SLO
TARGET_SAVING = 0.30                          # the target: >= 30% fewer GPU-seconds at equal or better SLO


@dataclass
class Model:
    key: str
    profile: str
    wa: Callable[[], list[Scenario]]
    wb: Callable[[], list[Scenario]]


def _named(key: str, scs: list[Scenario]) -> list[Scenario]:
    return [dataclasses.replace(sc, name=f"{key} {sc.name}") for sc in scs]


P70, P8 = "llama2-70b-tp2-a100", "llama3-8b-a100"
MODELS = (
    Model("70B", P70,
          lambda: _named("70B", [scenario_wa("poisson", 0), scenario_wa("gamma", 0), scenario_wa("gamma", 1)]),
          lambda: _named("70B", [scenario_wb(0, batch_trace="sharegpt", batch_requests=6000),
                                 scenario_wb(1, batch_trace="arxiv", batch_requests=4000)])),
    Model("8B", P8,
          lambda: _named("8B", [scenario_wa("poisson", 0, profile=P8, low=5.0, high=15.0),
                                scenario_wa("gamma", 0, profile=P8, low=5.0, high=15.0)]),
          lambda: _named("8B", [scenario_wb(s, profile=P8, interactive_scale=0.75, batch_trace="sharegpt",
                                            batch_requests=20000) for s in (0, 1)])),
)


# ---- choosing the band's settings (pure functions) ------------------------------------------------
def choose_static_cap(slo_by_cap: Mapping[int, Sequence[float]], tie: float = CAP_TIE) -> int:
    """The cap with the highest mean interactive SLO attainment over the W_A workloads; caps within `tie`
    of the best are tied and the largest of them wins (the most batch throughput per worker)."""
    if not slo_by_cap:
        raise ValueError("no caps to choose from")
    means = {cap: statistics.fmean(v) for cap, v in slo_by_cap.items()}
    best = max(means.values())
    return max(cap for cap, m in means.items() if m >= best - tie)


def _slo(r: ArmResult) -> float:
    return r.interactive.get("slo_attainment") or 0.0


def _on_time(r: ArmResult) -> float:
    v = r.batch.get("on_time")
    return 1.0 if v is None else v


def meets(candidate: ArmResult, reference: ArmResult) -> bool:
    """Equal or better on both SLOs: interactive attainment and batch on-time share."""
    return _slo(candidate) >= _slo(reference) and _on_time(candidate) >= _on_time(reference)


def iso_slo_comparator(reference: ArmResult, candidates: Sequence[ArmResult]) -> tuple[ArmResult, bool]:
    """The cheapest candidate at equal or better SLOs than `reference` (True). If there is none (False):
    the best interactive SLO (then the fewest GPU-seconds) among those at equal or better batch on-time,
    or among all when none is."""
    if not candidates:
        raise ValueError("no candidates")
    ok = [c for c in candidates if meets(c, reference)]
    if ok:
        return min(ok, key=lambda c: c.gpu_seconds), True
    pool = [c for c in candidates if _on_time(c) >= _on_time(reference)] or list(candidates)
    return max(pool, key=lambda c: (_slo(c), _on_time(c), -c.gpu_seconds)), False


def near_comparator(reference: ArmResult, candidates: Sequence[ArmResult], tol: float = NEAR_SLO) -> ArmResult | None:
    """The cheapest candidate within `tol` of the reference's interactive SLO, batch on-time not worse (a
    sensitivity check on the strict rule: an SLO a few requests short of Chiron's is close to a tie)."""
    near = [c for c in candidates if _slo(c) >= _slo(reference) - tol and _on_time(c) >= _on_time(reference)]
    return min(near, key=lambda c: c.gpu_seconds) if near else None


def pareto_front(results: Sequence[ArmResult]) -> list[ArmResult]:
    """Settings no other setting beats on all of GPU-seconds (lower), interactive SLO and batch on time."""
    def dominated(a: ArmResult) -> bool:
        return any(b is not a and b.gpu_seconds <= a.gpu_seconds and _slo(b) >= _slo(a) and _on_time(b) >= _on_time(a)
                   and (b.gpu_seconds, -_slo(b), -_on_time(b)) != (a.gpu_seconds, -_slo(a), -_on_time(a))
                   for b in results)
    return sorted((r for r in results if not dominated(r)), key=lambda r: r.gpu_seconds)


def saving(chiron: ArmResult, other: ArmResult) -> float:
    """Fraction of `other`'s GPU-seconds that Chiron does without (negative: Chiron spends more)."""
    return 1.0 - chiron.gpu_seconds / other.gpu_seconds


# ---- running ------------------------------------------------------------------------------------
def band_arm(low: float, high: float, cap: int, default_cap: int, cooldown_s: float = 60.0) -> Arm:
    label = (f"utilization {low:g}-{high:g}" + ("" if cap == default_cap else f" cap {cap}")
             + ("" if cooldown_s == 60.0 else f" step {cooldown_s:g}s"))
    return Arm("utilization", util_low=low, util_high=high, static_cap=cap, util_cooldown_s=cooldown_s, label=label)


@dataclass
class WorkloadResults:
    scenario: Scenario
    results: list[ArmResult]
    band: list[ArmResult] = field(default_factory=list)     # every utilization-band run (sweep candidates)

    def by(self, arm: str) -> ArmResult:
        return next(r for r in self.results if r.arm == arm)


@dataclass
class ModelResults:
    model: Model
    default_cap: int
    cap: int
    cap_slo: dict[int, list[float]]
    cap_gpu: dict[int, list[float]]
    wa: list[WorkloadResults]
    wb: list[WorkloadResults]


def _static(sc: Scenario, chiron: ArmResult) -> Arm:
    n = math.ceil(chiron.gpu_seconds / (sc.horizon_s * load_profile(sc.profile).gpus_per_worker))
    return Arm("static", static_workers=n, label=f"static {n}")


def run_model(model: Model, log: Callable[[ArmResult], None], only: str | None, cap_override: int | None) -> ModelResults:
    default_cap = load_profile(model.profile).max_num_seqs

    def run(sc: Scenario, arm: Arm) -> ArmResult:
        res = run_arm(sc, arm)
        log(res)
        return res

    wa: list[WorkloadResults] = []
    cap_slo: dict[int, list[float]] = {c: [] for c in CAP_GRID}
    cap_gpu: dict[int, list[float]] = {c: [] for c in CAP_GRID}
    if only in (None, "W_A"):
        for sc in model.wa():
            chiron = run(sc, Arm("chiron"))
            caps = [run(sc, band_arm(*DEFAULT_BAND, c, default_cap)) for c in CAP_GRID]
            for c, r in zip(CAP_GRID, caps, strict=True):
                cap_slo[c].append(_slo(r))
                cap_gpu[c].append(r.gpu_seconds)
            rest = [run(sc, band_arm(*CONSERVATIVE_BAND, default_cap, default_cap)),
                    run(sc, Arm("utilization_local", label="utilization+local")), run(sc, _static(sc, chiron))]
            wa.append(WorkloadResults(sc, [chiron, *caps, *rest], caps + rest[:1]))
    cap = cap_override or (choose_static_cap(cap_slo) if wa else default_cap)

    wb: list[WorkloadResults] = []
    if only in (None, "W_B"):
        for sc in model.wb():
            chiron = run(sc, Arm("chiron"))
            swap = run(sc, Arm("chiron", evict_mode="swap", label="chiron swap"))
            sweep = [run(sc, band_arm(lo, hi, cap, default_cap)) for lo, hi in THRESHOLD_GRID]
            sweep.append(run(sc, band_arm(*DEFAULT_BAND, cap, default_cap, FAST_STEP_S)))
            extra = [] if cap == default_cap else [run(sc, band_arm(*b, default_cap, default_cap))
                                                   for b in (DEFAULT_BAND, CONSERVATIVE_BAND)]
            others = [run(sc, Arm("utilization_local", label="utilization+local")), run(sc, _static(sc, chiron))]
            wb.append(WorkloadResults(sc, [chiron, swap, *extra, *sweep, *others], extra + sweep))
    return ModelResults(model, default_cap, cap, cap_slo, cap_gpu, wa, wb)


# ---- report ---------------------------------------------------------------------------------------
def _f(v: Any, fmt: str = "{:.3f}") -> str:
    if v is None:
        return "-"
    return fmt.format(v) if isinstance(v, float) else str(v)


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def gpu_seconds_after(r: ArmResult, t0: float, horizon: float, gpus: int) -> float:
    """GPU-seconds provisioned from t0 to the horizon, from the 15 s timeline (changes between ticks ignored)."""
    rows = r.timeline
    total = 0.0
    for a, b in zip(rows, [*rows[1:], {"t": horizon}], strict=True):
        lo, hi = max(a["t"], t0), min(b["t"], horizon)
        if hi > lo:
            total += a["workers"] * gpus * (hi - lo)
    return total


def table(results: Sequence[ArmResult], base: ArmResult, marks: Mapping[str, str] | None = None,
          sc: Scenario | None = None) -> str:
    """One row per arm; with a W_B scenario also the GPU-seconds spent after the arm's batch work was done."""
    marks = marks or {}
    post = sc is not None and bool(sc.batch)
    gpus = load_profile(sc.profile).gpus_per_worker if post and sc is not None else 1
    rows = ["| arm | GPU-s | vs util 0.3-0.7 | interactive SLO | TTFT p99 s | TPOT p99 s | batch on time | "
            "batch done s | " + ("GPU-s after batch done | " if post else "")
            + "peak workers | largest engine batch | scale-ups | hysteresis | evictions (tokens dropped) | wall s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if post else "") + "---:|---:|---:|---:|---:|---:|"]
    for r in results:
        s = r.summary()
        after = ""
        if post and sc is not None and s["batch_done_at"] is not None:
            after = f"{gpu_seconds_after(r, s['batch_done_at'], sc.horizon_s, gpus):,.0f} | "
        ev = f"{s['evictions']} ({s['evicted_tokens']:,})" if s["evictions"] else "0"
        if r.swap.get("swap_ins"):
            ev = f"{s['evictions']} (kept {s['evicted_tokens']:,}; {s['swap_ins']} swap-ins)"
        rows.append(
            f"| {r.arm}{marks.get(r.arm, '')} | {s['gpu_seconds']:,} | {(r.gpu_seconds / base.gpu_seconds - 1) * 100:+.1f}% | "
            f"{_f(s['interactive_slo'])} | {_f(s['ttft_p99'], '{:.1f}')} | {_f(s['tpot_p99'])} | "
            f"{_f(s['batch_on_time'])} | {_f(s['batch_done_at'], '{:.0f}')} | {after}{s['peak_workers']} | {s['max_running']} | {s['scale_ups']} | "
            f"{_f(s['hysteresis'], '{:.2f}')} | {ev} | {s['wall_s']} |")
    return "\n".join(rows)


def frontier_table(w: WorkloadResults) -> str:
    chirons = [w.by("chiron"), w.by("chiron swap")]
    front = {id(r) for r in pareto_front(w.band)}
    rows = ["| band setting | GPU-s | interactive SLO | batch on time | TTFT p99 s | peak workers | Pareto | "
            ">= chiron | >= chiron swap |", "|---|---:|---:|---:|---:|---:|:-:|:-:|:-:|"]
    for r in sorted(w.band, key=lambda r: r.gpu_seconds):
        s = r.summary()
        rows.append(f"| {r.arm} | {s['gpu_seconds']:,} | {_f(s['interactive_slo'])} | {_f(s['batch_on_time'])} | "
                    f"{_f(s['ttft_p99'], '{:.1f}')} | {s['peak_workers']} | {'yes' if id(r) in front else ''} | "
                    + " | ".join("yes" if meets(r, c) else "" for c in chirons) + " |")
    return "\n".join(rows)


def comparisons(w: WorkloadResults) -> list[tuple[ArmResult, ArmResult, bool]]:
    """(chiron variant, its iso-SLO band comparator, whether the comparator meets its SLOs)."""
    out = []
    for name in ("chiron", "chiron swap"):
        c = w.by(name)
        comp, ok = iso_slo_comparator(c, w.band)
        out.append((c, comp, ok))
    return out


def _comparison_line(name: str, c: ArmResult, comp: ArmResult, ok: bool, default: ArmResult,
                     band: Sequence[ArmResult]) -> str:
    head = (f"- {name} / {c.arm}: {c.gpu_seconds:,.0f} GPU-s, interactive SLO {_slo(c):.3f}, batch on time "
            f"{_on_time(c):.3f}. ")
    if ok:
        n_ok = sum(meets(b, c) for b in band)
        ties = sum(abs(b.gpu_seconds - comp.gpu_seconds) <= 0.005 * comp.gpu_seconds for b in band if meets(b, c))
        body = (f"{n_ok} of {len(band)} band settings reach both its SLOs; the cheapest, {comp.arm}"
                + (f" (tied within 0.5% with {ties - 1} more)" if ties > 1 else "")
                + f", spends {comp.gpu_seconds:,.0f} GPU-s (SLO {_slo(comp):.3f}, on time {_on_time(comp):.3f}): "
                f"Chiron saves **{_pct(saving(c, comp))}**")
    else:
        body = (f"**None of the {len(band)} band settings reaches its SLOs**; the best-SLO one, {comp.arm}, spends "
                f"{comp.gpu_seconds:,.0f} GPU-s at SLO {_slo(comp):.3f} (on time {_on_time(comp):.3f}): Chiron "
                f"saves {_pct(saving(c, comp))} against it, at better SLO")
    near = near_comparator(c, band)
    tail = ""
    if near is not None and near.gpu_seconds < comp.gpu_seconds:
        tail = (f" Within {NEAR_SLO} of its SLO: {near.arm}, {near.gpu_seconds:,.0f} GPU-s at SLO {_slo(near):.4f} "
                f"(on time {_on_time(near):.3f}): Chiron saves {_pct(saving(c, near))}.")
    return (head + body + f"; against the default band {default.arm} ({default.gpu_seconds:,.0f} GPU-s, SLO "
            f"{_slo(default):.3f}) {_pct(saving(c, default))}." + tail)


def headline(models: Sequence[ModelResults]) -> list[str]:
    lines: list[str] = []
    met: dict[str, list[str]] = {"chiron": [], "chiron swap": []}
    met_near: dict[str, list[str]] = {"chiron": [], "chiron swap": []}
    total = 0
    for m in models:
        for w in m.wb:
            total += 1
            default = w.by("utilization 0.3-0.7")
            for c, comp, ok in comparisons(w):
                lines.append(_comparison_line(w.scenario.name, c, comp, ok, default, w.band))
                if ok and saving(c, comp) >= TARGET_SAVING:
                    met[c.arm].append(w.scenario.name)
                near = near_comparator(c, w.band)
                if near is not None and saving(c, near) >= TARGET_SAVING:
                    met_near[c.arm].append(w.scenario.name)
    verdict = []
    for arm, names in met.items():
        verdict.append(f"- **Target (>= 30% fewer GPU-seconds than the utilization autoscaler at equal or better "
                       f"SLO), {arm}: met on {len(names)} of {total} W_B workloads**"
                       + (f" ({', '.join(names)})." if names else ".")
                       + f" Counting band settings within {NEAR_SLO} of Chiron's SLO as equal: met on "
                       f"{len(met_near[arm])} of {total}" + (f" ({', '.join(met_near[arm])})." if met_near[arm] else "."))
    return verdict + [""] + lines


def cap_table(m: ModelResults) -> str:
    names = [w.scenario.name for w in m.wa]
    rows = ["| cap | " + " | ".join(f"SLO {n}" for n in names) + " | mean SLO | mean GPU-s |",
            "|---:|" + "---:|" * (len(names) + 2)]
    for cap in CAP_GRID:
        slos = m.cap_slo[cap]
        mark = " (chosen)" if cap == m.cap else ""
        rows.append(f"| {cap}{mark} | " + " | ".join(f"{v:.3f}" for v in slos)
                    + f" | {statistics.fmean(slos):.3f} | {statistics.fmean(m.cap_gpu[cap]):,.0f} |")
    return "\n".join(rows)


def _key_arms(w: WorkloadResults) -> list[ArmResult]:
    """The arms drawn in the time-series figures (the sweep would bury them)."""
    names = ["chiron", "chiron swap", "utilization 0.3-0.7"]
    out = [r for r in w.results if r.arm in names]
    if w.scenario.batch:
        comp, _ = iso_slo_comparator(w.by("chiron"), w.band)
        if comp not in out:
            out.append(comp)
    out += [r for r in w.results if r.arm.startswith("static")]
    return out


def plot(models: Sequence[ModelResults], path_workers: Path, path_slo: Path, path_frontier: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = [w for m in models for w in m.wa + m.wb]
    fig, axes = plt.subplots(len(ws), 1, figsize=(10, 2.4 * len(ws)), squeeze=False)
    for ax, w in zip(axes[:, 0], ws, strict=True):
        for r in _key_arms(w):
            ax.step([row["t"] / 60 for row in r.timeline], [row["workers"] for row in r.timeline], where="post",
                    label=r.arm, linewidth=1.1)
        for job in w.scenario.batch:
            ax.axvline(job.submit_at / 60, color="grey", linestyle=":", linewidth=1)
            ax.axvline((job.submit_at + job.deadline_s) / 60, color="red", linestyle=":", linewidth=1)
        ax.set_title(f"{w.scenario.name}: workers (provisioned, incl. cold start)", fontsize=9)
        ax.set_ylabel("workers")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=3)
    axes[-1, 0].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path_workers, dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(len(ws), 1, figsize=(10, 2.4 * len(ws)), squeeze=False)
    for ax, w in zip(axes[:, 0], ws, strict=True):
        for r in _key_arms(w):
            pm = r.interactive["per_minute"]
            ax.plot([m for m, _, _ in pm], [met / n if n else None for _, n, met in pm],
                    label=f"{r.arm} ({_slo(r):.3f}, {r.gpu_seconds / 3600:,.1f} GPU-h)", linewidth=1)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{w.scenario.name}: interactive SLO attainment per minute of arrival", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    axes[-1, 0].set_xlabel("minute")
    fig.tight_layout()
    fig.savefig(path_slo, dpi=100)
    plt.close(fig)

    wbs = [w for m in models for w in m.wb]
    if not wbs:
        return
    cols = min(2, len(wbs))
    rows = math.ceil(len(wbs) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.6 * rows), squeeze=False)
    for ax, w in zip(axes.flat, wbs, strict=False):
        band = w.band
        ax.scatter([r.gpu_seconds / 3600 for r in band], [_slo(r) for r in band],
                   c=["tab:blue" if _on_time(r) >= _on_time(w.by("chiron")) else "tab:orange" for r in band],
                   s=22, label="utilization band settings")
        spots: dict[tuple[float, float], list[str]] = {}     # settings on the same spot share one label
        for r in band:
            spots.setdefault((round(r.gpu_seconds / 3600, 2), round(_slo(r), 3)), []).append(
                r.arm.replace("utilization ", ""))
        for (x, y), names in spots.items():
            label = names[0] if len(names) == 1 else f"{len(names)} settings"
            ax.annotate(label, (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
        for r in w.results:
            if r.arm == "utilization+local" or r.arm.startswith("static"):
                ax.scatter([r.gpu_seconds / 3600], [_slo(r)], marker="x", s=30, color="grey")
                ax.annotate(r.arm, (r.gpu_seconds / 3600, _slo(r)), fontsize=6, color="grey", xytext=(3, -8),
                            textcoords="offset points")
        front = pareto_front(band)
        ax.step([r.gpu_seconds / 3600 for r in front], [_slo(r) for r in front], where="post", color="tab:blue",
                linewidth=0.8, alpha=0.6, label="band Pareto front")
        for name, marker, color in (("chiron", "*", "tab:red"), ("chiron swap", "P", "tab:green")):
            c = w.by(name)
            ax.scatter([c.gpu_seconds / 3600], [_slo(c)], marker=marker, s=120, color=color, label=name, zorder=3)
        ax.axhline(_slo(w.by("chiron")), color="tab:red", linestyle=":", linewidth=0.8)
        ys = [_slo(r) for r in w.results]
        lo, hi = min(ys), max(ys)
        ax.set_ylim(min(lo, hi - 0.02) - 0.005, hi + 0.005)       # no magnified noise when all arms tie
        ax.set_title(f"{w.scenario.name}: GPU-hours vs interactive SLO", fontsize=9)
        ax.set_xlabel("GPU-hours")
        ax.set_ylabel("interactive SLO attainment")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(wbs):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path_frontier, dpi=100)
    plt.close(fig)


def render(models: Sequence[ModelResults], wall: float, cpu: float, note: str = "") -> str:
    body = [_intro(models, wall, cpu, note)]
    for m in models:
        prof = load_profile(m.model.profile)
        body.append(f"## {m.model.key}: `{m.model.profile}` ({prof.gpus_per_worker} GPU per worker)\n")
        if m.wa:
            body.append(f"### The band's static per-worker cap ({m.model.key}), chosen on W_A\n\n"
                        f"Default band 0.3-0.7 at each cap; the chosen cap (highest mean SLO, ties within "
                        f"{CAP_TIE} to the larger cap) is fixed for W_B. vLLM's default is {m.default_cap}.\n\n"
                        f"{cap_table(m)}\n")
        for w in m.wa + m.wb:
            sc = w.scenario
            spike = "an independent draw of the same process" if sc.name.split()[-1].startswith("W_A") else "the trace"
            text = (f"### {sc.name}\n\n{sc.description}; theta {sc.theta:.3f} (Chiron section 5.2, from the tail "
                    f"arrival spike of {spike} in 45 s windows).\n\n")
            if sc.batch:
                tags: dict[str, list[str]] = {}
                for c, comp, ok in comparisons(w):
                    tags.setdefault(comp.arm, []).append(("iso-SLO comparator of " if ok else "best-SLO band, below ")
                                                         + c.arm)
                marks = {arm: " [" + "; ".join(t) + "]" for arm, t in tags.items()}
                band_ids = {id(r) for r in w.band}
                main = [r for r in w.results if id(r) not in band_ids or r.arm in marks
                        or r.arm in ("utilization 0.3-0.7", "utilization 0.1-0.3", f"utilization 0.3-0.7 cap {m.cap}")]
                text += table(main, w.by("utilization 0.3-0.7"), marks, sc) + "\n\n"
                sw = w.by("chiron swap").swap
                text += (f"chiron swap: {sw.get('swap_ins', 0)} swap-ins, {sw.get('swap_in_s', 0.0):.1f} s of KV "
                         f"copies in all, peak {sw.get('peak_host_kv_bytes', 0) / 1e9:.1f} GB of KV in host memory "
                         f"(fleet-wide).\n\n")
                text += (f"All band settings (cap {m.cap}" + (f"; and the default cap {m.default_cap} rows" if m.cap != m.default_cap else "")
                         + "), cheapest first:\n\n" + frontier_table(w) + "\n")
            else:
                text += table(w.results, w.by("utilization 0.3-0.7")) + "\n"
            body.append(text)
    body.append(NOTES)
    return "\n".join(body)


def _intro(models: Sequence[ModelResults], wall: float, cpu: float, note: str = "") -> str:
    head = "\n".join(headline(models))
    caps = "; ".join(f"{m.model.key}: {m.cap}" for m in models)
    grid = ", ".join(f"{lo:g}-{hi:g}" for lo, hi in THRESHOLD_GRID)
    return f"""Virtual-time runs of `simulator/autoscale_sim.py` on the cluster simulator (`simulator/cluster.py`,
engine model `simulator/engine.py`). Two models as in Chiron section 6: `llama2-70b-tp2-a100` (2 GPUs per
worker; GPU-seconds count both) and `llama3-8b-a100` (1 GPU). Worker cold start uniform in [30, 60] s, at
most 16 workers, 2 warm workers at t=0. Interactive SLO (Chiron section 6): TTFT <= 10 s and TPOT <= 200 ms;
a request still unfinished at the horizon misses it. Batch: ITL SLO 2 s, on time if it finished by its
deadline (submission + 1 h). Deterministic (seeded); whole bench: {wall:.0f} s wall, {cpu:.0f} s CPU, on one
core (`taskset -c 1 nice -n 19`, shared with other jobs).{note}

Arms (same routing, gateway queue, drain and cold-start code; only the controller differs):
- **chiron**: local caps (Algorithm 1) on every worker, batch-pool workers up to 4096 (Chiron section 6.2
  reports 2048-4096); interactive/mixed/batch pools with the interactive band theta +- delta (delta =
  min(0.1, theta/4)) and Aladdin's N = ceil(k5 rate + c5) forecast; the batch pool from Algorithm 2 (groups by
  deadline, W = sum O_i / Theta with the normal approximation); interactive requests evict batch ones from
  mixed workers; scale-to-zero of the batch pool. An evicted batch request **restarts from scratch**, as it
  does in the live gateway (gateway/batch/runner.py: the relay closes the upstream request, vLLM aborts it,
  it is queued again).
- **chiron swap** (simulator only): the same, but an evicted request keeps its generated tokens and its KV
  goes to host memory (Chiron section 4's fast restart); placed again it waits for the copy, (prompt +
  generated) x KV bytes / 25 GB/s (PCIe Gen4 x16; also across the network when it lands on another worker),
  and decodes on. Real vLLM exposes no API to move one request's KV out and back in, so the live gateway
  cannot do this; the row shows what the mechanism would be worth.
- **utilization a-b [cap c] [step s]**: one pool, mean KV utilisation (plus the KV the queued requests will
  need) kept in [a, b] by +1/-1 worker per 60 s (per s seconds when the label says so); one static
  per-worker cap: vLLM's default max_num_seqs (256) unless the label names another. 0.3-0.7 is the default
  band and 0.1-0.3 a conservative one (both at 256, as before). The band's cap for the sweep, chosen on W_A
  as described per model below: {caps}. Sweep on every W_B workload ("Llumnix tuned"), fixed before any
  W_B run: {grid}; plus the default band stepping every {FAST_STEP_S:g} s (added after the first full run,
  see the notes).
- **utilization+local**: the 0.3-0.7 band plus Chiron's local caps (Chiron's ablation "global replaced by
  a utilisation autoscaler"). Not a comparator for the target (it contains half of Chiron).
- **static N**: N workers all the time, N = Chiron's mean worker count rounded up (the same GPU budget).

The target compares Chiron with the cheapest utilization-band setting (any threshold pair, either cap) whose
interactive SLO attainment and batch on-time share are both >= Chiron's. A band setting with a worse SLO is
not a valid comparator; when none reaches Chiron's SLO, that is said and the best-SLO setting is shown.

{head}

Figures: `autoscale_frontier.png` (every band setting on W_B, GPU-hours against interactive SLO, with both
Chiron variants), `autoscale_workers.png` and `autoscale_slo.png` (worker counts and per-minute SLO of
the main arms on every workload).
"""


NOTES = """## Reading the results, honestly

- **The >= 30% target is not met on any of the four W_B workloads**, for either Chiron variant, under the
  rule (the cheapest band setting whose interactive SLO and batch on-time are both >= Chiron's):
  - 70B: no band setting reaches Chiron's SLO (0.993-0.994). The best band settings get 0.969 (ShareGPT)
    and 0.930 (arXiv) and spend 23-27% more GPU-seconds than Chiron doing so (Chiron saves ~19-21%
    against them); the default band costs only 5-10% more than Chiron, at SLO 0.905-0.938. Chiron buys a
    better SLO for fewer GPU-seconds, but at equal SLO there is no comparator at all.
  - 8B: every band setting reaches Chiron's SLO (all arms get 0.9996: the same ~8 of ~19k interactive
    requests arrive in the last seconds of the horizon and cannot finish) with all batch work on time. The
    cheapest is the default band stepping every 15 s, 13.5k GPU-s against Chiron's 12.4k: Chiron saves
    8.6-8.9%. Against the thresholds swept at the band's usual 60 s step, all of which cost 18.3k, Chiron
    saves 32%; that comparison alone would have read "target met on the 8B". The 15 s candidate was added
    after the first full run showed that the 60 s step was the band's whole extra cost (see the changes
    below); it can only make the band look better, and it is the kind of setting the paper's per-workload
    "Llumnix (tuned)" would find. A static fleet of 3 workers also does the 8B job for 13.5k.
- **Where the 8B gap comes from.** At the 60 s step every threshold pair gives the same run: the KV the
  queued batch requests will need keeps the utilisation far above any high threshold until the queue is
  empty, so the band adds a worker per step up to the 16-worker limit (reached about when the batch is
  done, t ~ 1215 s); afterwards the 8B's interactive load fills a few per cent of its 444k-token KV, below
  any low threshold, and the band removes a worker per step. The thresholds never bind. Before its batch is
  done that band spends less than Chiron (8.7k against 10.6k GPU-s on seed 0); after it, 9.6k against 1.8k
  ("GPU-s after batch done"). Stepping every 15 s, the band finishes the batch at 908 s and is back near
  its interactive floor a few minutes later (5.1k after the batch). What remains of Chiron's lead is that it
  sizes the batch pool to the deadline (Algorithm 2: 4-5 workers, done at ~2750 s of a 3900 s deadline)
  instead of rushing all 16 workers in and out.
- **It is not a batch-size effect here.** An 8B on an 80 GB A100 running ShareGPT-length requests is
  KV-bound at ~150-230 running requests (the cache is full and preemptions start); Chiron's batch workers
  peak at 198-200 running, the band's at 227-228 ("largest engine batch", sampled every 15 s). The
  paper's 2048-4096 batches, and the 2-3x per-GPU throughput it attributes to them, do not fit in this KV
  cache, so the 4096 ceiling of Chiron's batch workers is never approached.
- **Why no band reaches Chiron's SLO on 70B.** During the batch job every band setting runs all 16 workers
  full of batch requests (queued batch work reads as utilisation > 1), and an interactive request waits
  until some batch request finishes (TTFT p99 14-43 s). Lower thresholds only start workers earlier and
  keep them longer: 0.05-0.3 spends 93k GPU-s for the 0.967 that 0.1-0.3 gets with 74k; the 15 s step gets
  0.921 and 0.896. The band reserves no capacity for interactive work and evicts nothing; Chiron keeps
  interactive headroom (theta) and evicts batch requests from mixed workers. Before its batch is done the
  default band is again the cheaper one (ShareGPT: 40.9k against 48.1k GPU-s); it loses on the tail from
  16 workers (23.0k against 12.7k after the batch).
- **Fast restart (chiron swap) against restart.** Evictions throw away little work because the newest
  batch request is the one evicted: 29k and 34k generated tokens on the 70B runs (~1% of the batch
  output), 6k and 2.5k on the 8B. Keeping them costs 120-220 KV copies and up to ~100 GB of host memory
  fleet-wide (16 workers). Swap and restart differ by -0.5% to +3.7% in GPU-seconds, the size of the
  controllers' own noise (one batch worker more or less), not a measurable effect of the mechanism. The
  live gateway restarts (gateway/batch/runner.py): vLLM offers no per-request KV swap-out/in, and resuming
  as a continuation would need streaming batch requests and a text-level continuation (/v1/completions:
  prompt + partial output; chat: vLLM's continue_final_message), which is not implemented. The "chiron"
  rows are what the gateway does; "chiron swap" is what the paper's mechanism would add in this model:
  nothing measurable.
- **W_A.** Chiron over-provisions by design (theta >= 1/3 from the arrival spikes) and spends 1.6-2.7x the
  default band's GPU-seconds, at SLO 0.974-1.000 against 0.69-0.80 (70B) and 0.67-0.69 (8B). The 70B
  conservative band (0.1-0.3) is the real competitor: on W_A-poisson it beats Chiron on SLO (0.986 against
  0.974) for the same GPU-seconds (13.7k against 13.5k); on the Gamma bursts it spends 55-73% of Chiron's
  GPU-seconds for SLO 0.860 and 0.990 against 1.000 and 0.999. On the 8B no band setting tried reaches
  0.91: its 444k-token KV means a worker saturated by prefill (15 req/s of ~1.5k-token prompts) still reads
  10-20% utilisation, so the band adds workers only after requests queue and removes them as soon as the
  queue is gone.
- **The band's static cap.** 70B: cap 32 has the best W_A SLO (mean 0.784 against 0.728 for every cap from
  64 up, which all behave the same: a 70B/TP2 worker holds only a few dozen running requests in its KV and
  routing never queues inside an engine). On W_B it is not better than 256 (0.904 against 0.938 at
  0.3-0.7), and the 256 rows are candidates too. 8B: 1024, tied with 512 and 256 (the tie goes to the
  larger cap); on W_B the cap makes no difference.
- **Changes made after looking at results, and what they changed.**
  1. Routing throttle (simulator/autoscale_sim.py). `has_room` compared the in-flight count with a running
     count up to 0.5 s old, so a worker could take about one new request per scrape. Harmless for a
     KV-bound 70B worker, it starved the 8B: a development run of 8B W_B-sharegpt-s0 showed ~900
     interactive requests queued in front of a worker running 8. Routing now reads the engine's live state
     and the queues are retried after every engine step that leaves a worker with room. It moved every
     number: 70B W_B-sharegpt-s0 Chiron 58,453 -> 60,782 GPU-s (SLO 0.995 -> 0.994), default band
     64,735 / 0.910 -> 63,880 / 0.938; 70B W_A-poisson Chiron SLO 0.987 -> 0.974. One unit-test bound moved
     with it (the fixed-load local-cap test now sees caps down to 3, was >= 4: the worker fills at once).
  2. Caps 16 and 32 were added to the cap grid after the first 70B W_A run showed every cap from 64 up
     behaving the same; before any W_B sweep ran.
  3. The threshold grid went from 9 to 7 points (0.05-0.7 and 0.1-0.7 dropped) for wall time, before any
     W_B sweep ran.
  4. The 15 s-step candidate and the "within 0.005 of Chiron's SLO" sensitivity were added after the first
     full run (which read "target met on both 8B workloads, -32%"). The candidate turned the 8B verdict into
     "not met, -9%"; the sensitivity changes nothing.
  5. The 8B scenario (the Azure trace at 0.75x, the fastest replay that covers the 75 min horizon, and
     20000 batch requests) was fixed after one development run of seed 0 (which already showed Chiron at
     12.4k against 18.3k for the default band); seed 1 was first run in the bench. An earlier development
     run at 2x was dropped because the trace ends after 29 minutes at that speed.
- Nothing else was tuned per trace: theta comes from the arrival spikes, the SLOs are Chiron's, and the
  controllers' timing constants are unchanged (tick 15 s, local window 10 s, batch settle 180 s, batch
  cooldown 300 s, stabilisation 300 s).
- Cost of the bench: ~10 min of CPU on one core (the 8B W_B arms take 20-35 s each: the engine model's
  per-step cost grows with the batch), longer in wall time on a core shared with other jobs (header).
"""


def to_json(models: Sequence[ModelResults]) -> dict[str, Any]:
    return {m.model.key: {"cap": m.cap, "cap_slo": m.cap_slo,
                          "workloads": {w.scenario.name: [r.summary() for r in w.results] for w in m.wa + m.wb}}
            for m in models}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=[m.key for m in MODELS], help="run one model only")
    p.add_argument("--only", choices=["W_A", "W_B"], help="run one workload family only (W_B alone uses --cap)")
    p.add_argument("--cap", type=int, help="the band's static cap for W_B (default: chosen on W_A)")
    p.add_argument("--json", type=Path, help="also write the summaries to this JSON file")
    p.add_argument("--no-write", action="store_true", help="print only, do not write bench/results")
    p.add_argument("--save", type=Path, help="pickle the results here (to re-render the report without re-running)")
    p.add_argument("--render", type=Path, help="write the report from results saved by --save (runs nothing)")
    p.add_argument("--chiron-only", action="store_true", help="run only the chiron arms of every workload and print "
                   "them (what a change of the global autoscaler moves; writes nothing)")
    p.add_argument("--evict-continue", action="store_true", help="run chiron with evictions that restart and "
                   "that continue on every W_B workload; write that section of the report")
    args = p.parse_args(argv)
    if args.evict_continue:
        _evict_continue(args.model, not args.no_write)
        return
    if args.chiron_only:
        _chiron_only(args.model)
        return
    if args.render:
        saved = pickle.loads(args.render.read_bytes())
        keyed = {m.key: m for m in MODELS}
        models = [ModelResults(keyed[k], *rest) for k, *rest in saved["models"]]
        _write(models, saved["wall"], saved["cpu"], saved["cmd"],
               " The text was re-rendered (`--render`) from the results this run saved (`--save`).")
        return
    t0, c0 = time.perf_counter(), time.process_time()

    def log(r: ArmResult) -> None:
        s = r.summary()
        print(f"{r.scenario:<22} {r.arm:<30} GPU-s {s['gpu_seconds']:>8,} SLO {_f(s['interactive_slo'])} "
              f"batch {_f(s['batch_on_time'])} ({s['wall_s']} s)", flush=True)

    models = [run_model(m, log, args.only, args.cap) for m in MODELS if args.model in (None, m.key)]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"total wall {wall:.0f} s, CPU {cpu:.0f} s")
    for line in headline(models):
        print(line)
    if args.json:
        args.json.write_text(json.dumps(to_json(models), indent=1))
    cmd = "python -m bench.autoscale" + "".join(f" --{k} {v}" for k, v in (("model", args.model), ("only", args.only),
                                                                           ("cap", args.cap)) if v)
    if args.save:
        rows = [(m.model.key, m.default_cap, m.cap, m.cap_slo, m.cap_gpu, m.wa, m.wb) for m in models]
        args.save.write_bytes(pickle.dumps({"models": rows, "wall": wall, "cpu": cpu, "cmd": cmd}))
    if not args.no_write:
        _write(models, wall, cpu, cmd)


def _chiron_only(model_key: str | None) -> None:
    """The chiron and chiron-swap rows of every workload, one summary line each (JSON)."""
    t0, c0 = time.perf_counter(), time.process_time()
    for m in MODELS:
        if model_key not in (None, m.key):
            continue
        for sc in m.wa():
            print(json.dumps(run_arm(sc, Arm("chiron")).summary()), flush=True)
        for sc in m.wb():
            for arm in (Arm("chiron"), Arm("chiron", evict_mode="swap", label="chiron swap")):
                print(json.dumps(run_arm(sc, arm).summary()), flush=True)
    print(f"total wall {time.perf_counter() - t0:.0f} s, CPU {time.process_time() - c0:.0f} s", flush=True)


def _pool_gpu_seconds(r: ArmResult, pool: str, gpus: int) -> float:
    """GPU-seconds of one pool's workers (started or starting), from the timeline's samples (every tick)."""
    rows = r.timeline
    return sum(gpus * (b["t"] - a["t"]) * (a["active"].get(pool, 0) + a["pending"].get(pool, 0))
               for a, b in zip(rows, rows[1:], strict=False))


def _evict_continue(model_key: str | None, write: bool) -> None:
    """Chiron on every W_B workload, evicted batch requests restarting (evict_mode "restart") against
    continuing from their generated tokens ("continue", what the gateway's batch runner does)."""
    t0, c0 = time.perf_counter(), time.process_time()
    rows = ["| workload | eviction | GPU-s | batch-pool GPU-s | evictions (continued) | tokens generated before "
            "an eviction | engine prefill tokens | engine decode tokens | batch done at (s) | interactive SLO |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in MODELS:
        if model_key not in (None, m.key):
            continue
        gpus = load_profile(m.profile).gpus_per_worker
        for sc in m.wb():
            for mode in ("restart", "continue"):
                r = run_arm(sc, Arm("chiron", evict_mode=mode, label=f"chiron {mode}"))
                s, sw = r.summary(), r.swap
                row = (f"| {sc.name} | {mode} | {s['gpu_seconds']:,} | {_pool_gpu_seconds(r, 'batch', gpus):,.0f} | "
                       f"{s['evictions']} ({sw.get('continued', 0)}) | {s['evicted_tokens']:,} | "
                       f"{sw['engine_prompt_tokens']:,} | {sw['engine_generation_tokens']:,} | "
                       f"{_f(s['batch_done_at'], '{:.0f}')} | {_f(s['interactive_slo'])} |")
                print(row, flush=True)
                rows.append(row)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"total wall {wall:.0f} s, CPU {cpu:.0f} s")
    if write:
        cmd = "python -m bench.autoscale --evict-continue" + (f" --model {model_key}" if model_key else "")
        write_section(RESULTS / "autoscale.md", "Evicted batch work: continue against restart (virtual time)", cmd,
                      EVICT_CONTINUE_TEXT + "\n" + "\n".join(rows) + f"\n\nWall {wall:.0f} s, CPU {cpu:.0f} s.\n")
        print(f"wrote {RESULTS / 'autoscale.md'}")


EVICT_CONTINUE_TEXT = """\
The gateway's batch runner now streams a batch request to its worker and, when interactive traffic evicts it,
keeps the text it produced; its next run is the resume continuation (prompt plus that text, `max_tokens` less
its tokens) on the worker its pool's router picks (gateway/batch/runner.py). Requests the continuation cannot
carry (n > 1, logprobs, structured output, tools) still restart. The simulator models both
(simulator/autoscale_sim.py `Arm.evict_mode`): "restart" runs the request again from scratch; "continue"
prefills the prompt plus the kept tokens (no prefix-cache credit: conservative) and decodes only the rest.
Same scenario, same seed, chiron arm; only the eviction mode differs. Batch-pool GPU-s: the workers
labelled `pool: batch`, integrated over the 15 s timeline (mixed workers run batch work too and are in the
fleet total only).
"""


def _write(models: Sequence[ModelResults], wall: float, cpu: float, cmd: str, note: str = "") -> None:
    plot(models, RESULTS / "autoscale_workers.png", RESULTS / "autoscale_slo.png", RESULTS / "autoscale_frontier.png")
    write_report(RESULTS / "autoscale.md", "Autoscaling: Chiron-style vs utilization band vs static (virtual time)",
                 cmd, render(models, wall, cpu, note))
    print(f"wrote {RESULTS / 'autoscale.md'}")


if __name__ == "__main__":
    main(sys.argv[1:])
