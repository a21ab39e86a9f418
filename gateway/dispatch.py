"""The per-request pipeline for /v1/chat/completions and /v1/completions.

validate -> estimate -> candidates -> policy -> reserve -> relay -> release, on a raw ASGI scope:
the body is parsed once with orjson and forwarded byte for byte unless something must change.
Requests that find every candidate at its cap wait in a bounded FIFO admission queue per model.

Request headers the gateway reads: `Authorization: Bearer <key>` (when keys are set; gateway/auth.py),
`X-Request-Id` (kept if 1-128 chars of [A-Za-z0-9._:-], else a uuid4 hex is generated),
`X-Session-Id` (session affinity), `X-Request-Class: batch` (RequestFeatures.request_class),
`X-SLO-TTFT-Ms` / `X-SLO-TPOT-Ms` (the request's SLO; gateway/slo.py).
Other end-to-end headers are forwarded to the worker; hop-by-hop ones, those the Connection header names and
credentials are not; X-Forwarded-For gets the client's address (gateway/forwarding.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from engine_adapters.base import EngineAdapter
from gateway import errors
from gateway.auth import Authenticator
from gateway.config import GatewayConfig
from gateway.errors import GatewayError, sse_error_event
from gateway.forwarding import ForwardedFor, connection_named
from gateway.learning import Learner
from gateway.metrics import GatewayMetrics
from gateway.pd import PdRouter
from gateway.ratelimit import RateLimited, close_ticket, open_ticket
from gateway.registry import Registry, WorkerState
from gateway.relay import Relay, RelayResult, ResponseState, UpstreamFailure
from gateway.slo import SloBook
from gateway.state.base import StateStore
from gateway.upstream import encode_headers
from policies.base import Policy, make_policy
from policies.prefix import prompt_chunk_hashes
from policies.types import CLASS_BATCH, CLASS_INTERACTIVE, RequestFeatures

log = logging.getLogger("fleetgate.dispatch")

UNKNOWN_MODEL_LABEL = "_unknown"  # metrics label for requests that never resolved to a served model
STATUS_CLIENT_GONE = 499  # nginx's convention for "client closed the request"
_REQUEST_ID_RE = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")
_DEFAULT_OUTPUT_TOKENS = 128.0


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


@dataclass(frozen=True, slots=True)
class Route:
    kind: str  # "chat" | "completions"
    url_attr: str  # WorkerState attribute holding the upstream URL
    default_max_tokens: int | None  # vLLM's default when the body has none (reference section 1.3)


CHAT = Route("chat", "chat_url", None)
COMPLETIONS = Route("completions", "completions_url", 16)
ROUTES: dict[str, Route] = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS}


class AdmissionQueue:
    """FIFO of waiting requests for one model. Only the head tries to place itself; a success wakes
    the next waiter, a release wakes the head."""

    __slots__ = ("waiters", "max_size")

    def __init__(self, max_size: int) -> None:
        self.waiters: deque[asyncio.Event] = deque()
        self.max_size = max_size

    def full(self) -> bool:
        return len(self.waiters) >= self.max_size

    def enter(self) -> asyncio.Event:
        ev = asyncio.Event()
        self.waiters.append(ev)
        if len(self.waiters) == 1:
            ev.set()
        return ev

    def is_head(self, ev: asyncio.Event) -> bool:
        return bool(self.waiters) and self.waiters[0] is ev

    def leave(self, ev: asyncio.Event) -> None:
        was_head = self.is_head(ev)
        with contextlib.suppress(ValueError):
            self.waiters.remove(ev)
        if was_head:
            self.wake_head()

    def wake_head(self) -> None:
        if self.waiters:
            self.waiters[0].set()


@dataclass(slots=True)
class ModelRuntime:
    """Per-model routing state, built once on the model's first request."""

    model: str
    policy: Policy
    policy_name: str
    needs_prefix: bool
    slo_ttft_s: float | None
    slo_tpot_s: float | None
    queue: AdmissionQueue


@dataclass(slots=True)
class ParsedRequest:
    body: dict[str, Any]
    model: str | None
    stream: bool
    max_tokens: int | None
    priority: int


