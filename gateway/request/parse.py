"""What the gateway reads from a client's request before placing it: the route, the parsed and checked body,
the headers it acts on (and the ones it forwards), and the request id. Pure functions.

Request headers the gateway reads: `Authorization: Bearer <key>` (when keys are set; gateway/tenancy/auth.py),
`X-Request-Id` (kept if 1-128 chars of [A-Za-z0-9._:-], else a uuid4 hex is generated),
`X-Session-Id` (session affinity), `X-Request-Class: batch` (RequestFeatures.request_class),
`X-SLO-TTFT-Ms` / `X-SLO-TPOT-Ms` (the request's SLO; gateway/pipeline/slo.py).
Other end-to-end headers are forwarded to the worker; hop-by-hop ones, those the Connection header names and
credentials are not; X-Forwarded-For gets the client's address (gateway/wire/forwarding.py).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.wire import errors
from gateway.wire.forwarding import connection_named
from gateway.wire.upstream import encode_headers
from gateway.wire.validation import check_sampling
from policies.tokens import content_text
from policies.types import CLASS_BATCH, CLASS_INTERACTIVE

_REQUEST_ID_RE = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")


@dataclass(frozen=True, slots=True)
class Route:
    kind: str  # "chat" | "completions"
    url_attr: str  # WorkerState attribute holding the upstream URL
    default_max_tokens: int | None  # vLLM's default when the body has none (docs/reference/vllm-interface.md §1.3)


CHAT = Route("chat", "chat_url", None)
COMPLETIONS = Route("completions", "completions_url", 16)
ROUTES: dict[str, Route] = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS}


@dataclass(slots=True)
class ParsedRequest:
    body: dict[str, Any]
    model: str | None
    stream: bool
    max_tokens: int | None
    priority: int


# --- request parsing and estimates (pure functions) ----------------------------------------------

def parse_request(raw: bytes, route: Route) -> ParsedRequest:
    """Parse once and check the fields the gateway relies on; everything else is the engine's business."""
    body = parse_json_object(raw)
    if route is CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise errors.bad_request("`messages` is required and must be a non-empty array of message objects.",
                                     "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise errors.bad_request(f"`messages[{i}]` must be an object with a string `role`.",
                                         f"messages[{i}]")
            content = m.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise errors.bad_request(f"`messages[{i}].content` must be a string, an array of parts or null.",
                                         f"messages[{i}].content")
    else:
        if "prompt" not in body:
            raise errors.bad_request("`prompt` is required.", "prompt")
        if not _valid_prompt(body["prompt"]):
            raise errors.bad_request(
                "`prompt` must be a string, an array of strings, an array of token ids or an array of such arrays.",
                "prompt")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise errors.bad_request(f"`model` must be a string, got {_json_type(model)}.", "model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise errors.bad_request(f"`stream` must be true or false, got {_json_type(stream)}.", "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise errors.bad_request("`stream_options` must be an object or null.", "stream_options")
    max_tokens = None
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise errors.bad_request(f"`{key}` must be a positive integer, got {_short_json(v)}.", key)
        if max_tokens is None:
            max_tokens = v
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise errors.bad_request(f"`priority` must be an integer, got {_short_json(priority)}.", "priority")
    check_sampling(body)
    return ParsedRequest(body, model or None, stream, max_tokens, priority)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise errors.bad_request(f"The request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise errors.bad_request(f"The request body must be a JSON object, got {_json_type(body)}.")
    return body


def _valid_prompt(p: Any) -> bool:
    if isinstance(p, str):
        return True
    if not isinstance(p, list) or not p:
        return False
    first = p[0]
    if isinstance(first, str):
        return all(isinstance(x, str) for x in p)
    if isinstance(first, int) and not isinstance(first, bool):
        return all(isinstance(x, int) and not isinstance(x, bool) for x in p)
    if isinstance(first, list):
        return all(isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
                   for x in p)
    return False


def chat_text(messages: list[dict[str, Any]]) -> str:
    """The messages' text in order: what prefix hashing looks at."""
    return "\n".join(content_text(m.get("content")) for m in messages)


# Not forwarded upstream: hop-by-hop headers (RFC 9110 section 7.6.1), what the gateway sets itself,
# and the client's credentials for the gateway.
_NOT_FORWARDED = frozenset({
    b"host", b"content-length", b"content-type", b"connection", b"keep-alive", b"proxy-authorization",
    b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade", b"authorization",
    b"accept-encoding", b"expect", b"x-request-id", b"cookie", b"x-api-key", b"x-forwarded-for",
})


@dataclass(slots=True)
class ClientHeaders:
    content_length: int | None  # -1: present but not a number
    auth: bytes | None
    request_id: bytes
    session_id: str | None
    request_class: str
    forward: bytes  # the headers passed on to the worker, encoded `name: value\r\n` lines (Accept: */* if none)
    slo_ttft: bytes | None = None  # raw x-slo-ttft-ms / x-slo-tpot-ms (validated in gateway/pipeline/slo.py)
    slo_tpot: bytes | None = None
    xff: bytes | None = None  # the client's X-Forwarded-For (kept only from a trusted proxy)


_ACCEPT_ANY = b"Accept: */*\r\n"  # what aiohttp sent upstream when the client gave no Accept


def read_headers(headers: list[tuple[bytes, bytes]]) -> ClientHeaders:
    content_length = auth = rid = session = slo_ttft = slo_tpot = xff = conn = None
    rclass = CLASS_INTERACTIVE
    forward: list[bytes] = []
    accept = False
    for k, v in headers:
        if k in _NOT_FORWARDED:
            if k == b"content-length":
                try:
                    content_length = int(v)
                except ValueError:
                    content_length = -1
            elif k == b"authorization":
                auth = v
            elif k == b"x-request-id":
                rid = v
            elif k == b"x-forwarded-for":
                xff = v if xff is None else xff + b", " + v
            elif k == b"connection":
                conn = v
            continue
        if k == b"accept":
            accept = True
        elif k == b"x-session-id":
            session = v.decode("latin-1") or None
        elif k == b"x-request-class" and v == b"batch":
            rclass = CLASS_BATCH
        elif k == b"x-slo-ttft-ms":
            slo_ttft = v
        elif k == b"x-slo-tpot-ms":
            slo_tpot = v
        forward += (k, b": ", v, b"\r\n")
    if not accept:
        forward.append(_ACCEPT_ANY)
    block = b"".join(forward)
    lines = (len(forward) + 3) // 4
    if conn is not None and (named := connection_named(conn)):
        block = encode_headers([(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers
                                if k not in _NOT_FORWARDED and k not in named])
    elif block.count(b"\n") != lines or block.count(b"\r") != lines:
        # A header holds a CR or LF (it could smuggle a header upstream; httptools in front refuses them
        # already, so only a hand-made scope gets here): encode again, dropping those lines.
        block = encode_headers([(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers
                                if k not in _NOT_FORWARDED])
    if rid is None or not _REQUEST_ID_RE.match(rid):
        rid = new_request_id()
    return ClientHeaders(content_length, auth, rid, session, rclass, block, slo_ttft, slo_tpot, xff)


def new_request_id() -> bytes:
    """A random (version 4) UUID as 32 hex digits, like uuid.uuid4().hex, without building a UUID object."""
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40  # version 4
    b[8] = (b[8] & 0x3F) | 0x80  # RFC 4122 variant
    return b.hex().encode()


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def _short_json(v: Any) -> str:
    text = orjson.dumps(v).decode()
    return text if len(text) <= 40 else text[:37] + "..."
