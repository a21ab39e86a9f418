"""Service-aware priority in the live gateway (config `service_priority`): the services sharing a model's workers
are ordered by one of policies/service_priority.py's schedulers (SeaLLM's doubling budget, FCFS, round robin, and
VTC's fair sharing between tenants).

- The service of a request: the first of `service_from` that names one: the `X-Service` header (1-64 characters
  of letters, digits and `._:-`, else 400), the tenant of the API key (its name; anonymous callers have none),
  the model name.
- Where the order acts: the model's admission queue tries its waiting requests in the scheduler's order, and with
  `engine_priority` each request reaches its worker with vLLM's `priority` field set to the scheduler's number
  (workers run `--scheduling-policy priority`; it replaces a client's own `priority`). vLLM fixes a request's
  priority when it arrives, so a running request is never re-prioritised here (the simulator can, by preemption:
  simulator/service_sim.py). P/D legs keep the client's priority.
- Tenants (`vtc`): with `service_from: [tenant]` a tenant is an API key's `name` (keys sharing a name are one tenant)
  and all requests without a key are one more tenant (the service ""). `weights` name an X-Service value or a key's
  name. VTC charges a request's prompt when it leaves the queue for a worker and its output tokens when it finishes
  (the gateway does not count tokens while they stream), as if made evenly over its run: the part made before
  its tenant was lifted is absorbed by the lift (policies/service_priority.py). VTC reorders what waits in the
  gateway's queue, so give the workers a `cap`: without one every request goes at once to an engine, whose own
  queue VTC reaches only through `engine_priority` fixed at dispatch, and the order is then close to FCFS.
- A completed request teaches its service's profile its execution cost (prompt and generated tokens). Each gateway
  replica keeps its own profiles and order (its own queue).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from gateway.config import ServicePriorityConfig
from gateway.request.hooks import RequestHook
from gateway.tenancy.auth import Tenant
from gateway.wire import errors
from policies.admission import Waiting
from policies.service_priority import ServiceScheduler, make_service_scheduler
from policies.types import RequestFeatures

if TYPE_CHECKING:
    from gateway.request.context import Outcome, RequestContext

SERVICE_HEADER = b"x-service"
SERVICE_RE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
TENANT_PREFIX = "tenant:"   # the service of a keyed caller: "tenant:<key name>"


class ServiceOrder(RequestHook):
    """One scheduler per model, fed at arrival and finish (request hooks, gateway/request/hooks.py: registered while
    the order is on) and at dispatch (the leg runner, gateway/pipeline/legs.py)."""

    def __init__(self, config: ServicePriorityConfig) -> None:
        self.config = config
        self._schedulers: dict[str, ServiceScheduler] = {}

    @property
    def enabled(self) -> bool:
        return self.config.order != "off"

    def scheduler(self, model: str) -> ServiceScheduler:
        s = self._schedulers.get(model)
        if s is None:
            cfg = self.config
            params: dict[str, Any] = {"prompt_token_cost": cfg.prompt_token_cost}
            if cfg.order == "seallm":
                params.update(starvation_s=cfg.starvation_s, default_starvation_s=cfg.default_starvation_s)
            elif cfg.order == "vtc":
                weights = {**{TENANT_PREFIX + k: w for k, w in cfg.weights.items()}, **cfg.weights}
                params.update(weights=weights, input_weight=cfg.input_token_weight,
                              output_weight=cfg.output_token_weight)
            s = self._schedulers[model] = make_service_scheduler(cfg.order, **params)
        return s

    def service_of(self, headers: list[tuple[bytes, bytes]], tenant: Tenant, model: str) -> str:
        for source in self.config.service_from:
            if source == "header":
                raw = next((v for k, v in headers if k == SERVICE_HEADER), None)
                if raw is not None:
                    name = raw.decode("latin-1").strip()
                    if not SERVICE_RE.match(name):
                        raise errors.bad_request("X-Service must be 1-64 letters, digits or `._:-`.", "X-Service")
                    return name
            elif source == "tenant":
                if tenant.id:
                    return TENANT_PREFIX + tenant.name
            else:
                return "model:" + model
        return ""

    def arrived(self, ctx: RequestContext) -> None:
        """Request hook: the request joins its service's account (`ctx.service`); a malformed X-Service header
        refuses it (400)."""
        feats = ctx.feats
        service = self.service_of(ctx.headers, ctx.tenant, feats.model)
        self.scheduler(feats.model).arrived(feats.request_id, service, time.time(), prompt_tokens=feats.prompt_tokens)
        ctx.service = service

    def queue_order(self, model: str) -> Callable[[float], Callable[[Waiting], Any]]:
        """For the model's admission queue: given the drain's clock, the sort key of a waiting request."""
        key = self.scheduler(model).key
        return lambda now: (lambda w: key(w.features.request_id, now))

    def dispatched(self, feats: RequestFeatures, payload: bytes) -> bytes:
        """The request leaves for a worker: the body it is sent with (with vLLM's `priority` when configured)."""
        s = self.scheduler(feats.model)
        now = time.time()
        s.started(feats.request_id, now)
        if not self.config.engine_priority:
            return payload
        body = orjson.loads(payload)   # the shaped body or a continuation's: the bytes are what the worker gets
        body["priority"] = s.engine_priority(feats.request_id, now)
        return orjson.dumps(body)

    def finished(self, ctx: RequestContext, outcome: Outcome) -> None:
        """Request hook: the request leaves its service's account (on the model it arrived for), with the
        tokens it generated when it completed."""
        feats = outcome.feats
        if ctx.service is None or feats is None:
            return
        result = outcome.result
        done = result is not None and outcome.status == 200 and result.midstream_error is None
        self.scheduler(feats.model).finished(feats.request_id, feats.prompt_tokens,
                                             result.output_tokens if done else 0, time.time(), completed=done)
