"""Service-aware priority in the live gateway (config `service_priority`): the services sharing a model's workers
are ordered by one of policies/service_priority.py's schedulers (SeaLLM's doubling budget, FCFS, round robin).

- The service of a request: the first of `service_from` that names one: the `X-Service` header (1-64 characters
  of letters, digits and `._:-`, else 400), the tenant of the API key (its name; anonymous callers have none),
  the model name.
- Where the order acts: the model's admission queue tries its waiting requests in the scheduler's order, and with
  `engine_priority` each request reaches its worker with vLLM's `priority` field set to the scheduler's number
  (workers run `--scheduling-policy priority`; it replaces a client's own `priority`). vLLM fixes a request's
  priority when it arrives, so a running request is never re-prioritised here (the simulator can, by preemption:
  simulator/service_sim.py). P/D legs keep the client's priority.
- A completed request teaches its service's profile its execution cost (prompt and generated tokens). Each gateway
  replica keeps its own profiles and order (its own queue).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import orjson

from gateway import errors
from gateway.auth import Tenant
from gateway.config import ServicePriorityConfig
from policies.admission import Waiting
from policies.service_priority import ServiceScheduler, make_service_scheduler
from policies.types import RequestFeatures

SERVICE_HEADER = b"x-service"
SERVICE_RE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


class ServiceOrder:
    """One scheduler per model, fed by the dispatcher (gateway/dispatch.py) at arrival, dispatch and finish."""

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
                    return "tenant:" + tenant.name
            else:
                return "model:" + model
        return ""

    def arrived(self, feats: RequestFeatures, service: str) -> None:
        self.scheduler(feats.model).arrived(feats.request_id, service, time.time())

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

    def finished(self, feats: RequestFeatures, completed: bool, generated_tokens: int) -> None:
        self.scheduler(feats.model).finished(feats.request_id, feats.prompt_tokens, generated_tokens, time.time(),
                                             completed=completed)
