"""How many concurrent streams and relayed tokens/s one simulated vLLM server sustains on one core.

The server (`fleetgate sim`, one worker) runs pinned to core 1 (`taskset -c 1`); this process, an aiohttp
closed-loop load generator, pins itself to core 0. Every request streams `--max-tokens` tokens
(`ignore_eos`) of a short prompt. At each concurrency level the clients measure each request's TPOT
(wall x time_scale = model seconds) and compare it with the TPOT the engine model itself produced (the
server's `vllm:request_time_per_output_token_seconds`, model time, over the same requests): a level is
sustained while the clients' median TPOT stays within 10% of the model's, the server's clock never had
to skip model time and the load generator itself is not CPU-bound, i.e. while the simulator keeps up with
its own clock.

    .venv/bin/python -m bench.sim_capacity                    # writes bench/results/sim_capacity.md
    .venv/bin/python -m bench.sim_capacity --time-scales 50 --levels 8,32,128 --seconds 3 --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import process_cpu_seconds
from bench.report import git_commit, machine_info
from simulator.fleet import FleetProcess

RESULTS = Path(__file__).parent / "results" / "sim_capacity.md"
TOLERANCE = 0.10


@dataclass(slots=True)
class Level:
    concurrency: int
    requests: int
    tokens_per_s: float       # tokens relayed to clients per wall second
    client_tpot_ms: float     # median per-request TPOT the clients saw, model ms
    client_tpot_mean_ms: float
    model_tpot_ms: float      # mean per-request TPOT of the engine model, model ms
    p99_client_tpot_ms: float
    server_cpu: float         # fraction of one core
    client_cpu: float
    lost_model_s: float       # model time the server skipped because the host fell behind (lag resyncs)

    @property
    def server_us_per_token(self) -> float:
        """Server CPU per relayed token: what the simulator costs, whatever else the machine runs."""
        return 1e6 * self.server_cpu / self.tokens_per_s if self.tokens_per_s else float("nan")

    @property
    def ratio(self) -> float:
        return self.client_tpot_ms / self.model_tpot_ms if self.model_tpot_ms else float("inf")

    @property
    def client_bound(self) -> bool:
        """The load generator saturated its core: it reads bursts late, and its TPOT means nothing."""
        return self.client_cpu >= 0.95

    @property
    def sustained(self) -> bool:
        # Too fast is as wrong as too slow: tokens arriving in bursts (a late reader) shrink the TPOT.
        return abs(self.ratio - 1) <= TOLERANCE and self.lost_model_s == 0 and not self.client_bound


def _server_tpot(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
              if s.name.startswith("vllm:request_time_per_output_token_seconds_")}
    return (values["vllm:request_time_per_output_token_seconds_sum"],
            values["vllm:request_time_per_output_token_seconds_count"])


def _lost_model_s(url: str) -> float:
    return httpx.get(url + "/sim/state", timeout=30).json()["lost_model_s"]


def _self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def run_level(url: str, pid: int, concurrency: int, seconds: float, time_scale: float,
                    max_tokens: int) -> Level:
    body = orjson.dumps({"prompt": "Tell me a story about a simulated GPU.", "max_tokens": max_tokens,
                         "ignore_eos": True, "stream": True})
    headers = {"content-type": "application/json"}
    tpots: list[float] = []
    tokens = 0
    measuring = False
    stop_at = float("inf")
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as s:

        async def worker() -> None:
            nonlocal tokens
            while time.perf_counter() < stop_at:
                counted = measuring
                first = last = 0.0
                n = 0
                async with s.post("/v1/completions", data=body, headers=headers) as r:
                    async for line in r.content:
                        if line.startswith(b'data: {"id"') and b'"choices":[{' in line:
                            last = time.perf_counter()
                            if n == 0:
                                first = last
                            n += 1
                            if measuring:
                                tokens += 1
                if counted and measuring and n == max_tokens:  # started and finished inside the window
                    tpots.append((last - first) / (n - 1) * time_scale)

        workers = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        await asyncio.sleep(min(2.0, seconds / 2))  # warm up: fill the batch
        m_sum0, m_cnt0 = _server_tpot(url)
        lost0 = _lost_model_s(url)
        cpu_s0, cpu_c0, t0 = process_cpu_seconds(pid), _self_cpu(), time.perf_counter()
        measuring = True
        await asyncio.sleep(seconds)
        measuring = False
        wall = time.perf_counter() - t0
        cpu_s1, cpu_c1 = process_cpu_seconds(pid), _self_cpu()
        lost = _lost_model_s(url) - lost0
        stop_at = 0.0
        await asyncio.gather(*workers)
        m_sum1, m_cnt1 = _server_tpot(url)
    tpots.sort()
    model = (m_sum1 - m_sum0) / (m_cnt1 - m_cnt0) if m_cnt1 > m_cnt0 else float("nan")
    return Level(
        concurrency=concurrency, requests=len(tpots), tokens_per_s=tokens / wall,
        client_tpot_ms=1000 * tpots[len(tpots) // 2] if tpots else float("nan"),
        client_tpot_mean_ms=1000 * sum(tpots) / len(tpots) if tpots else float("nan"), model_tpot_ms=1000 * model,
        p99_client_tpot_ms=1000 * tpots[min(len(tpots) - 1, int(0.99 * len(tpots)))] if tpots else float("nan"),
        server_cpu=(cpu_s1 - cpu_s0) / wall, client_cpu=(cpu_c1 - cpu_c0) / wall, lost_model_s=lost)


def _table(levels: list[Level]) -> str:
    head = ("| streams | requests | tokens/s | model TPOT ms | client TPOT ms (median) | ratio | client TPOT ms "
            "(mean) | client p99 TPOT ms | server CPU | server CPU µs/token | client CPU | lost model s | sustained |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "\n".join(
        f"| {lv.concurrency} | {lv.requests} | {lv.tokens_per_s:,.0f} | {lv.model_tpot_ms:.2f} | "
        f"{lv.client_tpot_ms:.2f} | {lv.ratio:.3f} | {lv.client_tpot_mean_ms:.2f} | {lv.p99_client_tpot_ms:.2f} | "
        f"{100 * lv.server_cpu:.0f}% | {lv.server_us_per_token:.1f} | {100 * lv.client_cpu:.0f}% | "
        f"{lv.lost_model_s:.2f} | {_status(lv)} |" for lv in levels)


def _status(lv: Level) -> str:
    if lv.sustained:
        return "yes"
    return "no (client CPU-bound)" if lv.client_bound else "no"


def _verdict(levels: list[Level], time_scale: float) -> str:
    best = max((lv for lv in levels if lv.sustained), key=lambda lv: lv.concurrency, default=None)
    if best is None:
        return f"time_scale {time_scale:g}: no level kept the clients' TPOT within {TOLERANCE:.0%} of the model's."
    limit = next((lv for lv in levels if lv.concurrency > best.concurrency), None)
    why = ""
    if limit is not None:
        why = (f" Next level ({limit.concurrency} streams): "
               + ("the load generator saturated its core first." if limit.client_bound else "not sustained."))
    return (f"time_scale {time_scale:g}: **{best.concurrency} concurrent streams, {best.tokens_per_s:,.0f} tokens/s "
            f"relayed** (median client TPOT within {TOLERANCE:.0%} of the model's, no model time lost), using "
            f"{100 * best.server_cpu:.0f}% of the server's core, {best.server_us_per_token:.1f} µs per token.{why}")


def report(sweeps: dict[float, list[Level]], args: argparse.Namespace, command: str) -> str:
    sections = "\n\n".join(f"## time_scale {ts:g}\n\n{_table(levels)}\n\n{_verdict(levels, ts)}"
                             for ts, levels in sweeps.items())
    verdicts = "\n".join(f"- {_verdict(levels, ts)}" for ts, levels in sweeps.items())
    return f"""# Simulated vLLM server capacity (one core)

