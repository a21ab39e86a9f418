"""Multi-model workloads for pooled serving (Aegaeon section 7.1's setting).

    wl = multi_model_workload(ModelMix(num_models=16, total_rate=1.6, skew=1.0), duration=300, seed=1)
    wl.requests[0].model, wl.rates            # per request its model; per model its Poisson rate

Each of M models gets a Poisson stream. Popularity is Zipf-skewed: model i (1-based) gets a share of the total
rate proportional to 1 / i^s (s = 0: every model the same rate, Aegaeon's per-model lambda; section 2.2 reports
production traffic far more skewed). Each model draws its (prompt, output) lengths from one of the shipped
traces or the synthetic `code` stream of simulator/services.py (cycled over the models), keeping only rows
that fit the model's context, and carries the SLO of its class (here one SLO for all: Aegaeon section 7.1 uses TTFT 10 s and TBT 100 ms).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from simulator.services import code_lengths
from simulator.workload import WorkloadRequest, poisson_arrivals, trace_rows


@dataclass(slots=True)
class ModelRequest(WorkloadRequest):
    """A workload request for one model of a multi-model fleet."""

    model: str = ""


def parse_skew(text: str) -> float:
    """`zipf:S` (S >= 0) or `uniform` (S = 0) -> S."""
    text = text.strip().lower()
    if text == "uniform":
        return 0.0
    kind, sep, value = text.partition(":")
    if kind != "zipf" or not sep:
        raise ValueError(f"model skew must be 'uniform' or 'zipf:S', got {text!r}")
    try:
        s = float(value)
    except ValueError:
        raise ValueError(f"zipf exponent must be a number, got {value!r}") from None
    if not s >= 0:
        raise ValueError(f"zipf exponent must be >= 0, got {value!r}")
    return s


def zipf_rates(total_rate: float, num_models: int, skew: float) -> list[float]:
    """Per-model rates summing to `total_rate`, model i's share proportional to 1 / i^skew."""
    if total_rate <= 0 or num_models < 1 or skew < 0:
        raise ValueError("total_rate > 0, num_models >= 1 and skew >= 0 are required")
    weights = [1.0 / (i ** skew) for i in range(1, num_models + 1)]
    total = sum(weights)
    return [total_rate * w / total for w in weights]


def model_names(num_models: int) -> list[str]:
    return [f"model-{i:02d}" for i in range(num_models)]


@dataclass(frozen=True, slots=True)
class ModelMix:
    num_models: int
    total_rate: float
    skew: float = 0.0
    traces: tuple[str, ...] = ("sharegpt",)
    max_model_len: int = 4096
    slo_ttft_s: float = 10.0
    slo_tpot_s: float = 0.1


@dataclass(slots=True)
class MultiModelWorkload:
    requests: list[ModelRequest]
    rates: dict[str, float]
    traces: dict[str, str]
    mean_output: dict[str, float] = field(default_factory=dict)   # per model, over its trace's fitting rows


def multi_model_workload(mix: ModelMix, duration: float, seed: int = 0) -> MultiModelWorkload:
    """Arrivals over [0, duration) for every model of the mix, merged in arrival order."""
    if duration <= 0:
        raise ValueError("duration must be > 0")
    if not mix.traces:
        raise ValueError("at least one trace is required")
    names = model_names(mix.num_models)
    rates = dict(zip(names, zipf_rates(mix.total_rate, mix.num_models, mix.skew), strict=True))
    rng = random.Random(seed)
    out: list[ModelRequest] = []
    traces: dict[str, str] = {}
    means: dict[str, float] = {}
    for k, name in enumerate(names):
        trace = mix.traces[k % len(mix.traces)]
        rows = _fitting_rows(trace, mix.max_model_len)
        traces[name] = trace
        means[name] = sum(o for _, o in rows) / len(rows)
        model_rng = random.Random(rng.getrandbits(64))
        for t in poisson_arrivals(rates[name], model_rng):
            if t >= duration:
                break
            p, o = rows[model_rng.randrange(len(rows))]
            out.append(ModelRequest("", t, p, o, max_tokens=o, slo_ttft_s=mix.slo_ttft_s,
                                    slo_tpot_s=mix.slo_tpot_s, model=name))
    out.sort(key=lambda r: r.arrival)
    for i, r in enumerate(out):
        r.request_id = f"req-{i}"
    return MultiModelWorkload(out, rates, traces, means)


CODE_ROWS = 10_000     # the synthetic `code` lengths are drawn once (fixed seed) into a table of this many rows


def _fitting_rows(trace: str, max_model_len: int) -> Sequence[tuple[int, int]]:
    if trace == "code":          # simulator/services.py's code-completion stream (Splitwise's medians)
        rng = random.Random(0)
        source = [code_lengths(rng) for _ in range(CODE_ROWS)]
    else:
        source = trace_rows(trace)
    rows = [(p, o) for p, o in source if p + o < max_model_len]
    if not rows:
        raise ValueError(f"trace {trace!r} has no request that fits a context of {max_model_len} tokens")
    return rows
