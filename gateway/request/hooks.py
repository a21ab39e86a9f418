"""Request hooks: what the dispatcher's collaborators hear of every request, at four points of its life.

    arrived(ctx)            the request was read: its features, model and caller are known (before admission);
                            a hook may refuse it here with a GatewayError
    placed(ctx, worker)     the placement step placed it and its reservation on `worker` is held
    released(ctx, worker)   it left `worker`: the reservation given back and the placement step told
                            (a prefill worker, or a decode worker it moved from, is not reported)
    finished(ctx, outcome)  the response ended, whatever became of it (`Outcome`, gateway/request/context.py); every
                            request reaches it, also one refused before it was read

Who registers, in this order (the dispatcher registers the collaborators it is given, gateway/pipeline/dispatch.py
`Dispatcher`; gateway/core.py gives it the Batch API's class router): the class router (arrived: the
autoscaler's arrival count; placed, released), the service order while it is on (arrived, finished), the
callers' rate-limit tickets (arrived, finished), the learner (released), the SLO book (finished), the request
metrics (finished, gateway/pipeline/request_metrics.py), the request observer when the access log or tracing is on
(placed, finished). A hook is any object of the `RequestHook` shape; one that subclasses it overrides only the
points it needs, as llm-d's request-control plug-ins do. The dispatcher calls the hooks of a point in the order
they were registered; a hook must not block (no I/O).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gateway.fleet.registry import WorkerState
    from gateway.request.context import Outcome, RequestContext

POINTS = ("arrived", "placed", "released", "finished")


class RequestHook(Protocol):
    """The shape of a request hook (module docstring); the default of each point does nothing."""

    def arrived(self, ctx: RequestContext) -> None:
        return None

    def placed(self, ctx: RequestContext, worker: WorkerState) -> None:
        return None

    def released(self, ctx: RequestContext, worker: WorkerState) -> None:
        return None

    def finished(self, ctx: RequestContext, outcome: Outcome) -> None:
        return None


def _bound(hooks: Sequence[object], point: str) -> tuple[Callable, ...]:
    """The hooks' methods for `point`, skipping the do-nothing defaults (a point nobody hears costs a loop over
    nothing)."""
    default = getattr(RequestHook, point)
    out = []
    for h in hooks:
        fn = getattr(type(h), point, None)
        if fn is not None and fn is not default:
            out.append(getattr(h, point))
    return tuple(out)


class RequestHooks:
    """The registered hooks, called point by point."""

    __slots__ = ("hooks", "_arrived", "_placed", "_released", "_finished")

    def __init__(self, hooks: Sequence[RequestHook] = ()) -> None:
        self.hooks: tuple[RequestHook, ...] = tuple(hooks)
        self._arrived = _bound(self.hooks, "arrived")
        self._placed = _bound(self.hooks, "placed")
        self._released = _bound(self.hooks, "released")
        self._finished = _bound(self.hooks, "finished")

    def arrived(self, ctx: RequestContext) -> None:
        for fn in self._arrived:
            fn(ctx)

    def placed(self, ctx: RequestContext, worker: WorkerState) -> None:
        for fn in self._placed:
            fn(ctx, worker)

    def released(self, ctx: RequestContext, worker: WorkerState) -> None:
        for fn in self._released:
            fn(ctx, worker)

    def finished(self, ctx: RequestContext, outcome: Outcome) -> None:
        for fn in self._finished:
            fn(ctx, outcome)