Command: `{command}`
Commit: {git_commit()}
Machine: {machine_info()}
Date: {time.strftime("%Y-%m-%d %H:%M:%S %Z")}

One `fleetgate sim` worker (profile {args.profile}) pinned to core {args.server_core} with `taskset`; the
aiohttp load generator pinned to core {args.client_core}. Each client loops over streaming completions of
{args.max_tokens} tokens (`ignore_eos`), measured for {args.seconds:g} s per level after a warm-up; one
fresh server per time_scale. At time_scale K one stream asks for K / TPOT tokens per wall second, so a
high K measures token throughput and a low K the number of concurrent streams.

"model TPOT" is the engine model's own per-request TPOT (server /metrics, model time); "client TPOT" is
what the clients saw (wall x time_scale); the ratio uses the median, which sporadic scheduling delays of
other jobs on the machine do not move. "lost model s": model time the server's clock skipped because the
host fell more than 0.25 s behind it (then the model TPOT itself is inflated). Sustained = median client
TPOT within ±{TOLERANCE:.0%} of the model TPOT, no model time lost, and the load generator not CPU-bound
(>= 95% of its core: it then reads tokens late, in bursts). CPU columns are fractions of one core.
The machine (2 vCPUs) is shared with other jobs, so the numbers carry noise; CPU µs/token is the most
stable figure.

Summary:

{verdicts}

{sections}
"""


async def sweep(args: argparse.Namespace, time_scale: float) -> list[Level]:
    wrapper = ["taskset", "-c", str(args.server_core)] if args.pin else []
    levels: list[Level] = []
    with FleetProcess(1, profile=args.profile, time_scale=time_scale, wrapper=wrapper) as fleet:
        url = fleet.urls[0]
        pid = fleet.proc.pid
        for c in args.levels:
            lv = await run_level(url, pid, c, args.seconds, time_scale, args.max_tokens)
            levels.append(lv)
            print(f"time_scale={time_scale:g} streams={c:4d} tokens/s={lv.tokens_per_s:9,.0f} "
                  f"model_tpot={lv.model_tpot_ms:6.2f}ms client_tpot={lv.client_tpot_ms:6.2f}ms "
                  f"ratio={lv.ratio:.3f} server_cpu={lv.server_cpu:.0%} ({lv.server_us_per_token:.1f} us/token) "
                  f"client_cpu={lv.client_cpu:.0%} lost={lv.lost_model_s:.2f}s "
                  f"{_status(lv)}", flush=True)
            if lv.client_bound or (not lv.sustained and len(levels) >= 2 and not levels[-2].sustained):
                break  # past this point the load generator or the server is the limit
    return levels


async def main_async(args: argparse.Namespace) -> dict[float, list[Level]]:
    if args.pin:
        os.sched_setaffinity(0, {args.client_core})
    return {ts: await sweep(args, ts) for ts in args.time_scales}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time-scales", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 20.0])
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=4.0, help="measurement window per level (wall)")
    ap.add_argument("--levels", type=_ints, default=[1, 8, 16, 32, 64, 128, 256, 512])
    ap.add_argument("--server-core", type=int, default=1)
    ap.add_argument("--client-core", type=int, default=0)
    ap.add_argument("--no-pin", dest="pin", action="store_false")
    ap.add_argument("--no-write", dest="write", action="store_false")
    args = ap.parse_args()
    sweeps = asyncio.run(main_async(args))
    if args.write:
        command = " ".join([".venv/bin/python -m bench.sim_capacity", *sys.argv[1:]])
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(report(sweeps, args, command))
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
