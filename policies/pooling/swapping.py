"""Request-level swapping over shared hosts whose engines sleep and wake (ServerlessLLM-style, Aegaeon SOSP 2025
sections 2.3 and 3.1), pure: the caller (the gateway's swap controller, gateway/pooling.py) says which models
have requests waiting for an awake engine and what each host's engines are doing; `RequestLevelSwaps.plan`
answers which engine to put to sleep and which to wake.

The rules are `baselines.RequestSwapping`'s, over engines instead of one resident model per host:

- demand is served first come, first served: the model whose requests started waiting first is woken first;
- a host wakes a model while fewer than `max_awake` of its engines are awake (or waking);
- else only an idle engine is swapped out (nothing in flight on it and nothing waiting for it), the one idle
  longest first; a busy host makes the oldest demand wait for it (the head-of-line blocking of section 3.1), and
  younger demand for that host waits behind it;
- a host does one swap at a time.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field


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

    def plan(self, hosts: Mapping[str, HostView], waiting: Collection[str] = ()) -> list[SwapStep]:
        """The swaps to start now, at most one per host. `waiting`: models with requests waiting in the gateway
        (their engines are never swapped out). Demand already met (an engine of the model awake) is dropped."""
        steps: list[SwapStep] = []
        blocked: set[str] = set()     # hosts taken by an older demand (a step, or waiting for an idle engine)
        for model in sorted(self.demand, key=self.demand.__getitem__):
            holders = [h for h, v in hosts.items() if model in v.engines and v.engines[model].usable]
            if any(hosts[h].engines[model].awake for h in holders):
                self.served(model)      # awake (or waking) somewhere: its requests are placed there
                continue
            free = [h for h in holders if h not in blocked and not hosts[h].switching]
            step = _wake_on(model, free, hosts, waiting)
            if step is not None:
                steps.append(step)
            blocked.update(holders)
        return steps


def _wake_on(model: str, free: list[str], hosts: Mapping[str, HostView], waiting: Collection[str]) -> SwapStep | None:
    """A host with room first (the least loaded), else the host whose idle victim has been idle longest."""
    room = [h for h in free if hosts[h].awake_count() < hosts[h].max_awake]
    if room:
        return SwapStep(min(room, key=lambda h: (_busy(hosts[h]), h)), model)
    best: tuple[float, str, str] | None = None
    for h in free:
        for m, e in hosts[h].engines.items():
            if e.awake and e.busy == 0 and m not in waiting and (best is None or (e.idle_since, h, m) < best):
                best = (e.idle_since, h, m)
    if best is None:
        return None
    _, h, victim = best
    extra = hosts[h].awake_count() - hosts[h].max_awake   # more awake than allowed (e.g. at start): those too
    victims = [victim] + [m for m, e in hosts[h].engines.items()
                          if e.awake and e.busy == 0 and m != victim and m not in waiting][:max(extra, 0)]
    return SwapStep(h, model, tuple(victims))


def _busy(host: HostView) -> int:
    return sum(e.busy for e in host.engines.values())
