"""Scheduling quality next to the peer routers: the same simulated fleet, the same trace, one router at a time.

    python -m bench.peers_sched [--quick] [--workers 8] [--start 3000] [--requests 400] [--time-scale 1]

Each arm gets a fresh `fleetgate sim` fleet (N x `llama3-8b-h100`, time scale K, KV-cache events on in vLLM
0.33's format so `precise_prefix` can subscribe) pinned to core 1, the router on core 0 with this process, and
R requests of the shipped Mooncake trace (simulator/traces/mooncake_synthetic.jsonl, bench/prefix.py's
mooncake_workload) from request S on, replayed in real time at arrival / K as streamed /v1/completions. The trace
reuses prefixes mostly across long distances: a 400-request window (~100 s) from its start could reuse 6% of its
prompt tokens at best, the window from request 3000 41% (the whole trace 65%), so that window is the default. Each prompt is text of
exactly the trace's token count built from its chained 16-token block keys (simulator.tokenizer.synthetic_text
per block key), so requests that share hash-id prefixes share text and token prefixes: what a router's
approximate (text) tree and the engines' prefix caches both see. max_tokens = the trace's output length with
ignore_eos, so every router's requests generate the same tokens.

SLO per request (bench/prefix.py): TTFT <= 0.5 s + 2 x the prompt's uncached prefill time on an idle worker,
TPOT <= 100 ms, in model seconds (wall x K), measured by this client from the stream. The targets are also sent
as x-slo-ttft-ms / x-slo-tpot-ms (wall ms), which fleetgate's policies read and the peers ignore. Goodput =
requests that met their SLO per model second (first arrival to last completion). Prefix-cache hit rate = the
fleet's vllm:prefix_cache_hits / queries over the run.

Arms: vllm-router round_robin, power_of_two, cache_aware; sglang-router cache_aware; fleetgate least_requests,
least_tokens (the default), precise_prefix (from the workers' KV events) and aladdin (worker profiles as priors). One load point, --repeats
runs per arm interleaved (A B C, C B A, ...), with each arm's spread (flagged above 5 points); with
--sweep-workers, every probe next to an arm's answer runs --repeats times, interleaved across arms the same way.
Every failed request is labelled (failure_kind): a 429 with Retry-After (the gateway's admission under overload)
apart from other HTTP statuses with their error code, timeouts, connection errors and cut streams. Every run first
checks that nothing of the previous one is left (bench/run_hygiene.py: no child process, its ports free; else it
raises), records the machine's load before and after and each worker's peak queue, and keeps the fleet's log.
Results: bench/results/peers_sched.md; `--virtual-sweep` adds every policy by name in virtual time
(bench/peers_sched_virtual.py).

`--trace chat [--chat-rate C]` replays multi-turn chats instead (bench/prefix.py's conversation_workload: C new
conversations a second, 1-8 turns each, one of 8 shared 2,048-token system prompts; ShareGPT message and answer
lengths; turn k+1's prompt is turn k's prompt + its answer + a new message, so a turn can reuse every full block
of the one before). Requests --start.. of it by arrival, built into text the same way. Its answers average ~430
tokens, so replay it slowed down (--time-scale 0.2 at the default rate): at time scale 1 the fleet would stream
~14k tokens/s through the router and the client, which share one core.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import aiohttp
import orjson
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import REPO, free_port, log
from bench.loadgen import quantile
from bench.peers import Arm, started
from bench.peers_sweep import (
    TARGET,
    Probe,
    SweepResult,
    plot,
    rate_table,
    scaled,
    sweep_rate,
    sweep_workers,
    workers_table,
    workers_verdict,
)
from bench.prefix import SLO_TPOT_S, best_hit_rate, conversation_workload, mooncake_workload, with_slos
from bench.report import write_report, write_section
from bench.run_hygiene import assert_clean
from simulator.fleet import FleetProcess
from simulator.profiles import load_profile
from simulator.tokenizer import BLOCK_SIZE, synthetic_text
from simulator.workload import WorkloadRequest

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROFILE = "llama3-8b-h100"
FLEET_CORE, ROUTER_CORE = "1", "0"
ALADDIN_KV = "fleetgate aladdin + KV events"
# --trace chat: new conversations per second (mean 4 turns each: ~32 requests/s once under way). Chosen, before any
# arm ran live, as the load at which llama3-8b-h100 fleets need 4-6 workers for 99% in virtual time; at 1 a second
# two workers hold 99% with any policy, so a sweep would compare nothing.
CHAT_RATE = 12.0
CHAT_SEED = 1     # bench/prefix.py's conversations use seed 1 too (its weights were picked on seed 0)
ARMS: tuple[Arm, ...] = (
    Arm("vllm-router round_robin", "vllm-router", "round_robin"),
    Arm("vllm-router power_of_two", "vllm-router", "power_of_two"),
    Arm("vllm-router cache_aware", "vllm-router", "cache_aware"),
    Arm("sglang-router cache_aware", "sglang-router", "cache_aware"),
    Arm("fleetgate least_requests", "fleetgate", "least_requests"),
    Arm("fleetgate least_tokens", "fleetgate", "least_tokens"),
    Arm("fleetgate precise_prefix", "fleetgate", "precise_prefix"),
    Arm("fleetgate aladdin", "fleetgate", "aladdin"),
    Arm(ALADDIN_KV, "fleetgate", "aladdin"),
)
# fleetgate arms' policy parameters beyond the defaults: aladdin prices each worker's cached prefix from the
# workers' KV events (policies/aladdin/ price_cache; the gateway fills the view for policies that ask).
POLICY_PARAMS: dict[str, dict[str, object]] = {ALADDIN_KV: {"price_cache": True}}


REJECTED = "429 + Retry-After"   # the gateway refused the request under overload: admission, not a failure


@dataclass
class Outcome:
    ttft_s: float | None = None   # model seconds
    tpot_s: float | None = None
    ok: bool = False
    status: int = 0
    error: str = ""               # why a request did not complete: failure_kind's label ("" when ok)
    message: str = ""             # an error answer's message (a 429 names the predicted time that misses)


def failure_kind(status: int, code: str = "", retry_after: bool = False, exc: BaseException | None = None,
                 done: bool = True) -> str:
    """A failed request's label: REJECTED for a 429 with Retry-After; "HTTP <status> <error code>" for any other
    error status; "timeout", "connection: <kind>" when no answer came; "stream cut" for a 200 whose stream
    ended without [DONE]."""
    if exc is not None:
        if isinstance(exc, TimeoutError | asyncio.TimeoutError):
            return "timeout"
        return f"connection: {type(exc).__name__}"
    if status == 429 and retry_after:
        return REJECTED
    if status != 200:
        return f"HTTP {status}" + (f" {code}" if code else "")
    return "" if done else "stream cut"


def error_code(body: bytes) -> str:
    """The OpenAI-style error's code (else its type) from an error response's body, "" if it has none."""
    err = _error(body)
    return str(err.get("code") or err.get("type") or "")


def error_message(body: bytes) -> str:
    """The OpenAI-style error's message from an error response's body, "" if it has none."""
    return str(_error(body).get("message") or "")


def _error(body: bytes) -> dict:
    try:
        err = orjson.loads(body).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return {}
    return err if isinstance(err, dict) else {}


def refusal_reason(message: str) -> str:
    """What a 429 of the admission rule says will miss (policies/shedding.py `Shed.message`: "its predicted
    <metric>, ..."), "other" for any other message."""
    head, sep, _ = message.partition("its predicted ")
    return message[len(head) + len(sep):].split(",", 1)[0] if sep else "other"


@dataclass
class ArmRun:
    arm: str
    outcomes: list[Outcome] = field(default_factory=list)
    span_s: float = 0.0           # model seconds, first arrival to last completion
    hits: float = 0.0
    queries: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)   # the machine's 1-minute load average before and after the run
    peak_queue: list[int] = field(default_factory=list)   # per worker: most requests running + waiting at once
    logs: str = ""                # where the run's fleet log was kept ("" when the fleet logged nothing)

    def failures(self) -> dict[str, int]:
        """Failed requests by kind (failure_kind's labels), most frequent first."""
        return dict(Counter(o.error or "no answer" for o in self.outcomes if not o.ok).most_common())

    def refusals(self) -> dict[str, int]:
        """429s with Retry-After by what their message says will miss (`refusal_reason`)."""
        return dict(Counter(refusal_reason(o.message) for o in self.outcomes if o.error == REJECTED))

    def attainment(self, reqs: list[WorkloadRequest]) -> float:
        return self.met(reqs) / len(reqs) if reqs else 0.0

    def met(self, reqs: list[WorkloadRequest]) -> int:
        return sum(1 for o, r in zip(self.outcomes, reqs, strict=True) if meets(o, r))


