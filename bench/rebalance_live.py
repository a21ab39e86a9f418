"""One live point of rebalancing: the gateway (in this process) in front of simulated vLLM workers (`fleetgate sim`,
a child process), real time. Appends its table to bench/results/rebalance.md.

    .venv/bin/python -m bench.rebalance_live            # ~4 minutes

Four workers (Llama-3-8B/H100 profile, 4 sequences at a time, time scale 4) take Poisson arrivals of streamed chats
whose output lengths come from the ShareGPT trace (capped at 400 tokens). A quarter into the run one worker is
slowed 5x (POST /sim/faults {"slowdown": 5}) until the end. The same arrivals run with rebalancing off and on, for
two policies: aladdin (its defaults) and least_tokens (the gateway's default). Reported: SLO attainment (TTFT
1 s, TPOT 100 ms, as the gateway judges them), the TTFT p99 seen by the client, and the moves.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from bench.harness import free_port, running_process
from bench.report import git_commit
from gateway.config import load_config
from gateway.server import GatewayServer
from simulator.workload import trace_rows

ROOT = Path(__file__).parents[1]
OUT = ROOT / "bench" / "results" / "rebalance.md"
PROFILE, MODEL = "llama3-8b-h100", "meta-llama/Llama-3.1-8B-Instruct"
WORKERS, TIME_SCALE, MAX_SEQS = 4, 4.0, 4
TTFT_S, TPOT_S = 1.0, 0.1
SLOWDOWN = 5.0


def arrivals(rate: float, duration: float, seed: int) -> list[tuple[float, int]]:
    """(send time, output tokens) of Poisson arrivals with ShareGPT output lengths, capped at 400."""
    rng = random.Random(seed)
    rows = trace_rows("sharegpt")
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append((t, max(1, min(400, rows[rng.randrange(len(rows))][1]))))


async def one(http: httpx.AsyncClient, url: str, tokens: int) -> float | None:
    """The client's time to first token of one streamed chat (None: it failed)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 20}], "max_tokens": tokens,
            "stream": True}
    t0 = time.perf_counter()
    first = None
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body,
                               headers={"x-sim-output-tokens": str(tokens)}) as r:
            async for line in r.aiter_lines():
                if first is None and line.startswith("data: {") and orjson.loads(line[6:])["choices"] and \
                        orjson.loads(line[6:])["choices"][0].get("delta", {}).get("content"):
                    first = time.perf_counter() - t0
    except httpx.HTTPError:
        return None
    return first


async def arm(urls: list[str], policy: str, rebalance: bool, load: list[tuple[float, int]], slow_at: float
              ) -> dict[str, Any]:
    workers = [{"id": f"w{i}", "url": u, "profile": PROFILE} for i, u in enumerate(urls)]
    cfg = load_config(None, listen={"host": "127.0.0.1", "port": 0}, workers=workers, scrape_interval_s=0.25,
                      learning={"time_scale": TIME_SCALE},
                      models={MODEL: {"policy": policy, "slo": {"ttft_ms": TTFT_S * 1000, "tpot_ms": TPOT_S * 1000}}},
                      rebalance={"enabled": rebalance})
    async with GatewayServer(cfg) as gw, httpx.AsyncClient(timeout=300) as http:
        t0 = time.perf_counter()

        async def later(at: float, tokens: int) -> float | None:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            return await one(http, gw.url, tokens)

        async def slow() -> None:
            await asyncio.sleep(slow_at)
            await http.post(urls[0] + "/sim/faults", json={"slowdown": SLOWDOWN})

        results = await asyncio.gather(slow(), *(later(at, n) for at, n in load))
        ttfts = sorted(x for x in results[1:] if x is not None)
        text = (await http.get(gw.url + "/metrics")).text
        await http.delete(urls[0] + "/sim/faults")
    return {"policy": policy, "rebalance": rebalance, "requests": len(load), "failed": len(load) - len(ttfts),
            "attainment": _metric_ratio(text), "ttft_p50": ttfts[len(ttfts) // 2],
            "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "moves": _metric(text, "fleetgate_rebalance_moves_total"),
            "moves_met": _metric(text, "fleetgate_rebalance_moves_met_slo_total"),
            "wall_s": time.perf_counter() - t0}


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _metric_ratio(text: str) -> float:
    met = missed = 0.0
    for line in text.splitlines():
        if line.startswith("fleetgate_slo_requests_total{"):
            v = float(line.rsplit(" ", 1)[1])
            if 'result="met"' in line:
                met += v
            else:
                missed += v
    return met / (met + missed) if met + missed else 0.0


def fleet_yaml(ports: list[int]) -> str:
    return yaml.safe_dump({"defaults": {"profile": PROFILE, "model": MODEL, "time_scale": TIME_SCALE},
                           "servers": [{"port": p, "profile_overrides": {"max_num_seqs": MAX_SEQS}} for p in ports]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=16.0)
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", nargs="+", default=["aladdin", "least_tokens"])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    load = arrivals(args.rate, args.duration, args.seed)
    rows = []
    for policy in args.policies:
        for rebalance in (False, True):
            ports = [free_port() for _ in range(WORKERS)]
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "fleet.yaml"
                path.write_text(fleet_yaml(ports))
                cmd = [sys.executable, "-m", "gateway.cli", "sim", "--fleet", str(path), "--host", "127.0.0.1"]
                urls = [f"http://127.0.0.1:{p}" for p in ports]
                with running_process(cmd, "sim", urls[-1] + "/health"):
                    r = asyncio.run(arm(urls, policy, rebalance, load, args.duration / 4))
            print(r, flush=True)
            rows.append(r)
    load_avg = os.getloadavg()
    lines = ["", "## One live point (real time)", "",
             f"- command: `python -m bench.rebalance_live --rate {args.rate:g} --duration {args.duration:g} "
             f"--seed {args.seed}`",
             f"- commit: `{git_commit()}`",
             f"- machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; load "
             f"average at the end {load_avg[0]:.1f} / {load_avg[1]:.1f} / {load_avg[2]:.1f} (a shared machine: "
             "the gateway, the client and four simulated workers compete with other jobs)",
             f"- {WORKERS} simulated {PROFILE} workers (max_num_seqs {MAX_SEQS}, time scale {TIME_SCALE:g}), "
             f"{len(load)} streamed chats, Poisson {args.rate:g}/s for {args.duration:g} s, ShareGPT output lengths "
             f"capped at 400; w0 slowed {SLOWDOWN:g}x from {args.duration / 4:g} s; SLO TTFT {TTFT_S:g} s, TPOT "
             f"{TPOT_S * 1000:g} ms", "",
             "| policy | rebalance | attainment | client TTFT p50 / p99 (s) | failed | moves | moves that met the SLO |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {'on' if r['rebalance'] else 'off'} | {r['attainment']:.3f} | "
                     f"{r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | {r['failed']} | {r['moves']:.0f} | "
                     f"{r['moves_met']:.0f} |")
    with open(args.out, "a") as f:
        f.write("\n".join(lines) + "\n")
    print(f"appended to {args.out}")


if __name__ == "__main__":
    main()
