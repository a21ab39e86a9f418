"""Request-level swapping over shared hosts whose engines sleep and wake (ServerlessLLM-style, Aegaeon SOSP 2025
sections 2.3 and 3.1), pure: the caller says which models have requests waiting for an awake engine and what
each host's engines are doing; `RequestLevelSwaps.plan` answers which engine to put to sleep and which to wake.
The one planner of the live gateway (its swap controller, gateway/control/pooling.py) and the simulator
(simulator/pooled.py `--pooling request`, one engine awake per host, drained at once).

The rules:

- requests wait in one queue per model (not on a host: the first engine of the model awake takes them), and
  demand is served first come, first served: the model whose requests started waiting first is woken first
  (or, given an `order`, the model a service-aware priority ranks first); the model a swap wakes is fixed when
  the swap is planned (the drain of a busy engine included);
- a host wakes a model while fewer than `max_awake` of its engines are awake (or waking);
- else an idle engine is swapped out (nothing in flight), the one idle longest first;
- with none idle, once the demand has waited the host's `drain_after_s`, the engine with the fewest requests in flight is
  drained: it takes no new request (its model's later requests queue behind the waiting one, FCFS) and sleeps
  when its last request ends. A long request so blocks every model queued behind it (the head-of-line blocking
  of section 3.1). Draining at once
  (0) is strict FCFS but swaps more (the drained model's next requests want a host too); never (None) lets a
  model with steady traffic keep its host while others wait;
- an engine whose model has requests waiting in the gateway is not swapped out;
- a host does one swap at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineView:
    """One model's engine on a host, as the controller sees it now."""

    awake: bool              # awake, or waking (it counts against max_awake either way)
    busy: int = 0            # requests in flight on it (every gateway replica's)
    idle_since: float = 0.0  # when its last request ended (the longest idle is swapped out first)
    usable: bool = True      # healthy and not failed its last wake-up


@dataclass(frozen=True, slots=True)
class HostView:
    max_awake: int
    engines: Mapping[str, EngineView]   # model -> its engine on this host
    switching: bool = False             # a swap is under way on it
    drain_after_s: float | None = None  # a demand this old may drain a busy engine (module docstring); None: never

    def awake_count(self) -> int:
        return sum(1 for e in self.engines.values() if e.awake)


@dataclass(frozen=True, slots=True)
class SwapStep:
    """On `host`: put the engines of `sleep` to sleep (in order), then wake the engine of `wake`."""

    host: str
    wake: str
    sleep: tuple[str, ...] = ()


@dataclass(slots=True)
class RequestLevelSwaps:
    """The FCFS demand book and the planner (module docstring)."""

    demand: dict[str, float] = field(default_factory=dict)   # model -> when it started waiting (insertion order)

    def want(self, model: str, now: float) -> None:
        """Requests for `model` wait with none of its engines awake."""
        self.demand.setdefault(model, now)

    def served(self, model: str) -> None:
        self.demand.pop(model, None)

    def plan(self, hosts: Mapping[str, HostView], waiting: Collection[str] = (), now: float = 0.0,
             order: Callable[[str], Any] | None = None) -> list[SwapStep]:
        """The swaps to start now, at most one per host. `waiting`: models with requests waiting in the gateway
        (their engines are never swapped out). Demand already met (an engine of the model awake) is dropped.
        `order`: a service-aware priority's key of a waiting model (smaller first; SeaLLM section 4.2, the
        simulator's `--service-priority`); None: first come, first served."""
        steps: list[SwapStep] = []
        blocked: set[str] = set()     # hosts taken by an older demand (a step, or waiting for an idle engine)
        for model in sorted(self.demand, key=order or self.demand.__getitem__):
            holders = [h for h, v in hosts.items() if model in v.engines and v.engines[model].usable]
            if any(hosts[h].engines[model].awake for h in holders):
                self.served(model)      # awake (or waking) somewhere: its requests are placed there
                continue
            free = [h for h in holders if h not in blocked and not hosts[h].switching]
            step = _wake_on(model, free, hosts, waiting, now - self.demand[model])
            if step is not None:
                steps.append(step)
            blocked.update(holders)
        return steps


def _wake_on(model: str, free: list[str], hosts: Mapping[str, HostView], waiting: Collection[str],
             waited: float) -> SwapStep | None:
    """A host with room first (the least loaded), else the awake engine to swap out: an idle one (idle longest),
    or on hosts whose `drain_after_s` the demand has `waited`, the one with the fewest requests in flight."""
    room = [h for h in free if hosts[h].awake_count() < hosts[h].max_awake]
    if room:
        return SwapStep(min(room, key=lambda h: (_busy(hosts[h]), h)), model)
    best: tuple[int, float, str, str] | None = None
    for h in free:
        after = hosts[h].drain_after_s
        drain = after is not None and waited >= after
        for m, e in hosts[h].engines.items():
            if e.awake and (drain or e.busy == 0) and m not in waiting and (
                    best is None or (e.busy, e.idle_since, h, m) < best):
                best = (e.busy, e.idle_since, h, m)
    if best is None:
        return None
    _, _, h, victim = best
    drain = hosts[h].drain_after_s is not None and waited >= hosts[h].drain_after_s
    extra = hosts[h].awake_count() - hosts[h].max_awake   # more awake than allowed (e.g. at start): those too
    victims = [victim] + [m for m, e in hosts[h].engines.items()
                          if e.awake and (drain or e.busy == 0) and m != victim and m not in waiting][:max(extra, 0)]
    return SwapStep(h, model, tuple(victims))


def _busy(host: HostView) -> int:
    return sum(e.busy for e in host.engines.values())
