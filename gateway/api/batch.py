"""OpenAI's Files and Batches API, so `client.files.create(...)` / `client.batches.create(...)` work unchanged.

    POST   /v1/files                  multipart: file (JSONL), purpose=batch, expires_after[anchor|seconds]
    GET    /v1/files, /v1/files/{id}, /v1/files/{id}/content
    DELETE /v1/files/{id}
    POST   /v1/batches                {input_file_id, endpoint, completion_window, metadata?,
                                       output_expires_after?} -> Batch
    GET    /v1/batches (after, limit), /v1/batches/{id}
    POST   /v1/batches/{id}/cancel

Shapes follow the OpenAI API reference ("Files", "Batch"; input line {custom_id, method, url, body},
output line {id, custom_id, response: {status_code, request_id, body}, error}).

Tenants: files and batches belong to the key that made them (gateway/tenancy/auth.py); another key gets 404 for
them and does not see them listed. Each key may keep at most `batch.storage_per_key_bytes` of files; a file
expires at `expires_after` (OpenAI's {anchor: created_at, seconds: 3600..2592000}) or after
`batch.file_ttl_s`. Uploads are streamed into the store (gateway/api/uploads.py), never held whole in memory.

Validation: every line of the input file is checked when the batch is created. A line that cannot run
(not JSON, no custom_id or a repeated one, not POST, another endpoint, no body, a model the gateway does not
serve or the key may not use) goes straight into the error file and the others run: one bad line neither
fails nor blocks the batch. Only a file with no usable structure at all (empty, more than
`batch.max_requests` lines) fails the batch, with `errors`. Each good line becomes one request in the
durable, deadline-ordered batch queue (deadline = created_at + completion_window); gateway/batch/runner.py
runs them on spare capacity through the normal dispatch path and writes the output and error files.
Extension: completion_window accepts any "<n>s|m|h|d" up to 7 days, not only "24h" (short windows are what
tests and deadline ordering need).
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.api.uploads import receive_upload
from gateway.request.parse import parse_json_object
from gateway.state.jobs import QueuedRequest, StoreUnavailableError, new_id, request_id_for
from gateway.tenancy.auth import Tenant
from gateway.wire import errors
from gateway.wire.errors import GatewayError
from policies.tokens import estimate_chat_tokens, estimate_prompt_tokens

if TYPE_CHECKING:
    from gateway.core import Gateway

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
PURPOSE_BATCH = "batch"
MAX_WINDOW_S = 7 * 86_400.0
MAX_REPORTED_ERRORS = 100
_WINDOW_RE = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0}
_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
INTERNAL_KEYS = ("_fg_expiring", "_fg_owner", "_fg_output_ttl_s")  # kept in the stored document, never shown
EXPIRES_MIN_S, EXPIRES_MAX_S = 3600, 2_592_000  # OpenAI's bounds for expires_after.seconds


def parse_window(value: Any) -> float:
    """completion_window -> seconds ("24h" is OpenAI's only value; see the module docstring)."""
    m = _WINDOW_RE.match(value) if isinstance(value, str) else None
    seconds = float(m.group(1)) * _UNIT_S[m.group(2)] if m else math.nan
    if not 0 < seconds <= MAX_WINDOW_S:
        raise errors.bad_request(f"`completion_window` must be like '24h' (at most 7 days), got {_short(value)}.",
                                 "completion_window")
    return seconds


# --- validation of a batch input file --------------------------------------------------------------
class InputCheck:
    """What a batch's input file holds: requests to queue, lines that fail at once (into the error file), and
    problems that fail the whole batch (OpenAI's {code, message, line, param})."""

    def __init__(self) -> None:
        self.items: list[QueuedRequest] = []
        self.failed: dict[int, str] = {}      # line index -> error-file line
        self.problems: list[dict[str, Any]] = []
        self.lines = 0                        # request lines (not blank ones): the batch's total


def check_input_file(lines: Iterator[str], endpoint: str, batch_id: str, deadline: float, max_requests: int,
                     model_ok: Callable[[Any], str | None], owner: str = "") -> InputCheck:
    """Check every non-empty line. `model_ok(model)` returns None for a model the batch may use, else why not."""
    out = InputCheck()
    seen: set[str] = set()
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        index = out.lines
        out.lines += 1
        if out.lines > max_requests:
            out.problems.append({"code": "too_many_requests", "message": f"A batch holds at most {max_requests} "
                                 "requests.", "line": n, "param": None})
            break
        custom_id, why = _check_line(raw, endpoint, seen, model_ok)
        if why is not None:
            out.failed[index] = orjson.dumps({
                "id": f"batch_req_{request_id_for(batch_id, index)}", "custom_id": custom_id, "response": None,
                "error": {"code": why[0], "message": f"Line {n}: {why[1]}"}}).decode()
        else:
            obj = orjson.loads(raw)
            body, url = obj["body"], obj["url"]
            model = body.get("model") if isinstance(body.get("model"), str) else ""
            out.items.append(QueuedRequest(request_id_for(batch_id, index), batch_id, index, obj["custom_id"], url,
                                           body, deadline, model, _prompt_tokens(url, body), owner))
    if out.lines == 0:
        out.problems.append({"code": "empty_file", "message": "The input file has no requests.", "line": 0,
                             "param": None})
    return out


def _check_line(raw: str, endpoint: str, seen: set[str], model_ok: Callable[[Any], str | None]
                ) -> tuple[str | None, tuple[str, str] | None]:
    """(custom_id for the error line, (code, message) or None when the line can run); adds to `seen`."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None, ("invalid_json_line", "This line is not valid JSON.")
    if not isinstance(obj, dict):
        return None, ("invalid_json_line", "Each line must be a JSON object.")
    cid, method, url, body = obj.get("custom_id"), obj.get("method"), obj.get("url"), obj.get("body")
    if not isinstance(cid, str) or not cid:
        return None, ("missing_required_parameter", "`custom_id` must be a non-empty string.")
    if cid in seen:  # the first line with this custom_id keeps it
        return None, ("duplicate_custom_id", f"The custom_id {cid[:64]!r} appears more than once.")
    seen.add(cid)
    if method != "POST":
        return cid, ("invalid_method", "`method` must be POST.")
    if url != endpoint:
        return cid, ("mismatched_endpoint", f"`url` must be the batch's endpoint {endpoint}, got {_short(url)}.")
    if not isinstance(body, dict):
        return cid, ("missing_required_parameter", "`body` must be a JSON object.")
    why = model_ok(body.get("model"))
    return cid, (("model_not_found", why) if why is not None else None)


async def file_lines(chunks: AsyncIterator[bytes]) -> list[str]:
    """The lines of a stored file, read a piece at a time."""
    lines: list[str] = []
    rest = b""
    async for chunk in chunks:
        parts = (rest + chunk).split(b"\n")
        rest = parts.pop()
        lines += [p.decode("utf-8", "replace") for p in parts]
    if rest:
        lines.append(rest.decode("utf-8", "replace"))
    return lines


def _prompt_tokens(url: str, body: dict[str, Any]) -> int:
    try:
        if url == "/v1/chat/completions":
            messages = body.get("messages")
            return estimate_chat_tokens(messages) if isinstance(messages, list) else 0
        prompt = body.get("prompt")
        return estimate_prompt_tokens(prompt) if isinstance(prompt, (str, list)) else 0
    except (TypeError, AttributeError, KeyError):
        return 0  # a malformed body: the engine's 400 goes to the error file


# --- objects in OpenAI's shapes --------------------------------------------------------------------
def file_object(file_id: str, size: int, filename: str, purpose: str, created_at: int, expires_at: int | None,
                owner: str) -> dict[str, Any]:
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created_at, "filename": filename,
            "purpose": purpose, "status": "processed", "expires_at": expires_at, "status_details": None,
            "_fg_owner": owner}


def parse_expires_after(anchor: Any, seconds: Any, param: str) -> float | None:
    """OpenAI's expires_after: {anchor: "created_at", seconds: 3600..2592000}; None when not given."""
    if anchor is None and seconds is None:
        return None
    try:
        secs = int(seconds)
    except (TypeError, ValueError):
        secs = -1
    if anchor != "created_at" or not EXPIRES_MIN_S <= secs <= EXPIRES_MAX_S:
        raise errors.bad_request(f"`{param}` must be {{anchor: created_at, seconds: {EXPIRES_MIN_S}.."
                                 f"{EXPIRES_MAX_S}}}.", param)
    return float(secs)


def batch_object(batch_id: str, input_file_id: str, endpoint: str, window: str, created_at: int,
                 expires_at: int, metadata: dict[str, str] | None) -> dict[str, Any]:
    return {
        "id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None, "input_file_id": input_file_id,
        "completion_window": window, "status": "validating", "output_file_id": None, "error_file_id": None,
        "created_at": created_at, "in_progress_at": None, "expires_at": expires_at, "finalizing_at": None,
        "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata or None,
    }


def public(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k not in INTERNAL_KEYS}


def _store_errors(fn: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """A state store that cannot be reached (Redis down) is a 503 with a clear message, not a 500."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Response:
        try:
            return await fn(*args, **kwargs)
        except GatewayError:
            raise
        except (OSError, StoreUnavailableError) as e:
            raise GatewayError(503, f"The batch store is unavailable ({type(e).__name__}); retry shortly.",
                               "service_unavailable_error", None, "store_unavailable", 5.0) from None
    return wrapper


def _not_found(kind: str, ident: str, param: str) -> GatewayError:
    return GatewayError(404, f"No {kind} with id {ident[:80]!r}.", "invalid_request_error", param, "not_found")


def _short(v: Any) -> str:
    text = orjson.dumps(v).decode() if not isinstance(v, bytes) else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


# --- routes: one handler per route, registered by `batch_router` ------------------------------------
def owned(doc: dict[str, Any] | None, tenant: Tenant) -> dict[str, Any] | None:
    """The document if `tenant` made it (other keys: as if it did not exist)."""
    return doc if doc is not None and doc.get("_fg_owner", "") == tenant.id else None


def _caller(request: Request) -> tuple[Gateway, Tenant]:
    """The gateway and the key calling it; 404 for every route when the Batch API is off."""
    gw = request.app.state.gateway
    tenant = gw.auth.authenticate(request.headers.get("authorization"))
    if not gw.config.batch.enabled:
        raise GatewayError(404, "The Batch API is disabled on this gateway (batch.enabled: false).",
                           "invalid_request_error", None, "batch_disabled")
    return gw, tenant


async def _own_file(gw: Gateway, tenant: Tenant, file_id: str, param: str = "file_id") -> dict[str, Any]:
    meta = owned(await gw.store.get_file(file_id), tenant) if _ID_RE.match(file_id) else None
    if meta is None:
        raise _not_found("file", file_id, param)
    return meta


async def _own_batch(gw: Gateway, tenant: Tenant, batch_id: str) -> dict[str, Any]:
    doc = owned(await gw.store.get_batch(batch_id), tenant) if _ID_RE.match(batch_id) else None
    if doc is None:
        raise _not_found("batch", batch_id, "batch_id")
    return doc


# --- files -------------------------------------------------------------------------------------------
@_store_errors
async def create_file(request: Request) -> JSONResponse:
    """POST /v1/files: the upload streamed into the store within the key's quota (module docstring)."""
    gw, tenant = _caller(request)
    cfg = gw.config.batch
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cfg.max_file_bytes + 65_536:
        raise errors.body_too_large(cfg.max_file_bytes)
    used = sum(m.get("bytes", 0) for m in await gw.store.list_files() if owned(m, tenant))
    room = cfg.storage_per_key_bytes - used
    if room <= 0:
        raise _quota_error(cfg.storage_per_key_bytes, used)
    limit = min(cfg.max_file_bytes, room)
    too_large = (errors.body_too_large(limit) if limit == cfg.max_file_bytes
                 else _quota_error(cfg.storage_per_key_bytes, used))
    file_id = new_id("file-")
    writer = await gw.store.open_upload(file_id)
    got = await receive_upload(request.stream(), request.headers.get("content-type", ""), writer, limit,
                               too_large)
    try:
        purpose = got.fields.get("purpose", "")
        if purpose != PURPOSE_BATCH:
            raise errors.bad_request(f"`purpose` must be 'batch' (the only purpose this gateway stores), got "
                                     f"{_short(purpose)}.", "purpose")
        ttl = parse_expires_after(got.fields.get("expires_after[anchor]"),
                                  got.fields.get("expires_after[seconds]"), "expires_after")
        now = int(time.time())
        meta = file_object(file_id, got.size, got.filename or "upload.jsonl", purpose, now,
                           now + int(ttl if ttl is not None else cfg.file_ttl_s), tenant.id)
        await writer.commit(meta)
    except BaseException:
        await writer.abort()
        raise
    return JSONResponse(public(meta))


@_store_errors
async def list_files(request: Request) -> JSONResponse:
    gw, tenant = _caller(request)
    files = [public(m) for m in await gw.store.list_files() if owned(m, tenant)]
    return JSONResponse({"object": "list", "data": files, "has_more": False})


@_store_errors
async def get_file(file_id: str, request: Request) -> JSONResponse:
    gw, tenant = _caller(request)
    return JSONResponse(public(await _own_file(gw, tenant, file_id)))


@_store_errors
async def delete_file(file_id: str, request: Request) -> JSONResponse:
    gw, tenant = _caller(request)
    await _own_file(gw, tenant, file_id)
    await gw.store.delete_file(file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


@_store_errors
async def file_content(file_id: str, request: Request) -> Response:
    gw, tenant = _caller(request)
    meta = await _own_file(gw, tenant, file_id)
    return StreamingResponse(gw.store.read_file(file_id), media_type="application/octet-stream",
                             headers={"content-length": str(meta["bytes"])})


# --- batches -----------------------------------------------------------------------------------------
def _checked_metadata(body: dict[str, Any]) -> dict[str, str] | None:
    """The batch's `metadata`: at most 16 string keys (<= 64 chars) to strings (<= 512 chars)."""
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in metadata.items())):
        raise errors.bad_request("`metadata` must map at most 16 keys (<= 64 chars) to strings (<= 512 chars).",
                                 "metadata")
    return metadata


def _output_ttl(body: dict[str, Any]) -> float | None:
    """The batch's `output_expires_after` in seconds (None: not given)."""
    out_exp = body.get("output_expires_after")
    if out_exp is not None and not isinstance(out_exp, dict):
        raise errors.bad_request("`output_expires_after` must be an object.", "output_expires_after")
    return parse_expires_after((out_exp or {}).get("anchor"), (out_exp or {}).get("seconds"),
                               "output_expires_after") if out_exp else None


@_store_errors
async def create_batch(request: Request) -> JSONResponse:
    """POST /v1/batches: the request checked (each field, then every line of its input file); a file with no
    usable structure fails the batch, else its good lines are queued (module docstring)."""
    gw, tenant = _caller(request)
    body = parse_json_object(await request.body())
    input_file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
    if not isinstance(input_file_id, str) or not input_file_id:
        raise errors.bad_request("`input_file_id` is required.", "input_file_id")
    if endpoint not in ENDPOINTS:
        raise errors.bad_request(f"`endpoint` must be one of {', '.join(ENDPOINTS)}, got {_short(endpoint)}.",
                                 "endpoint")
    window_s = parse_window(body.get("completion_window"))
    metadata = _checked_metadata(body)
    out_ttl = _output_ttl(body)
    meta = await _own_file(gw, tenant, input_file_id, "input_file_id")
    if meta.get("purpose") != PURPOSE_BATCH:
        raise errors.bad_request(f"File {input_file_id} has purpose {meta.get('purpose')!r}, not 'batch'.",
                                 "input_file_id")
    lines = await file_lines(gw.store.read_file(input_file_id))
    now = time.time()
    batch_id = new_id("batch_")
    doc = batch_object(batch_id, input_file_id, endpoint, body["completion_window"], int(now),
                       int(now + window_s), metadata)
    doc["_fg_owner"] = tenant.id
    doc["_fg_output_ttl_s"] = out_ttl if out_ttl is not None else gw.config.batch.file_ttl_s
    check = check_input_file(iter(lines), endpoint, batch_id, now + window_s, gw.config.batch.max_requests,
                             _model_check(gw, tenant), tenant.id)
    del lines
    if check.problems:
        doc.update(status="failed", failed_at=int(time.time()),
                   errors={"object": "list", "data": check.problems[:MAX_REPORTED_ERRORS]})
        await gw.store.put_batch(doc)
        return JSONResponse(public(doc))
    doc = await gw.batch.submit(doc, check.items, check.failed)
    return JSONResponse(public(doc))


@_store_errors
async def list_batches(request: Request) -> JSONResponse:
    """GET /v1/batches: the key's batches, a page of `limit` after `after`."""
    gw, tenant = _caller(request)
    q = request.query_params
    raw_limit = q.get("limit", "20")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
        raise errors.bad_request(f"`limit` must be an integer from 1 to 100, got {raw_limit[:20]!r}.", "limit")
    limit = int(raw_limit)
    docs = [d for d in await gw.store.list_batches() if owned(d, tenant)]
    after = q.get("after")
    if after:
        ids = [d["id"] for d in docs]
        if after not in ids:
            raise _not_found("batch", after, "after")
        docs = docs[ids.index(after) + 1:]
    page = [public(await gw.batch.with_counts(d)) for d in docs[:limit]]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(docs) > limit})


