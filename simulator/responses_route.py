"""`POST /v1/responses` on the simulated vLLM server: vLLM 0.11 and 0.33 both serve it (vllm-interface §1.1), so
the simulator does whichever it imitates. vLLM's serving_responses.py renders the request with the chat template
and generates, which is what running it through this server's chat route does.

Stateless, like vLLM without VLLM_ENABLE_RESPONSES_API_STORE=1: `store` is ignored and a `previous_response_id` is
not found. The translation is engine_adapters/apis/responses.py, the same the gateway uses; the ASGI glue is
gateway/api/translated.py (it knows nothing of the gateway).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson

from engine_adapters.apis import responses as api
from gateway.api.translated import dispatch_chat, read_body

ASGI = Callable[[dict, Callable, Callable], Awaitable[None]]


def responses_route(chat: ASGI, api_error: Callable[..., Exception], model: str) -> ASGI:
    """The route's handler over the server's own chat handler; refusals raise `api_error(status, message,
    err_type, param)` (the server's ApiError, answered in vLLM's error shape)."""

    async def serve(scope: dict, receive: Callable, send: Callable) -> None:
        raw = await read_body(receive)
        if raw is None:
            return   # the client left
        try:
            body = orjson.loads(raw)
            if not isinstance(body, dict):
                raise api.ResponsesRequestError("The request body must be a JSON object.")
            req = api.parse_request(body)
        except orjson.JSONDecodeError as e:
            raise api_error(400, f"Invalid JSON: {e}", "BadRequestError") from None
        except api.ResponsesRequestError as e:
            raise api_error(e.status, e.message, "BadRequestError", e.param) from None
        if req.previous_response_id is not None:
            raise api_error(404, f"Response with id '{req.previous_response_id}' not found: this server stores no "
                                 "responses (VLLM_ENABLE_RESPONSES_API_STORE is off).", "NotFoundError",
                            "previous_response_id")
        translator = api.ResponsesTranslator(req, api.new_id(api.RESPONSE_PREFIX), req.model or model)
        await dispatch_chat(chat, scope, receive, send, api.chat_body(req), translator)

    return serve

