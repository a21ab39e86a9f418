"""OpenAI-style error bodies and the one exception type the request pipeline raises.

Body shape (OpenAI API reference, "Error codes"): {"error": {"message", "type", "param", "code"}}.
`type` follows OpenAI's names (invalid_request_error, authentication_error, ...); `code` is a short
machine-readable string or null. The body and the SSE error event are the engines' wire format too, so they
live with the adapters (engine_adapters/openai_errors.py) and are re-exported here.
"""

from __future__ import annotations

from engine_adapters.openai_errors import error_body
from engine_adapters.openai_errors import sse_error_event as sse_error_event  # re-exported for the pipeline

JSON_HEADERS: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json")]


class GatewayError(Exception):
    """An error the client should see with `status` and an OpenAI-style body."""

    __slots__ = ("status", "message", "type", "param", "code", "retry_after")

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> list[tuple[bytes, bytes]]:
        if self.retry_after is None:
            return JSON_HEADERS
        # Retry-After is whole seconds (RFC 9110 section 10.2.3); never 0, so clients back off.
        return [*JSON_HEADERS, (b"retry-after", str(max(1, round(self.retry_after))).encode())]


# --- constructors for the cases the gateway produces ---------------------------------------------

def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", param, code)


class ContextTooLong(GatewayError):
    """vLLM's 400 for a request longer than the context of every worker of its model."""

    __slots__ = ()


def context_too_long(message: str) -> ContextTooLong:
    return ContextTooLong(400, message, "invalid_request_error")


class ModelNotFound(GatewayError):
    """404 model_not_found; `model` is the name the client sent (the status page lists unknown ones)."""

    __slots__ = ("model",)

    def __init__(self, model: str, message: str) -> None:
        super().__init__(404, message, "invalid_request_error", "model", "model_not_found")
        self.model = model


def model_not_found(model: str, served: list[str]) -> ModelNotFound:
    names = ", ".join(served) if served else "(none yet)"
    return ModelNotFound(model, f"The model `{model}` does not exist. Models served: {names}.")


def body_too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"Request body is larger than the limit of {limit} bytes.",
                        "invalid_request_error", None, "request_too_large")


def unauthorized(message: str = "Missing or invalid API key.") -> GatewayError:
    return GatewayError(401, message, "authentication_error", None, "invalid_api_key")


def no_worker(model: str, retry_after: float) -> GatewayError:
    return GatewayError(503, f"No healthy worker is serving `{model}` right now.",
                        "service_unavailable_error", "model", "no_healthy_worker", retry_after)


def overloaded(model: str, retry_after: float, reason: str) -> GatewayError:
    return GatewayError(429, f"All workers serving `{model}` are at capacity ({reason}). Retry later.",
                        "rate_limit_error", None, "capacity_exceeded", retry_after)


def will_miss(model: str, retry_after: float, reason: str) -> GatewayError:
    """A request the admission rule shed (policies/shedding.py): it would miss its TTFT target now."""
    return GatewayError(429, f"`{model}` cannot serve this request within its SLO now: {reason}. Retry "
                             f"after {max(1, round(retry_after))} s, when the fleet's backlog is predicted to "
                             "have drained.", "rate_limit_error", None, "slo_unattainable", retry_after)


def upstream_failed(detail: str) -> GatewayError:
    return GatewayError(502, f"The request failed on every worker tried: {detail}",
                        "upstream_error", None, "worker_failed")


def internal_error() -> GatewayError:
    return GatewayError(500, "Internal gateway error; it has been logged.", "internal_error", None, "internal_error")