def miss_causes(run: ArmRun, reqs: list[WorkloadRequest]) -> str:
    """Which requests missed their SLO: failed, TTFT over (with those prompts' mean length), TPOT over only."""
    ttft, tpot = [], 0
    for o, r in zip(run.outcomes, reqs, strict=True):
        if meets(o, r) or not o.ok or o.ttft_s is None:
            continue
        if o.ttft_s > (r.slo_ttft_s or 0):
            ttft.append(r.prompt_tokens)
        else:
            tpot += 1
    fails = run.failures()
    rejected = fails.pop(REJECTED, 0)
    parts = ([f"{rejected} rejected ({REJECTED})"] if rejected else []) + (
        [f"{sum(fails.values())} failed ({', '.join(f'{n} {kind}' for kind, n in fails.items())})"] if fails else [])
    parts += ([f"{len(ttft)} TTFT (mean prompt "
                                                         f"{statistics.fmean(ttft) / 1000:.0f}k)"] if ttft else [])
    return ", ".join(parts + ([f"{tpot} TPOT"] if tpot else []))


def meets(o: Outcome, r: WorkloadRequest) -> bool:
    if not o.ok or o.ttft_s is None or o.ttft_s > (r.slo_ttft_s or 0):
        return False
    return o.tpot_s is None or o.tpot_s <= (r.slo_tpot_s or SLO_TPOT_S)


