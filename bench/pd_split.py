"""P/D-disaggregated vs mixed serving, and decode-pool sizing per placement policy (virtual time).

Two experiments with the cluster simulator (simulator/cluster.py), the same policies/pd.py code the
gateway runs, Llama-3.1-8B on H100 workers (simulator/profiles/llama3-8b-h100.yaml):

1. Equal worker count: 8 mixed workers against P/D splits 2:6 and 3:5 (with and without overflow of a
   saturated prefill pool to local prefill) on the Azure 2023 conversation trace (its timestamps, rate
   scaled) and on ShareGPT lengths (Poisson arrivals). TTFT, TPOT, SLO attainment for two SLO sets.
2. Decode workers needed for 99% SLO attainment (Aladdin appendix I, figure 12): every request is split
   (no local prefill) over a prefill pool sized generously, so only the decode pool and its placement
   policy decide; the smallest decode pool meeting 99% is found by bisection, per arrival rate, for
   `aladdin` (split-phase decode packing), `least_requests` (JSQ) and `power_of_two`.

    .venv/bin/python -m bench.pd_split              # writes bench/results/pd.md and pd.png
    .venv/bin/python -m bench.pd_split --quick --no-write
    .venv/bin/python -m bench.pd_split --render     # re-render the report from bench/results/pd.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import bisect_smallest
from bench.report import write_report
from policies.pd import pd_policy_for_profiles
from simulator.cluster import ClusterSim, RequestResult
from simulator.profiles import Profile, load_profile
from simulator.progress import stderr_progress
from simulator.workload import WorkloadRequest, load_workload

RESULTS = Path(__file__).parent / "results"
PROFILE = "llama3-8b-h100"
# (TTFT s, TPOT s): Aladdin table 3's 600 ms / 30 ms, and a tight TPOT of ~1.3x this profile's
# single-request ITL (7.4 ms), Aladdin appendix G's rule for its decode SLOs.
SLOS = {"600ms/30ms": (0.6, 0.030), "600ms/10ms": (0.6, 0.010)}
TARGET = 0.99
TITLE = "P/D disaggregation: equal-count comparison and decode-pool sizing"


def attainment(results: list[RequestResult], ttft: float, tpot: float) -> float:
    """Aladdin appendix G: a request attains its SLO when both its TTFT and its ATGT (TPOT) are in target."""
    ok = sum(1 for r in results if r.completed and r.ttft <= ttft and r.tpot <= tpot)
    return ok / len(results) if results else 0.0


# --- experiment 1: equal worker count ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Setup:
    label: str
    prefill: int           # 0: all mixed
    overflow: bool = True


SETUPS = (Setup("8 mixed", 0), Setup("P/D 2:6", 2), Setup("P/D 3:5", 3),
          Setup("P/D 2:6, no overflow", 2, False), Setup("P/D 3:5, no overflow", 3, False))


def run_setup(setup: Setup, workload: list[WorkloadRequest], prof: Profile, workers: int = 8) -> dict[str, Any]:
    slo_ttft, slo_tpot = SLOS["600ms/30ms"]
    if setup.prefill:
        policy = pd_policy_for_profiles("least_requests", None, [prof], slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot,
                                        prefix_chunk_tokens=16, prefill_overflow=setup.overflow)
    else:
        policy = "least_requests"
    sim = ClusterSim(prof, workers, policy, prefill_workers=setup.prefill, slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot)
    res = sim.run(workload)
    out = res.to_dict()
    for name, (ttft, tpot) in SLOS.items():
        out[f"att {name}"] = attainment(res.results, ttft, tpot)
    return out


def equal_count(levels: list[tuple[str, str, float]], prof: Profile, duration: float) -> tuple[str, list[dict]]:
    rows: list[dict] = []
    lines = ["| workload | setup | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | SLO 600ms/30ms | SLO 600ms/10ms "
             "| split / local / overflow |",
             "|---|---|---|---|---|---|---|---|---|"]
    done, total = 0, len(levels) * len(SETUPS)
    with stderr_progress("P/D equal worker count") as progress:
        for trace, label, level in levels:
            wl = (load_workload(trace, rate_scale=level, duration=duration) if trace == "azure_conv"
                  else load_workload(trace, rate=level, duration=duration, seed=1))
            rate = len(wl) / max(wl[-1].arrival - wl[0].arrival, 1e-9)
            for setup in SETUPS:
                t = time.perf_counter()
                d = run_setup(setup, wl, prof)
                dec = d.get("pd_decisions", {})
                mix = (f"{dec.get('disaggregated', 0)} / {dec.get('local_short', 0)} / {dec.get('local_overflow', 0)}"
                       if dec else "-")
                lines.append(f"| {label} ({len(wl)} req, {rate:.1f} req/s) | {setup.label} | {_ms(d['ttft_p50'])} | "
                             f"{_ms(d['ttft_p99'])} | {_ms(d['tpot_p50'], 1)} | {_ms(d['tpot_p99'], 1)} | "
                             f"{d['att 600ms/30ms']:.1%} | {d['att 600ms/10ms']:.1%} | {mix} |")
                rows.append({"workload": label, "setup": setup.label, **d})
                print(f"  {label} {setup.label}: {time.perf_counter() - t:.1f}s", file=sys.stderr, flush=True)
                done += 1
                progress(done, total)
    return "\n".join(lines), rows


def _ms(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v * 1000:.{digits}f} ms"


# --- experiment 2: decode workers for 99% attainment ---------------------------------------------------------

DECODE_POLICIES: dict[str, tuple[str, dict[str, Any]]] = {
    "aladdin": ("aladdin", {}),
    "aladdin θ=1, γ=0": ("aladdin", {"theta": 1.0, "gamma": 0.0}),
    "least_requests (JSQ)": ("least_requests", {}),
    "power_of_two": ("power_of_two", {"seed": 0}),
}


def prefill_pool(rate: float) -> int:
    """Prefill workers so the prefill pool is never the bottleneck: 5 ShareGPT prompts/s each (mean 2338
    tokens) is ~30% of a worker's prefill throughput here (~41k tokens/s at 8192-token chunks)."""
    return max(2, math.ceil(rate / 5))