class Dispatcher:
    def __init__(self, config: GatewayConfig, store: StateStore, registry: Registry, relay: Relay,
                 adapter: EngineAdapter, metrics: GatewayMetrics, shared_state: bool = False,
                 slo: SloBook | None = None, learner: Learner | None = None,
                 auth: Authenticator | None = None) -> None:
        self.config = config
        self.store = store
        self.registry = registry
        self.relay = relay
        self.adapter = adapter
        self.metrics = metrics
        self.max_body = config.limits.max_body_bytes
        self.queue_timeout = config.limits.queue_timeout_s
        self.attempts = config.limits.retries + 1
        self.auth = auth if auth is not None else Authenticator(config, store)
        self.forwarded_for = ForwardedFor(config.server.trusted_proxies)
        # With shared state another replica's release frees a slot without telling us: poll sooner.
        self.poll_s = config.limits.queue_poll_s or (0.05 if shared_state else 0.5)
        self.shield_release = shared_state
        self.retry_after_s = max(1.0, config.health.interval_s)
        self.runtimes: dict[str, ModelRuntime] = {}
        self.pd = PdRouter(self)  # models with prefill/decode workers take the two-leg path
        self.slo = slo if slo is not None else SloBook(config, metrics.registry)
        self.learner = learner if learner is not None else Learner(config, store, registry, metrics.registry)
        registry.on_change(self._wake_all)
        # Request classes and worker types (gateway/batch_runner.py ClassRouter): pool-aware candidates,
        # per-worker class counts, eviction of batch work; None: every worker takes every request.
        self.pools: Any = None

    # --- per-model state ------------------------------------------------------------------------
    def runtime(self, model: str) -> ModelRuntime:
        rt = self.runtimes.get(model)
        if rt is None:
            name, params, slo = self.config.model_settings(model)
            policy = make_policy(name, **params)
            rt = ModelRuntime(
                model=model, policy=policy, policy_name=name, needs_prefix=needs_prefix_hashes(policy),
                slo_ttft_s=slo.ttft_ms / 1000 if slo.ttft_ms else None,
                slo_tpot_s=slo.tpot_ms / 1000 if slo.tpot_ms else None,
                queue=AdmissionQueue(self.config.limits.queue_size),
            )
            self.runtimes[model] = rt
            self.learner.attach(model, policy)
        return rt

    def _wake_all(self) -> None:
        for rt in self.runtimes.values():
            rt.queue.wake_head()

    # --- ASGI entry -------------------------------------------------------------------------------
    async def handle(self, scope: dict, receive, send, route: Route) -> None:  # noqa: ANN001
        t0 = time.perf_counter()
        state = ResponseState()
        model_label, policy_label, status = UNKNOWN_MODEL_LABEL, "", 0
        task = asyncio.current_task()
        gone: list[bool] = []
        watcher: asyncio.Task | None = None
        hdrs = _read_headers(scope["headers"])
        rid = hdrs.request_id
        client_headers = [(b"x-request-id", rid)]
        feats: RequestFeatures | None = None
        ticket = result = None
        try:
            try:
                if hdrs.content_length == -1:
                    raise errors.bad_request("Invalid Content-Length header.")
                tenant = self.auth.tenant_of_scope(scope, hdrs.auth)
                raw = await self._read_body(receive, hdrs.content_length)
                watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, task, state, gone))
                req = parse_request(raw, route)
                model, changed = self._resolve_model(req)
                rt = self.runtime(model)
                model_label, policy_label = model, rt.policy_name
                shaped = self.adapter.shape_request(raw, req.body, req.stream, changed)
                feats = self._features(req, route, rt, rid.decode(), hdrs)
                ticket = open_ticket(self.store, tenant, feats, client_headers)  # limited keys only
                upstream_headers = b"".join((b"Content-Type: application/json\r\nX-Request-Id: ", rid, b"\r\n",
                                             hdrs.forward, self.forwarded_for.line(scope, hdrs.xff)))
                result = await self._run(rt, feats, route, shaped.body, shaped.strip_usage, req.stream,
                                         upstream_headers, client_headers, send, state)
                status = result.status
                self._observe(model, t0, result)
                self.slo.record(feats, req.stream, t0, result, time.perf_counter())
            except GatewayError as e:
                status = e.status
                if feats is not None and status in (429, 503) and not isinstance(e, RateLimited):
                    self.slo.record_refused(feats)
                if not state.started:
                    await _send_error(send, e, client_headers)
        except ClientGone:
            status = STATUS_CLIENT_GONE
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()  # the client left; nothing more to send
            status = STATUS_CLIENT_GONE
        except Exception:
            log.exception("unexpected error handling %s (request id %s)", scope.get("path"), rid.decode())
            status = 500
            with contextlib.suppress(Exception):
                if not state.started:
                    await _send_error(send, errors.internal_error(), client_headers)
                elif not state.ended:
                    state.ended = True
                    await send({"type": "http.response.body", "more_body": False,
                                "body": sse_error_event("internal gateway error", "internal_error", "internal_error")})
        finally:
            if watcher is not None:
                watcher.cancel()
            if ticket is not None:
                close_ticket(self.store, ticket, result.usage if result is not None else None, feats.prompt_tokens,
                             state.tokens)
            self.metrics.count_request(model_label, policy_label, status)
            if model_label != UNKNOWN_MODEL_LABEL:
                self.metrics.observe_duration(model_label, time.perf_counter() - t0)

    async def _read_body(self, receive, content_length: int | None) -> bytes:  # noqa: ANN001
        if content_length is not None and content_length > self.max_body:
            raise errors.body_too_large(self.max_body)
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientGone
        body = msg.get("body", b"")
        if not msg.get("more_body"):
            if len(body) > self.max_body:
                raise errors.body_too_large(self.max_body)
            return body
        parts = [body]
        size = len(body)
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise ClientGone
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise errors.body_too_large(self.max_body)
            parts.append(chunk)
            if not msg.get("more_body"):
                return b"".join(parts)

    def _resolve_model(self, req: ParsedRequest) -> tuple[str, bool]:
        model = req.model
        if model:
            if not self.registry.knows_model(model):
                raise errors.model_not_found(model, self.registry.served_models())
            return model, False
        served = self.registry.served_models()
        if len(served) == 1:
            req.body["model"] = served[0]
            return served[0], True
        if not served:
            raise errors.no_worker("any model", self.retry_after_s)
        raise errors.bad_request(
            f"`model` is required: this gateway serves several models ({', '.join(served)}).", "model")

    def _features(self, req: ParsedRequest, route: Route, rt: ModelRuntime, rid: str,
                  hdrs: ClientHeaders) -> RequestFeatures:
        body = req.body
        if route is CHAT:
            messages = body["messages"]
            prompt_tokens = estimate_chat_tokens(messages)
            prefix = prompt_chunk_hashes(chat_text(messages)) if rt.needs_prefix else ()
        else:
            prompt = body["prompt"]
            prompt_tokens = estimate_prompt_tokens(prompt)
            prefix = prompt_chunk_hashes(prompt) if rt.needs_prefix and isinstance(prompt, str) else ()
        max_tokens = req.max_tokens if req.max_tokens is not None else route.default_max_tokens
        rclass = hdrs.request_class
        slo_ttft, slo_tpot = self.slo.targets(rt.model, rclass, hdrs.slo_ttft, hdrs.slo_tpot)
        return RequestFeatures(
            request_id=rid, model=rt.model, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
            predicted_output_tokens=self.learner.predict(rt.model, prompt_tokens, max_tokens),
            session_id=hdrs.session_id, prefix_hashes=prefix, slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot,
            priority=req.priority, request_class=rclass, arrival=time.time(),
        )

    # --- placement ----------------------------------------------------------------------------------
    async def _run(self, rt: ModelRuntime, feats: RequestFeatures, route: Route, payload: bytes,
                   strip_usage: bool, stream: bool, upstream_headers: bytes,
                   client_headers: list[tuple[bytes, bytes]], send, state: ResponseState) -> RelayResult:  # noqa: ANN001
        """`upstream_headers`: the request headers for the worker besides Host and Content-Length, encoded."""
        if self.pd.active(rt.model):
            return await self.pd.run(rt, feats, route, payload, strip_usage, stream, upstream_headers,
                                     client_headers, send, state)
        tried: list[str] = []
        failure: UpstreamFailure | None = None
        for attempt in range(self.attempts):
            ws = await self._acquire(rt, feats, tried, may_queue=attempt == 0)
            if ws is None:
                break  # a retry found nobody else to try
            if attempt:
                self.metrics.count_retry(rt.model)
            t_sent = self.learner.dispatched(rt.policy, feats, ws.id, state)
            try:
                result = await self.relay.forward(
                    send, getattr(ws, route.url_attr), payload, upstream_headers, client_headers, stream,
                    strip_usage, attempt + 1 < self.attempts, state)
                if result.midstream_error is not None:
                    self.metrics.upstream_error(ws.id, "midstream")
                self.learner.finished(feats, ws.id, t_sent, result)
                return result
            except UpstreamFailure as f:
                failure = f
                tried.append(ws.id)
                self.metrics.upstream_error(ws.id, f.kind)
                if f.kind == "connect":
                    self.registry.report_failure(ws.id)
                log.debug("request %s failed on %s (%s); %s", feats.request_id, ws.id, f.detail,
                          "retrying" if attempt + 1 < self.attempts else "giving up")
            finally:
                await self._release(rt, feats, ws)
        assert failure is not None
        if failure.status is not None:  # the last worker's own error answer, unchanged
            state.started = state.ended = True
            await send({"type": "http.response.start", "status": failure.status,
                        "headers": [(b"content-type", failure.content_type), *client_headers]})
            await send({"type": "http.response.body", "body": failure.body, "more_body": False})
            return RelayResult(status=failure.status)
        raise errors.upstream_failed(failure.detail)

    async def _acquire(self, rt: ModelRuntime, feats: RequestFeatures, exclude: Sequence[str],
                       may_queue: bool) -> WorkerState | None:
        if not may_queue:
            return await self._try_place(rt, feats, exclude)
        if not rt.queue.waiters:  # nobody waiting: no one to overtake
            ws = await self._try_place(rt, feats, exclude)
            if ws is not None:
                return ws
        if self.pools is not None:  # may evict batch work, or refuse a batch-runner request at once
            await self.pools.no_room(rt, feats)
        if not self.registry.rotation(rt.model):
            raise errors.no_worker(rt.model, self.retry_after_s)
        return await self._wait_in_queue(rt, feats)

    async def _try_place(self, rt: ModelRuntime, feats: RequestFeatures, exclude: Sequence[str]) -> WorkerState | None:
        t = time.perf_counter()
        inflight = self.store.inflight()
        views = []
        by_id: dict[str, WorkerState] = {}
        for ws in self.registry.rotation(rt.model):
            wid = ws.rec.id
            if exclude and wid in exclude:
                continue
            f = inflight.get(wid)
            if f is None:
                n = tokens_in = 0
            else:
                n, tokens_in = f.requests, f.tokens
            cap = ws.rec.cap
            if cap is not None and n >= cap:
                continue
            views.append(ws.view(n, tokens_in))
            by_id[wid] = ws
        pools = self.pools
        if pools is not None:
            views = pools.filter(feats, views)
        tokens = feats.prompt_tokens + int(feats.predicted_output_tokens)
        placed = None
        now = time.time()
        policy = rt.policy
        while views:
            decision = policy.choose(feats, views, now)
            ws = by_id.get(decision.worker_id) if decision.worker_id is not None else None
            if ws is None:
                break
            wid = ws.rec.id
            if await self.store.try_reserve(wid, feats.request_id, ws.rec.cap, tokens):
                policy.on_dispatch(feats, wid, time.time())
                if pools is not None:
                    pools.placed(feats, wid)
                placed = ws
                break
            views = [v for v in views if v.id != wid]  # another replica took the last slot
        self.metrics.observe_routing(rt.model, time.perf_counter() - t)
        return placed

    async def _wait_in_queue(self, rt: ModelRuntime, feats: RequestFeatures) -> WorkerState:
        q = rt.queue
        if q.full():
            raise errors.overloaded(rt.model, self.retry_after_s, "admission queue full")
        t0 = time.perf_counter()
        budget, why = self.slo.queue_budget(feats, self.queue_timeout)
        deadline = t0 + budget
        ev = q.enter()
        self.metrics.set_queue_depth(rt.model, len(q.waiters))
        try:
            while True:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    raise errors.overloaded(rt.model, self.retry_after_s, why)
                if not ev.is_set():
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(min(remaining, self.poll_s)):
                            await ev.wait()
                ev.clear()
                if not q.is_head(ev):
                    continue
                if not self.registry.rotation(rt.model):
                    raise errors.no_worker(rt.model, self.retry_after_s)
                ws = await self._try_place(rt, feats, ())
                if ws is not None:
                    self.metrics.observe_queue_wait(rt.model, time.perf_counter() - t0)
                    return ws
        finally:
            q.leave(ev)  # wakes the next waiter when we were the head
            self.metrics.set_queue_depth(rt.model, len(q.waiters))

    async def _release(self, rt: ModelRuntime, feats: RequestFeatures, ws: WorkerState) -> None:
        try:
            if self.shield_release:  # a networked store: a cancelled client must not leak the slot
                await asyncio.shield(self.store.release(ws.id, feats.request_id))
            else:
                await self.store.release(ws.id, feats.request_id)
        finally:
            self.learner.released(feats.request_id)
            if self.pools is not None:
                self.pools.released(feats, ws.id)
            rt.policy.on_complete(feats, ws.id, time.time())
            for m in ws.models:
                other = self.runtimes.get(m)
                if other is not None:
                    other.queue.wake_head()

    def _observe(self, model: str, t0: float, result: RelayResult) -> None:
        if result.first_token_at is None:
            return
        self.metrics.observe_ttft(model, result.first_token_at - t0)
        n = result.usage.completion_tokens if result.usage is not None else result.tokens
        if n > 1 and result.last_token_at is not None:
            self.metrics.observe_tpot(model, (result.last_token_at - result.first_token_at) / (n - 1))


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


