"""Live check: the same workloads through the live gateway (in front of `fleetgate sim`) and through the
virtual-time simulator (`simulator.cluster.ClusterSim`), one load point per experiment.

    .venv/bin/python -m bench.live_check             # writes bench/results/live_check.md
    .venv/bin/python -m bench.live_check --quick     # shorter runs, no file

Experiments (the issue's, one load point each):
- workers needed (Aladdin fig. 10): `llama2-13b-a100`, 4 workers, ShareGPT lengths with Poisson arrivals at
  3 req/s (bench/placement.py's workload, seed 0), TTFT 600 ms / ATGT 30 ms; round_robin, least_requests,
  power_of_two, aladdin (with the parameters bench/placement.py's protocol chose for ShareGPT). Simulator side:
  bench.placement.probe of the same SimSpec (what `fleetgate simulate` runs).
- heterogeneous pair (hetero paper fig. 5): one `llama3-8b-h100` (strong) and one `llama3-8b-a100` (weak)
  serving the same model, ShareGPT at 16 req/s; round_robin, memory-only (hetero memory_only) and hetero;
  throughput (completed requests per second from the first arrival to the last completion) and attainment.

Live side: a fresh `fleetgate sim` process per run (pinned to core 1 when taskset exists) at time scale K,
the gateway in this process (policy and SLO per model in its config, priors from the declared worker
profiles with learning.time_scale = K, so the policies see exactly the simulator's coefficients in wall
seconds; refits off unless --refit), and an aiohttp client replaying the workload at arrival / K: a
streamed /v1/completions with a prompt of exactly the trace's token count (simulator.tokenizer
.synthetic_text), `x-sim-output-tokens` = the trace's output length (the simulated engine stops there,
as with `ignore_eos` and max_tokens = that length), and max_tokens = the context left, so the length is
not revealed to the gateway's predictor (`ignore_eos` itself is not sent: it would run to max_tokens). Both sides warm the output-length
predictor with the same 2000 history samples (the gateway loads them as a shared-state document at start).
Both run the same admission queue (policies/admission.py: look-ahead, deadlines from the TTFT budget, 429 when
it passes) with the same settings, time-scaled on the live side. SLO attainment on the live side is the
gateway's own `fleetgate_slo_requests_total` (met / judged: a worker's 400 for a too-long prompt is not judged,
as the simulator leaves it out of its denominator); times are wall seconds x K. Known differences: the gateway
reports a request's progress to aladdin once per learning tick (20 ms wall) instead of at the exact first token;
engine metrics are scraped every 0.5 s / K; the live fleet shares the machine with the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.placement import CANDIDATES, point_spec, probe, with_policy
from bench.report import write_report
from gateway.config import load_config
from gateway.pipeline.learning import DOC_PREDICTOR
from gateway.server import GatewayServer
from gateway.state.memory import MemoryStore
from policies.length_predictor import LengthPredictor
from simulator.fleet import FleetProcess
from simulator.profiles import load_profile
from simulator.simulate import SimSpec, build_sim, build_workload, history
from simulator.tokenizer import synthetic_text
from simulator.workload import WorkloadRequest

ROOT = Path(__file__).resolve().parents[1]
RESULTS_MD = ROOT / "bench" / "results" / "live_check.md"
SLO_TTFT_S, SLO_ATGT_S = 0.600, 0.030      # Aladdin table 3
SEED = 0
TOLERANCE_PP = 5.0
# aladdin's parameters: what bench/placement.py's leave-one-trace-out chose for ShareGPT (read from its .json when
# the study has run, else the candidate it chose on every trace of its quick run).
PLACEMENT_JSON = ROOT / "bench" / "results" / "placement.json"


@dataclass
class Side:
    attainment: float
    throughput: float   # completed requests per model second, first arrival to last completion
    completed: int
    requests: int
    note: str = ""


# --- the live side -----------------------------------------------------------------------------------
def metric(text: str, name: str, labels: dict[str, str]) -> float | None:
    """A sample's value from a Prometheus text exposition (first match of name and labels)."""
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def unique_prompt(tokens: int, i: int, seed: int) -> str:
    """Exactly `tokens` tokens of filler whose first 16-token block is unique to the request: the trace has
    no shared prefixes, so no two prompts may share a prefix-cache block (synthetic_text alone repeats)."""
    text = synthetic_text(tokens, f"{seed}-{i}")
    tag = f"#{seed}:{i}#"
    return tag + text[len(tag):] if len(text) > len(tag) else text


