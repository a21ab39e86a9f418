"""fleetgate side by side with the routers users could install instead, on the same backends, in one run.

    python -m bench.peers [--quick] [--rounds 2] [--out bench/results/peers.md]

Peers: vllm-router and sglang-router (Rust, PyPI, versions pinned in bench/peer_env.py and installed into a
cached venv outside the project on first use). fleetgate arms: round_robin and least_requests in memory, and
least_requests with its state in Redis (127.0.0.1:6379 db 14, a key prefix of this run's own, deleted at the
end), each as users run it: `fleetgate serve` defaults, access log on. A "direct" arm sends the same load
straight to one backend, for the floor.

Backends: two zero-latency vLLM-shaped servers (bench/null_backend.py), so what is measured is the router. Every
router and both backends run on core 1 (`taskset`); this process, the load generator (bench/loadgen.py), on
core 0, so the client is not what limits a router. All routers are up for the whole run; the arms are measured
in interleaved rounds A-B-...-B-A (the second round in reverse order), so drift in the machine's load hits every
arm alike, and each round records the 1-minute load average.

Per arm and round:
- added latency at concurrency 1 (short non-streaming requests, 1 output token): blocks alternating with the
  direct path, p50/p99 minus the direct path's;
- at concurrency 32 (and 256 without --quick), non-streaming and streaming, 16 output tokens: requests/s,
  relayed tokens/s, and CPU per request of the router's whole process tree (utime+stime of every process in
  it, from /proc, read before and after the phase).

Results: bench/results/peers.md (+ peers.png), with the command, commit, machine, date and load.

Not an arm: LiteLLM's proxy. `litellm[proxy]==1.110.2` needs `litellm-proxy==1.110.2`, which the package index
this machine reaches does not have (tried 2026-11-26); without the extra there is no proxy server to measure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import REPO, delete_redis_keys, free_port, log, pinned, running_process
from bench.loadgen import RunResult, chat_body, process_tree_cpu_seconds, run_closed_loop
from bench.peer_env import PEER_PACKAGES, ensure_peer_env, peer_command
from bench.report import write_report

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
ROUTER_CORE, CLIENT_CORE = 1, 0
REDIS_URL = os.environ.get("FLEETGATE_PEERS_REDIS_URL", "redis://127.0.0.1:6379/14")
OUTPUT_TOKENS = 16
BASELINE = "vllm-router round_robin"


@dataclass(frozen=True)
class Arm:
    """One router in front of the backends. kind: vllm-router, sglang-router, fleetgate or direct (no router)."""

    name: str
    kind: str
    policy: str = "round_robin"
    redis: bool = False
    config: str | None = None    # fleetgate only: a config file that names the workers itself


ARMS: tuple[Arm, ...] = (
    Arm("direct (no router)", "direct"),
    Arm(BASELINE, "vllm-router"),
    Arm("sglang-router round_robin", "sglang-router"),
    Arm("fleetgate round_robin", "fleetgate"),
    Arm("fleetgate least_requests", "fleetgate", "least_requests"),
    Arm("fleetgate least_requests, Redis", "fleetgate", "least_requests", redis=True),
)


@dataclass(frozen=True)
class Sizes:
    latency_requests: int        # concurrency 1, per arm and round
    load_requests: int           # each loaded phase (per concurrency, streaming or not), per arm and round
    concurrencies: tuple[int, ...]


QUICK = Sizes(latency_requests=200, load_requests=2000, concurrencies=(32,))
FULL = Sizes(latency_requests=1000, load_requests=6000, concurrencies=(32, 256))


@dataclass
class Phase:
    """One measured phase of one arm in one round."""

    arm: str
    round: int
    phase: str                   # "c1", "c32", "c32 stream", ...
    load_1m: float
    result: RunResult
    cpu_s: float | None          # the router's process tree; None for the direct arm
    direct: RunResult | None = None   # c1 only: the interleaved direct blocks

    @property
    def failed(self) -> int:
        return len(self.result.samples) - len(self.result.ok)

    @property
    def cpu_ms_per_request(self) -> float | None:
        return None if self.cpu_s is None else self.cpu_s / max(1, len(self.result.ok)) * 1000

    @property
    def tokens_per_s(self) -> float:
        if self.phase == "c1":
            return float("nan")   # latency blocks: 1 token each, not a throughput
        if self.phase.endswith("stream"):
            return self.result.chunks_per_s
        return self.result.rps * OUTPUT_TOKENS


@dataclass
class RunningArm:
    arm: Arm
    url: str
    pid: int | None
    samples: list[Phase] = field(default_factory=list)


def arm_command(arm: Arm, port: int, backends: Sequence[str], venv: Path | None) -> tuple[list[str], str]:
    """The command that starts `arm` on `port` in front of `backends`, and the path that answers 200 once ready."""
    if arm.kind == "fleetgate":
        workers = ["--config", arm.config] if arm.config else [a for u in backends for a in ("-w", u)]
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--policy", arm.policy, *workers]
        return cmd + (["--redis-url", REDIS_URL] if arm.redis else []), "/ready"
    if arm.kind in PEER_PACKAGES:
        assert venv is not None
        launch = [str(peer_command(venv, arm.kind))] + (["launch"] if arm.kind == "sglang-router" else [])
        return [*launch, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *backends,
                "--policy", arm.policy, "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(free_port())], "/v1/models"
    raise ValueError(f"unknown arm kind {arm.kind!r}")


@contextlib.contextmanager
def started(arms: Sequence[Arm], backends: Sequence[str], redis_prefix: str,
            cpus: int | str | None = ROUTER_CORE) -> Iterator[list[RunningArm]]:
    """Every arm running on `cpus` (the direct arm points at the first backend)."""
    venv = ensure_peer_env() if any(a.kind in PEER_PACKAGES for a in arms) else None
    with contextlib.ExitStack() as stack:
        running = []
        for arm in arms:
            if arm.kind == "direct":
                running.append(RunningArm(arm, backends[0], None))
                continue
            port = free_port()
            cmd, ready = arm_command(arm, port, backends, venv)
            url = f"http://127.0.0.1:{port}"
            env = {"FLEETGATE_REDIS_KEY_PREFIX": redis_prefix} if arm.redis else None
            proc = stack.enter_context(running_process(pinned(cmd, cpus), arm.kind, url + ready, env=env))
            log(f"started {arm.name} (pid {proc.pid}) on {url}")
            running.append(RunningArm(arm, url, proc.pid))
        yield running


@contextlib.contextmanager
def null_backends(n: int = 2) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        urls = []
        for _ in range(n):
            port = free_port()
            cmd = pinned([sys.executable, "-m", "bench.null_backend", "--port", str(port)], ROUTER_CORE)
            url = f"http://127.0.0.1:{port}"
            stack.enter_context(running_process(cmd, "null-backend", url + "/health"))
            urls.append(url)
        yield urls


async def _measure(ra: RunningArm, rnd: int, phase: str, url: str, body: bytes, concurrency: int, requests: int,
                   stream: bool) -> Phase:
    load = os.getloadavg()[0]
    cpu0 = process_tree_cpu_seconds(ra.pid) if ra.pid else None
    res = await run_closed_loop(url, lambda i: body, concurrency=concurrency, requests=requests, stream=stream)
    cpu = process_tree_cpu_seconds(ra.pid) - cpu0 if ra.pid and cpu0 is not None else None
    return Phase(ra.arm.name, rnd, phase, load, res, cpu)


async def measure_round(ra: RunningArm, rnd: int, direct_url: str, sizes: Sizes) -> list[Phase]:
    """One round of every phase for one arm."""
    url = ra.url + "/v1/chat/completions"
    short = chat_body(MODEL, "Say hi.", 1, stream=False)
    phases = []
    if ra.pid is not None:   # added latency: 5 blocks alternating with the direct path, both on the same machine
        load = os.getloadavg()[0]
        via, direct = RunResult(), RunResult()
        for _ in range(5):
            for target, into in ((direct_url, direct), (url, via)):
                r = await run_closed_loop(target, lambda i: short, concurrency=1, requests=sizes.latency_requests // 5)
                into.samples += r.samples
                into.wall_s += r.wall_s
        phases.append(Phase(ra.arm.name, rnd, "c1", load, via, None, direct))
    for conc in sizes.concurrencies:
        for stream in (False, True):
            body = chat_body(MODEL, "Tell a story.", OUTPUT_TOKENS, stream=stream)
            name = f"c{conc}" + (" stream" if stream else "")
            phases.append(await _measure(ra, rnd, name, url, body, conc, sizes.load_requests, stream))
    return phases


def round_order(n_arms: int, rounds: int) -> list[tuple[int, int]]:
    """(round, arm index) in A-B-...-B-A order: odd rounds forwards, even rounds backwards."""
    order = []
    for rnd in range(rounds):
        idx = range(n_arms) if rnd % 2 == 0 else reversed(range(n_arms))
        order += [(rnd + 1, i) for i in idx]
    return order


async def run_all(arms: Sequence[Arm], sizes: Sizes, rounds: int) -> list[Phase]:
    """Start the backends and every arm, measure them in interleaved rounds, stop everything; every phase."""
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_setaffinity") else None
    if affinity is not None and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {CLIENT_CORE})
    prefix = f"fgpeers:{uuid.uuid4().hex[:12]}:"
    try:
        with null_backends() as backends, started(arms, backends, prefix) as running:
            direct_url = backends[0] + "/v1/chat/completions"
            warm = chat_body(MODEL, "Say hi.", 1, stream=False)
            warm_stream = chat_body(MODEL, "Tell a story.", OUTPUT_TOKENS, stream=True)
            for ra in running:   # connection pools, caches, lazy imports
                await run_closed_loop(ra.url + "/v1/chat/completions", lambda i: warm, concurrency=8, requests=200)
                # streamed too: fleetgate's first fit of its performance models (which imports scipy, ~0.5 s of
                # CPU once per process) comes with its first streamed requests, not inside a measured phase
                await run_closed_loop(ra.url + "/v1/chat/completions", lambda i: warm_stream, concurrency=8,
                                      requests=200, stream=True)
            phases: list[Phase] = []
            for rnd, i in round_order(len(running), rounds):
                log(f"round {rnd}: {running[i].arm.name} (load {os.getloadavg()[0]:.2f})")
                phases += await measure_round(running[i], rnd, direct_url, sizes)
    finally:
        if affinity is not None:   # a caller (a test session) keeps its cores
            os.sched_setaffinity(0, affinity)
        if any(a.redis for a in arms):
            delete_redis_keys(REDIS_URL, prefix)
    return phases


# --- report ----------------------------------------------------------------------------------------------------
def _span(values: Sequence[float], fmt: str) -> str:
    """'a-b' over the rounds (or one value)."""
    lo, hi = min(values), max(values)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}-{format(hi, fmt)}"


def _of(phases: Sequence[Phase], arm: str, phase: str) -> list[Phase]:
    return [p for p in phases if p.arm == arm and p.phase == phase]


def summary_rows(phases: Sequence[Phase], arms: Sequence[str], conc: int) -> list[str]:
    rows = ["| router | CPU ms/request | CPU ms/request, streaming | requests/s | requests/s, streaming "
            "| relayed tokens/s, streaming | added p50 ms, c=1 | added p99 ms, c=1 |", "|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        plain, stream, lat = _of(phases, arm, f"c{conc}"), _of(phases, arm, f"c{conc} stream"), _of(phases, arm, "c1")
        if not plain:
            continue
        cpu = "-" if plain[0].cpu_s is None else _span([p.cpu_ms_per_request for p in plain], ".3f")
        cpu_st = "-" if stream[0].cpu_s is None else _span([p.cpu_ms_per_request for p in stream], ".3f")
        add50: list[float] = [(p.result.latency_quantile(0.5) - p.direct.latency_quantile(0.5)) * 1000 for p in lat if p.direct]
        add99: list[float] = [(p.result.latency_quantile(0.99) - p.direct.latency_quantile(0.99)) * 1000 for p in lat if p.direct]
        rows.append(f"| {arm} | {cpu} | {cpu_st} | {_span([p.result.rps for p in plain], ',.0f')} "
                    f"| {_span([p.result.rps for p in stream], ',.0f')} | {_span([p.tokens_per_s for p in stream], ',.0f')} "
                    f"| {_span(add50, '.3f') if add50 else '-'} | {_span(add99, '.3f') if add99 else '-'} |")
    return rows


def _mean(phases: Sequence[Phase], attr: str) -> float:
    vals = [p.cpu_ms_per_request if attr == "cpu" else p.result.rps for p in phases]
    return statistics.fmean(v for v in vals if v is not None)


def ratio_rows(phases: Sequence[Phase], arms: Sequence[str], conc: int) -> list[str]:
    """Each fleetgate arm against vllm-router (means over the rounds), with the targets."""
    rows = ["| arm | CPU/request vs vllm-router | streaming CPU/request vs vllm-router | requests/s vs vllm-router "
            "| targets |", "|---|---|---|---|---|"]
    base = {ph: _of(phases, BASELINE, ph) for ph in (f"c{conc}", f"c{conc} stream")}
    if not all(base.values()):
        return []
    for arm in arms:
        if arm == BASELINE or not _of(phases, arm, f"c{conc}") or _of(phases, arm, f"c{conc}")[0].cpu_s is None:
            continue
        cpu = _mean(_of(phases, arm, f"c{conc}"), "cpu") / _mean(base[f"c{conc}"], "cpu")
        cpu_st = _mean(_of(phases, arm, f"c{conc} stream"), "cpu") / _mean(base[f"c{conc} stream"], "cpu")
        rps = _mean(_of(phases, arm, f"c{conc}"), "rps") / _mean(base[f"c{conc}"], "rps")
        worst_ms = max(p.cpu_ms_per_request or 0 for p in phases if p.arm == arm and p.phase.startswith(f"c{conc}"))
        if "Redis" in arm:
            met = cpu <= 2 and cpu_st <= 2 and worst_ms <= 0.4
            target = f"<= 2x and <= 0.4 ms: {'met' if met else 'missed'} (worst {worst_ms:.3f} ms)"
        elif "fleetgate" in arm:
            target = f"<= 1.3x: {'met' if cpu <= 1.3 and cpu_st <= 1.3 else 'missed'}"
        else:
            target = "(peer)"
        if "fleetgate" in arm:
            target += f"; throughput >= 0.8x: {'met' if rps >= 0.8 else 'missed'}"
        rows.append(f"| {arm} | {cpu:.2f}x | {cpu_st:.2f}x | {rps:.2f}x | {target} |")
    return rows


def raw_rows(phases: Sequence[Phase]) -> list[str]:
    rows = ["| round | arm | phase | load 1m | ok | failed | wall s | requests/s | relayed tokens/s | chunks/stream "
            "| CPU ms/request | p50 ms | p99 ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in phases:
        ok = p.result.ok
        chunks = f"{statistics.fmean(s.chunks for s in ok):.1f}" if ok and p.phase.endswith("stream") else "-"
        cpu = "-" if p.cpu_ms_per_request is None else f"{p.cpu_ms_per_request:.3f}"
        rows.append(f"| {p.round} | {p.arm} | {p.phase} | {p.load_1m:.2f} | {len(ok)} | {p.failed} "
                    f"| {p.result.wall_s:.2f} | {p.result.rps:,.0f} | {'-' if p.phase == 'c1' else f'{p.tokens_per_s:,.0f}'} "
                    f"| {chunks} | {cpu} "
                    f"| {p.result.latency_quantile(0.5) * 1000:.3f} | {p.result.latency_quantile(0.99) * 1000:.3f} |")
    return rows


def report_body(phases: Sequence[Phase], arms: Sequence[Arm], sizes: Sizes, rounds: int, plot: str | None) -> str:
    names = [a.name for a in arms]
    loads = [p.load_1m for p in phases]
    failed = sum(p.failed for p in phases)
    peers = ", ".join(f"{n} {v}" for n, v in sorted(PEER_PACKAGES.items()))
    parts = [
        f"Peers: {peers} (PyPI). Two zero-latency backends (bench/null_backend.py); routers and backends on core "
        f"{ROUTER_CORE}, the load generator on core {CLIENT_CORE}. {rounds} rounds in A-B-...-B-A order; each cell "
        f"is the range over the rounds. {OUTPUT_TOKENS} output tokens per loaded request, {sizes.load_requests} "
        f"requests per loaded phase, {sizes.latency_requests} per arm at concurrency 1. CPU is the router's whole "
        "process tree (utime+stime from /proc). fleetgate runs `fleetgate serve` defaults (access log on); "
        f"Redis at {REDIS_URL}.",
        "",
        f"Machine load (1-minute average) during the run: {min(loads):.2f}-{max(loads):.2f} on "
        f"{os.cpu_count()} cores (the machine is shared; the interleaving spreads that over every arm). "
        f"Failed requests across all phases: {failed}.",
        "",
    ]
    for conc in sizes.concurrencies:
        parts += [f"## Overhead at concurrency {conc}", "", *summary_rows(phases, names, conc), ""]
        ratios = ratio_rows(phases, names, conc)
        if ratios:
            parts += [f"### Ratios to vllm-router at concurrency {conc} (means over the rounds)", "", *ratios, ""]
    if plot:
        parts += [f"![CPU per request and requests/s]({plot})", ""]
    parts += ["## Every phase", "", *raw_rows(phases)]
    return "\n".join(parts)


def plot(phases: Sequence[Phase], arms: Sequence[Arm], conc: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routed = [a.name for a in arms if a.kind != "direct"]
    fig, (ax_cpu, ax_rps) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.38
    for k, (phase, label) in enumerate(((f"c{conc}", "non-streaming"), (f"c{conc} stream", "streaming"))):
        for ax, val in ((ax_cpu, lambda p: p.cpu_ms_per_request), (ax_rps, lambda p: p.result.rps)):
            vals = [[val(p) for p in _of(phases, a, phase)] for a in routed]
            mid = [statistics.fmean(v) for v in vals]
            err = [[m - min(v) for m, v in zip(mid, vals, strict=True)], [max(v) - m for m, v in zip(mid, vals, strict=True)]]
            ax.bar([i + (k - 0.5) * width for i in range(len(routed))], mid, width, yerr=err, capsize=3, label=label)
    for ax, title in ((ax_cpu, "router CPU ms per request (whole process tree)"), (ax_rps, "requests/s")):
        ax.set_xticks(range(len(routed)))
        ax.set_xticklabels([a.replace(" ", "\n", 1) for a in routed], fontsize=7)
        ax.set_title(f"{title}, concurrency {conc}", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer requests, concurrency 32 only (a few minutes)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (A-B-B-A is 2)")
    ap.add_argument("--arms", nargs="*", help="only these arms (names as in the report)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "peers.md"))
    args = ap.parse_args()
    sizes = QUICK if args.quick else FULL
    arms = [a for a in ARMS if not args.arms or a.name in args.arms]
    phases = asyncio.run(run_all(arms, sizes, args.rounds))
    cmd = "nice -n 5 python -m bench.peers" + (" --quick" if args.quick else "") + f" --rounds {args.rounds}"
    write_results(phases, arms, sizes, args.rounds, Path(args.out), cmd)
    print(Path(args.out).read_text())


def write_results(phases: Sequence[Phase], arms: Sequence[Arm], sizes: Sizes, rounds: int, out: Path,
                  cmd: str) -> None:
    """The report at `out` and its plot beside it (same name, .png)."""
    png = out.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(phases, arms, sizes.concurrencies[0], png)
    write_report(out, "fleetgate and the peer routers: overhead", cmd,
                 report_body(phases, arms, sizes, rounds, png.name))

if __name__ == "__main__":
    main()
