"""Every proxied request counted, as a request hook (gateway/hooks.py `finished`): its status per model and policy,
its duration, and for an answered request its time to first token and time per output token
(gateway/metrics.py series)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gateway.context import UNKNOWN_MODEL_LABEL
from gateway.hooks import RequestHook

if TYPE_CHECKING:
    from gateway.context import Outcome, RequestContext
    from gateway.metrics import GatewayMetrics


class RequestMetrics(RequestHook):
    """The request series of the gateway's metrics, fed when each request finishes."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def finished(self, ctx: RequestContext, outcome: Outcome) -> None:
        m, model, result = self.metrics, outcome.model, outcome.result
        if outcome.error is None and result is not None and result.first_token_at is not None:
            m.observe_ttft(model, result.first_token_at - ctx.t0)
            n = result.output_tokens
            if n > 1 and result.last_token_at is not None:
                m.observe_tpot(model, (result.last_token_at - result.first_token_at) / (n - 1))
        m.count_request(model, outcome.policy, outcome.status)
        if model != UNKNOWN_MODEL_LABEL:
            m.observe_duration(model, time.perf_counter() - ctx.t0)