async def replay(url: str, model: str, workload: list[WorkloadRequest], k: float, max_model_len: int,
                 seed: int) -> tuple[int, float, list[int]]:
    """Send the workload at arrival / k; (completed, model seconds from first arrival to last completion,
    statuses of the failures)."""
    conn = aiohttp.TCPConnector(limit=0)
    failures: list[int] = []
    last_done = 0.0
    completed = 0
    bodies = [orjson.dumps({
        "model": model, "prompt": unique_prompt(r.prompt_tokens, i, seed),
        "max_tokens": max(max_model_len - r.prompt_tokens, 1), "stream": True,
        "stream_options": {"include_usage": True}}) for i, r in enumerate(workload)]
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as s:
        t0 = time.perf_counter() + 0.2

        async def one(r: WorkloadRequest, body: bytes) -> None:
            nonlocal last_done, completed
            delay = t0 + r.arrival / k - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            headers = {"content-type": "application/json", "x-sim-output-tokens": str(r.output_tokens),
                       "x-request-id": r.request_id}
            try:
                async with s.post(url + "/v1/completions", data=body, headers=headers) as resp:
                    tail = b""
                    async for chunk in resp.content.iter_any():
                        tail = (tail + chunk)[-64:]
                    if resp.status == 200 and tail.endswith(b"data: [DONE]\n\n"):
                        completed += 1
                        last_done = max(last_done, time.perf_counter())
                    else:
                        failures.append(resp.status)
            except aiohttp.ClientError:
                failures.append(0)

        await asyncio.gather(*(one(r, b) for r, b in zip(workload, bodies, strict=True)))
    first = t0 + workload[0].arrival / k
    return completed, (last_done - first) * k, failures


async def live_run(profiles: list[str], model: str, policy: str, params: dict[str, Any],
                   workload: list[WorkloadRequest], k: float, warm: list[tuple[int, int]], refit: bool,
                   lookahead: int = 1, slo_ttft_s: float = SLO_TTFT_S, slo_atgt_s: float = SLO_ATGT_S) -> Side:
    fleet_file = Path(tempfile.mkstemp(suffix=".yaml")[1])
    fleet_file.write_text(yaml.safe_dump({"servers": [{"profile": p, "model": model} for p in profiles]}))
    wrapper = ["taskset", "-c", "1"] if shutil.which("taskset") and os.cpu_count() and os.cpu_count() > 1 else []
    store = MemoryStore()
    warm_predictor = LengthPredictor()
    for p, o in warm:
        warm_predictor.observe(model, p, o)
    await store.put_doc(DOC_PREDICTOR + "history", {"predictor": warm_predictor.to_dict(), "updated_at": time.time()})
    mml = load_profile(profiles[0]).max_model_len
    try:
        with FleetProcess(fleet_file=fleet_file, time_scale=k, seed=SEED, wrapper=wrapper) as fleet:
            cfg = load_config(
                None, listen={"host": "127.0.0.1", "port": 0}, scrape_interval_s=0.5 / k,
                workers=[{"id": f"w{i}", "url": u, "profile": p}
                         for i, (u, p) in enumerate(zip(fleet.urls, profiles, strict=True))],
                models={model: {"policy": policy, "params": params}},
                slo={"ttft_ms": slo_ttft_s * 1000 / k, "tpot_ms": slo_atgt_s * 1000 / k},
                limits={"queue_timeout_s": 5.0 / k, "queue_lookahead": lookahead},
                health={"interval_s": 1.0},
                learning={"time_scale": k, "interval_s": 0.02,
                          **({"refit_interval_s": 2.0} if refit else {"refit_min_new": 10**9})},
            )
            async with GatewayServer(cfg, store=store) as gw:
                completed, span, failures = await replay(gw.url, model, workload, k, mml, SEED)
                async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics") as r:
                    text = await r.text()
    finally:
        fleet_file.unlink(missing_ok=True)
    lab = {"model": model, "class": "interactive"}
    met = metric(text, "fleetgate_slo_requests_total", {**lab, "result": "met"}) or 0.0
    missed = metric(text, "fleetgate_slo_requests_total", {**lab, "result": "missed"}) or 0.0
    note = f"{len(failures)} failed ({sorted(set(failures))})" if failures else ""
    judged = met + missed
    return Side(met / judged if judged else 0.0, completed / span if span > 0 else 0.0, completed,
                len(workload), note)


