"""One request's context from end to end, and the per-model state it runs against.

`RequestContext` is the one place a request's state lives while the gateway serves it: what the client sent,
the placement step's decision (P/D included), the reservations it holds, the observer's record (access log and
tracing, gateway/ops/observe.py) and the learner's in-flight entry (gateway/pipeline/learning.py). The dispatcher
(gateway/pipeline/dispatch.py) builds it when the request arrives; the attempt loop (gateway/pipeline/attempts.py) alone writes
its placement state; the leg runner (gateway/pipeline/legs.py), the P/D legs (gateway/pipeline/pd_legs.py) and the request hooks
(gateway/request/hooks.py) read it (and fill their own entries). This module holds only data, so
all of them import it and none of them imports the dispatcher.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.fleet.registry import WorkerState
    from gateway.ops.observe import RequestRecord
    from gateway.request.admission import ModelQueue
    from gateway.request.parse import ClientHeaders, ParsedRequest, Route
    from gateway.state.ratelimit import Ticket
    from gateway.wire.errors import GatewayError
    from gateway.wire.results import RelayResult, ResponseState
    from policies.base import Policy
    from policies.placement import ModelPlacement
    from policies.types import Decision, RequestFeatures


UNKNOWN_MODEL_LABEL = "_unknown"  # the model of a request that never resolved to a served model (metrics label)


@dataclass(slots=True)
class ModelRuntime:
    """Per-model routing state, built once on the model's first request."""

    model: str
    policy: Policy
    policy_name: str
    needs_prefix: bool
    placement: ModelPlacement
    queue: ModelQueue
    needs_chain: bool = False   # the policy infers a turn's conversation from RequestFeatures.prefix_chain


@dataclass(slots=True)
class InFlight:
    """The learner's entry for a request sent to a worker (gateway/pipeline/learning.py): its control loop reports the
    request's progress to the placement step and settles prefill observations by it."""

    worker: str
    t_sent: float            # perf_counter() when the leg was sent
    reported: int = 0        # output tokens already reported to the placement step


@dataclass(slots=True, eq=False)
class RequestContext:
    """One request on its way through the pipeline: what the client sent, what the gateway decided, and the
    reservations it holds.

    Built when the request arrives (the first group of fields); the request's reading (`req` to `models`) is
    set by `Dispatcher.handle` before the request is admitted, and only then do the hooks' `arrived`, `placed`
    and `released` see it. A request refused before that (a malformed body, an unknown model) reaches
    `finished` without them: `Outcome.feats` is None then."""

    rid: bytes
    route: Route
    send: Any                           # ASGI send
    state: ResponseState
    t0: float                           # perf_counter() at arrival
    client_headers: list[tuple[bytes, bytes]]   # response headers for the client (X-Request-Id, ...)
    headers: list[tuple[bytes, bytes]]  # the client's request headers, as the server read them
    record: RequestRecord | None = None  # the observer's record (None: no access log and no tracing)
    # --- the request's reading (set before admission) ---
    req: ParsedRequest = field(init=False)
    rt: ModelRuntime = field(init=False)
    feats: RequestFeatures = field(init=False)
    payload: bytes = field(init=False)  # the body for the worker, byte for byte unless shaping changed it
    strip_usage: bool = field(init=False)
    upstream_headers: bytes = field(init=False)  # worker-bound headers besides Host and Content-Length, encoded
    hdrs: ClientHeaders | None = None   # the client's headers (request features for a fallback model)
    tenant: Any = None                  # the caller (gateway/tenancy/auth.py Tenant): the models it may use
    models: list[str] = field(default_factory=list)  # the models it was placed on, the requested one first
    service: str | None = None          # its service in the service order (gateway/tenancy/services.py), once arrived
    ticket: Ticket | None = None        # its caller's rate-limit ticket (gateway/tenancy/tickets.py), a limited key's
    # --- placement and reservations ---
    decision: Decision | None = None
    pd: bool = False                    # the placement step's P/D profile placed it (it runs as P/D legs)
    routing_s: float = 0.0              # how long its last placement took
    swap_s: float = 0.0                 # its model's wake on a shared host it waited for: part of its TTFT budget
    worker: WorkerState | None = None   # the (decode) worker holding a reservation for the request
    prefill: WorkerState | None = None  # P/D: the prefill worker holding a reservation for its prompt
    tried: list[str] = field(default_factory=list)
    refusal_fails: bool = False         # a worker's 429 is a failure to place again (a fallback is left)
    moved_to: str | None = None         # rebalancing moved it (at most once), towards this worker
    replacing: str | None = None        # P/D: the decode worker its decode leg is being re-placed from
    inflight: InFlight | None = None    # the learner's entry while a leg generates (gateway/pipeline/learning.py)

    @property
    def stream(self) -> bool:
        return self.req.stream


@dataclass(slots=True)
class Outcome:
    """How a request ended, as the `finished` hooks hear it."""

    status: int                          # the status counted: the one the client received (a front door's own,
                                         # gateway/wire/translated.py), 499: client gone, 502: a stream that broke
    result: RelayResult | None           # the answer relayed (None: refused, failed or gone before one)
    model: str                           # the model that served it (UNKNOWN_MODEL_LABEL: it resolved to none)
    policy: str                          # that model's policy ("" when none)
    feats: RequestFeatures | None        # its features at arrival (None: refused before it was read)
    t_end: float                         # perf_counter() when the answer ended (or the request was refused)
    error: GatewayError | None = None    # the gateway's own refusal, if it answered with one
