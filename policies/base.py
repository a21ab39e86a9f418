"""The policy interface and the name -> policy registry.

A policy is an object (it may keep state such as a round-robin counter or a prefix index) whose
methods take the clock as an argument. The gateway's dispatcher and the virtual-time simulator call
exactly these methods, in the same order:

    decision = policy.choose(request, candidates, now)   # candidates: healthy, serve the model, under cap
    policy.on_dispatch(request, decision.worker_id, now)  # the request was sent there
    policy.on_complete(request, worker_id, now)           # it finished (any outcome)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from policies.types import Decision, RequestFeatures, WorkerView


class Policy:
    """Base class: subclasses implement `choose`; the hooks are optional."""

    name: str = "base"
    # A policy that reads RequestFeatures.prefix_hashes says so: the gateway hashes prompts only for those.
    needs_prefix_hashes: bool = False
    # ... and one that reads RequestFeatures.prefix_chain (every full chunk of the prompt) says so too.
    needs_prefix_chain: bool = False
    # A policy that places by performance models says so: every worker then needs its profile's model.
    needs_perf_models: bool = False

    def choose(self, request: RequestFeatures, workers: Sequence[WorkerView], now: float) -> Decision:
        raise NotImplementedError

    def on_dispatch(self, request: RequestFeatures, worker_id: str, now: float) -> None:  # noqa: B027
        """Called once the request was sent to `worker_id`."""

    def on_complete(self, request: RequestFeatures, worker_id: str, now: float) -> None:  # noqa: B027
        """Called when the request finished on `worker_id`, whatever the outcome."""


PolicyFactory = Callable[..., Policy]
_REGISTRY: dict[str, PolicyFactory] = {}
# The policy of models that name none (config `default_policy`, the CLI's and demos' defaults): token-aware load,
# which held on long-prompt traffic where counting requests did not (bench/results/peers_sched.md).
DEFAULT_POLICY = "least_tokens"


def register(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    """Class decorator: make a policy constructible by name (`make_policy(name, **params)`)."""

    def deco(factory: PolicyFactory) -> PolicyFactory:
        _REGISTRY[name] = factory
        return factory

    return deco


def make_policy(name: str, **params: Any) -> Policy:
    _load_builtin()
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None
    return factory(**params)


def policy_names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def _load_builtin() -> None:
    # Importing the modules registers their policies.
    import policies.aladdin  # noqa: F401
    import policies.autoscale.routing  # noqa: F401
    import policies.baselines  # noqa: F401
    import policies.hetero  # noqa: F401
    import policies.precise_prefix  # noqa: F401