# --- the simulator side ------------------------------------------------------------------------------
def sim_placement(spec: SimSpec) -> Side:
    r = probe(spec, stop_early=False)
    return Side(r.attainment, float("nan"), r.servable, r.servable)


def chosen_aladdin(trace: str = "sharegpt") -> dict[str, Any]:
    """aladdin's parameter set the placement study chose for `trace` (leave-one-trace-out)."""
    try:
        name = orjson.loads(PLACEMENT_JSON.read_bytes())["chosen"][trace]
    except (OSError, KeyError, ValueError):
        name = "spread_lookahead"
    return dict(CANDIDATES[name])


def sim_hetero(spec: SimSpec, workload: list[WorkloadRequest]) -> Side:
    d = build_sim(spec, workload).run([dataclasses.replace(r) for r in workload]).to_dict()
    return Side(d["slo_attainment"], d["throughput_rps"], d["completed"], d["servable"])


# --- experiments -------------------------------------------------------------------------------------
def ordering(values: dict[str, float]) -> str:
    return " < ".join(name for name, _ in sorted(values.items(), key=lambda kv: kv[1]))


def pairs_agree(sim: dict[str, float], live: dict[str, float], min_gap: float) -> tuple[bool, list[str]]:
    """Every pair the simulator separates by more than `min_gap` is ordered the same way live."""
    bad = []
    names = list(sim)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if abs(sim[a] - sim[b]) > min_gap and (sim[a] - sim[b]) * (live[a] - live[b]) <= 0:
                bad.append(f"{a} vs {b}")
    return not bad, bad


async def workers_needed(k: float, duration: float, refit: bool) -> tuple[list[str], bool]:
    profile, workers, rate = "llama2-13b-a100", 4, 3.0
    prof = load_profile(profile)
    base = point_spec("sharegpt", rate, SEED, duration)
    workload = build_workload(base)
    warm = history(base, workload)
    scaled = {"slo_ttft_s": SLO_TTFT_S / k, "slo_atgt_s": SLO_ATGT_S / k, "deadline_margin_s": 0.05 / k}
    runs = {"round_robin": {}, "least_requests": {}, "power_of_two": {}, "aladdin": chosen_aladdin()}
    sim, live = {}, {}
    lines = [f"### Workers needed: `{profile}` x {workers}, ShareGPT, Poisson {rate:g} req/s, {len(workload)} requests "
             f"over {duration:g} s, TTFT 600 ms / ATGT 30 ms", "",
             "| policy | simulator attainment | live attainment | difference (pp) | live completed | live notes |",
             "|---|---|---|---|---|---|"]
    ok = True
    for name, params in runs.items():
        spec = with_policy(base, name, params, workers=workers)
        s = sim_placement(spec)
        live_params = dict(spec.policy_params)
        if name == "aladdin":
            live_params.update(scaled)      # the gateway's clock is K times faster than model time
        elif name == "power_of_two":
            live_params["seed"] = SEED
        lv = await live_run([profile] * workers, prof.model, name, live_params, workload, k, warm, refit,
                            spec.queue_lookahead)
        sim[name], live[name] = s.attainment, lv.attainment
        diff = (lv.attainment - s.attainment) * 100
        ok &= abs(diff) <= TOLERANCE_PP
        lines.append(f"| {name} | {s.attainment:.3f} | {lv.attainment:.3f} | {diff:+.1f} | "
                     f"{lv.completed}/{lv.requests} | {lv.note} |")
        print(lines[-1], flush=True)
    same, bad = pairs_agree(sim, live, 0.02)
    lines += ["", f"Ordering by attainment: simulator {ordering(sim)}; live {ordering(live)}.",
              f"Pairs the simulator separates by more than 2 pp, ordered the same live: "
              f"{'yes' if same else 'no (' + ', '.join(bad) + ')'}. All within {TOLERANCE_PP:g} pp: "
              f"{'yes' if ok else 'no'}.", ""]
    return lines, ok and same