def _utf8_len(s: str) -> int:
    return len(s) if s.isascii() else len(s.encode("utf-8", "surrogatepass"))


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def estimate_chat_tokens(messages: list[dict[str, Any]]) -> int:
    """An estimate, not a tokenizer: ~4 UTF-8 bytes per token of each message's text plus its role
    framing (`<|role|>\\n`...`\\n`, ~3 tokens) and the generation prompt. Exact for the simulator's
    tokenizer (simulator/tokenizer.py), close for English text with Llama-3-class vocabularies."""
    size = 14  # "<|assistant|>\n"
    for m in messages:
        size += _utf8_len(_content_text(m.get("content"))) + len(m.get("role", "")) + 5
    return -(-size // 4)


def estimate_prompt_tokens(prompt: Any) -> int:
    """Completions: ~4 UTF-8 bytes per token for text, exact for token-id prompts."""
    if isinstance(prompt, str):
        return -(-_utf8_len(prompt) // 4)
    if prompt and isinstance(prompt[0], str):
        return sum(-(-_utf8_len(p) // 4) for p in prompt)
    if prompt and isinstance(prompt[0], list):
        return sum(len(p) for p in prompt)
    return len(prompt)


def chat_text(messages: list[dict[str, Any]]) -> str:
    """The messages' text in order: what prefix hashing looks at."""
    return "\n".join(_content_text(m.get("content")) for m in messages)


def needs_prefix_hashes(policy: Policy) -> bool:
    """Policies that read RequestFeatures.prefix_hashes say so with `needs_prefix_hashes = True`;
    until every policy declares it, a name containing "prefix" counts too."""
    declared = getattr(policy, "needs_prefix_hashes", None)
    if declared is not None:
        return bool(declared)
    return "prefix" in getattr(policy, "name", "")


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
    slo_ttft: bytes | None = None  # raw x-slo-ttft-ms / x-slo-tpot-ms (validated in gateway/slo.py)
    slo_tpot: bytes | None = None
    xff: bytes | None = None  # the client's X-Forwarded-For (kept only from a trusted proxy)


_ACCEPT_ANY = b"Accept: */*\r\n"  # what aiohttp sent upstream when the client gave no Accept


def _read_headers(headers: list[tuple[bytes, bytes]]) -> ClientHeaders:
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


async def _watch_disconnect(receive, task: asyncio.Task, state: ResponseState, gone: list[bool]) -> None:  # noqa: ANN001
    """Cancel the request's task when the client goes away (this closes the upstream response)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            if not state.ended:
                gone.append(True)
                task.cancel()
            return


async def _send_error(send, err: GatewayError, extra_headers: list[tuple[bytes, bytes]]) -> None:  # noqa: ANN001
    body = err.body()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [*err.headers(), (b"content-length", str(len(body)).encode()), *extra_headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


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
