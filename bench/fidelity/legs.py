"""The fidelity comparison's workload and legs: what is sent, how, and how two legs are compared.

- workload: request lengths drawn (fixed seed) from the simulator's ShareGPT length trace, scaled to the tiny
  model's context, with random token-id prompts; Poisson arrivals; per load level two halves (level_plan);
- a leg: one open-loop run of such requests through a gateway, with the engine's own histograms scraped before
  and after (run_leg); two halves of a level pooled as one (pool);
- statistics: p50/p90 TTFT and TPOT and throughput per leg, and the sim/real ratio per metric against its
  target (compare).

Used by bench/fidelity/run.py (`python -m bench.fidelity`) and bench/fidelity/at_speed.py.
"""

from __future__ import annotations

import asyncio
import csv
import functools
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.resources.abc import Traversable
from pathlib import Path

import numpy as np

from bench.fidelity.harness import (
    MAX_MODEL_LEN,
    StreamResult,
    client_session,
    histogram_totals,
    load_average,
    random_prompt,
    stream_completion,
)
from bench.harness import http_text, log
from simulator.package_data import builtin_trace

TRACE = builtin_trace("sharegpt")  # sharegpt_lengths_llama2.csv, package data of the simulator
TRACE_CONTEXT = 8192          # sarathi-serve's sharegpt_8k_filtered: prompt + output <= 8k tokens
SCALE = MAX_MODEL_LEN / TRACE_CONTEXT
LEVELS = (("light", 0.25), ("medium", 0.55), ("near saturation", 0.85))
STEP_KEYS = ("c_step_s", "c_decode_s", "k_ctx_s", "k_prefill_s", "k_attn_s", "t_weights_s", "c_admit_s")
TARGET_P50, TARGET_P90 = 0.20, 0.30


# --- workload ------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class WorkItem:
    prompt: list[int]
    max_tokens: int


@functools.cache
def load_lengths(path: Path | Traversable = TRACE) -> tuple[tuple[int, int], ...]:
    """(prompt tokens, output tokens) per row of a sarathi-serve length trace."""
    with path.open(newline="") as f:
        return tuple((int(float(r["num_prefill_tokens"])), int(float(r["num_decode_tokens"])))
                     for r in csv.DictReader(f))


def scale_lengths(prompt: int, output: int, scale: float = SCALE, max_len: int = MAX_MODEL_LEN) -> tuple[int, int]:
    """Both lengths times `scale`, rounded, at least 1; the prompt leaves room for one output token and the
    output is cut so prompt + output <= max_len (vLLM refuses more)."""
    p = min(max(1, round(prompt * scale)), max_len - 1)
    o = min(max(1, round(output * scale)), max_len - p)
    return p, o


def make_workload(n: int, seed: int, variant: int = 0,
                  lengths: Sequence[tuple[int, int]] | None = None) -> list[WorkItem]:
    """n requests: rows drawn with replacement (`seed`), scaled, with random token-id prompts (`seed`, `variant`).

    Variants have the same lengths and fresh token ids: each run gets its own, or the server's prefix cache
    (on by default in vLLM, and in the simulator) would serve the prompts of a repeated list from cache."""
    rows = lengths if lengths is not None else load_lengths()
    rng = random.Random(seed)
    ids = random.Random(f"{seed}/{variant}")
    items = []
    for _ in range(n):
        p, o = scale_lengths(*rows[rng.randrange(len(rows))])
        items.append(WorkItem(random_prompt(ids, p), o))
    return items


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process of `rate` req/s; the first request at 0."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


@dataclass(slots=True)
class LegResult:
    results: list[StreamResult]
    start: float
    max_send_lag_s: float
    load_before: float
    engine: dict[str, float] = field(default_factory=dict)   # the server's own histograms over the leg (ENGINE_VIEW)
    windows: list[tuple[float, float]] = field(default_factory=list)   # wall clock (time.time) of the leg's run(s)


