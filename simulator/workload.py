"""Workloads for the simulators: shipped traces (simulator/traces) and synthetic arrival processes.

    reqs = load_workload("azure_conv", rate_scale=2.0, duration=600)
    reqs = load_workload("sharegpt", rate=8.0, arrival="gamma", cv=3.0, duration=300, seed=1)

Built-in names: azure_conv (timestamps), sharegpt and arxiv (lengths only: arrivals are synthetic and
need a rate), mooncake (timestamps in ms, prefix sharing via 512-token hash ids). A path to a file in
one of these formats works too (the format is detected from its header / first line).
"""

from __future__ import annotations

import bisect
import csv
import functools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date
from importlib.resources.abc import Traversable
from pathlib import Path

from simulator.engine import BLOCK_SIZE
from simulator.package_data import BUILTIN_TRACES, builtin_trace

MOONCAKE_BLOCK_TOKENS = 512     # Mooncake's hash_ids each cover 512 tokens (simulator/traces/README.md)
TraceFile = Path | Traversable  # a user's file, or a shipped trace (package data)


@dataclass(slots=True)
class WorkloadRequest:
    request_id: str
    arrival: float                      # seconds from the workload's start
    prompt_tokens: int
    output_tokens: int                  # true output length (the engine stops there)
    prefix_blocks: tuple[int, ...] = ()  # chained 16-token block keys; equal prefixes share a head
    session_id: str | None = None
    priority: int = 0
    max_tokens: int | None = None
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    source_row: int | None = None       # its row in the trace file (so a history can leave it out)
    service: str = ""                   # the service it belongs to (simulator/services.py), "" for none


# ---- arrival processes ----------------------------------------------------------------------------
def poisson_arrivals(rate: float, rng: random.Random, start: float = 0.0) -> Iterator[float]:
    """Endless Poisson arrival times at `rate` req/s."""
    if rate <= 0:
        raise ValueError("arrival rate must be > 0")
    t = start
    while True:
        t += rng.expovariate(rate)
        yield t


def gamma_arrivals(rate: float, cv: float, rng: random.Random, start: float = 0.0) -> Iterator[float]:
    """Endless Gamma-renewal arrivals: mean gap 1/rate, coefficient of variation `cv` (cv > 1: bursty)."""
    if rate <= 0 or cv <= 0:
        raise ValueError("gamma arrivals need rate > 0 and cv > 0")
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    t = start
    while True:
        t += rng.gammavariate(shape, scale)
        yield t


def arrival_process(kind: str, rate: float, cv: float, rng: random.Random) -> Iterator[float]:
    if kind == "poisson":
        return poisson_arrivals(rate, rng)
    if kind == "gamma":
        return gamma_arrivals(rate, cv, rng)
    raise ValueError(f"unknown arrival process {kind!r}; use poisson or gamma")


# ---- trace readers --------------------------------------------------------------------------------
def resolve_trace(name_or_path: str | Path) -> TraceFile:
    """A built-in trace by name (package data), or a file path."""
    name = str(name_or_path)
    builtin = builtin_trace(name)
    if builtin is not None:
        return builtin
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"unknown trace {name!r}: not a built-in ({', '.join(BUILTIN_TRACES)}) nor a file")
    return path


def _azure_stamp(stamp: str) -> tuple[int, float]:
    """'2023-11-16 18:15:46.6805900' -> (day ordinal, seconds into the day), 7 fractional digits kept."""
    day, clock = stamp.strip().split(" ")
    y, mo, d = day.split("-")
    h, mi, s = clock.split(":")
    return date(int(y), int(mo), int(d)).toordinal(), int(h) * 3600 + int(mi) * 60 + float(s)


def _mtime(path: TraceFile) -> float:
    """A cache key part that changes when a user's file changes (package data does not change)."""
    return path.stat().st_mtime if isinstance(path, Path) else 0.0


