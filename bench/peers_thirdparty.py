"""A third-party load generator as the client: guidellm drives vllm-router and fleetgate in front of the same
simulated fleet, for one prefix-sharing scheduling scenario, with bench/peers_sched.py's own client beside it.

    python -m bench.peers_thirdparty [--rate 6] [--requests 240] [--workers 4] [--time-scale 1]

guidellm (PyPI, pinned in bench/loadgen_env.py, its own cached venv) sends `--requests` streamed completions at
a Poisson `--rate` (requests per wall second): synthetic text of `prompt` tokens after one of `prefix_count`
shared prefixes of `prefix_tokens` tokens, `output` tokens each, the text made with the tiny model's tokenizer
that scripts/make_tiny_model.py builds locally (nothing is downloaded). Each arm gets a fresh fleet (N x
llama3-8b-h100 at time scale K, KV events on: bench/peers_sched.py arm_on_fleet); guidellm runs on the router's
core. Reported from guidellm's own JSON: completed and errored requests, requests/s, TTFT and inter-token
latency p50/p99 (wall ms x K = model ms), and the fleet's prefix-cache hit rate from the workers' /metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import REPO, log, pinned
from bench.loadgen_env import LOADGEN_PACKAGE, LOADGEN_VERSION, ensure_loadgen_env
from bench.peers import Arm
from bench.peers_sched import MODEL, PROFILE, ROUTER_CORE, arm_on_fleet, prefix_counters
from bench.report import write_report

ARMS: tuple[Arm, ...] = (
    Arm("vllm-router cache_aware", "vllm-router", "cache_aware"),
    Arm("fleetgate precise_prefix", "fleetgate", "precise_prefix"),
    Arm("fleetgate aladdin + KV events", "fleetgate", "aladdin"),
)


@dataclass(frozen=True)
class Scenario:
    rate: float            # requests per wall second (Poisson)
    requests: int
    prompt: int            # tokens after the shared prefix (guidellm's tokenizer)
    prefix_tokens: int
    prefix_count: int
    output: int


def guidellm_command(venv: Path, url: str, tokenizer: Path, sc: Scenario, out: Path) -> list[str]:
    data = (f"kind=synthetic_text,prompt_tokens={sc.prompt},output_tokens={sc.output},"
            f"prefix_count={sc.prefix_count},prefix_tokens={sc.prefix_tokens}")
    return [str(venv / "bin" / LOADGEN_PACKAGE), "run",
            "--backend", f"kind=openai_http,target={url},model={MODEL},request_format=/v1/completions",
            "--profile", f"kind=poisson,rate={sc.rate:g}",
            "--constraint", f"kind=max_requests,count={sc.requests}",
            "--data", data,
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--seed", "kind=static,value=42",
            "--output", f"kind=json,path={out}",
            "--disable-console-interactive"]


def tiny_tokenizer() -> Path:
    """The tiny model's directory (its tokenizer.json), built locally by scripts/make_tiny_model.py."""
    from scripts.vllm_servers import ensure_model

    return ensure_model()


def run_guidellm(cmd: list[str], timeout_s: float) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(pinned(cmd, ROUTER_CORE), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"guidellm failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def metric(report: dict[str, Any], name: str, stat: str) -> float:
    """One statistic of guidellm's metric `name` over the successful requests ("median", "mean" or a
    percentile such as "p99"), NaN when missing."""
    m = (report.get("benchmarks") or [{}])[0].get("metrics", {}).get(name, {}).get("successful") or {}
    v = m.get("percentiles", {}).get(stat) if stat.startswith("p") else m.get(stat)
    return float("nan") if v is None else float(v)


def row(arm: str, report: dict[str, Any], k: float, hit_rate: float) -> str:
    b = (report.get("benchmarks") or [{}])[0]
    totals = b.get("metrics", {}).get("request_totals", {})
    dur = float(b.get("duration") or 0.0)
    ok = int(totals.get("successful", 0))
    ttft = [metric(report, "time_to_first_token_ms", s) * k for s in ("median", "p99")]
    itl = [metric(report, "inter_token_latency_ms", s) * k for s in ("median", "p99")]
    return (f"| {arm} | {ok} | {totals.get('errored', 0)} | {ok / dur * k if dur else 0:.2f} | {ttft[0]:.0f} "
            f"| {ttft[1]:.0f} | {itl[0]:.1f} | {itl[1]:.1f} | {hit_rate:.1%} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=6.0, help="requests per wall second (Poisson)")
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--prefix-count", type=int, default=8)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--arms", nargs="*", help="only these arms (names as in the report)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "peers_thirdparty.md"))
    args = ap.parse_args()
    sc = Scenario(args.rate, args.requests, args.prompt, args.prefix_tokens, args.prefix_count, args.output)
    venv, tok = ensure_loadgen_env(), tiny_tokenizer()
    arms = [a for a in ARMS if not args.arms or a.name in args.arms]
    rows = ["| router, policy | completed | errored | requests/s (model) | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
            "| ITL p99 ms | prefix-cache hit rate |", "|---|---|---|---|---|---|---|---|---|"]
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="fleetgate-guidellm-") as tmp:
        for arm in arms:
            log(f"{arm.name}: guidellm, {sc.requests} requests at {sc.rate:g}/s (load {os.getloadavg()[0]:.2f})")
            out = Path(tmp) / f"{len(rows)}.json"
            with arm_on_fleet(arm, args.workers, args.time_scale) as (url, worker_urls):
                h0, q0 = prefix_counters(worker_urls)
                run_guidellm(guidellm_command(venv, url, tok, sc, out), timeout_s=900)
                h1, q1 = prefix_counters(worker_urls)
            rows.append(row(arm.name, json.loads(out.read_text()), args.time_scale,
                            (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0))
            log(rows[-1])
            loads.append(os.getloadavg()[0])
    body = "\n".join([
        f"Client: {LOADGEN_PACKAGE} {LOADGEN_VERSION} (`guidellm run`, Poisson at {sc.rate:g} requests per wall "
        f"second, {sc.requests} requests, synthetic text: one of {sc.prefix_count} shared prefixes of "
        f"{sc.prefix_tokens} tokens + {sc.prompt} tokens, {sc.output} output tokens, streamed /v1/completions; "
        f"tokenizer: the tiny model's, built locally). Fleet: {args.workers} x {PROFILE} simulated at time scale "
        f"{args.time_scale:g}, KV events on, fresh per arm; guidellm on the router's core. Machine load (1-minute "
        f"average) {min(loads):.2f}-{max(loads):.2f} on {os.cpu_count()} cores. Latencies and rates in model time "
        "(wall x K), as guidellm measured them.", "", *rows])
    cmd = (f"python -m bench.peers_thirdparty --rate {sc.rate:g} --requests {sc.requests} --workers {args.workers} "
           f"--time-scale {args.time_scale:g} --prompt {sc.prompt} --prefix-tokens {sc.prefix_tokens} "
           f"--prefix-count {sc.prefix_count} --output {sc.output}"
           + (f" --arms {' '.join(repr(a) for a in args.arms)}" if args.arms else ""))
    write_report(Path(args.out), "The peers through a third-party load generator (guidellm)", cmd, body)
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
