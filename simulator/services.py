"""Workloads of several services sharing the same engines (SeaLLM's setting, docs/reference/seallm-scheduling.md
§1): each service is its own Poisson stream with its own length distribution, and every request carries its
service's name (WorkloadRequest.service).

    wl = service_workload(parse_services("sharegpt,arxiv,azure_conv,code"), rate=20, duration=300, seed=1)

A service's lengths come from a shipped trace (`sharegpt`, `arxiv`, `azure_conv`, `mooncake`: rows drawn i.i.d.)
or from `code`, a synthetic code-completion stream: log-normal prompt and output lengths with the medians of Azure's
2023 LLM-inference code trace as Splitwise reports them (Patel et al., "Splitwise", ISCA 2024, section 3: median
prompt 1500 tokens, median output 13 tokens; the conversation trace shipped here, azure_conv, has the medians that
paper gives for conversation, 1020 and 129). The spreads (sigma 0.8 and 1.0) are ours.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from simulator.package_data import BUILTIN_TRACES
from simulator.workload import WorkloadRequest, arrival_process, trace_rows

CODE_PROMPT_MEDIAN, CODE_PROMPT_SIGMA = 1500, 0.8
CODE_OUTPUT_MEDIAN, CODE_OUTPUT_SIGMA = 13, 1.0
CODE_MAX_TOKENS = 8192
SERVICE_LENGTHS = (*BUILTIN_TRACES, "code")
DEFAULT_SERVICES = "sharegpt,arxiv,azure_conv,code"


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """One service: its name, where its lengths come from and its share of the total arrival rate."""

    name: str
    lengths: str
    share: float = 1.0


def parse_services(text: str) -> list[ServiceSpec]:
    """`sharegpt,arxiv:2,chat=azure_conv:0.5`: comma-separated `[name=]lengths[:share]`; the name defaults to the
    lengths source, shares are relative (equal by default)."""
    out: list[ServiceSpec] = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        name, _, rest = item.rpartition("=")
        lengths, _, share = rest.partition(":")
        name = name or lengths
        if lengths not in SERVICE_LENGTHS:
            raise ValueError(f"service {name!r}: unknown lengths {lengths!r}; use one of {', '.join(SERVICE_LENGTHS)}")
        try:
            weight = float(share) if share else 1.0
        except ValueError:
            raise ValueError(f"service {name!r}: share {share!r} is not a number") from None
        if not weight > 0:
            raise ValueError(f"service {name!r}: share must be > 0")
        if any(s.name == name for s in out):
            raise ValueError(f"service {name!r} is listed twice")
        out.append(ServiceSpec(name, lengths, weight))
    if not out:
        raise ValueError("no services given")
    return out


def code_lengths(rng: random.Random) -> tuple[int, int]:
    """One (prompt, output) pair of the synthetic code service (module docstring)."""
    p = rng.lognormvariate(math.log(CODE_PROMPT_MEDIAN), CODE_PROMPT_SIGMA)
    o = rng.lognormvariate(math.log(CODE_OUTPUT_MEDIAN), CODE_OUTPUT_SIGMA)
    return min(max(1, round(p)), CODE_MAX_TOKENS), min(max(1, round(o)), CODE_MAX_TOKENS)


def service_workload(services: list[ServiceSpec], rate: float, duration: float, *, arrival: str = "poisson",
                     cv: float = 1.0, seed: int = 0) -> list[WorkloadRequest]:
    """Requests of all services sorted by arrival; service i arrives at rate x its share of the total, with its own
    random stream (adding a service leaves the others' requests as they were)."""
    if not rate > 0 or not duration > 0:
        raise ValueError("service workloads need a rate > 0 and a duration > 0")
    total = sum(s.share for s in services)
    out: list[WorkloadRequest] = []
    for i, svc in enumerate(services):
        rng = random.Random(seed * 1009 + i)
        rows = trace_rows(svc.lengths) if svc.lengths != "code" else None
        for n, t in enumerate(arrival_process(arrival, rate * svc.share / total, cv, rng)):
            if t >= duration:
                break
            if rows is None:
                p, o = code_lengths(rng)
                row = None
            else:
                row = rng.randrange(len(rows))
                p, o = rows[row]
            out.append(WorkloadRequest(f"{svc.name}-{n}", t, p, o, service=svc.name, source_row=row))
    out.sort(key=lambda r: r.arrival)
    return out
