"""The request-level ways to share hosts between models, which Aegaeon (SOSP 2025, sections 2.3 and 7.1)
compares against, pure like every policy.

- Dedicated: one model per host (`static_placement(..., per_host=1)`): no switching, N >= M hosts.
- Co-resident multiplexing (MuxServe-style, section 2.3): as many models awake on a host as its memory holds
  (`resident_capacity`), placed once by popularity (`static_placement`), time-shared step by step in round
  robin (`RoundRobin`). Models beyond the hosts' room are not served.
- Request-level swapping (ServerlessLLM-style, sections 2.3 and 3.1, `RequestSwapping`): one model awake per
  host; requests queue on a host in arrival order (FCFS) and the host switches to the model of the oldest
  waiting request only when its engine is idle, so a long request blocks every other model queued behind it
  (the head-of-line blocking of section 3.1).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass


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


@dataclass(frozen=True, slots=True)
class Placed:
    host: str
    direct: bool        # True: join the host's engine now (it runs this model and nobody waits before it)


class RequestSwapping:
    """Request-level auto-scaling over hosts that each hold one model awake (module docstring).

    The caller reports: `place` (a request arrived), `finished` (one of a host's requests ended) and asks
    `next_load` when a host's engine is idle; it answers which model to run next and which queued requests
    go to it (all queued requests of that model: its engine batches them)."""

    def __init__(self, hosts: Sequence[str]) -> None:
        if not hosts:
            raise ValueError("request-level swapping needs at least one host")
        self.hosts = list(hosts)
        self.current: dict[str, str | None] = dict.fromkeys(self.hosts)
        self.queues: dict[str, deque[tuple[str, str]]] = {h: deque() for h in self.hosts}
        self.inflight: dict[str, int] = dict.fromkeys(self.hosts, 0)

    def place(self, request_id: str, model: str) -> Placed:
        serving = [h for h in self.hosts if self.current[h] == model and not self.queues[h]]
        if serving:
            h = min(serving, key=lambda x: self.inflight[x])
            self.inflight[h] += 1
            return Placed(h, True)
        h = min(self.hosts, key=lambda x: (len(self.queues[x]) + self.inflight[x], self.current[x] != model))
        self.queues[h].append((request_id, model))
        return Placed(h, False)

    def finished(self, host: str) -> None:
        self.inflight[host] -= 1

    def idle(self, host: str) -> bool:
        return self.inflight[host] == 0

    def peek(self, host: str, pick: Callable[[Sequence[tuple[str, str]]], str] | None = None) -> str | None:
        """The model `next_load` would bring next (None: nothing queued); what a prefetch should bring."""
        queue = self.queues[host]
        if not queue:
            return None
        return pick(queue) if pick is not None else queue[0][1]

    def next_load(self, host: str, pick: Callable[[Sequence[tuple[str, str]]], str] | None = None
                  ) -> tuple[str, list[str]] | None:
        """With the host's engine idle: the model of its oldest queued request (or the one `pick` chooses from
        the queue's (request id, model) pairs: a service priority) and every queued request of that model, now
        in flight (None: nothing queued)."""
        queue = self.queues[host]
        if not queue or self.inflight[host]:
            return None
        model = self.peek(host, pick)
        taken = [rid for rid, m in queue if m == model]
        self.queues[host] = deque((rid, m) for rid, m in queue if m != model)
        self.current[host] = model
        self.inflight[host] += len(taken)
        return model, taken