@functools.lru_cache(maxsize=16)
def _read_cached(kind: str, path: TraceFile, mtime: float) -> tuple:
    """A trace file parsed once per process (studies replay the same file hundreds of times)."""
    reader = {"azure": read_azure, "lengths": read_lengths, "mooncake": read_mooncake}[kind]
    return tuple(reader(path))


def read_trace(kind: str, path: TraceFile) -> tuple:
    """`read_azure` / `read_lengths` / `read_mooncake` of `path`, cached until the file changes (read-only)."""
    return _read_cached(kind, path, _mtime(path))


def read_azure(path: TraceFile) -> list[tuple[float, int, int]]:
    """(seconds from the first request, context tokens, generated tokens); the file lacks a final newline."""
    raw = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            raw.append((_azure_stamp(row["TIMESTAMP"]), int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    if not raw:
        raise ValueError(f"{path}: no requests")
    d0, s0 = min(r[0] for r in raw)
    # Subtract before combining days and seconds, so float precision stays sub-microsecond.
    rows = [((d - d0) * 86400 + (s - s0), max(1, p), max(1, o)) for (d, s), p, o in raw]
    rows.sort(key=lambda r: r[0])
    return rows


def read_lengths(path: TraceFile) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) from a Vidur/Sarathi processed-trace CSV."""
    with path.open(newline="") as f:
        out = [(max(1, int(r["num_prefill_tokens"])), max(1, int(r["num_decode_tokens"]))) for r in csv.DictReader(f)]
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def read_mooncake(path: TraceFile) -> list[dict]:
    with path.open() as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no requests")
    return rows


def mooncake_block_keys(hash_ids: list[int], prompt_tokens: int, cache: dict[int, tuple[int, ...]]) -> tuple[int, ...]:
    """Expand 512-token hash ids into chained 16-token block keys: equal id prefixes give equal keys."""
    per = MOONCAKE_BLOCK_TOKENS // BLOCK_SIZE
    keys: list[int] = []
    parent = 0x9E3779B97F4A7C15
    for hid in hash_ids:
        parent = hash((parent, hid)) & 0xFFFFFFFFFFFFFFFF   # tuples of ints hash deterministically
        sub = cache.get(parent)
        if sub is None:
            sub = cache[parent] = tuple(hash((parent, j)) & 0xFFFFFFFFFFFFFFFF for j in range(per))
        keys.extend(sub)
    return tuple(keys[: prompt_tokens // BLOCK_SIZE])


def _detect(path: TraceFile) -> str:
    with path.open() as f:
        head = f.readline()
    if head.lstrip().startswith("{"):
        return "mooncake"
    if "TIMESTAMP" in head:
        return "azure"
    if "num_prefill_tokens" in head:
        return "lengths"
    raise ValueError(f"{path}: unrecognised trace format (header {head.strip()[:80]!r})")


# ---- the one entry point --------------------------------------------------------------------------
def load_workload(
    trace: str | Path = "azure_conv",
    *,
    rate: float | None = None,
    rate_scale: float = 1.0,
    arrival: str = "poisson",
    cv: float = 1.0,
    duration: float | None = None,
    seed: int = 0,
    limit: int | None = None,
) -> list[WorkloadRequest]:
    """Requests sorted by arrival. Timestamped traces keep their arrivals unless `rate` is given;
    `rate_scale` multiplies the arrival rate (divides gaps); `duration` keeps arrivals before it.

    The seed decides what is replayed: for a timestamped trace longer than `duration`, seed k replays the
    window starting k windows in (wrapping around); with synthetic arrivals (lengths-only traces, or `rate`
    given), each request's (prompt, output) pair is drawn i.i.d. from the trace's rows (a file that lists a
    conversation's turns in order would otherwise send bursts of ever longer prompts)."""
    if rate_scale <= 0:
        raise ValueError("rate_scale must be > 0")
    if duration is not None and duration <= 0:
        raise ValueError("duration must be > 0")
    path = resolve_trace(trace)
    rng = random.Random(seed)
    stamps, lengths = _rows_of(path, _mtime(path))
    if rate is not None or stamps is None:
        if rate is None:
            raise ValueError(f"trace {trace!r} has no timestamps: give an arrival rate (req/s)")
        arrivals = arrival_process(arrival, rate * rate_scale, cv, rng)
        n = len(lengths) if duration is None else None   # without a duration: as many requests as rows
        stamps = []
        for i, t in enumerate(arrivals):
            if (n is not None and i >= n) or (duration is not None and t >= duration) or (limit and i >= limit):
                break
            stamps.append(t)
        rows = [rng.randrange(len(lengths)) for _ in stamps]
    else:
        stamps = [t / rate_scale for t in stamps]       # a new list: the cached one stays as it was
        start = 0.0
        span = stamps[-1] if stamps else 0.0
        if duration is not None and seed and span > duration:
            start = (seed * duration) % (span - duration)
        first = bisect.bisect_left(stamps, start)
        rows = list(range(first, len(stamps)))
        stamps = [stamps[j] - start for j in rows]
    out: list[WorkloadRequest] = []
    for i, (t, j) in enumerate(zip(stamps, rows, strict=True)):
        if (duration is not None and t >= duration) or (limit is not None and i >= limit):
            break
        p, o, keys = lengths[j]
        out.append(WorkloadRequest(f"req-{i}", t, p, o, keys, source_row=j))
    return out


@functools.lru_cache(maxsize=8)
def _rows_of(path: TraceFile, mtime: float) -> tuple[tuple[float, ...] | None, tuple[tuple[int, int, tuple[int, ...]], ...]]:
    """(arrival seconds or None for a lengths-only trace, (prompt, output, block keys) per row), parsed once per
    process: studies replay the same file hundreds of times (mooncake's block keys take seconds to expand)."""
    kind = _detect(path)
    if kind == "azure":
        rows = read_trace("azure", path)
        return tuple(t for t, _, _ in rows), tuple((p, o, ()) for _, p, o in rows)
    if kind == "mooncake":
        rows = read_trace("mooncake", path)
        cache: dict[int, tuple[int, ...]] = {}
        t0 = rows[0]["timestamp"]
        return (tuple((r["timestamp"] - t0) / 1000.0 for r in rows),       # ms -> s
                tuple((max(1, r["input_length"]), max(1, r["output_length"]),
                       mooncake_block_keys(r.get("hash_ids", []), r["input_length"], cache)) for r in rows))
    return None, tuple((p, o, ()) for p, o in read_trace("lengths", path))


def trace_rows(trace: str | Path) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of every row of a trace, in file order (the rows `source_row` indexes)."""
    path = resolve_trace(trace)
    kind = _detect(path)
    if kind == "azure":
        return [(p, o) for _, p, o in read_trace("azure", path)]
    if kind == "mooncake":
        return [(max(1, r["input_length"]), max(1, r["output_length"])) for r in read_trace("mooncake", path)]
    return list(read_trace("lengths", path))


def mean_output_tokens(requests: list[WorkloadRequest]) -> float:
    return sum(r.output_tokens for r in requests) / len(requests) if requests else 0.0


def synthetic_workload(
    n: int, rate: float, prompt_tokens: int | tuple[int, int], output_tokens: int | tuple[int, int], *,
    arrival: str = "poisson", cv: float = 1.0, seed: int = 0,
) -> list[WorkloadRequest]:
    """n requests with uniform lengths in the given (lo, hi) ranges (or fixed ints)."""
    rng = random.Random(seed)
    times = arrival_process(arrival, rate, cv, rng)

    def draw(spec: int | tuple[int, int]) -> int:
        return spec if isinstance(spec, int) else rng.randint(*spec)

    return [WorkloadRequest(f"req-{i}", next(times), draw(prompt_tokens), draw(output_tokens)) for i in range(n)]


def rate_of(requests: list[WorkloadRequest]) -> float:
    """Mean arrival rate (req/s) of a workload."""
    if len(requests) < 2:
        return 0.0
    span = requests[-1].arrival - requests[0].arrival
    return (len(requests) - 1) / span if span > 0 else math.inf
