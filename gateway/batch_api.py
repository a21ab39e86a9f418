"""OpenAI's Files and Batches API, so `client.files.create(...)` / `client.batches.create(...)` work unchanged.

    POST /v1/files                    multipart: file (JSONL), purpose=batch      -> File object
    GET  /v1/files, /v1/files/{id}, /v1/files/{id}/content
    POST /v1/batches                  {input_file_id, endpoint, completion_window, metadata?} -> Batch
    GET  /v1/batches (after, limit), /v1/batches/{id}
    POST /v1/batches/{id}/cancel

Shapes follow the OpenAI API reference ("Files", "Batch"; input line {custom_id, method, url, body},
output line {id, custom_id, response: {status_code, request_id, body}, error}). The input file is
validated when the batch is created: a bad line fails the whole batch (status "failed" with `errors`,
as OpenAI's "validating" step does); a good batch is queued at once ("in_progress"). Each line becomes
one request in the durable, deadline-ordered batch queue (deadline = created_at + completion_window);
gateway/batch_runner.py runs them on spare capacity through the normal dispatch path and writes the
output and error files. Extension: completion_window accepts any "<n>s|m|h|d" up to 7 days, not only
"24h" (short windows are what tests and deadline ordering need).
"""

from __future__ import annotations

import functools
import math
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from gateway import errors
from gateway.admin import check_api_key
from gateway.errors import GatewayError
from gateway.request import estimate_chat_tokens, estimate_prompt_tokens, parse_json_object
from gateway.state.jobs import QueuedRequest, request_id_for

if TYPE_CHECKING:
    from gateway.app import Gateway

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
PURPOSE_BATCH = "batch"
MAX_WINDOW_S = 7 * 86_400.0
MAX_REPORTED_ERRORS = 100
_WINDOW_RE = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0}
_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
INTERNAL_KEYS = ("_fg_expiring",)  # kept in the stored document, never shown


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def parse_window(value: Any) -> float:
    """completion_window -> seconds ("24h" is OpenAI's only value; see the module docstring)."""
    m = _WINDOW_RE.match(value) if isinstance(value, str) else None
    seconds = float(m.group(1)) * _UNIT_S[m.group(2)] if m else math.nan
    if not 0 < seconds <= MAX_WINDOW_S:
        raise errors.bad_request(f"`completion_window` must be like '24h' (at most 7 days), got {_short(value)}.",
                                 "completion_window")
    return seconds


# --- multipart/form-data (RFC 7578), enough for file uploads ---------------------------------------
def parse_multipart(body: bytes, content_type: str) -> dict[str, tuple[str | None, bytes]]:
    """{field name: (filename or None, bytes)}; a clear 400 for anything malformed."""
    m = re.search(r'boundary=(?:"([^"]+)"|([^;\s]+))', content_type)
    if not content_type.lower().startswith("multipart/form-data") or not m:
        raise errors.bad_request("Upload the file as multipart/form-data with fields `file` and `purpose`.")
    boundary = (m.group(1) or m.group(2)).encode("latin-1")
    fields: dict[str, tuple[str | None, bytes]] = {}
    chunks = (b"\r\n" + body).split(b"\r\n--" + boundary)
    if len(chunks) < 3:
        raise errors.bad_request("Malformed multipart body: boundary not found.")
    for part in chunks[1:]:
        if part.startswith(b"--"):
            break  # the closing delimiter
        head, sep, data = part.partition(b"\r\n\r\n")
        if not sep or not head.startswith(b"\r\n"):
            raise errors.bad_request("Malformed multipart body: a part has no header block.")
        name = filename = None
        for line in head[2:].split(b"\r\n"):
            key, _, value = line.decode("utf-8", "replace").partition(":")
            if key.strip().lower() == "content-disposition":
                n = re.search(r'\bname="([^"]*)"', value)
                f = re.search(r'\bfilename="([^"]*)"', value)
                name = n.group(1) if n else None
                filename = f.group(1) if f else None
        if name is None:
            raise errors.bad_request("Malformed multipart body: a part has no name.")
        fields[name] = (filename, data)
    return fields