def prompt_text(r: WorkloadRequest, cache: dict[int, str]) -> str:
    """Exactly r.prompt_tokens tokens: one synthetic 16-token piece per block key, then a tail unique to r."""
    parts = []
    for key in r.prefix_blocks[: r.prompt_tokens // BLOCK_SIZE]:
        if key not in cache:
            cache[key] = synthetic_text(BLOCK_SIZE, key)
        parts.append(cache[key])
    rest = r.prompt_tokens - len(parts) * BLOCK_SIZE
    tail = synthetic_text(rest, r.request_id) if rest > 0 else ""
    tag = f"#{r.request_id}#"
    if rest > 0 and len(tail) > len(tag):
        tail = tag + tail[len(tag):]
    return "".join(parts) + tail


async def replay(url: str, reqs: list[WorkloadRequest], texts: list[str], k: float) -> tuple[list[Outcome], float]:
    """Send every request at arrival / k; each one's outcome and the span in model seconds."""
    outcomes = [Outcome() for _ in reqs]
    last_done = 0.0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        t0 = time.perf_counter() + 0.5

        async def one(i: int) -> None:
            nonlocal last_done
            r = reqs[i]
            delay = t0 + r.arrival / k - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = orjson.dumps({"model": MODEL, "prompt": texts[i], "max_tokens": r.output_tokens,
                                 "ignore_eos": True, "stream": True})
            headers = {"content-type": "application/json", "x-slo-ttft-ms": f"{(r.slo_ttft_s or 0) * 1000 / k:.3f}",
                       "x-slo-tpot-ms": f"{(r.slo_tpot_s or SLO_TPOT_S) * 1000 / k:.3f}"}
            sent = time.perf_counter()
            first = end = None
            o = outcomes[i]
            try:
                async with s.post(url + "/v1/completions", data=body, headers=headers) as resp:
                    o.status = resp.status
                    if resp.status != 200:
                        raw = await resp.read()
                        o.error = failure_kind(resp.status, error_code(raw), "Retry-After" in resp.headers)
                        o.message = error_message(raw)
                        return
                    async for line in resp.content:
                        if line.startswith(b"data: {") and first is None:
                            first = time.perf_counter()
                        elif line.startswith(b"data: [DONE]"):
                            end = time.perf_counter()
            except (TimeoutError, aiohttp.ClientError) as exc:
                o.error = failure_kind(o.status, exc=exc)
                return
            if end is None:
                o.error = failure_kind(200, done=False)
            if outcomes[i].status == 200 and first is not None and end is not None:
                outcomes[i].ok = True
                outcomes[i].ttft_s = (first - sent) * k
                if r.output_tokens > 1:
                    outcomes[i].tpot_s = (end - first) * k / (r.output_tokens - 1)
                last_done = max(last_done, end)

        await asyncio.gather(*(one(i) for i in range(len(reqs))))
    return outcomes, max(0.0, last_done - (t0 + reqs[0].arrival / k)) * k


def prefix_counters(urls: list[str]) -> tuple[float, float]:
    """The fleet's (prefix-cache hit tokens, queried tokens) so far."""
    import urllib.request

    hits = queries = 0.0
    for u in urls:
        with urllib.request.urlopen(u + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                if smp.name == "vllm:prefix_cache_hits_total":
                    hits += smp.value
                elif smp.name == "vllm:prefix_cache_queries_total":
                    queries += smp.value
    return hits, queries


async def sample_queues(urls: list[str], stop: asyncio.Event, every_s: float = 1.0) -> list[int]:
    """Each worker's largest vllm:num_requests_running + waiting seen, polling /metrics every `every_s` until
    `stop` is set (a worker that does not answer in time keeps its last count)."""
    peak = [0] * len(urls)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
        while not stop.is_set():
            for i, u in enumerate(urls):
                try:
                    async with s.get(u + "/metrics") as resp:
                        text = await resp.text()
                except (TimeoutError, aiohttp.ClientError):
                    continue
                now = sum(smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples
                          if smp.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"))
                peak[i] = max(peak[i], int(now))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
    return peak


def free_port_run(n: int) -> int:
    """A base port whose next n-1 ports are free too (the simulated worker i publishes on base + i)."""
    import socket

    while True:
        base = free_port()
        socks = []
        try:
            for i in range(n):
                socks.append(socket.socket())
                socks[-1].bind(("0.0.0.0", base + i))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()


def fleetgate_config(urls: list[str], k: float, path: Path, policy: str = "least_requests",
                     params: dict[str, object] | None = None) -> None:
    """Workers with their profile (aladdin's priors), time-scaled learning and scraping, the KV-event view, the
    policy's parameters."""
    cfg: dict[str, object] = {
        "workers": [{"id": f"w{i}", "url": u, "profile": PROFILE} for i, u in enumerate(urls)],
        "learning": {"time_scale": k},
        "scrape_interval_s": 0.5 / k,
        "kv_events": {"enabled": True, "hash_algo": "sha256_cbor", "hash_style": "0.32", "tokenizer": "sim"},
    }
    if params:   # with the policy they belong to (the config is validated before --policy overrides it)
        cfg["default_policy"], cfg["default_policy_params"] = policy, params
    path.write_text(yaml.safe_dump(cfg))


def drain(stream: IO[str] | None, path: Path) -> None:
    """Copy a process's stderr into `path` as it comes (a pipe nobody reads blocks the writer once it fills)."""
    if stream is None:
        return

    def pump() -> None:
        with open(path, "a") as out:
            for line in stream:
                out.write(line)
                out.flush()

    threading.Thread(target=pump, daemon=True).start()


def ports_of(urls: list[str]) -> list[int]:
    return [int(u.rsplit(":", 1)[1].split("/")[0]) for u in urls]


@contextlib.contextmanager
def arm_on_fleet(arm: Arm, workers: int, k: float, used_ports: list[int] | None = None,
                 log_dir: Path | None = None) -> Iterator[tuple[str, list[str]]]:
    """`arm` started in front of a fresh fleet of `workers` x PROFILE at time scale k (KV events on, fleetgate
    configured with the workers' profiles and the KV-event view); yields (router URL, worker URLs). The ports the
    run held are appended to `used_ports` (for the next run's check) and the fleet's stderr goes to
    `log_dir`/fleet.log."""
    kv_base = free_port_run(workers)
    kv = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{kv_base}"})
    extra = ["--kv-events-config", kv, "--kv-events-format", "0.33", "--prefix-caching-hash-algo", "sha256_cbor"]
    with FleetProcess(workers, profile=PROFILE, model=MODEL, time_scale=k, wrapper=["taskset", "-c", FLEET_CORE],
                      extra_args=extra) as fleet, tempfile.TemporaryDirectory(prefix="fleetgate-peers-") as tmp:
        if log_dir is not None:
            drain(fleet.proc.stderr if fleet.proc else None, log_dir / "fleet.log")
        if used_ports is not None:
            used_ports += [*ports_of(fleet.urls), *range(kv_base, kv_base + workers)]
        if arm.kind == "fleetgate":
            cfg = Path(tmp) / "gateway.yaml"
            fleetgate_config(fleet.urls, k, cfg, arm.policy, POLICY_PARAMS.get(arm.name))
            arm = Arm(arm.name, arm.kind, arm.policy, config=str(cfg))
        with started([arm], fleet.urls, "fgpeers-sched:", cpus=ROUTER_CORE) as (running,):
            if used_ports is not None and running.url:
                used_ports += ports_of([running.url])
            time.sleep(1.0)   # KV-event subscriptions, first scrapes
            yield running.url, list(fleet.urls)


# the ports the previous live run held: the next run starts only once they are free and no child is left
_LAST_PORTS: list[int] = []


async def run_arm(arm: Arm, reqs: list[WorkloadRequest], texts: list[str], workers: int, k: float) -> ArmRun:
    """One live run: checks that nothing of the previous run is left, records the machine's load before and
    after, each worker's peak queue and the fleet's log (kept in a temp directory named in the log)."""
    assert_clean(_LAST_PORTS)
    _LAST_PORTS.clear()
    log_dir = Path(tempfile.mkdtemp(prefix="fleetgate-peers-run-"))
    load0 = os.getloadavg()[0]
    with arm_on_fleet(arm, workers, k, _LAST_PORTS, log_dir) as (url, worker_urls):
        h0, q0 = prefix_counters(worker_urls)
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_queues(worker_urls, stop))
        try:
            outcomes, span = await replay(url, reqs, texts, k)
        finally:
            stop.set()
            peak = await sampler
        h1, q1 = prefix_counters(worker_urls)
    fleet_log = log_dir / "fleet.log"
    if not fleet_log.exists() or not fleet_log.stat().st_size:   # nothing logged: keep nothing
        shutil.rmtree(log_dir, ignore_errors=True)
        log_dir = Path("")
    run = ArmRun(arm.name, outcomes, span, h1 - h0, q1 - q0, (load0, os.getloadavg()[0]), peak, str(log_dir))
    if run.failures():
        log(f"  {arm.name}: failed requests by kind {run.failures()} (429s by the predicted time that misses: "
            f"{run.refusals()}); fleet log {log_dir / 'fleet.log'}")
    return run


def failure_cells(run: ArmRun) -> tuple[str, str]:
    """(rejected under overload, other failures by kind) for a table row."""
    fails = run.failures()
    rejected = fails.pop(REJECTED, 0)
    return str(rejected), ", ".join(f"{n} {kind}" for kind, n in fails.items()) or "0"


def table(runs: list[ArmRun], reqs: list[WorkloadRequest]) -> list[str]:
    """One row per run, in the order they ran."""
    rows = ["| # | router, policy | SLO attainment | goodput (met req/s) | TTFT p50 s | TTFT p99 s | TPOT p99 ms "
            f"| prefix-cache hit rate | rejected ({REJECTED}) | failed, by kind | peak queue per worker "
            "| load before -> after |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, run in enumerate(runs, 1):
        met = run.met(reqs)
        ttft = [o.ttft_s for o in run.outcomes if o.ttft_s is not None]
        tpot = [o.tpot_s for o in run.outcomes if o.tpot_s is not None]
        rejected, failed = failure_cells(run)
        rows.append(f"| {i} | {run.arm} | {met / len(reqs):.1%} | {met / run.span_s if run.span_s else 0:.3f} "
                    f"| {quantile(ttft, 0.5):.2f} | {quantile(ttft, 0.99):.2f} | {quantile(tpot, 0.99) * 1000:.1f} "
                    f"| {run.hits / run.queries if run.queries else 0:.1%} | {rejected} | {failed} "
                    f"| {'/'.join(map(str, run.peak_queue)) or '-'} | {run.load[0]:.1f} -> {run.load[1]:.1f} |")
    return rows


SPREAD_FLAG = 0.05   # an arm whose repeated runs differ by more than this much attainment is flagged


def interleaved(arms: list[Arm], repeats: int) -> list[Arm]:
    """The arms `repeats` times, every other pass reversed (A B C, C B A, A B C ...): each arm's runs sit at
    different places in the sequence, so a drift in the machine does not fall on one arm."""
    return [a for r in range(repeats) for a in (arms if r % 2 == 0 else arms[::-1])]


def spread_rows(results: list[tuple[str, float]], label: str = "router, policy") -> list[str]:
    """Per arm (or arm at a size): every run's attainment, the spread (max - min) and a flag above SPREAD_FLAG."""
    by: dict[str, list[float]] = {}
    for name, att in results:
        by.setdefault(name, []).append(att)
    rows = [f"| {label} | runs | attainment per run | spread | flag |", "|---|---|---|---|---|"]
    for name, atts in by.items():
        spread = max(atts) - min(atts)
        rows.append(f"| {name} | {len(atts)} | {', '.join(f'{a:.1%}' for a in atts)} | {spread * 100:.1f} points "
                    f"| {f'**> {SPREAD_FLAG * 100:.0f} points**' if spread > SPREAD_FLAG else ''} |")
    return rows


def trace_window(start: int, n: int) -> list[WorkloadRequest]:
    """Requests start..start+n-1 of the Mooncake trace (those that fit the context), arrivals from 0, with SLOs."""
    return _from_zero(mooncake_workload(None)[0][start:start + n])


def chat_window(start: int, n: int, rate: float, seed: int = CHAT_SEED) -> list[WorkloadRequest]:
    """Requests start..start+n-1, by arrival, of bench/prefix.py's multi-turn chats (conversation_workload: a new
    conversation `rate` times a second, 1-8 turns, each turn's prompt = the previous prompt + its answer + a new
    message, 8 shared system prompts), arrivals from 0, with SLOs. Conversations are generated until every one
    that could have a turn in the window has started, so the window holds every turn that arrives in it."""
    horizon = 60.0
    while True:
        reqs = conversation_workload(rate, horizon, seed)
        if len(reqs) >= start + n and reqs[start + n - 1].arrival < horizon:
            return _from_zero(reqs[start:start + n])
        horizon *= 2


def _from_zero(reqs: list[WorkloadRequest]) -> list[WorkloadRequest]:
    t0 = reqs[0].arrival
    return with_slos([dataclasses.replace(r, arrival=r.arrival - t0) for r in reqs], load_profile(PROFILE))


def window(args: argparse.Namespace, start: int, n: int) -> list[WorkloadRequest]:
    """The --trace window the arms replay: Mooncake requests or multi-turn chats from request `start` on."""
    return chat_window(start, n, args.chat_rate) if args.trace == "chat" else trace_window(start, n)


def trace_args(args: argparse.Namespace) -> str:
    """The --trace options of a report's command line ('' for the Mooncake default)."""
    return f" --trace chat --chat-rate {args.chat_rate:g}" if args.trace == "chat" else ""


def trace_name(args: argparse.Namespace) -> str:
    return (f"multi-turn chat trace ({args.chat_rate:g} new conversations/s, seed {CHAT_SEED})"
            if args.trace == "chat" else "Mooncake trace")


def headline(runs: list[ArmRun], reqs: list[WorkloadRequest]) -> str:
    """fleetgate's best arm against the best peer arm, by goodput (the target: >= 1.3x at 99% SLO)."""
    def goodput(run: ArmRun) -> float:
        return run.met(reqs) / run.span_s if run.span_s else 0.0

    ours = [r for r in runs if r.arm.startswith("fleetgate")]
    peers = [r for r in runs if not r.arm.startswith("fleetgate")]
    if not ours or not peers:
        return ""
    best, rival = max(ours, key=goodput), max(peers, key=goodput)
    return (f"Best fleetgate arm by goodput: {best.arm}, {goodput(best):.3f} met req/s = "
            f"{goodput(best) / goodput(rival):.2f}x the best peer arm's ({rival.arm}, {goodput(rival):.3f}), at "
            f"attainment {best.met(reqs) / len(reqs):.1%} vs {rival.met(reqs) / len(reqs):.1%}. This is one load "
            "point, not goodput at 99% attainment (no rate sweep).")


class ProbeRunner:
    """Live runs of an arm (by name) at a fleet size and arrival-rate multiplier, as sweep Probes. Called as a
    RunPoint, a point both sweeps ask for (--workers at rate 1) runs once; `live` runs it again. Every run is
    kept in `runs` (in order) with its load and failures."""

    def __init__(self, reqs: list[WorkloadRequest], texts: list[str], k: float) -> None:
        self.reqs, self.texts, self.k = reqs, texts, k
        self.done: dict[tuple[str, int, float], Probe] = {}
        self.runs: list[tuple[Probe, ArmRun]] = []

    def __call__(self, name: str, workers: int, rate: float) -> Probe:
        if (name, workers, rate) not in self.done:
            self.done[name, workers, rate] = self.live(name, workers, rate)
        return self.done[name, workers, rate]

    def live(self, name: str, workers: int, rate: float) -> Probe:
        reqs, texts, k = self.reqs, self.texts, self.k
        by_name = {a.name: a for a in ARMS}
        window = scaled(reqs, rate)
        log(f"{name}: {workers} workers, rate x{rate:g}, {len(reqs)} requests at time scale {k:g} "
            f"(load {os.getloadavg()[0]:.2f})")
        r = asyncio.run(run_arm(by_name[name], window, texts, workers, k))
        met = r.met(window)
        p = Probe(name, workers, rate, met / len(window), met / r.span_s if r.span_s else 0.0,
                  r.hits / r.queries if r.queries else 0.0, miss_causes(r, window))
        log(f"  -> attainment {p.attainment:.1%}, goodput {p.goodput:.3f}, hit rate {p.hit_rate:.1%}"
            + (f"; misses: {p.misses}" if p.misses else ""))
        self.runs.append((p, r))
        return p


def boundary_sizes(res: SweepResult) -> list[int]:
    """The fleet sizes next to a workers sweep's answer that were probed: the answer and the one below."""
    if res.answer is None:
        return []
    sizes = {p.workers for p in res.probes}
    return [n for n in (int(res.answer) - 1, int(res.answer)) if n in sizes]


def repeat_boundary(results: list[SweepResult], runner: ProbeRunner, repeats: int) -> list[str]:
    """Runs every arm's boundary probes again until each has `repeats` runs, interleaved across arms (every other
    pass in reverse arm order); the spread per arm and size, and whether the repeats confirm each answer."""
    for r in range(1, repeats):
        order = results[::-1] if r % 2 else results
        for res in order:
            for n in boundary_sizes(res):
                res.probes.append(runner.live(res.arm, n, 1.0))
    rows = spread_rows([(f"{res.arm}, {p.workers} workers", p.attainment)
                        for res in results for p in sorted(res.probes, key=lambda p: p.workers)
                        if p.workers in boundary_sizes(res)], "router, policy, fleet size")
    notes = []
    for res in results:
        for n in boundary_sizes(res):
            atts = [p.attainment for p in res.probes if p.workers == n]
            if len({a >= TARGET for a in atts}) > 1:
                notes.append(f"{res.arm} at {n} workers: runs on both sides of {TARGET:.0%} "
                             f"({', '.join(f'{a:.1%}' for a in atts)}), so its answer is not confirmed")
    return rows + ([""] + [f"- {n}" for n in notes] if notes else [])


def virtual_time_rows(reqs: list[WorkloadRequest], sizes: list[int]) -> list[str]:
    """aladdin with and without cache pricing on the same window in the virtual-time simulator (ClusterSim, the
    engines feeding the exact view synchronously; bench/prefix.py's queue settings, profile priors, no online
    fitting): deterministic, so it separates the policy from the live runs' noise. The policy is built by name, as
    the simulator builds it, with the workers' own profile model (as the gateway's priors give it): built by hand
    without one, it ran on PerfModel()'s Llama-2-13B A100 defaults, which the earlier rows of this table did."""
    from bench.prefix import QUEUE_LOOKAHEAD, QUEUE_POLL_S
    from simulator.cluster import ClusterSim

    rows = ["| workers | aladdin: attainment | hit rate | TTFT p50 s | aladdin + cache pricing: attainment "
            "| hit rate | TTFT p50 s |", "|---|---|---|---|---|---|---|"]
    for n in sizes:
        cells = []
        for price in (False, True):
            sim = ClusterSim(PROFILE, n, "aladdin", policy_params={"price_cache": price}, slo_tpot_s=SLO_TPOT_S,
                             queue_poll_s=QUEUE_POLL_S, queue_lookahead=QUEUE_LOOKAHEAD)
            d = sim.run(list(reqs)).to_dict()
            cells.append(f"{d['slo_attainment']:.1%} | {d['prefix_cache_hit_rate']:.1%} | {d['ttft_p50']:.2f}")
        rows.append(f"| {n} | {' | '.join(cells)} |")
        log(rows[-1])
    return rows


def virtual_sweep(args: argparse.Namespace, n: int) -> None:
    """The report's virtual-time section: every policy by name, workers for 99% on both Mooncake windows (requests
    0- and --start's), or on the --trace chat window."""
    from bench.peers_sched_virtual import Window, jitter_table, user_policies, virtual_table

    lo, hi = args.workers_range
    chat = args.trace == "chat"
    windows = [Window(f"requests {s}-{s + n - 1} (reuse {best_hit_rate(w):.0%})", s, w)
               for s in ((args.start,) if chat else (0, args.start)) for w in [window(args, s, n)]]
    rows = virtual_table(windows, user_policies(), lo, hi, args.seeds, PROFILE)
    jitter = jitter_table(windows[0], ("least_requests", "least_tokens", "aladdin"), 6, range(6), 0.05, PROFILE)
    cmd = (f"python -m bench.peers_sched{trace_args(args)} --virtual-sweep --start {args.start} --requests {n} "
           f"--workers-range {lo} {hi} --seeds {' '.join(map(str, args.seeds))}")
    body = "\n".join([
        f"Every policy a user can pick by name, in virtual time, on the {trace_name(args)} (ClusterSim, {PROFILE} "
        "workers, the policy's default parameters, the same SLO rule as the live runs; bench/peers_sched_virtual.py). "
        f"Workers for 99%: the fewest in ({lo}, {hi}] by bisection. The seed reaches random and power_of_two only. "
        "Mean prompt: "
        + ", ".join(f"{w.name} {statistics.fmean(r.prompt_tokens for r in w.reqs):,.0f} tokens (longest "
                    f"{max(r.prompt_tokens for r in w.reqs):,})" for w in windows) + ".", "", *rows, "",
        f"Stable against a live replay's timing noise? {windows[0].name} at 6 workers, every arrival moved by a "
        "Gaussian offset of sigma 50 ms (jitter seed 0: the trace as it is; bench/peers_sched_virtual.py "
        "jittered):", "", *jitter])
    title = ("Virtual time: every policy by name on multi-turn chats" if chat
             else "Virtual time: every policy by name, workers for 99% on low and high reuse")
    write_section(Path(args.out), title, cmd, body)
    print(Path(args.out).read_text().split(f"## {title}", 1)[1])


def sweep_body(args: argparse.Namespace, arms: list[Arm], reqs: list[WorkloadRequest], texts: list[str],
               out: Path) -> list[str]:
    """The --sweep-workers / --sweep-rate sections (and their plots beside `out`)."""
    run = ProbeRunner(reqs, texts, args.time_scale)
    body: list[str] = []
    if args.sweep_workers:
        lo, hi = args.workers_range
        results = [sweep_workers(a.name, run, lo, hi) for a in arms]
        spreads = repeat_boundary(results, run, args.repeats)
        png = out.with_name(out.stem + "_workers.png")
        plot(results, "workers", png, f"SLO attainment vs workers, {len(reqs)} requests, {trace_name(args)}")
        body += [f"### Workers needed for {TARGET:.0%} SLO attainment (fleet sizes searched in ({lo}, {hi}])", "",
                 *workers_table(results, lo, hi), "", workers_verdict(results, ALADDIN_KV, hi), "",
                 f"![attainment vs workers]({png.name})", "",
                 f"#### The boundary probes, {args.repeats} runs each, interleaved across arms", "", *spreads, ""]
    if args.sweep_workers or args.sweep_rate:
        body += ["#### Every live run, in order", "", "| # | router, policy | workers | rate | attainment "
                 f"| rejected ({REJECTED}) | failed, by kind | peak queue per worker | load before -> after |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for i, (p, r) in enumerate(run.runs, 1):
            rejected, failed = failure_cells(r)
            body.append(f"| {i} | {p.arm} | {p.workers} | {p.rate:g} | {p.attainment:.1%} | {rejected} | {failed} "
                        f"| {'/'.join(map(str, r.peak_queue)) or '-'} | {r.load[0]:.1f} -> {r.load[1]:.1f} |")
        body.append("")
    if args.sweep_rate:
        results = [sweep_rate(a.name, run, args.workers, sorted(args.rates)) for a in arms]
        png = out.with_name(out.stem + "_rate.png")
        plot(results, "rate", png, f"SLO attainment vs arrival-rate multiplier, {args.workers} workers")
        rows, verdict = rate_table(results, sorted(args.rates), len(reqs) / reqs[-1].arrival)
        body += [f"### Goodput at {TARGET:.0%} SLO attainment, {args.workers} workers (rate multipliers "
                 f"{', '.join(f'{m:g}' for m in sorted(args.rates))})", "", *rows, "", verdict, "",
                 f"![attainment vs rate]({png.name})", ""]
    return body


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="120 requests (a smoke run)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--trace", choices=("mooncake", "chat"), default="mooncake",
                    help="the shipped Mooncake trace, or multi-turn chats built from ShareGPT lengths (bench/prefix.py)")
    ap.add_argument("--chat-rate", type=float, default=CHAT_RATE, help="--trace chat: new conversations per second")
    ap.add_argument("--start", type=int, default=3000, help="first request of the trace window")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--arms", nargs="*", help="only these arms (names as in the report)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs per arm (one load point) or per boundary probe (--sweep-workers), interleaved "
                         "across arms")
    ap.add_argument("--sweep-workers", action="store_true",
                    help="per arm, the fewest workers in (LO, HI] reaching 99%% attainment (bisection)")
    ap.add_argument("--workers-range", type=int, nargs=2, default=(4, 12), metavar=("LO", "HI"))
    ap.add_argument("--sweep-rate", action="store_true",
                    help="per arm at --workers, the largest arrival-rate multiplier keeping 99%% and its goodput")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2, 1.5],
                    help="the rate multipliers --sweep-rate bisects over")
    ap.add_argument("--virtual-time", type=int, nargs="+", metavar="N",
                    help="only print aladdin with and without cache pricing in virtual time at these fleet sizes")
    ap.add_argument("--virtual-sweep", action="store_true",
                    help="every policy by name in virtual time: workers for 99%% on the low-reuse window (requests "
                         "0-) and --start's, written as the report's virtual-time section")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                    help="--virtual-sweep's seeds (they reach the seeded policies only)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "peers_sched.md"))
    args = ap.parse_args()
    n = 120 if args.quick else args.requests
    reqs = window(args, args.start, n)
    if args.virtual_time:
        print("\n".join(virtual_time_rows(reqs, args.virtual_time)))
        return
    if args.virtual_sweep:
        virtual_sweep(args, n)
        return
    cache: dict[int, str] = {}
    texts = [prompt_text(r, cache) for r in reqs]
    arms = [a for a in ARMS if not args.arms or a.name in args.arms]
    loads = [os.getloadavg()[0]]
    setting = (f"Requests {args.start}-{args.start + len(reqs) - 1} of the {trace_name(args)} ({reqs[-1].arrival:.0f} "
               f"model seconds, mean prompt {statistics.fmean(r.prompt_tokens for r in reqs):,.0f} tokens, best "
               f"possible prefix-cache hit rate {best_hit_rate(reqs):.1%}), {PROFILE} workers simulated at time "
               f"scale {args.time_scale:g}")
    slo_note = ("Times are model seconds (wall x K). A request meets its SLO when it completed, its TTFT <= 0.5 s "
                "+ 2 x its uncached prefill time and its TPOT <= 100 ms (bench/prefix.py).")
    sweep = args.sweep_workers or args.sweep_rate
    if sweep:
        sections = sweep_body(args, arms, reqs, texts, Path(args.out))
        loads.append(os.getloadavg()[0])
        body = "\n".join([f"{setting}; one live run per probe, {args.repeats} per probe next to an answer. Machine load (1-minute average) "
                          f"{min(loads):.2f}-{max(loads):.2f} on {os.cpu_count()} cores.", "", *sections, slo_note])
    else:
        runs = []
        for arm in interleaved(arms, args.repeats):
            log(f"{arm.name}: {len(reqs)} requests at time scale {args.time_scale:g} (load {os.getloadavg()[0]:.2f})")
            runs.append(asyncio.run(run_arm(arm, reqs, texts, args.workers, args.time_scale)))
            log(f"  -> attainment {runs[-1].attainment(reqs):.1%}")
            loads.append(os.getloadavg()[0])
        worst = {r.arm: r for r in sorted(runs, key=lambda r: -r.attainment(reqs))}   # each arm's worst run
        body = "\n".join([
            f"{setting}, {args.workers} of them; {args.repeats} run(s) per arm, interleaved (arms in order, then "
            f"reversed, ...), in the order below. Machine load (1-minute average) {min(loads):.2f}-{max(loads):.2f} "
            f"on {os.cpu_count()} cores.", "",
            *table(runs, reqs), "", *spread_rows([(r.arm, r.attainment(reqs)) for r in runs]), "",
            *([h + " (each arm's worst run)", ""] if (h := headline(list(worst.values()), reqs)) else []),
            slo_note,
        ])
    cmd = (f"python -m bench.peers_sched{trace_args(args)} --workers {args.workers} --start {args.start} --requests {n} "
           f"--time-scale {args.time_scale:g} --repeats {args.repeats}"
           + (f" --sweep-workers --workers-range {args.workers_range[0]} {args.workers_range[1]}"
              if args.sweep_workers else "")
           + (f" --sweep-rate --rates {' '.join(f'{m:g}' for m in args.rates)}" if args.sweep_rate else "")
           + (f" --arms {' '.join(repr(a) for a in args.arms)}" if args.arms else ""))
    write_report(Path(args.out), "fleetgate and the peer routers: scheduling quality", cmd, body)
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