@_store_errors
async def get_batch(batch_id: str, request: Request) -> JSONResponse:
    gw, tenant = _caller(request)
    return JSONResponse(public(await gw.batch.with_counts(await _own_batch(gw, tenant, batch_id))))


@_store_errors
async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
    gw, tenant = _caller(request)
    doc = await _own_batch(gw, tenant, batch_id)
    if doc["status"] in ("completed", "failed", "expired", "finalizing"):
        raise GatewayError(409, f"Cannot cancel a batch with status {doc['status']!r}.", "invalid_request_error",
                           None, "batch_not_cancellable")
    return JSONResponse(public(await gw.batch.cancel(doc)))


def batch_router() -> APIRouter:
    """The Files and Batches routes (module docstring), each its handler above."""
    r = APIRouter(prefix="/v1")
    r.post("/files")(create_file)
    r.get("/files")(list_files)
    r.get("/files/{file_id}")(get_file)
    r.delete("/files/{file_id}")(delete_file)
    r.get("/files/{file_id}/content")(file_content)
    r.post("/batches")(create_batch)
    r.get("/batches")(list_batches)
    r.get("/batches/{batch_id}")(get_batch)
    r.post("/batches/{batch_id}/cancel")(cancel_batch)
    return r


def _model_check(gw: Gateway, tenant: Tenant) -> Callable[[Any], str | None]:
    served = gw.registry.served_models()

    def check(model: Any) -> str | None:
        if model is None and len(served) == 1 and tenant.may_use(served[0]):
            return None  # the gateway fills in its only model
        if not isinstance(model, str) or not model:
            return "`body.model` is required: this gateway serves several models." if len(served) > 1 \
                else "`body.model` must be a model name."
        if model not in served or not tenant.may_use(model):
            return f"The model `{model[:100]}` does not exist or this key may not use it."
        return None
    return check


def _quota_error(quota: int, used: int) -> GatewayError:
    return GatewayError(400, f"This key's file storage is full ({used} of {quota} bytes used): delete files "
                        "(DELETE /v1/files/{id}) or wait for them to expire.", "invalid_request_error", "file",
                        "storage_quota_exceeded")