# The server's own view of a leg, from its /metrics before and after (vLLM and the simulator export the same names):
# key -> histogram. Sums and counts of each; the report sets them beside the client's timings.
ENGINE_VIEW = {
    "tpot": "vllm:request_time_per_output_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "step_tokens": "vllm:iteration_tokens_total",
}


def engine_totals(metrics_text: str) -> dict[str, float]:
    """{key_sum, key_count} of every ENGINE_VIEW histogram in one /metrics scrape."""
    out: dict[str, float] = {}
    for key, name in ENGINE_VIEW.items():
        out[f"{key}_sum"], out[f"{key}_count"] = histogram_totals(metrics_text, name)
    return out


async def run_open_loop(url: str, items: Sequence[WorkItem], arrivals: Sequence[float]) -> LegResult:
    """Send item i at start + arrivals[i] (open loop, whatever the server does) and stream all of them."""
    load = load_average()
    async with client_session() as session:
        start, wall = time.perf_counter(), time.time()
        tasks = []
        lag = 0.0
        for item, at in zip(items, arrivals, strict=True):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            lag = max(lag, time.perf_counter() - start - at)
            tasks.append(asyncio.create_task(stream_completion(session, url, item.prompt, item.max_tokens)))
        results = await asyncio.gather(*tasks)
    return LegResult(list(results), start, lag, load, windows=[(wall, time.time())])


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


@dataclass(slots=True)
class LegStats:
    n: int
    failed: int
    ttft_p50: float
    ttft_p90: float
    tpot_p50: float
    tpot_p90: float
    tokens_per_s: float
    requests_per_s: float
    duration_s: float
    ttft_mean: float = float("nan")
    tpot_mean: float = float("nan")
    errors: list[str] = field(default_factory=list)   # distinct error messages (first few)


