"""Admin API: workers (list, add, drain, activate, remove) and API keys (list, create, delete).

Off (404) unless an admin key is configured (`auth.admin_key` or FLEETGATE_ADMIN_KEY; `fleetgate demo` makes
one and prints it); every call then needs `Authorization: Bearer <admin key>`. Inference keys are never
admin keys. A worker added here must be on an allowed host (`admin.worker_hosts`, loopback and the configured
workers' hosts): the gateway sends it requests and probes it, so the admin API cannot point it anywhere.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from gateway.config import GatewayConfig, WorkerConfig, describe_validation_error
from gateway.config.engine_identity import engine_address
from gateway.fleet.registry import record_from_config
from gateway.request.parse import parse_json_object
from gateway.state.base import WORKER_ACTIVE, WORKER_DRAINING
from gateway.state.ratelimit import limits_from
from gateway.tenancy.auth import describe
from gateway.wire import errors
from gateway.wire.errors import GatewayError

if TYPE_CHECKING:
    from gateway.core import Gateway


def require_admin(request: Request) -> None:
    request.app.state.gateway.auth.check_admin(request.headers.get("authorization"))


def _host(url: str) -> str:
    return (urlsplit(url).hostname or "").lower()


def worker_host_allowed(url: str, config: GatewayConfig) -> bool:
    """Loopback, a configured worker's host, or a match of `admin.worker_hosts` (name, `*.suffix`, address,
    network)."""
    host = _host(url)
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        addr = None
    if host == "localhost" or (addr is not None and addr.is_loopback):
        return True
    if host in {_host(w.url) for w in config.workers}:
        return True
    for pattern in config.admin.worker_hosts:
        p = pattern.lower()
        if p.startswith("*."):
            if host.endswith(p[1:]):
                return True
        elif addr is not None and ("/" in p or _is_ip(p)):
            if addr in ipaddress.ip_network(p, strict=False):
                return True
        elif host == p:
            return True
    return False


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _not_found(worker_id: str) -> GatewayError:
    return GatewayError(404, f"No worker with id {worker_id!r}.", "not_found_error", "id", "worker_not_found")


# --- workers: one handler per route ------------------------------------------------------------------
async def list_workers(request: Request) -> JSONResponse:
    reg = request.app.state.gateway.registry
    return JSONResponse({"object": "list", "data": reg.describe_all()})


async def prefix_cache(request: Request) -> JSONResponse:
    """Where a request's prompt prefix is cached, from the KV-event index: the body of a chat
    (`messages`) or completion (`prompt`) request, optionally `cache_salt`; answers every worker
    holding a prefix with its cached prompt tokens (gateway/fleet/kv_events.py)."""
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


def _checked_worker(data: dict, gw: Gateway) -> WorkerConfig:
    """A worker record the admin API may add: valid (400), on an allowed host (403), a new id and a new
    engine (409)."""
    try:
        wc = WorkerConfig.model_validate(data)
    except ValidationError as e:
        problems = describe_validation_error(e, WorkerConfig)
        raise errors.bad_request("Invalid worker record: " + "; ".join(problems)) from None
    if not worker_host_allowed(wc.url, gw.config):
        raise GatewayError(403, f"Workers on {_host(wc.url)!r} are not allowed: add the host to "
                           "admin.worker_hosts.", "permission_error", "url", "worker_host_not_allowed")
    reg = gw.registry
    if wc.id in reg.workers:
        raise GatewayError(409, f"A worker with id {wc.id!r} already exists.", "invalid_request_error",
                           "id", "worker_exists")
    same = [ws.id for ws in reg.workers.values() if engine_address(ws.rec.url) == engine_address(wc.url)]
    if same:   # one engine, one worker (gateway/config/engine_identity.py)
        raise GatewayError(409, f"Worker {same[0]!r} already names the engine at {wc.url}.",
                           "invalid_request_error", "url", "engine_exists")
    return wc


async def add_worker(request: Request) -> JSONResponse:
    """Body: a worker record as in the config file's `workers` list (id, url, role, models, labels,
    profile, cap). The worker is probed once before the answer; it serves once healthy."""
    data = parse_json_object(await request.body())
    gw = request.app.state.gateway
    wc = _checked_worker(data, gw)
    ws = await gw.registry.add(record_from_config(wc, source="admin"))
    return JSONResponse(gw.registry.describe(ws), status_code=201)


async def get_worker(worker_id: str, request: Request) -> JSONResponse:
    reg = request.app.state.gateway.registry
    ws = reg.workers.get(worker_id)
    if ws is None:
        raise _not_found(worker_id)
    return JSONResponse(reg.describe(ws))


async def delete_worker(worker_id: str, request: Request) -> Response:
    """Remove the worker from the fleet; requests already on it run to completion."""
    reg = request.app.state.gateway.registry
    if not await reg.remove(worker_id):
        raise _not_found(worker_id)
    return JSONResponse({"id": worker_id, "deleted": True})


async def _set_state(request: Request, worker_id: str, state: str) -> JSONResponse:
    reg = request.app.state.gateway.registry
    ws = await reg.set_state(worker_id, state)
    if ws is None:
        raise _not_found(worker_id)
    return JSONResponse(reg.describe(ws))


async def drain_worker(worker_id: str, request: Request) -> JSONResponse:
    """No new requests go to the worker; in-flight ones finish."""
    return await _set_state(request, worker_id, WORKER_DRAINING)


async def activate_worker(worker_id: str, request: Request) -> JSONResponse:
    """Undo a drain."""
    return await _set_state(request, worker_id, WORKER_ACTIVE)


# --- API keys ------------------------------------------------------------------------------------------
async def list_keys(request: Request) -> JSONResponse:
    auth = request.app.state.gateway.auth
    return JSONResponse({"object": "list", "data": [describe(t) for t in auth.all()]})


async def create_key(request: Request) -> JSONResponse:
    """Body: {name, rpm?, tpm?, max_concurrency?, models?, key?}. Without `key` one is made; the answer
    holds it, the only time it is shown."""
    data = parse_json_object(await request.body())
    name, models, key = data.get("name", ""), data.get("models", []), data.get("key")
    if not isinstance(name, str) or len(name) > 128:
        raise errors.bad_request("`name` must be a string of at most 128 characters.", "name")
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise errors.bad_request("`models` must be an array of model names.", "models")
    if key is not None and (not isinstance(key, str) or not 16 <= len(key) <= 256):
        raise errors.bad_request("`key` must be a string of 16 to 256 characters.", "key")
    made, tenant = await request.app.state.gateway.auth.create(name, limits_from(data), models, key)
    return JSONResponse({**describe(tenant), **({"key": made} if made else {})}, status_code=201)


async def delete_key(key_id: str, request: Request) -> JSONResponse:
    auth = request.app.state.gateway.auth
    tenant = auth.by_id(key_id)
    if tenant is not None and tenant.source != "admin":
        raise GatewayError(409, "This key is defined in the configuration; remove it there.",
                           "invalid_request_error", "id", "key_in_config")
    if not await auth.delete(key_id):
        raise GatewayError(404, f"No key with id {key_id[:40]!r}.", "not_found_error", "id", "key_not_found")
    return JSONResponse({"id": key_id, "deleted": True})


def admin_router() -> APIRouter:
    """The admin routes (module docstring), each its handler above, all behind the admin key."""
    r = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])
    r.get("/workers")(list_workers)
    r.post("/prefix_cache")(prefix_cache)
    r.post("/workers")(add_worker)
    r.get("/workers/{worker_id}")(get_worker)
    r.delete("/workers/{worker_id}")(delete_worker)
    r.post("/workers/{worker_id}/drain")(drain_worker)
    r.post("/workers/{worker_id}/activate")(activate_worker)
    r.get("/keys")(list_keys)
    r.post("/keys")(create_key)
    r.delete("/keys/{key_id}")(delete_key)
    return r