# --- validation of a batch input file --------------------------------------------------------------
def parse_input_file(text: str, endpoint: str, batch_id: str, deadline: float,
                     max_requests: int) -> tuple[list[QueuedRequest], list[dict[str, Any]]]:
    """(queued requests, errors) for every non-empty line; errors follow OpenAI's {code, message, line, param}."""
    items: list[QueuedRequest] = []
    problems: list[dict[str, Any]] = []
    seen: set[str] = set()

    def bad(code: str, message: str, line: int, param: str | None = None) -> None:
        problems.append({"code": code, "message": message, "line": line, "param": param})

    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            bad("invalid_json_line", "This line is not valid JSON.", n)
            continue
        if not isinstance(obj, dict):
            bad("invalid_json_line", "Each line must be a JSON object.", n)
            continue
        custom_id, method, url, body = obj.get("custom_id"), obj.get("method"), obj.get("url"), obj.get("body")
        if not isinstance(custom_id, str) or not custom_id:
            bad("missing_required_parameter", "`custom_id` must be a non-empty string.", n, "custom_id")
            continue
        if custom_id in seen:
            bad("duplicate_custom_id", f"The custom_id {custom_id[:64]!r} appears more than once.", n, "custom_id")
            continue
        seen.add(custom_id)
        if method != "POST":
            bad("invalid_method", "`method` must be POST.", n, "method")
            continue
        if url != endpoint:
            bad("mismatched_endpoint", f"`url` must be the batch's endpoint {endpoint}, got {_short(url)}.", n, "url")
            continue
        if not isinstance(body, dict):
            bad("missing_required_parameter", "`body` must be a JSON object.", n, "body")
            continue
        if len(items) >= max_requests:
            bad("too_many_requests", f"A batch holds at most {max_requests} requests.", n)
            break
        model = body.get("model") if isinstance(body.get("model"), str) else ""
        items.append(QueuedRequest(request_id_for(batch_id, len(items)), batch_id, len(items), custom_id, url, body,
                                   deadline, model, _prompt_tokens(url, body)))
    if not items and not problems:
        bad("empty_file", "The input file has no requests.", 0)
    return items, problems


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
def file_object(file_id: str, size: int, filename: str, purpose: str, created_at: int) -> dict[str, Any]:
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created_at, "filename": filename,
            "purpose": purpose, "status": "processed", "expires_at": None, "status_details": None}


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
        except (OSError, ConnectionError, TimeoutError, RedisError) as e:
            raise GatewayError(503, f"The batch store is unavailable ({type(e).__name__}); retry shortly.",
                               "service_unavailable_error", None, "store_unavailable", 5.0) from None
    return wrapper


def _not_found(kind: str, ident: str, param: str) -> GatewayError:
    return GatewayError(404, f"No {kind} with id {ident[:80]!r}.", "invalid_request_error", param, "not_found")


def _short(v: Any) -> str:
    text = orjson.dumps(v).decode() if not isinstance(v, bytes) else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


