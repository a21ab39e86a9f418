"""What the fidelity tools share: the machine, the real server, the streaming client, the engine's facts.

- the machine: a quiet-load wait and core pinning, so the real engine has a core to itself;
- the real vLLM CPU server (scripts/vllm_servers.py; `step_trace` makes its engine log every step, see
  bench/fidelity/step_trace.py); the gateway and simulator processes come from bench/harness.py;
- a streaming client that timestamps every token chunk (continuous usage stats) of a completion;
- what the real server says about itself (KV capacity from /metrics, scheduler limits from /server_info).

Used by bench/fidelity/calibrate.py (probes and fits), bench/fidelity/legs.py (open-loop legs) and the tools
built on them; `python -m bench.fidelity` runs the whole comparison (bench/fidelity/run.py).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.fidelity.step_trace import hook_env
from bench.harness import REPO, http_json, http_text, log
from scripts.vllm_servers import ServerSpec, VllmFleet

DEFAULT_PROFILE = REPO / "simulator" / "profiles" / "tiny-cpu.yaml"   # what a calibration writes
CALIBRATION_JSON = REPO / "bench" / "results" / "calibration.json"
MODEL = "tiny"
MAX_MODEL_LEN = 1024
# Token ids drawn for prompts: the tiny model's vocabulary is 4096; ids below 16 include its special tokens.
TOKEN_LO, TOKEN_HI = 16, 4000
# vLLM CPU defaults for the OpenAI server when the log does not say (vllm/engine/arg_utils.py get_batch_defaults).
CPU_DEFAULT_MAX_NUM_SEQS = 128
CPU_DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
QUIET_LOAD = 1.5
_TOKENS_RE = re.compile(rb'"completion_tokens":(\d+)')
_TTFT = "vllm:time_to_first_token_seconds"


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


def keep_off_core(cpu: int) -> set[int]:
    """Move this harness (and so the gateway, the load generator and the real server's API process, which inherit
    or are released to its cores) off the engine's core: the engine then has core `cpu` to itself, as in the
    calibration, whichever other jobs run on the machine. Returns the cores left to the harness."""
    others = set(os.sched_getaffinity(0)) - {cpu}
    if others:
        os.sched_setaffinity(0, others)
        log(f"harness, gateway and API server on cores {sorted(others)}; engine alone on core {cpu}")
    return others


# --- the real server ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class RealServer:
    url: str
    log_text: str
    model_dir: Path


@contextlib.contextmanager
def run_real_server(cpu: int, step_trace: Path | None = None) -> Iterator[RealServer]:
    """One real vLLM CPU server (scripts/vllm_servers.py: EngineCore and Worker pinned to `cpu`); with
    `step_trace`, its engine logs every step there (bench/fidelity/step_trace.py)."""
    # dev mode only adds /server_info (the scheduler limits) and the sleep routes; no effect on serving.
    env = hook_env(step_trace) if step_trace is not None else {}
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
        info = http_json(server.url + "/server_info?config_format=json", 120.0)
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


def histogram_totals(metrics_text: str, name: str = _TTFT) -> tuple[float, float]:
    """(sum, count) of one histogram in a server's Prometheus text (summed over label sets); TTFT by default."""
    total = count = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name + "_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count
