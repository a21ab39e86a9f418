"""The access log: one structured line per proxied request, on the logger `fleetgate.access` (level INFO).

Fields, in this order (absent values are empty in logfmt, null in JSON):

    request_id  the X-Request-Id the client sent or the gateway made (also sent to the worker)
    key         the API key's name (null until keys have names: the tenants work fills it)
    method/path the route, model (`_unknown` if it never resolved), policy
    worker      the worker that answered (P/D: the decode worker; prefill_worker beside it)
    reason      the policy's reason for the placement (Decision.reason, P/D: the plan's decision)
    status      HTTP status sent (499: the client went away)
    prompt_tokens / completion_tokens   from the usage block, else the streamed token count
    ttft_ms     arrival -> first token relayed (streams); total_ms arrival -> last byte
    queue_ms    time in the admission queue (only when it waited)
    attempts    upstream legs tried; retries = attempts - 1 on the plain path
    resumes     broken streams resumed on another worker
    errors      the kinds of upstream failures met on the way (connect, timeout, status_5xx, ...)

The line format (text, logfmt, JSON) is the process's: gateway/ops/logs.py, `fleetgate serve --log-format`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from gateway.ops.logs import ACCESS_LOGGER, access_sink
from gateway.ops.observe import RequestRecord, result_tokens, ttft_s

if TYPE_CHECKING:
    from gateway.wire.results import RelayResult
    from policies.types import RequestFeatures


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


class AccessLog:
    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger(ACCESS_LOGGER)

    def fields(self, rec: RequestRecord, status: int, feats: RequestFeatures | None, result: RelayResult | None,
               total_s: float) -> dict[str, Any]:
        prompt, completion = result_tokens(result)
        if prompt is None and feats is not None:
            prompt = feats.prompt_tokens  # the gateway's estimate when the worker sent no usage
        out: dict[str, Any] = {
            "request_id": rec.request_id, "key": rec.key, "method": "POST", "path": rec.route,
            "model": rec.model, "policy": rec.policy, "worker": rec.worker, "reason": rec.reason or None,
            "status": status, "prompt_tokens": prompt, "completion_tokens": completion,
            "ttft_ms": _ms(ttft_s(rec, result)), "total_ms": _ms(total_s), "attempts": rec.attempts,
            "resumes": rec.resumes,
        }
        if rec.prefill_worker is not None:
            out["prefill_worker"] = rec.prefill_worker
        if rec.queue_s is not None:
            out["queue_ms"] = _ms(rec.queue_s)
        if rec.errors:
            out["errors"] = ",".join(rec.errors)
        if feats is not None and feats.request_class != "interactive":
            out["class"] = feats.request_class
        return out

    def emit(self, rec: RequestRecord, status: int, feats: RequestFeatures | None, result: RelayResult | None,
             total_s: float) -> None:
        if not self.logger.isEnabledFor(logging.INFO):
            return
        fields = self.fields(rec, status, feats, result, total_s)
        sink = access_sink() if self.logger.name == ACCESS_LOGGER else None
        if sink is not None:  # the process's handler (gateway/ops/logs.py): the line without a LogRecord
            sink.emit_access(fields)
            return
        # makeRecord + handle: logger.info() would also walk the stack for the caller's file and line.
        record = self.logger.makeRecord(self.logger.name, logging.INFO, __file__, 0, "request", None, None,
                                        extra={"fields": fields})
        self.logger.handle(record)