async def hetero_pair(k: float, duration: float, refit: bool) -> tuple[list[str], bool]:
    profiles, rate = ["llama3-8b-h100", "llama3-8b-a100"], 16.0
    model = load_profile(profiles[0]).model
    base = SimSpec(trace="sharegpt", rate=rate, duration=duration, seed=SEED, profile=",".join(profiles),
                   workers=len(profiles), slo_ttft_s=SLO_TTFT_S, slo_tpot_s=SLO_ATGT_S)
    workload = build_workload(base)
    warm = history(base, workload)
    runs = {"round_robin": ("round_robin", {}), "memory-only": ("hetero", {"memory_only": True}),
            "hetero": ("hetero", {})}
    sim_thr, live_thr, sim_att, live_att = {}, {}, {}, {}
    lines = [f"### Heterogeneous pair: `{profiles[0]}` (strong) + `{profiles[1]}` (weak), ShareGPT, Poisson "
             f"{rate:g} req/s, {len(workload)} requests over {duration:g} s", "",
             "| policy | sim throughput (req/s) | live throughput | difference | sim attainment | live attainment | "
             "difference (pp) | live notes |", "|---|---|---|---|---|---|---|---|"]
    ok = True
    for label, (name, params) in runs.items():
        s = sim_hetero(dataclasses.replace(base, policy=name, policy_params=params), workload)
        lv = await live_run(profiles, model, name, params, workload, k, warm, refit)
        sim_thr[label], live_thr[label] = s.throughput, lv.throughput
        sim_att[label], live_att[label] = s.attainment, lv.attainment
        diff = (lv.attainment - s.attainment) * 100
        ok &= abs(diff) <= TOLERANCE_PP
        lines.append(f"| {label} | {s.throughput:.2f} | {lv.throughput:.2f} | "
                     f"{(lv.throughput / s.throughput - 1) * 100:+.1f}% | {s.attainment:.3f} | {lv.attainment:.3f} | "
                     f"{diff:+.1f} | {lv.note} |")
        print(lines[-1], flush=True)
    same_t, bad_t = pairs_agree(sim_thr, live_thr, 0.3)
    same_a, bad_a = pairs_agree(sim_att, live_att, 0.02)
    lines += ["", f"Ordering by throughput: simulator {ordering(sim_thr)}; live {ordering(live_thr)} "
              f"(pairs > 0.3 req/s apart agree: {'yes' if same_t else 'no: ' + ', '.join(bad_t)}).",
              f"Ordering by attainment: simulator {ordering(sim_att)}; live {ordering(live_att)} "
              f"(pairs > 2 pp apart agree: {'yes' if same_a else 'no: ' + ', '.join(bad_a)}). "
              f"All attainments within {TOLERANCE_PP:g} pp: {'yes' if ok else 'no'}.", ""]
    return lines, ok and same_t and same_a


async def main_async(args: argparse.Namespace) -> str:
    body = [f"Time scale K = {args.time_scale:g} (wall second = K model seconds); SLOs and coefficients are "
            f"divided by K on the live side and live times multiplied by K. Online refits: "
            f"{'on (every 2 s)' if args.refit else 'off (declared-profile priors, as the simulator uses)'}.", ""]
    verdicts = []
    for fn, dur in ((workers_needed, args.duration), (hetero_pair, args.hetero_duration)):
        lines, ok = await fn(args.time_scale, dur, args.refit)
        body += lines
        verdicts.append(ok)
    body += [f"**Overall: {'same ordering and attainment within 10 pp in both experiments' if all(verdicts) else 'see the tables: not every check held'}.**", ""]
    return "\n".join(body)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=120.0, help="model seconds of arrivals (workers needed)")
    ap.add_argument("--hetero-duration", type=float, default=60.0, help="model seconds of arrivals (hetero pair)")
    ap.add_argument("--refit", action="store_true", help="let the gateway refit its models online")
    ap.add_argument("--quick", action="store_true", help="short runs, print only")
    args = ap.parse_args(argv)
    if args.quick:
        args.duration, args.hetero_duration = 30.0, 15.0
    body = asyncio.run(main_async(args))
    if args.quick:
        print(body)
        return
    cmd = "python -m bench.live_check " + " ".join(argv if argv is not None else sys.argv[1:])
    write_report(RESULTS_MD, "Live check: gateway vs simulator", cmd.strip(), body)
    print(RESULTS_MD.read_text())


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