def attainment_with(policy_key: str, n_decode: int, wl: list[WorkloadRequest], rate: float, prof: Profile,
                    slo: tuple[float, float]) -> float:
    name, params = DECODE_POLICIES[policy_key]
    n_prefill = prefill_pool(rate)
    policy = pd_policy_for_profiles(name, params, [prof], slo_ttft_s=slo[0], slo_tpot_s=slo[1], prefix_chunk_tokens=16,
                                    local_prefill_tokens=0, prefill_overflow=False)
    sim = ClusterSim(prof, n_prefill + n_decode, policy, prefill_workers=n_prefill, slo_ttft_s=slo[0],
                     slo_tpot_s=slo[1])
    return attainment(sim.run(wl).results, *slo)


def decode_workers_needed(policy_key: str, wl: list[WorkloadRequest], rate: float, prof: Profile,
                          slo: tuple[float, float], hi: int) -> tuple[int | None, dict[int, float]]:
    """Smallest decode pool in [1, hi] with attainment >= TARGET (bisection; attainment grows with the pool)."""
    seen: dict[int, float] = {}

    def ok(n: int) -> bool:
        if n not in seen:
            seen[n] = attainment_with(policy_key, n, wl, rate, prof, slo)
        return seen[n] >= TARGET

    if not ok(hi):
        return None, seen
    return bisect_smallest(ok, 0, hi), seen


def sizing(rates: list[float], prof: Profile, duration: float, hi: int) -> tuple[str, dict]:
    needed: dict[str, dict[str, dict[float, int | None]]] = {}
    lines = []
    done, total = 0, len(SLOS) * len(rates) * len(DECODE_POLICIES)
    with stderr_progress("P/D decode workers needed") as progress:
        for slo_name, slo in SLOS.items():
            needed[slo_name] = {k: {} for k in DECODE_POLICIES}
            lines += [f"\nSLO {slo_name} (TTFT/TPOT), decode workers needed for {TARGET:.0%} attainment "
                      "(prefill pool in brackets):\n",
                      "| rate (req/s) | " + " | ".join(DECODE_POLICIES) + " | aladdin vs JSQ | aladdin vs power_of_two |",
                      "|---" * (len(DECODE_POLICIES) + 3) + "|"]
            for rate in rates:
                wl = load_workload("sharegpt", rate=rate, duration=duration, seed=1)
                cells = []
                for key in DECODE_POLICIES:
                    t = time.perf_counter()
                    n, seen = decode_workers_needed(key, wl, rate, prof, slo, hi)
                    needed[slo_name][key][rate] = n
                    near = f" ({seen[n - 1]:.1%} at {n - 1})" if n is not None and n - 1 in seen else ""
                    cells.append(f"{n if n is not None else f'>{hi}'}{near}")
                    print(f"  {slo_name} {rate} {key}: {n} ({time.perf_counter() - t:.1f}s)", file=sys.stderr, flush=True)
                    done += 1
                    progress(done, total)
                a, j, p = (needed[slo_name][k][rate] for k in ("aladdin", "least_requests (JSQ)", "power_of_two"))
                lines.append(f"| {rate:g} [{prefill_pool(rate)}] | " + " | ".join(cells) + f" | {_saving(a, j)} | "
                             f"{_saving(a, p)} |")
    return "\n".join(lines), needed


