"""vLLM's error bodies in OpenAI's shape (docs/reference/vllm-interface.md §1.2).

vLLM (>= 0.10.1) answers `{"error": {"message", "type": "BadRequestError", "param": null, "code": 400}}`:
the Python exception's name as `type` and the HTTP status as an integer `code`. OpenAI's clients read
`type` as one of OpenAI's names and `code` as a short string or null. The message and `param` are kept;
the flat pre-0.10.1 body (`{"object": "error", ...}`) is read too. Anything else is left as it is.
"""

from __future__ import annotations

from typing import Any

import orjson

# vLLM's `type` (exception name or HTTP phrase) -> OpenAI's error type
_TYPES = {
    "BadRequestError": "invalid_request_error", "Bad Request": "invalid_request_error",
    "InvalidUserInput": "invalid_request_error", "UnprocessableEntityError": "invalid_request_error",
    "NotFoundError": "not_found_error", "Not Found": "not_found_error",
    "InternalServerError": "server_error", "Internal Server Error": "server_error",
    "NotImplementedError": "invalid_request_error",
    "ServiceUnavailableError": "service_unavailable_error", "Service Unavailable": "service_unavailable_error",
}
_BY_STATUS = {400: "invalid_request_error", 404: "not_found_error", 422: "invalid_request_error",
              503: "service_unavailable_error"}


# vLLM's 400 for a request over max_model_len words it one of these ways, depending on the version and on where
# the check fails (prompt alone, prompt plus max_tokens)
_CONTEXT_MARKERS = (b"maximum context length", b"longer than the maximum model length")


def context_exceeded(body: bytes) -> bool:
    """Is `body` vLLM's refusal of a request longer than the model's context?"""
    return any(m in body for m in _CONTEXT_MARKERS)


def openai_error_body(status: int, body: bytes) -> bytes:
    """The same error in OpenAI's shape; `body` unchanged when it is not a vLLM error object."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(doc, dict):
        return body
    err: Any = doc.get("error") if isinstance(doc.get("error"), dict) else (doc if doc.get("object") == "error" else None)
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return body
    vtype = err.get("type")
    if isinstance(vtype, str) and vtype in _TYPES.values():
        return body  # already OpenAI-shaped
    otype = _TYPES.get(vtype) if isinstance(vtype, str) else None
    otype = otype or _BY_STATUS.get(status) or ("server_error" if status >= 500 else "invalid_request_error")
    code = err.get("code")
    param = err.get("param")
    return orjson.dumps({"error": {"message": err["message"], "type": otype,
                                   "param": param if isinstance(param, str) else None,
                                   "code": code if isinstance(code, str) else None}})
