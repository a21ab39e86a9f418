"""Profile the gateway's per-request hot path in-process: CPU microseconds per request, and where they go.

    python -m bench.profile_hotpath [--requests 4000] [--repeats 5] [--mode asgi|http] [--no-profile]

The gateway (one `Gateway`, default config, `round_robin` like bench/overhead.py) runs in this process in front
of bench/null_backend.py (a subprocess, so its CPU is not counted). Requests go in at concurrency 32:

- `asgi` (default): the gateway's ASGI app is called directly with uvicorn-shaped scopes, so the number is the
  gateway's own code plus its upstream client, without the HTTP server in front (what this repository's code
  controls);
- `http`: the gateway is served by uvicorn in this process and the load comes from bench/loadgen.py in a
  subprocess, so the number also holds uvicorn's HTTP parsing (what bench/overhead.py measures from outside).

CPU per request is time.process_time() over a run / requests, for non-streaming (1 output token) and streaming
(`--stream-tokens` chunks, `--token-interval-ms` apart so each reaches the gateway on its own) requests; each
phase is repeated and the median is printed with the spread. Then one more run of each phase under cProfile
(timed by process CPU time) prints the top functions by cumulative and by own time (profiling adds its own
overhead: read it for proportions, not for absolute numbers). On a shared machine pin it:
`taskset -c 1 nice -n 19 python -m bench.profile_hotpath`.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from bench.harness import REPO, free_port, stop_processes, wait_ready
from bench.loadgen import chat_body
from gateway.app import FleetgateApp, create_app
from gateway.server import GatewayServer, build_serve_config, start_gateway

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CONCURRENCY = 32
# What aiohttp (bench/loadgen.py) sends, so the header loop sees a realistic request.
_CLIENT_HEADERS = [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                   (b"accept", b"*/*"), (b"accept-encoding", b"gzip, deflate"),
                   (b"user-agent", b"Python/3.11 aiohttp/3.11")]


@dataclass(slots=True)
class Phase:
    name: str
    body: bytes
    stream: bool


# --- asgi mode: drive the app directly ---------------------------------------------------------------
async def _asgi_request(app: FleetgateApp, body: bytes, keep: list[bytes] | None = None) -> int:
    """One POST through the ASGI app, the way uvicorn would call it; returns the status (the body's parts
    are appended to `keep` when given)."""
    done = asyncio.get_running_loop().create_future()
    status = 0
    first = True

    async def receive() -> dict:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": body, "more_body": False}
        await done  # like uvicorn: the next receive() returns only once the response is over
        return {"type": "http.disconnect"}

    async def send(msg: dict) -> None:
        nonlocal status
        if msg["type"] == "http.response.start":
            status = msg["status"]
            return
        if keep is not None:
            keep.append(msg.get("body", b""))
        if not msg.get("more_body", False) and not done.done():
            done.set_result(None)

    headers = [*_CLIENT_HEADERS, (b"content-length", str(len(body)).encode())]
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000), "scheme": "http", "method": "POST",
             "root_path": "", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "headers": headers}
    await app(scope, receive, send)
    if not done.done():
        done.set_result(None)
    return status


async def check_answer(app: FleetgateApp, phase: Phase) -> None:
    """One request whose answer is read in full: the relay must deliver every token and the usage."""
    import orjson

    parts: list[bytes] = []
    status = await _asgi_request(app, phase.body, parts)
    body = b"".join(parts)
    want = _tokens_of(phase)
    if phase.stream:
        events = [e for e in body.split(b"\n\n") if e]
        tokens = [e for e in events if e.startswith(b"data: {") and b'"choices":[{' in e]
        ok = status == 200 and events[-1] == b"data: [DONE]" and len(tokens) == want
    else:
        ok = status == 200 and orjson.loads(body)["usage"]["completion_tokens"] == want
    if not ok:
        raise RuntimeError(f"{phase.name}: unexpected answer (status {status}): {body[:300]!r}")


async def _asgi_run(app: FleetgateApp, phase: Phase, requests: int) -> int:
    """`requests` requests at CONCURRENCY in flight; returns how many answered 200."""
    left = requests
    ok = 0

    async def worker() -> None:
        nonlocal left, ok
        while left > 0:
            left -= 1
            status = await _asgi_request(app, phase.body)  # awaited first: `ok += await ...` would race
            ok += status == 200

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return ok


# --- http mode: uvicorn in this process, the load generator in a subprocess -----------------------------
def _client_cmd(url: str, phase: Phase, requests: int) -> list[str]:
    return [sys.executable, "-m", "bench.profile_hotpath", "--client", url, "--requests", str(requests),
            "--stream-tokens", str(_tokens_of(phase)), *(["--stream"] if phase.stream else [])]


def _tokens_of(phase: Phase) -> int:
    import orjson

    return int(orjson.loads(phase.body)["max_tokens"])


async def _http_run(url: str, phase: Phase, requests: int) -> int:
    proc = await asyncio.create_subprocess_exec(*_client_cmd(url, phase, requests), cwd=REPO,
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    return int(out.decode().strip() or 0)


def _client_main(url: str, requests: int, stream: bool, tokens: int) -> None:
    from bench.loadgen import run_closed_loop

    body = chat_body(MODEL, "Tell a story." if stream else "Say hi.", tokens, stream=stream)
    res = asyncio.run(run_closed_loop(url, lambda i: body, concurrency=CONCURRENCY, requests=requests,
                                      stream=stream))
    print(len(res.ok))


# --- measurement -----------------------------------------------------------------------------------------
async def measure(run: Callable[[Phase, int], object], phase: Phase, requests: int,
                  profiler: cProfile.Profile | None = None) -> tuple[float, int]:
    """(CPU seconds of this process, requests answered 200) for one run."""
    cpu0 = time.process_time()
    if profiler is not None:
        profiler.enable()
    ok = await run(phase, requests)
    if profiler is not None:
        profiler.disable()
    return time.process_time() - cpu0, ok


def _print_profile(profiler: cProfile.Profile, title: str, top: int) -> None:
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).strip_dirs().sort_stats(key).print_stats(top)
        lines = buf.getvalue().splitlines()
        start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
        print(f"\n### {title}: top {top} by {key}\n")
        print("\n".join(lines[start:]).rstrip())


async def main_async(args: argparse.Namespace) -> None:
    null_port = free_port()
    backend = subprocess.Popen([sys.executable, "-m", "bench.null_backend", "--port", str(null_port),
                                "--token-interval-ms", str(args.token_interval_ms)], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    server: GatewayServer | None = None
    app: FleetgateApp | None = None
    try:
        await wait_ready(f"http://127.0.0.1:{null_port}/health")
        cfg = build_serve_config(host="127.0.0.1", port=0, workers=[f"http://127.0.0.1:{null_port}"],
                                 policy=args.policy)
        if args.slo:
            cfg = cfg.model_copy(update={"slo": cfg.slo.model_copy(update={"ttft_ms": 1000.0, "tpot_ms": 100.0})})
        if args.mode == "http":
            server = GatewayServer(cfg)
            await server.start()
            url = server.url + "/v1/chat/completions"

            async def run(phase: Phase, n: int) -> int:
                return await _http_run(url, phase, n)
            await wait_ready(server.url + "/ready")
        else:
            app = create_app(cfg)
            await start_gateway(app.gateway)
            deadline = time.monotonic() + 30
            while not app.gateway.registry.any_healthy():
                if time.monotonic() > deadline:
                    raise RuntimeError("the null backend never became healthy")
                await asyncio.sleep(0.05)

            async def run(phase: Phase, n: int) -> int:
                return await _asgi_run(app, phase, n)

        phases = [Phase("non-streaming (1 token)", chat_body(MODEL, "Say hi.", 1, stream=False), False),
                  Phase(f"streaming ({args.stream_tokens} tokens)",
                        chat_body(MODEL, "Tell a story.", args.stream_tokens, stream=True), True)]
        if args.only:
            phases = [p for p in phases if p.stream == (args.only == "stream")]
        print(f"mode {args.mode}, policy {args.policy}, slo {'on' if args.slo else 'off'}, "
              f"concurrency {CONCURRENCY}, token interval {args.token_interval_ms:g} ms, pid {os.getpid()}")
        for phase in phases:
            n = args.requests if not phase.stream else max(1, args.requests // 8)
            if app is not None:
                await check_answer(app, phase)
            await run(phase, min(n, 500))  # warm-up: pools, caches, the model's runtime
            per_req = []
            for _ in range(args.repeats):
                cpu, ok = await measure(run, phase, n)
                if ok != n:
                    raise RuntimeError(f"{phase.name}: {n - ok} of {n} requests failed")
                per_req.append(cpu / n * 1e6)
            med = statistics.median(per_req)
            print(f"{phase.name}: {med:.1f} us CPU/request (median of {args.repeats} x {n}; "
                  f"min {min(per_req):.1f}, max {max(per_req):.1f})"
                  + (f"; {med / args.stream_tokens:.2f} us per relayed token" if phase.stream else ""))
        if not args.no_profile:
            for phase in phases:
                n = args.requests if not phase.stream else max(1, args.requests // 8)
                profiler = cProfile.Profile(time.process_time)  # CPU time, not wall: the core is shared
                await measure(run, phase, n, profiler)
                _print_profile(profiler, phase.name, args.top)
    finally:
        if server is not None:
            await server.stop()
        if app is not None:
            await app.gateway.stop()
        stop_processes([backend])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4000, help="non-streaming requests per repeat (streams: 1/8)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--token-interval-ms", type=float, default=1.0,
                    help="the backend's pause between a stream's chunks (0: unpaced; how chunks then coalesce "
                         "depends on the scheduler, which makes streaming numbers noisy)")
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--slo", action="store_true", help="give every request an SLO (TTFT 1 s, TPOT 100 ms)")
    ap.add_argument("--mode", choices=("asgi", "http"), default="asgi")
    ap.add_argument("--only", choices=("unary", "stream"), help="run one phase only")
    ap.add_argument("--no-profile", action="store_true", help="skip the cProfile runs")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--client", help=argparse.SUPPRESS)  # internal: the http mode's load generator
    ap.add_argument("--stream", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        _client_main(args.client, args.requests, args.stream, args.stream_tokens)
        return
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop  # what `fleetgate serve` runs on
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main_async(args))


if __name__ == "__main__":
    main()
