"""Admin API: list, add, drain and remove workers (protected by the API keys when any are set)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from gateway import errors
from gateway.auth import bearer_key_ok
from gateway.config import WorkerConfig, describe_validation_error
from gateway.errors import GatewayError
from gateway.registry import record_from_config
from gateway.request import parse_json_object
from gateway.state.base import WORKER_ACTIVE, WORKER_DRAINING


def check_api_key(request: Request) -> None:
    keys = request.app.state.gateway.config.api_keys
    if keys and not bearer_key_ok(request.headers.get("authorization"), [k.encode() for k in keys]):
        raise errors.unauthorized()


def _not_found(worker_id: str) -> GatewayError:
    return GatewayError(404, f"No worker with id {worker_id!r}.", "not_found_error", "id", "worker_not_found")


def admin_router() -> APIRouter:
    r = APIRouter(prefix="/admin")

    @r.get("/workers")
    async def list_workers(request: Request) -> JSONResponse:
        check_api_key(request)
        reg = request.app.state.gateway.registry
        return JSONResponse({"object": "list", "data": reg.describe_all()})

    @r.post("/prefix_cache")
    async def prefix_cache(request: Request) -> JSONResponse:
        """Where a request's prompt prefix is cached, from the KV-event index: the body of a chat
        (`messages`) or completion (`prompt`) request, optionally `cache_salt`; answers every worker
        holding a prefix with its cached prompt tokens (gateway/kv_events.py)."""
        check_api_key(request)
        data = parse_json_object(await request.body())
        kv = request.app.state.gateway.kv_events
        if not kv.enabled:
            raise errors.bad_request("KV events are off (config kv_events.enabled).")
        chat = "messages" in data
        if not chat and "prompt" not in data:
            raise errors.bad_request("Give `messages` or `prompt`.", "messages")
        view = kv.request_view(data, chat)
        return JSONResponse({"block_size": kv.kc.block_size, "hashed": view is not None,
                             "workers": dict(view) if view is not None else {},
                             "index_blocks": len(kv.index),
                             "subscribed": sorted(kv.subscribers)})

    @r.post("/workers")
    async def add_worker(request: Request) -> JSONResponse:
        """Body: a worker record as in the config file's `workers` list (id, url, role, models, labels,
        profile, cap). The worker is probed once before the answer; it serves once healthy."""
        check_api_key(request)
        data = parse_json_object(await request.body())
        try:
            wc = WorkerConfig.model_validate(data)
        except ValidationError as e:
            problems = describe_validation_error(e, WorkerConfig)
            raise errors.bad_request("Invalid worker record: " + "; ".join(problems)) from None
        reg = request.app.state.gateway.registry
        if wc.id in reg.workers:
            raise GatewayError(409, f"A worker with id {wc.id!r} already exists.", "invalid_request_error",
                               "id", "worker_exists")
        ws = await reg.add(record_from_config(wc, source="admin"))
        return JSONResponse(reg.describe(ws), status_code=201)

    @r.get("/workers/{worker_id}")
    async def get_worker(worker_id: str, request: Request) -> JSONResponse:
        check_api_key(request)
        reg = request.app.state.gateway.registry
        ws = reg.workers.get(worker_id)
        if ws is None:
            raise _not_found(worker_id)
        return JSONResponse(reg.describe(ws))

    @r.delete("/workers/{worker_id}")
    async def delete_worker(worker_id: str, request: Request) -> Response:
        """Remove the worker from the fleet; requests already on it run to completion."""
        check_api_key(request)
        reg = request.app.state.gateway.registry
        if not await reg.remove(worker_id):
            raise _not_found(worker_id)
        return JSONResponse({"id": worker_id, "deleted": True})

    @r.post("/workers/{worker_id}/drain")
    async def drain_worker(worker_id: str, request: Request) -> JSONResponse:
        """No new requests go to the worker; in-flight ones finish."""
        check_api_key(request)
        reg = request.app.state.gateway.registry
        ws = await reg.set_state(worker_id, WORKER_DRAINING)
        if ws is None:
            raise _not_found(worker_id)
        return JSONResponse(reg.describe(ws))

    @r.post("/workers/{worker_id}/activate")
    async def activate_worker(worker_id: str, request: Request) -> JSONResponse:
        """Undo a drain."""
        check_api_key(request)
        reg = request.app.state.gateway.registry
        ws = await reg.set_state(worker_id, WORKER_ACTIVE)
        if ws is None:
            raise _not_found(worker_id)
        return JSONResponse(reg.describe(ws))

    return r