def leg_stats(results: Sequence[StreamResult], start: float) -> LegStats:
    """p50/p90 TTFT and TPOT over requests (TPOT: requests with >= 2 tokens), output tokens/s and req/s over
    [first send, last token]."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    end = max((r.finished for r in ok), default=start)
    dur = max(end - start, 1e-9)
    return LegStats(
        n=len(results), failed=len(results) - len(ok),
        ttft_p50=percentile(ttft, 50), ttft_p90=percentile(ttft, 90),
        tpot_p50=percentile(tpot, 50), tpot_p90=percentile(tpot, 90),
        tokens_per_s=sum(r.output_tokens for r in ok) / dur, requests_per_s=len(ok) / dur, duration_s=dur,
        ttft_mean=float(np.mean(ttft)) if ttft else float("nan"), tpot_mean=float(np.mean(tpot)) if tpot else float("nan"),
        errors=sorted({f"{r.status}: {r.error[:160]}" for r in results if not r.ok})[:3],
    )


# metric key, label, unit scale, target (relative tolerance)
METRICS = (
    ("ttft_p50", "TTFT p50 (ms)", 1e3, TARGET_P50),
    ("ttft_p90", "TTFT p90 (ms)", 1e3, TARGET_P90),
    ("tpot_p50", "TPOT p50 (ms)", 1e3, TARGET_P50),
    ("tpot_p90", "TPOT p90 (ms)", 1e3, TARGET_P90),
    ("tokens_per_s", "throughput (output tok/s)", 1.0, TARGET_P50),
)


@dataclass(slots=True)
class Cell:
    metric: str
    label: str
    real: float
    sim: float
    target: float

    @property
    def ratio(self) -> float:
        return self.sim / self.real if self.real else float("nan")

    @property
    def passed(self) -> bool:
        return math.isfinite(self.ratio) and abs(self.ratio - 1.0) <= self.target + 1e-12


def compare(real: LegStats, sim: LegStats) -> list[Cell]:
    """One cell per metric: sim/real ratio, PASS when within the target (p50 and throughput 20 %, p90 30 %)."""
    return [Cell(key, label, getattr(real, key) * unit, getattr(sim, key) * unit, target)
            for key, label, unit, target in METRICS]


def pool(a: LegResult, b: LegResult) -> LegResult:
    """Two halves of a level as one leg: b's times shifted to follow a's (durations add up for throughput)."""
    end_a = max((r.finished for r in a.results if r.ok), default=a.start)
    shift = end_a - b.start
    moved = []
    for r in b.results:
        m = StreamResult(r.prompt_tokens, r.max_tokens, r.sent + shift, [(t + shift, n) for t, n in r.chunks],
                         r.status, r.error)
        moved.append(m)
    engine = {k: a.engine.get(k, 0.0) + b.engine.get(k, 0.0) for k in a.engine.keys() | b.engine.keys()}
    return LegResult(a.results + moved, a.start, max(a.max_send_lag_s, b.max_send_lag_s),
                     max(a.load_before, b.load_before), engine, a.windows + b.windows)


async def run_leg(url: str, engine_url: str, items: Sequence[WorkItem], arrivals: Sequence[float], what: str) -> LegResult:
    """One open-loop leg through the gateway at `url`; the server at `engine_url` is scraped before and after."""
    before = engine_totals(http_text(engine_url + "/metrics"))
    res = await run_open_loop(url, items, arrivals)
    await asyncio.sleep(0.2)   # the last request's numbers reach the server's histograms
    after = engine_totals(http_text(engine_url + "/metrics"))
    res.engine = {k: after[k] - before[k] for k in after}
    st = leg_stats(res.results, res.start)
    log(f"  {what}: TTFT p50 {st.ttft_p50 * 1e3:.1f} ms, TPOT p50 {st.tpot_p50 * 1e3:.1f} ms, "
        f"{st.tokens_per_s:.0f} tok/s, load {res.load_before:.2f}"
        + (f", {st.failed} failed: {st.errors}" if st.failed else ""))
    await asyncio.sleep(1.0)   # idle again before the next leg
    return res


def scaled_profile(profile: Path, factor: float, out: Path, drift: bool = True) -> Path:
    """A copy of `profile` with every step-time coefficient (STEP_KEYS) times `factor`: an engine that much slower;
    `drift` False also drops its speed drift (one constant speed)."""
    import yaml

    data = yaml.safe_load(profile.read_text())
    for key in STEP_KEYS:
        if key in data:
            data[key] = float(data[key]) * factor
    if not drift:
        data["speed_quantiles"] = []
    data["name"] = f"{data.get('name', 'profile')}-x{factor:g}{'' if drift else '-steady'}"
    out.write_text(json.dumps(data))   # JSON is YAML
    return out


def reset_prefix_cache(url: str) -> None:
    """Empty a server's prefix cache (vLLM dev mode and the simulator), so every leg starts from the same state."""
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(url + "/reset_prefix_cache", method="POST"), timeout=30).close()
    except OSError as exc:
        log(f"reset_prefix_cache at {url} failed: {exc}")


LEG_MIN_S = 30.0   # each half-level sends arrivals for at least this long: several times the host's speed
#                    correlation time (speed_tau_s 2-7 s), so one slow or fast stretch does not decide a level


def level_size(n: int, rate: float, min_s: float = LEG_MIN_S) -> int:
    """Requests in a level: at least `n`, and enough for each half to last `min_s` at `rate` (an even count)."""
    return max(n, 2 * math.ceil(min_s * rate))


def level_plan(k: int, rate: float, seed: int, n: int, min_s: float = LEG_MIN_S
               ) -> tuple[list[WorkItem], list[float], list[WorkItem], list[float]]:
    """Level k's requests (workload variant 2 + k, level_size of them) and Poisson arrivals at `rate`, as two
    halves: (A requests, A arrivals, B requests, B arrivals)."""
    size = level_size(n, rate, min_s)
    items = make_workload(size, seed, variant=2 + k)
    half = size // 2
    return (items[:half], poisson_arrivals(half, rate, seed + 10 * k + 1),
            items[half:], poisson_arrivals(size - half, rate, seed + 10 * k + 2))
