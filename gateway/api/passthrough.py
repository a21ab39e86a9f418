"""The workers' other OpenAI-compatible routes, and `GET /v1/models/{id}`.

`POST /v1/embeddings`, `/tokenize`, `/detokenize` and vLLM's pooling routes (`/pooling`, `/classify`,
`/score`, `/v1/score`, `/rerank`, `/v1/rerank`, `/v2/rerank`; docs/reference/vllm-interface.md §1.1) go to a
worker serving the body's `model` (the only model when the body names none, as vLLM does): the one with
the fewest requests in flight, trying the next on a connection failure or a 5xx, each try a leg of the attempt
loop (gateway/pipeline/attempts.py `passthrough`, through the leg runner: outlier ejection and health reports as for
any leg). These calls are short and hold no reservation; the answer is relayed whole, its error body in OpenAI's shape. vLLM 0.11 answers an
unsupported task with HTTP 200 and an error body (§1.2): that goes out with the status in the body.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from gateway.pipeline.request_metrics import response_reason
from gateway.request.parse import new_request_id, parse_json_object
from gateway.tenancy.auth import tenant_of_request
from gateway.wire import errors
from gateway.wire.results import UpstreamFailure
from gateway.wire.upstream import encode_headers

if TYPE_CHECKING:
    from gateway.core import Gateway
    from gateway.fleet.registry import WorkerState

ROUTES = ("/v1/embeddings", "/tokenize", "/detokenize", "/pooling", "/classify", "/score", "/v1/score",
          "/rerank", "/v1/rerank", "/v2/rerank")
POLICY_LABEL = "passthrough"  # fleetgate_requests_total{policy} of these calls
_turn = itertools.count()


def _resolve_model(gw: Gateway, body: dict[str, Any]) -> tuple[str, bool]:
    model = body.get("model")
    served = gw.registry.served_models()
    if model is not None and not isinstance(model, str):
        raise errors.bad_request("`model` must be a string.", "model")
    if model:
        if not gw.registry.knows_model(model):
            raise errors.model_not_found(model, served)
        return model, False
    if len(served) == 1:
        return served[0], True
    if not served:
        raise errors.no_worker("any model", gw.config.health.interval_s)
    raise errors.bad_request(f"`model` is required: this gateway serves several models ({', '.join(served)}).",
                             "model")


def _order(gw: Gateway, model: str) -> list[WorkerState]:
    workers = list(gw.registry.rotation(model))
    if not workers:
        raise errors.no_worker(model, gw.config.health.interval_s)
    inflight = gw.store.inflight()
    start = next(_turn) % len(workers)  # rotate ties
    workers = workers[start:] + workers[:start]
    return sorted(workers, key=lambda w: inflight[w.id].requests if w.id in inflight else 0)


def _unwrap_quirk(status: int, payload: bytes) -> int:
    """vLLM 0.11 sends some errors with HTTP 200 and `{"error": {..., "code": 400}}`: the real status."""
    if status != 200 or not payload.startswith(b'{"error"'):
        return status
    try:
        code = orjson.loads(payload)["error"]["code"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return status
    return code if isinstance(code, int) and 400 <= code < 600 else status


async def forward(gw: Gateway, request: Request, path: str) -> Response:
    tenant = tenant_of_request(request)
    raw = await request.body()
    if len(raw) > gw.config.limits.max_body_bytes:
        raise errors.body_too_large(gw.config.limits.max_body_bytes)
    body = parse_json_object(raw)
    model, filled = _resolve_model(gw, body)
    if not tenant.may_use(model):      # the key's model allow-list (gateway/tenancy/auth.py)
        raise errors.model_not_found(model, sorted(tenant.models))
    if filled:
        body["model"] = model
        raw = orjson.dumps(body)
    rid = request.headers.get("x-request-id") or new_request_id().decode()
    headers = {"Content-Type": "application/json", "X-Request-Id": rid}
    for h in ("traceparent", "tracestate"):
        if h in request.headers:
            headers[h] = request.headers[h]
    try:   # each try a leg of the attempt loop (gateway/pipeline/attempts.py): ejection and health reports as any leg
        answer = await gw.dispatcher.attempts.passthrough(_order(gw, model), path, raw,
                                                          encode_headers(list(headers.items())))
    except UpstreamFailure as f:
        raise errors.upstream_failed(f.detail) from None
    status, payload, ctype = answer[0], answer[1], answer[2].decode("latin-1")
    status = _unwrap_quirk(status, payload)
    if status >= 400:
        payload = gw.adapter.openai_error(status, payload)
    gw.metrics.count_request(model, POLICY_LABEL, status)
    gw.metrics.count_response(model, status, response_reason(status, None))
    return Response(payload, status_code=status, media_type=ctype, headers={"x-request-id": rid})


def passthrough_router() -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str, request: Request) -> Response:
        tenant = tenant_of_request(request)
        gw = request.app.state.gateway
        if not tenant.may_use(model_id):
            raise errors.model_not_found(model_id, sorted(tenant.models))
        for card in gw.registry.model_cards():
            if card.get("id") == model_id:
                return JSONResponse(card)
        raise errors.model_not_found(model_id, gw.registry.served_models())

    for path in ROUTES:
        r.add_api_route(path, _handler(path), methods=["POST"], include_in_schema=False)
    return r


def _handler(path: str):  # noqa: ANN202 - a FastAPI endpoint whose only parameter is the request
    async def handler(request: Request) -> Response:
        return await forward(request.app.state.gateway, request, path)

    return handler
