"""Every proxied request counted, as a request hook (gateway/request/hooks.py `finished`): its status per model and policy,
its status and reason (`response_reason`: what the status page's error table and fleetgate_responses_total show),
its duration, and for an answered request its time to first token and time per output token
(gateway/ops/metrics.py series). A model name the gateway does not serve is counted under `_unknown` and kept among
the last few unknown names (bounded: a client cannot grow the label set)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gateway.request.context import UNKNOWN_MODEL_LABEL
from gateway.request.hooks import RequestHook
from gateway.wire.errors import GatewayError, ModelNotFound

if TYPE_CHECKING:
    from gateway.ops.metrics import GatewayMetrics
    from gateway.request.context import Outcome, RequestContext

STATUS_CLIENT_GONE = 499   # Outcome.status of a client that left (gateway/pipeline/dispatch.py, which imports this module)
REASON_OK, REASON_WORKER, REASON_CLIENT_GONE, REASON_BROKEN = "ok", "worker", "client_gone", "stream_broken"


def response_reason(status: int, error: GatewayError | None, broken: bool = False) -> str:
    """Why an answer had its status, as a short bounded label: the gateway's error code (or type) when it
    refused or failed the request itself, `worker` for a worker's own answer relayed, `client_gone`,
    `stream_broken` (a stream that ended with an error event), `ok` below 400."""
    if status == STATUS_CLIENT_GONE:
        return REASON_CLIENT_GONE
    if error is not None:
        return error.code or error.type
    if broken:
        return REASON_BROKEN
    return REASON_OK if status < 400 else REASON_WORKER


def count_error_response(metrics: GatewayMetrics, error: GatewayError, model: str = UNKNOWN_MODEL_LABEL) -> None:
    """An error answered outside the proxy pipeline (no route, the other APIs): fleetgate_responses_total and
    the unknown model names."""
    metrics.count_response(model, error.status, response_reason(error.status, error))
    if isinstance(error, ModelNotFound) and model == UNKNOWN_MODEL_LABEL:
        metrics.unknown_models.add(error.model, time.time())


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
        error = outcome.error
        if error is not None:
            count_error_response(m, error, model)
        else:
            broken = result is not None and result.midstream_error is not None
            m.count_response(model, outcome.status, response_reason(outcome.status, None, broken))
        if model != UNKNOWN_MODEL_LABEL:
            m.observe_duration(model, time.perf_counter() - ctx.t0)