def _saving(a: int | None, b: int | None) -> str:
    if a is None or b is None:
        return "-"
    return f"{(b - a) / b:+.0%} fewer" if a < b else ("same" if a == b else f"{(a - b) / b:.0%} more")


def plot(needed: dict, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 1 + len(needed), figsize=(5 * (1 + len(needed)), 4))
    ax = axes[0]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    setups = [s.label for s in SETUPS]
    width = 0.8 / len(setups)
    for i, s in enumerate(setups):
        vals = [next(r["att 600ms/10ms"] for r in rows if r["workload"] == w and r["setup"] == s) for w in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], vals, width, label=s)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))], workloads, rotation=15, fontsize=7)
    ax.set_ylabel("SLO attainment (600 ms / 10 ms)")
    ax.set_title("8 workers: mixed vs P/D")
    ax.legend(fontsize=6)
    for ax, (slo_name, per) in zip(axes[1:], needed.items(), strict=True):
        for key, by_rate in per.items():
            xs = [r for r, n in by_rate.items() if n is not None]
            ax.plot(xs, [by_rate[r] for r in xs], marker="o", label=key)
        ax.set_xlabel("arrival rate (req/s, ShareGPT lengths)")
        ax.set_ylabel(f"decode workers for {TARGET:.0%}")
        ax.set_title(f"decode pool size, SLO {slo_name}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one load level per trace, two rates, short runs")
    ap.add_argument("--no-write", action="store_true", help="print the report instead of writing bench/results")
    ap.add_argument("--render", action="store_true", help="rewrite pd.md / pd.png from the saved pd.json")
    args = ap.parse_args(argv)
    if args.render:
        saved = json.loads((RESULTS / "pd.json").read_text())
        needed = {k: {pk: {float(r): n for r, n in v.items()} for pk, v in per.items()}
                  for k, per in saved["needed"].items()}
        body = _report(saved["table1"], saved["table2"], needed, saved["rows"], saved["duration"],
                       saved["sizing_duration"], saved["wall"])
        write_report(RESULTS / "pd.md", TITLE, saved["command"], body)
        plot(needed, saved["rows"], RESULTS / "pd.png")
        return
    prof = load_profile(PROFILE)
    t0 = time.perf_counter()
    if args.quick:
        levels = [("azure_conv", "Azure conv x12", 12.0), ("sharegpt", "ShareGPT 30/s", 30.0)]
        rates, duration, sizing_duration = [10.0, 30.0], 120.0, 60.0
    else:
        levels = [("azure_conv", "Azure conv x8", 8.0), ("azure_conv", "Azure conv x12", 12.0),
                  ("sharegpt", "ShareGPT 20/s", 20.0), ("sharegpt", "ShareGPT 35/s", 35.0)]
        rates, duration, sizing_duration = [10.0, 20.0, 40.0, 60.0], 600.0, 120.0
    table1, rows = equal_count(levels, prof, duration)
    table2, needed = sizing(rates, prof, sizing_duration, hi=24)
    wall = time.perf_counter() - t0
    body = _report(table1, table2, needed, rows, duration, sizing_duration, wall)
    command = "python -m bench.pd_split" + (" --quick" if args.quick else "")
    if args.no_write:
        print(body)
        return
    write_report(RESULTS / "pd.md", TITLE, command, body)
    (RESULTS / "pd.json").write_text(json.dumps(
        {"command": command, "table1": table1, "table2": table2, "rows": rows, "needed": needed,
         "duration": duration, "sizing_duration": sizing_duration, "wall": wall}, indent=1))
    plot(needed, rows, RESULTS / "pd.png")
    print(f"wrote {RESULTS / 'pd.md'} and {RESULTS / 'pd.png'} in {wall:.0f}s")