# --- routes ---------------------------------------------------------------------------------------
def batch_router() -> APIRouter:
    r = APIRouter(prefix="/v1")

    def gw_of(request: Request) -> Gateway:
        check_api_key(request)
        gw = request.app.state.gateway
        if not gw.config.batch.enabled:
            raise GatewayError(404, "The Batch API is disabled on this gateway (batch.enabled: false).",
                               "invalid_request_error", None, "batch_disabled")
        return gw

    @r.post("/files")
    @_store_errors
    async def create_file(request: Request) -> JSONResponse:
        gw = gw_of(request)
        limit = gw.config.batch.max_file_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit + 65_536:
            raise errors.body_too_large(limit)
        body = await request.body()
        fields = parse_multipart(body, request.headers.get("content-type", ""))
        purpose = fields.get("purpose", (None, b""))[1].decode("utf-8", "replace").strip()
        if "file" not in fields:
            raise errors.bad_request("The multipart field `file` is required.", "file")
        if purpose != PURPOSE_BATCH:
            raise errors.bad_request(f"`purpose` must be 'batch' (the only purpose this gateway stores), got "
                                     f"{_short(purpose)}.", "purpose")
        filename, data = fields["file"]
        if len(data) > limit:
            raise errors.body_too_large(limit)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise errors.bad_request("The file must be UTF-8 encoded JSONL.", "file") from None
        meta = file_object(new_id("file-"), len(data), filename or "upload.jsonl", purpose, int(time.time()))
        await gw.store.put_file(meta, text)
        return JSONResponse(meta)

    @r.get("/files")
    @_store_errors
    async def list_files(request: Request) -> JSONResponse:
        gw = gw_of(request)
        return JSONResponse({"object": "list", "data": await gw.store.list_files(), "has_more": False})

    @r.get("/files/{file_id}")
    @_store_errors
    async def get_file(file_id: str, request: Request) -> JSONResponse:
        gw = gw_of(request)
        meta = await gw.store.get_file(file_id) if _ID_RE.match(file_id) else None
        if meta is None:
            raise _not_found("file", file_id, "file_id")
        return JSONResponse(meta)

    @r.get("/files/{file_id}/content")
    @_store_errors
    async def file_content(file_id: str, request: Request) -> Response:
        gw = gw_of(request)
        text = await gw.store.get_file_content(file_id) if _ID_RE.match(file_id) else None
        if text is None:
            raise _not_found("file", file_id, "file_id")
        return Response(text.encode("utf-8"), media_type="application/octet-stream")

    @r.post("/batches")
    @_store_errors
    async def create_batch(request: Request) -> JSONResponse:
        gw = gw_of(request)
        body = parse_json_object(await request.body())
        input_file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
        if not isinstance(input_file_id, str) or not input_file_id:
            raise errors.bad_request("`input_file_id` is required.", "input_file_id")
        if endpoint not in ENDPOINTS:
            raise errors.bad_request(f"`endpoint` must be one of {', '.join(ENDPOINTS)}, got {_short(endpoint)}.",
                                     "endpoint")
        window_s = parse_window(body.get("completion_window"))
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items())):
            raise errors.bad_request("`metadata` must map at most 16 keys (<= 64 chars) to strings (<= 512 chars).",
                                     "metadata")
        meta = await gw.store.get_file(input_file_id) if _ID_RE.match(input_file_id) else None
        if meta is None:
            raise _not_found("file", input_file_id, "input_file_id")
        if meta.get("purpose") != PURPOSE_BATCH:
            raise errors.bad_request(f"File {input_file_id} has purpose {meta.get('purpose')!r}, not 'batch'.",
                                     "input_file_id")
        text = await gw.store.get_file_content(input_file_id) or ""
        now = time.time()
        batch_id = new_id("batch_")
        doc = batch_object(batch_id, input_file_id, endpoint, body["completion_window"], int(now),
                           int(now + window_s), metadata)
        items, problems = parse_input_file(text, endpoint, batch_id, now + window_s, gw.config.batch.max_requests)
        if problems:
            doc.update(status="failed", failed_at=int(time.time()),
                       errors={"object": "list", "data": problems[:MAX_REPORTED_ERRORS]})
            await gw.store.put_batch(doc)
            return JSONResponse(public(doc))
        doc = await gw.batch.submit(doc, items)
        return JSONResponse(public(doc))

    @r.get("/batches")
    @_store_errors
    async def list_batches(request: Request) -> JSONResponse:
        gw = gw_of(request)
        q = request.query_params
        raw_limit = q.get("limit", "20")
        if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
            raise errors.bad_request(f"`limit` must be an integer from 1 to 100, got {raw_limit[:20]!r}.", "limit")
        limit = int(raw_limit)
        docs = await gw.store.list_batches()
        after = q.get("after")
        if after:
            ids = [d["id"] for d in docs]
            if after not in ids:
                raise _not_found("batch", after, "after")
            docs = docs[ids.index(after) + 1:]
        page = [public(await gw.batch.with_counts(d)) for d in docs[:limit]]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(docs) > limit})

    @r.get("/batches/{batch_id}")
    @_store_errors
    async def get_batch(batch_id: str, request: Request) -> JSONResponse:
        gw = gw_of(request)
        doc = await gw.store.get_batch(batch_id) if _ID_RE.match(batch_id) else None
        if doc is None:
            raise _not_found("batch", batch_id, "batch_id")
        return JSONResponse(public(await gw.batch.with_counts(doc)))

    @r.post("/batches/{batch_id}/cancel")
    @_store_errors
    async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
        gw = gw_of(request)
        doc = await gw.store.get_batch(batch_id) if _ID_RE.match(batch_id) else None
        if doc is None:
            raise _not_found("batch", batch_id, "batch_id")
        if doc["status"] in ("completed", "failed", "expired", "finalizing"):
            raise GatewayError(409, f"Cannot cancel a batch with status {doc['status']!r}.", "invalid_request_error",
                               None, "batch_not_cancellable")
        return JSONResponse(public(await gw.batch.cancel(doc)))

    return r
