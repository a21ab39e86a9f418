"""The request-level ways to share hosts between models, which Aegaeon (SOSP 2025, sections 2.3 and 7.1)
compares against, pure like every policy.

- Dedicated: one model per host (`static_placement(..., per_host=1)`): no switching, N >= M hosts.
- Co-resident multiplexing (MuxServe-style, section 2.3): as many models awake on a host as its memory holds
  (`resident_capacity`), placed once by popularity (`static_placement`), time-shared step by step in round
  robin (`RoundRobin`). Models beyond the hosts' room are not served.
- Request-level swapping (ServerlessLLM-style, sections 2.3 and 3.1): policies/pooling/swapping.py
  `RequestLevelSwaps`, the one planner the live gateway (gateway/control/pooling.py) and the simulator
  (simulator/pooled.py, `--pooling request`) both use.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence


def resident_capacity(memory_bytes: float, weight_bytes: float, kv_bytes_per_token: float,
                      min_kv_tokens: int) -> int:
    """How many copies of a model fit awake on one host: each needs its weights and room for at least one
    longest request's KV (`min_kv_tokens`, the model's context), from `memory_bytes` for weights plus KV."""
    if weight_bytes <= 0 or kv_bytes_per_token <= 0:
        raise ValueError("weight_bytes and kv_bytes_per_token must be > 0")
    return max(0, int(memory_bytes // (weight_bytes + kv_bytes_per_token * min_kv_tokens)))


def shared_kv_capacity(memory_bytes: float, weight_bytes: float, kv_bytes_per_token: float,
                       min_kv_tokens: int) -> int:
    """How many models fit awake on one host when their KV cache is one shared pool (SeaLLM section 4.4, the
    unified KV cache): every model's weights plus room for one longest request's KV in all."""
    if weight_bytes <= 0 or kv_bytes_per_token <= 0:
        raise ValueError("weight_bytes and kv_bytes_per_token must be > 0")
    return max(0, int((memory_bytes - kv_bytes_per_token * min_kv_tokens) // weight_bytes))


def static_placement(rates: Mapping[str, float], hosts: Sequence[str], per_host: int) -> dict[str, list[str]]:
    """Models -> the hosts holding a copy awake (MuxServe-style placement by popularity).

    There are len(hosts) x per_host slots. With fewer slots than models the most requested models get one
    each and the rest none (absent from the result). Spare slots become extra copies of the model with the
    most traffic per copy. Copies go, busiest first, to the host with the least traffic so far that has room
    and does not yet hold that model."""
    if per_host < 1 or not hosts:
        return {}
    slots = len(hosts) * per_host
    ranked = sorted(rates, key=lambda m: (-rates[m], m))
    copies = dict.fromkeys(ranked[:slots], 1)
    for _ in range(slots - len(copies)):
        if not copies:
            break
        busiest = max(copies, key=lambda m: (rates[m] / copies[m], m))
        if copies[busiest] >= len(hosts):
            break
        copies[busiest] += 1
    load = dict.fromkeys(hosts, 0.0)
    held: dict[str, list[str]] = {h: [] for h in hosts}
    out: dict[str, list[str]] = {}
    for m in sorted(copies, key=lambda m: (-rates[m] / copies[m], m)):
        for _ in range(copies[m]):
            room = [h for h in hosts if len(held[h]) < per_host and m not in held[h]]
            if not room:
                break
            h = min(room, key=lambda x: (load[x], hosts.index(x)))
            held[h].append(m)
            load[h] += rates[m] / copies[m]
            out.setdefault(m, []).append(h)
    return out


class RoundRobin:
    """Temporal multiplexing on one host: the next resident model with work after the one that ran last."""

    def __init__(self, models: Sequence[str]) -> None:
        self.models = list(models)
        self._last = -1

    def next(self, with_work: Collection[str]) -> str | None:
        n = len(self.models)
        for k in range(1, n + 1):
            i = (self._last + k) % n
            if self.models[i] in with_work:
                self._last = i
                return self.models[i]
        return None