def _report(table1: str, table2: str, needed: dict, rows: list[dict], duration: float, sizing_duration: float,
            wall: float) -> str:
    return f"""All numbers come from the virtual-time cluster simulator (`simulator/cluster.py`) driving the same
`policies/pd.py` pairing code as the gateway; workers are `{PROFILE}` (Llama-3.1-8B BF16 on one H100,
vLLM 0.11 defaults, chunked prefill 8192 tokens). A split request pays two API overheads (15 ms each)
and the KV transfer (1 ms + 128 KiB/token over 40 GB/s); the producer keeps its blocks pinned until the
decode worker's first token. Nothing here was measured on a GPU. Run time {wall:.0f} s.

## 1. Eight workers: mixed vs P/D splits

Arrivals: Azure conv keeps its timestamps (rate multiplied), {duration:.0f} s of arrivals; ShareGPT lengths
with Poisson arrivals at the given rate. Placement: `least_requests` for mixed workers and for the
decode legs; prefill workers by predicted prefill completion (policies/pd.py). Prompts of at most 256
tokens are prefilled by their decode worker (`local`). "overflow": a prompt whose best prefill worker is
predicted to miss the 600 ms TTFT SLO is prefilled by its decode worker instead.

{table1}

## 2. Decode workers needed for {TARGET:.0%} attainment

ShareGPT lengths, Poisson arrivals, {sizing_duration:.0f} s of arrivals per run; every request is split
(no local or overflow prefill) and the prefill pool is sized so it never limits; the smallest decode pool
that reaches {TARGET:.0%} attainment is found by bisection (24 at most). `aladdin` runs in split-phase mode
(policies/pd.py `AladdinDecodePolicy`: its prefill term is the KV transfer; ATGT and KV constraints as
in the paper, θ=0.8, γ=0.5); the second column relaxes its margins. Aladdin reports up to 60% fewer
decode GPUs than JSQ and 49% fewer than power-of-two (appendix I, figure 12).
{table2}

## Reading

{_reading(needed, rows)}
"""


def _reading(needed: dict, rows: list[dict]) -> str:
    lines = ["Equal worker count (table 1):"]
    for w in dict.fromkeys(r["workload"] for r in rows):
        mixed = next(r for r in rows if r["workload"] == w and r["setup"] == "8 mixed")
        best = max((r for r in rows if r["workload"] == w and r["setup"] != "8 mixed"),
                   key=lambda r: r["att 600ms/10ms"] + r["att 600ms/30ms"])
        lines.append(
            f"- {w}: TPOT p99 {mixed['tpot_p99'] * 1e3:.1f} ms mixed vs {best['tpot_p99'] * 1e3:.1f} ms for the best split "
            f"({best['setup']}, best summed attainment); TTFT p50 {mixed['ttft_p50'] * 1e3:.0f} vs {best['ttft_p50'] * 1e3:.0f} ms; attainment "
            f"600ms/30ms {mixed['att 600ms/30ms']:.1%} vs {best['att 600ms/30ms']:.1%}, "
            f"600ms/10ms {mixed['att 600ms/10ms']:.1%} vs {best['att 600ms/10ms']:.1%}.")
    lines.append(
        "\nSplitting removes prefill chunks from the decode batches, so TPOT tails shrink; it costs a second API "
        "overhead, the transfer and the prefill queue in TTFT. It pays off when TPOT is the binding SLO and the "
        "prefill pool matches the workload's prompt volume: both traces are prompt-heavy (mean prompt 1155 "
        "tokens for Azure conv, 2338 for these ShareGPT lengths), and a 2-worker prefill pool saturates at the "
        "higher rates unless saturated prompts overflow to local prefill (the `no overflow` rows show the "
        "queueing). With the loose 30 ms TPOT target, 8 mixed workers already meet it and are as good or "
        "better. At ShareGPT 35/s no 8-worker setup comes close to a 10 ms TPOT: the decode pool is too small.")
    lines.append("\nDecode-pool sizing (table 2):")
    for slo_name, per in needed.items():
        a, j, p = per["aladdin"], per["least_requests (JSQ)"], per["power_of_two"]
        diffs = [(a[r] - j[r]) / j[r] for r in a if a[r] is not None and j[r] is not None]
        diffs_p = [(a[r] - p[r]) / p[r] for r in a if a[r] is not None and p[r] is not None]
        lines.append(f"- SLO {slo_name}, aladdin's decode pool across the rates: {_span(diffs)} than JSQ's, "
                     f"{_span(diffs_p)} than power-of-two's.")
    lines.append(
        "\nWe do not reproduce Aladdin's 60% / 49% savings. On identical workers with a per-request "
        "SLO, JSQ already spreads the decode load evenly, and with no admission limit of its own it never "
        "holds a request back. Aladdin packs the fullest worker that its models say still fits and queues "
        "what fits nowhere; its models bound the simulator's step time from above (PerfModel."
        "from_step_profile) and θ keeps a further margin, so at a tight TPOT it declares workers full "
        "early and the queueing costs TTFT; relaxing θ and γ narrows but does not close the gap. Its "
        "packing helps when the goal is to keep a pool small and idle workers free (autoscaling), not when "
        "the pool is fixed and every worker is already paid for. The loose 30 ms target is "
        "capacity-bound: all policies need the same pool.")
    return "\n".join(lines)


def _span(values: list[float]) -> str:
    if not values:
        return "n/a"
    lo, hi = min(values), max(values)
    fmt = lambda v: f"{abs(v):.0%} {'larger' if v > 0 else 'smaller'}" if v else "no larger"  # noqa: E731
    return fmt(lo) if lo == hi else f"between {fmt(lo)} and {fmt(hi)}"


if __name__ == "__main__":
    main()
