"""A vLLM 0.11-compatible OpenAI HTTP server around one simulated EngineCore (a plain ASGI app).

What a router can see is copied from vLLM 0.11 (docs/reference/vllm-interface.md, cited
below as "vllm-interface §N"): routes (§1.1), nested error bodies and messages (§1.2), response shapes and defaults
(§1.3), SSE framing byte for byte (§2), /metrics (§3, in simulator/vllm_metrics.py), P/D
`kv_transfer_params` (§4.2), dev-mode sleep/wake (§6.1) and KV-cache events (§5: `kv_events_config`, published by
simulator/kv_events.py; block hashes as vLLM computes them, policies/kv_hash.py). Sim-only extras: `/sim/faults`, `/sim/state`
and the request header `x-sim-output-tokens` (how many tokens to generate before "stop").

It is a raw ASGI callable rather than a FastAPI app so the per-token path is a bytes concatenation
and one `send`: the simulator must never be the bottleneck of a gateway benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from typing import Any, Literal
from urllib.parse import parse_qs

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from engine_adapters.vllm.kv_events import WIRE_FORMATS, KvEventsError, parse_kv_events_config
from policies.kv_hash import HASH_ALGOS, BlockHasher, engine_seed
from simulator import tokenizer
from simulator.driver import SLEEP_MODES, EngineDriver, RequestHandle, build_engine, claim_remote_kv
from simulator.faults import FaultConfigError, Faults, parse_faults
from simulator.lora import LoraError, LoraModule, check_limits, parse_lora_modules, runtime_updating_from_env
from simulator.messages_api import messages_routes
from simulator.profiles import Profile, load_profile, profile_from_dict
from simulator.responses_route import responses_route
from simulator.tool_calls import ToolCallSend, tool_call_for

VLLM_VERSION = "0.11.0"
ROLES = ("kv_both", "kv_producer", "kv_consumer")
SCHEDULING_POLICIES = ("fcfs", "priority")
OUTPUT_TOKENS_HEADER = b"x-sim-output-tokens"

# Filler output: 3-letter words, so every token after the first is exactly 4 bytes (" the") and the
# first 3 ("the"): n generated tokens re-tokenize to exactly n tokens under simulator.tokenizer.
_WORDS = ("the", "and", "for", "was", "not", "but", "all", "can", "one", "its", "new", "has", "are", "two",
          "may", "any", "use", "way", "how", "our", "out", "day", "get", "see", "now", "own", "set", "far")
_FIRST = tuple(w.encode() for w in _WORDS)
_NEXT = tuple(b" " + w for w in _FIRST)
_WORD_INDEX = {w: i for i, w in enumerate(_WORDS)}
FILLER_WORDS = _WORDS  # the output's word cycle: a test can check that a text continues without a gap


# --- configuration -------------------------------------------------------------------------------
@dataclass(slots=True)
class ServerConfig:
    """One simulated vLLM server (one engine, one served model)."""

    profile: str | Profile = "llama3-8b-h100"
    model: str | None = None                # served model name; default: the profile's model
    time_scale: float = 1.0                 # model seconds per wall second
    seed: int = 0
    role: str = "kv_both"                   # P/D role (vllm-interface §4.1); kv_both: the request decides
    scheduling_policy: str = "fcfs"         # vLLM --scheduling-policy
    profile_overrides: dict[str, Any] = field(default_factory=dict)   # e.g. {"num_gpu_blocks": 64}
    faults: dict[str, Any] | Faults | None = None
    dev_mode: bool = True                   # VLLM_SERVER_DEV_MODE=1: /sleep, /wake_up, /reset_prefix_cache
    side_channel_port: int = 5557           # advertised NIXL side-channel port (0.11 default, vllm-interface §4.1)
    kv_lease_s: float = 120.0               # VLLM_NIXL_ABORT_REQUEST_TIMEOUT: how long P keeps pinned KV
    # KV-cache events (simulator/kv_events.py): vLLM's --kv-events-config JSON (or a dict); None: off.
    kv_events_config: str | dict[str, Any] | None = None
    # Which vLLM the KV-event side imitates: "0.11" (array events, salt untagged in hashes, NONE_HASH random
    # without PYTHONHASHSEED) or "0.33" (map events, tagged salt, fixed default seed, GET /kv_event_sources).
    kv_events_format: str = "0.11"
    kv_events_offset: int | None = None     # publisher port offset; None: the server's index in its fleet
    prefix_caching_hash_algo: str = "sha256"  # vLLM --prefix-caching-hash-algo: sha256 | sha256_cbor
    hash_seed: str | None = None            # PYTHONHASHSEED for block hashes; None: the environment's
    # LoRA adapters (simulator/lora.py), vLLM's flags: --enable-lora, --lora-modules (name=path or JSON strings, or
    # dicts), --max-loras (distinct adapters per step), --max-cpu-loras (None: = max_loras), --max-lora-rank.
    enable_lora: bool = False
    lora_modules: list[Any] = field(default_factory=list)
    max_loras: int = 1
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    # The runtime load/unload routes, as VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; None: read that variable.
    allow_runtime_lora_updating: bool | None = None


class ConfigError(ValueError):
    """A server or fleet setting that cannot work; the message names it."""


def resolve_profile(cfg: ServerConfig) -> Profile:
    try:
        prof = load_profile(cfg.profile)
        if cfg.profile_overrides:
            data = {**asdict(prof), **cfg.profile_overrides}
            prof = profile_from_dict(data, f"profile {prof.name} with overrides")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return prof


# --- request bodies (vLLM extensions included; unknown fields are ignored, vllm-interface §1.3) ---------------
class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Lenient):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class ContentPart(_Lenient):
    type: str = "text"
    text: str | None = None


class ChatMessage(_Lenient):
    role: str
    content: str | list[ContentPart] | None = None


class _GenRequest(_Lenient):
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    request_id: str | None = None


class ChatRequest(_GenRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # typed as vLLM's ChatCompletionRequest types them (a list of tool objects; a mode or a named function): any
    # other shape is its 400, not a crash of the simulated model
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def check_generation_prompt(cls, data: Any) -> Any:
        # protocol.py ChatCompletionRequest.check_generation_prompt: both given as true is refused
        if isinstance(data, dict) and data.get("continue_final_message") and data.get("add_generation_prompt"):
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return data


class CompletionRequest(_GenRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    suffix: str | None = None


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]


class LoadLoraRequest(_Lenient):
    lora_name: str
    lora_path: str


class UnloadLoraRequest(_Lenient):
    lora_name: str
    lora_int_id: int | None = None


@dataclass(frozen=True, slots=True)
class Adapter:
    """A served LoRA adapter (vLLM's LoRARequest): the name clients use as `model`, its path, id and parent."""

    name: str
    path: str
    lora_id: int
    parent: str


# --- errors (vllm-interface §1.2) -----------------------------------------------------------------------------
class ApiError(Exception):
    def __init__(self, status: int, message: str, err_type: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type or _error_type(status)
        self.param = param


def _error_type(status: int) -> str:
    return {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
            501: "NotImplementedError"}.get(status) or HTTPStatus(status).phrase


def error_body(status: int, message: str, err_type: str | None = None, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": err_type or _error_type(status),
                                   "param": param, "code": status}})


def _validation_error(exc: ValidationError) -> ApiError:
    # FastAPI's RequestValidationError as vLLM 0.11 renders it: 400, type "Bad Request" (vllm-interface §1.2).
    errors = [{"type": e["type"], "loc": ("body", *e["loc"]), "msg": e["msg"], "input": e.get("input")}
              for e in exc.errors(include_url=False)]
    lines = [f"{len(errors)} validation error{'s' if len(errors) != 1 else ''}:"]
    lines += [f"  {{'type': {e['type']!r}, 'loc': {e['loc']!r}, 'msg': {e['msg']!r}}}" for e in errors]
    return ApiError(400, "\n".join(lines), "Bad Request")


def _json_error(exc: Exception) -> ApiError:
    detail = {"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error", "ctx": {"error": str(exc)}}
    return ApiError(400, f"1 validation error:\n  {detail!r}", "Bad Request")


# --- connection dropping (drop_after_tokens fault) ---------------------------------------------------
_dropping: contextvars.ContextVar[bool] = contextvars.ContextVar("sim_dropping", default=False)


class _HideDeliberateDrops(logging.Filter):
    """uvicorn logs an error when an app returns mid-response; ours do it on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _dropping.get()


logging.getLogger("uvicorn.error").addFilter(_HideDeliberateDrops())
_log = logging.getLogger("simulator.vllm_api")


# --- the server -----------------------------------------------------------------------------------
Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]
Handler = Callable[[dict, Receive, Send], Awaitable[None]]
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]


class SimServer:
    """ASGI app: `await server(scope, receive, send)`. Start its engine loop with `await start()`
    (the fleet does it; the ASGI lifespan protocol also does it when the host server sends it)."""

    def __init__(self, config: ServerConfig, name: str = "sim-0"):
        if config.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {config.role!r}")
        if config.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                              f"got {config.scheduling_policy!r}")
        if not config.time_scale > 0:
            raise ConfigError(f"time_scale must be > 0, got {config.time_scale!r}")
        self.config = config
        self.name = name
        self.profile = resolve_profile(config)
        self.model = config.model or self.profile.model
        self.max_model_len = self.profile.max_model_len
        try:
            spec = config.faults.to_dict() if isinstance(config.faults, Faults) else config.faults
            self.faults = parse_faults(spec)  # always this server's own copy
        except FaultConfigError as exc:
            raise ConfigError(f"faults: {exc}") from None
        self.rng = random.Random(config.seed)
        self.engine_id = str(uuid.uuid4())  # KVTransferConfig.engine_id default (docs/reference/vllm-interface.md §4.1)
        self.kv_events, self.hasher = _kv_setup(config, self.profile)
        try:
            modules = parse_lora_modules(config.lora_modules)
            check_limits(config.enable_lora, config.max_loras, config.max_cpu_loras, config.max_lora_rank, modules)
        except LoraError as exc:
            raise ConfigError(str(exc)) from None
        self.driver: EngineDriver = build_engine(self.profile, config, self.model, self.faults, self.engine_id,
                                                 self.kv_events.active)
        self.created = int(time.time())
        self._model_json = orjson.dumps(self.model)
        self.adapters: dict[str, Adapter] = {}
        self._lora_ids = 0
        for module in modules:   # static adapters: loaded at start-up, before the server answers
            self._register(module)
        self._inflight = 0
        self._sleep_api_033 = False    # the last /sleep was 0.33-style: /wake_up answers with JSON
        self._counter = 0
        self._closed = asyncio.Event()
        self.traceparents: deque[str] = deque(maxlen=64)  # the last W3C traceparent headers received
        self._routes: dict[str, dict[str, Handler]] = {
            "/v1/chat/completions": {"POST": self._chat},
            "/v1/completions": {"POST": self._completions},
            "/v1/models": {"GET": self._models},
            "/health": {"GET": self._health},
            "/ping": {"GET": self._health, "POST": self._health},
            "/version": {"GET": self._version},
            "/load": {"GET": self._load},
            "/metrics": {"GET": self._metrics},
            "/tokenize": {"POST": self._tokenize},
            "/detokenize": {"POST": self._detokenize},
            "/v1/embeddings": {"POST": self._embeddings},
            "/v1/responses": {"POST": responses_route(self._chat, ApiError, self.model)},   # ref §1.1, 0.11 and 0.33
            "/sim/faults": {"GET": self._get_faults, "POST": self._post_faults, "DELETE": self._delete_faults},
            "/sim/state": {"GET": self._state},
        }
        if config.kv_events_format == "0.33":   # ref §5.1: 0.33 advertises its publishers
            self._routes["/kv_event_sources"] = {"GET": self._kv_event_sources}
        runtime_lora = config.allow_runtime_lora_updating
        if runtime_lora if runtime_lora is not None else runtime_updating_from_env():
            self._routes["/v1/load_lora_adapter"] = {"POST": self._load_lora}
            self._routes["/v1/unload_lora_adapter"] = {"POST": self._unload_lora}
        if config.dev_mode:
            self._routes.update({
                "/sleep": {"POST": self._sleep},
                "/wake_up": {"POST": self._wake_up},
                "/is_sleeping": {"GET": self._is_sleeping},
                "/reset_prefix_cache": {"POST": self._reset_prefix_cache},
            })
        if config.kv_events_format != "0.11":   # 0.32/0.33 serve Anthropic's Messages API (simulator/messages_api.py)
            self._routes.update(messages_routes(self._chat, ApiError))

    async def start(self) -> None:
        self._closed.clear()
        if self.kv_events.active and self.driver.publisher is None:
            from simulator.kv_events import KvEventPublisher

            try:
                self.driver.publisher = KvEventPublisher(self.kv_events, self.config.kv_events_format,
                                                         self.config.kv_events_offset or 0)
            except KvEventsError as exc:
                raise ConfigError(str(exc)) from None
        await self.driver.start()

    async def stop(self) -> None:
        self._closed.set()
        await self.driver.stop()
        publisher, self.driver.publisher = self.driver.publisher, None
        if publisher is not None:
            publisher.close()

    # --- LoRA adapters (simulator/lora.py; vLLM 0.11 serving_models.py, docs/reference/vllm-interface.md §6.2) ----
    def _register(self, module: LoraModule, now: float | None = None) -> float:
        """Serve an adapter under its name, with the next integer id; its weights go to the engine's host-memory
        cache. Returns the model seconds the load takes (`now` None: a static module, loaded before the server
        starts, at no cost to the engine's clock)."""
        self._lora_ids += 1
        parent = module.base_model_name if module.base_model_name == self.model else self.model
        adapter = Adapter(module.name, module.path, self._lora_ids, parent)
        self.adapters[adapter.name] = adapter
        core = self.driver.core
        return core.add_lora(adapter.lora_id, now or 0.0, at_start=now is None) if core.max_loras else 0.0

    def _resolve(self, model: str | None) -> Adapter | None:
        """The adapter a request's `model` names (None: the base model), else vLLM's 404
        (serving_engine.py::_check_model; a missing or empty `model` means the base model)."""
        if not model or model == self.model:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            raise ApiError(404, f"The model `{model}` does not exist.")
        return adapter

    async def _load_lora(self, scope: dict, receive: Receive, send: Send) -> None:
        """POST /v1/load_lora_adapter: 200 with a plain-text body and no content type (a bare Starlette Response),
        after the engine has read the adapter from disk; errors as serving_models.py words them."""
        req = _parse(LoadLoraRequest, await _read_body(receive))
        if not req.lora_name or not req.lora_path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if req.lora_name in self.adapters:
            raise ApiError(400, f"The lora adapter '{req.lora_name}' has already been loaded.", "InvalidUserInput")
        if not self.driver.core.max_loras:   # the worker's add_lora without --enable-lora (engine error: 400)
            raise ApiError(400, "LoRA is not enabled. Use --enable-lora to enable LoRA.")
        wait = self._register(LoraModule(req.lora_name, req.lora_path), self.driver.model_now())
        if wait > 0:
            await asyncio.sleep(wait / self.config.time_scale)
        await _respond(send, 200, f"Success: LoRA adapter '{req.lora_name}' added successfully.".encode(),
                       headers=[])

    async def _unload_lora(self, scope: dict, receive: Receive, send: Send) -> None:
        """POST /v1/unload_lora_adapter: the name leaves the registry (0.11 does not evict the engine's copy)."""
        req = _parse(UnloadLoraRequest, await _read_body(receive))
        if not req.lora_name and not req.lora_int_id:
            raise ApiError(400, "either 'lora_name' and 'lora_int_id' needs to be provided.", "InvalidUserInput")
        if req.lora_name not in self.adapters:
            raise ApiError(404, f"The lora adapter '{req.lora_name}' cannot be found.")
        del self.adapters[req.lora_name]
        await _respond(send, 200, f"Success: LoRA adapter '{req.lora_name}' removed successfully.".encode(),
                       headers=[])

    # --- ASGI entry ----------------------------------------------------------------------------
    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            methods = self._routes.get(scope["path"])
            if methods is None:
                return await _respond(send, 404, b'{"detail":"Not Found"}')
            handler = methods.get(scope["method"])
            if handler is None:
                return await _respond(send, 405, b'{"detail":"Method Not Allowed"}')
            try:
                await handler(scope, receive, send)
            except ApiError as exc:
                await _respond(send, exc.status, error_body(exc.status, exc.message, exc.err_type, exc.param))
            except Exception as exc:  # a simulator bug: still a vLLM-shaped body, never uvicorn's plain text
                _log.exception("unhandled error in %s %s", scope["method"], scope["path"])
                with contextlib.suppress(RuntimeError):  # the response may have started already
                    await _respond(send, 500, error_body(500, f"{type(exc).__name__}: {exc}"))
        elif kind == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await self.start()
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await self.stop()
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    # --- generation ----------------------------------------------------------------------------
    async def _chat(self, scope: dict, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, chat=True)

    async def _completions(self, scope: dict, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, chat=False)

    async def _generate(self, scope: dict, receive: Receive, send: Send, chat: bool) -> None:
        self._inflight += 1
        try:
            await self._generate_inner(scope, receive, send, chat)
        finally:
            self._inflight -= 1

    async def _generate_inner(self, scope: dict, receive: Receive, send: Send, chat: bool) -> None:
        arrival = self.driver.model_now()
        body = await _read_body(receive)
        faults = self.faults
        if faults.hang:
            return await _hang(receive, send, self._closed)
        if faults.error_status is not None and faults.should_error(self.rng):
            status = faults.error_status
            raise ApiError(status, f"Simulated fault: this server answers {status} (POST /sim/faults to clear).")
        req = _parse(ChatRequest if chat else CompletionRequest, body)
        if req.stream_options is not None and not req.stream:  # protocol.py validator (0.11)
            raise ApiError(400, "Stream options can only be defined when `stream=True`.", "Bad Request")
        headers = dict(scope["headers"])
        tp = headers.get(b"traceparent")
        if tp is not None:  # vLLM continues the caller's trace with it (--otlp-traces-endpoint); kept for /sim/state
            self.traceparents.append(tp.decode("latin-1"))
        plan = self._plan(req, headers, chat)
        if chat and req.tools and (call := tool_call_for(orjson.loads(body))):
            send = ToolCallSend(send, call)   # the answer as a function call (simulator/tool_calls.py)
        self._counter += 1
        handle = self.driver.submit(
            request_id=f"{plan.response_id}#{self._counter}", prompt_len=plan.prompt_len,
            block_hashes=plan.block_hashes, max_tokens=plan.max_tokens, target_tokens=plan.target_tokens,
            priority=req.priority, arrival=arrival, remote_decode=plan.remote_decode,
            remote_kv_delay=plan.remote_kv_delay, token_ids=plan.token_ids,
            lora_id=plan.adapter.lora_id if plan.adapter else 0, lora_name=plan.adapter.name if plan.adapter else None,
        )
        try:
            if req.stream:
                await self._stream(plan, handle, receive, send, chat)
            else:
                await self._complete(plan, handle, receive, send, chat)
        finally:
            if not handle.finished:
                self.driver.abort(handle)

    def _plan(self, req: ChatRequest | CompletionRequest, headers: dict[bytes, bytes], chat: bool) -> _Plan:
        """Everything vLLM decides before the request reaches the engine, with its error messages."""
        adapter = self._resolve(req.model)  # serving_engine.py::_check_model (vllm-interface §1.2)
        L = self.max_model_len
        if chat:
            messages = [m.model_dump() for m in req.messages]
            if req.continue_final_message and (not messages or messages[-1]["role"] != "assistant"):
                raise ApiError(400, "Cannot set `continue_final_message` to True when the last message is not "
                                    "from the assistant.")
            continues = req.continue_final_message
            prompt = tokenizer.render_chat(messages, req.add_generation_prompt and not continues, continues)
            text_so_far = tokenizer.message_text(messages[-1]) if continues else ""
            token_ids = tokenizer.encode(prompt)
            n = len(token_ids)
            requested = req.max_completion_tokens or req.max_tokens
            # serving_engine.py::_validate_input (vllm-interface §1.2, chat messages)
            if n >= L:
                raise ApiError(400, f"This model's maximum context length is {L} tokens. However, your request "
                                    f"has {n} input tokens. Please reduce the length of the input messages.")
            if requested is not None and n + requested > L:
                raise ApiError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This "
                                    f"model's maximum context length is {L} tokens and your request has {n} "
                                    f"input tokens ({requested} > {L} - {n}).")
            response_id = "chatcmpl-" + _base_id(headers, req.request_id)
        else:
            if req.suffix is not None:
                raise ApiError(400, "suffix is not currently supported")
            token_ids = _completion_prompt_tokens(req.prompt)
            text_so_far = req.prompt if isinstance(req.prompt, str) else ""
            n = len(token_ids)
            requested = req.max_tokens
            # renderer.py::_create_tokens_prompt with max_length = max_model_len - max_tokens (vllm-interface §1.2)
            if requested is not None and n > L - requested:
                raise ApiError(400, f"This model's maximum context length is {L - requested} tokens. However, "
                                    f"your request has {n} input tokens. Please reduce the length of the input "
                                    "messages.")
            response_id = "cmpl-" + _base_id(headers, req.request_id)
        if n == 0:
            raise ApiError(400, "The decoder prompt cannot be empty")
        # entrypoints/utils.py::get_max_tokens: None means "until the end of the context".
        max_tokens = L - n if requested is None else min(requested, L - n)
        if requested is not None and requested < 1:  # SamplingParams._verify_args
            raise ApiError(400, f"max_tokens must be at least 1, got {requested}.")
        if req.n is not None and req.n != 1:
            if req.n < 1:
                raise ApiError(400, f"n must be at least 1, got {req.n}.")
            raise ApiError(400, f"n={req.n}: the simulator generates one choice per request.")
        if req.min_tokens < 0:
            raise ApiError(400, f"min_tokens must be greater than or equal to 0, got {req.min_tokens}.")
        if req.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                                f"got {req.min_tokens}.")
        if req.priority != 0 and self.config.scheduling_policy != "priority":  # v1/engine/processor.py
            raise ApiError(400, f"Got priority {req.priority} but Priority scheduling is not enabled.")
        target = self._target_tokens(req, headers, max_tokens)

        kv = req.kv_transfer_params if isinstance(req.kv_transfer_params, dict) else {}
        remote_decode = bool(kv.get("do_remote_decode")) and self.config.role != "kv_consumer"
        remote_kv_delay = None
        if kv.get("do_remote_prefill") and self.config.role != "kv_producer":
            # Fetch P's pinned blocks; unknown or expired params -> local prefill (kv_load_failure_policy
            # "recompute", vllm-interface §4.1). Only producers in this process can be reached (no real NIXL).
            remote_kv_delay = claim_remote_kv(kv, n, self.profile)
        stream_opts = req.stream_options
        offset = self.rng.randrange(len(_WORDS))
        seed = (req.model_extra or {}).get("seed")
        if isinstance(seed, int):  # seeded sampling repeats its answer, as vLLM's does
            offset = random.Random(seed).randrange(len(_WORDS))
        return _Plan(
            response_id=response_id, prompt_len=n, max_tokens=max_tokens, target_tokens=target,
            block_hashes=self.hasher.hashes(token_ids, req.cache_salt),
            token_ids=token_ids if self.kv_events.active else None,
            include_usage=bool(req.stream and stream_opts and stream_opts.include_usage),
            continuous_usage=bool(req.stream and stream_opts and stream_opts.include_usage
                                  and stream_opts.continuous_usage_stats),
            remote_decode=remote_decode, remote_kv_delay=remote_kv_delay,
            word_offset=offset, created=int(time.time()),
            continued=_continued_word(text_so_far), adapter=adapter,
        )

    def _target_tokens(self, req: ChatRequest | CompletionRequest, headers: dict[bytes, bytes],
                       max_tokens: int) -> int:
        """How many tokens this request generates: max_tokens with ignore_eos, else the sim header, else
        a draw from the profile's output-length distribution; never above max_tokens."""
        if req.ignore_eos:
            target = max_tokens
        elif OUTPUT_TOKENS_HEADER in headers:
            raw = headers[OUTPUT_TOKENS_HEADER]
            try:
                target = int(raw)
            except ValueError:
                raise ApiError(400, f"x-sim-output-tokens must be an integer, got {raw.decode(errors='replace')!r}",
                               param="x-sim-output-tokens") from None
            if target < 1:
                raise ApiError(400, "x-sim-output-tokens must be >= 1", param="x-sim-output-tokens")
        else:
            target = self.profile.sample_output_tokens(self.rng, max_tokens)
        return max(min(target, max_tokens), min(req.min_tokens, max_tokens), 1)

    async def _complete(self, plan: _Plan, h: RequestHandle, receive: Receive, send: Send, chat: bool) -> None:
        """Non-streaming: wait for the end, then one JSON body (vllm-interface §1.3 shapes)."""
        watcher = _DisconnectWatcher(receive, h)
        try:
            drop_at = self.faults.drop_after_tokens
            while not h.finished:
                await h.event.wait()
                h.event.clear()
                if h.client_gone:
                    return
                if drop_at is not None and h.generated >= drop_at and not h.finished:
                    break
        finally:
            watcher.cancel()
        # The drop fault cuts every answer longer than its threshold, also one the engine finished before this
        # handler woke (a host behind the wall clock runs many engine steps in one burst, without yielding).
        dropped = drop_at is not None and (not h.finished or h.generated > drop_at)
        text = _text(plan, 0, h.generated).decode()
        usage = {"prompt_tokens": plan.prompt_len, "total_tokens": plan.prompt_len + h.generated,
                 "completion_tokens": h.generated, "prompt_tokens_details": None}
        kv_params = self._kv_params(h) if plan.remote_decode else None
        model = plan.adapter.name if plan.adapter else self.model   # vLLM answers with the adapter's name
        if chat:
            body = {"id": plan.response_id, "object": "chat.completion", "created": plan.created, "model": model,
                    "choices": [{"index": 0, "message": {
                        "role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                        "function_call": None, "tool_calls": [], "reasoning_content": None},
                        "logprobs": None, "finish_reason": h.finish_reason, "stop_reason": None, "token_ids": None}],
                    "service_tier": None, "system_fingerprint": None, "usage": usage,
                    "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": kv_params}
        else:
            body = {"id": plan.response_id, "object": "text_completion", "created": plan.created, "model": model,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": h.finish_reason,
                                 "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                                 "prompt_token_ids": None}],
                    "service_tier": None, "system_fingerprint": None, "usage": usage, "kv_transfer_params": kv_params}
        data = orjson.dumps(body)
        if dropped:  # drop fault: promise the whole body, send half, hang up
            if not h.finished:
                self.driver.abort(h)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [*_JSON, (b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data[: len(data) // 2], "more_body": True})
            _dropping.set(True)
            return
        await _respond(send, 200, data)

    def _kv_params(self, h: RequestHandle) -> dict[str, Any] | None:
        """P's answer to a do_remote_decode request (0.11 nixl_connector.py::request_finished, vllm-interface §4.2):
        only a length-capped finish hands its blocks over."""
        if h.finish_reason != "length" or h.remote_block_ids is None:
            return None
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": h.remote_block_ids,
                "remote_engine_id": self.engine_id, "remote_host": "127.0.0.1",
                "remote_port": self.config.side_channel_port, "tp_size": 1}

    async def _stream(self, plan: _Plan, h: RequestHandle, receive: Receive, send: Send, chat: bool) -> None:
        """SSE exactly as vLLM 0.11 frames it (vllm-interface §2); several ready tokens go out in one write."""
        rid = plan.response_id.encode()
        head = b'data: {"id":"' + rid + b'","object":"' + (b"chat.completion.chunk" if chat else b"text_completion")
        model = orjson.dumps(plan.adapter.name) if plan.adapter else self._model_json
        head += b'","created":' + str(plan.created).encode() + b',"model":' + model + b',"choices":['
        if chat:
            tok_open = head + b'{"index":0,"delta":{"content":"'
            tok_mid = b'"},"logprobs":null,"finish_reason":null,"token_ids":null}]'
            tok_last = b'"},"logprobs":null,"finish_reason":"%s","stop_reason":null,"token_ids":null}]'
        else:
            tok_open = head + b'{"index":0,"text":"'
            tok_mid = b'","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]'
            tok_last = (b'","logprobs":null,"finish_reason":"%s","stop_reason":null,"prompt_token_ids":null,'
                        b'"token_ids":null}]')
        P = plan.prompt_len
        cont = plan.continuous_usage
        usage_tail = b',"prompt_tokens_details":null}' if not chat else b"}"
        no_usage = b"}\n\n" if chat else b',"usage":null}\n\n'

        def usage(c: int) -> bytes:
            return b',"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d' % (P, P + c, c) + usage_tail

        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        if chat:  # the role chunk (serving_chat.py: first chunk of each choice)
            first = head + b'{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
            first += (usage(0) + b',"prompt_token_ids":null}\n\n') if cont else b',"prompt_token_ids":null}\n\n'
            await send({"type": "http.response.body", "body": first, "more_body": True})
        watcher = _DisconnectWatcher(receive, h)
        drop_at = self.faults.drop_after_tokens
        sent = 0
        try:
            while True:
                await h.event.wait()
                h.event.clear()
                if h.client_gone:
                    return
                n, fin = h.generated, h.finished
                if drop_at is not None and n > drop_at:
                    n, fin = drop_at, False
                parts = []
                for i in range(sent, n):
                    word = _word(plan, i)
                    last = fin and i == n - 1
                    parts.append(tok_open + word + (tok_last % h.finish_reason.encode() if last else tok_mid)
                                 + (usage(i + 1) + b"}\n\n" if cont else no_usage))
                if fin and n == sent:  # finished without a new token: an empty delta carries the reason
                    parts.append(_finish_only(head, chat, h.finish_reason, usage(n) if cont else None))
                sent = n
                if drop_at is not None and sent >= drop_at and not fin:
                    if parts:
                        await send({"type": "http.response.body", "body": b"".join(parts), "more_body": True})
                    self.driver.abort(h)
                    _dropping.set(True)
                    return
                if fin:
                    if plan.include_usage:
                        # the usage chunk: choices [], serialized with exclude_none (vllm-interface §2)
                        parts.append(head + b'],"usage":{"prompt_tokens":%d,"total_tokens":%d,'
                                     b'"completion_tokens":%d}}\n\n' % (P, P + n, n))
                    parts.append(b"data: [DONE]\n\n")
                    await send({"type": "http.response.body", "body": b"".join(parts), "more_body": False})
                    return
                if parts:
                    await send({"type": "http.response.body", "body": b"".join(parts), "more_body": True})
        finally:
            watcher.cancel()

    # --- small endpoints ----------------------------------------------------------------------
    async def _models(self, scope: dict, receive: Receive, send: Send) -> None:
        card = {"id": self.model, "object": "model", "created": self.created, "owned_by": "vllm", "root": self.model,
                "parent": None, "max_model_len": self.max_model_len,
                "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                                "created": self.created, "allow_create_engine": False, "allow_sampling": True,
                                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}]}
        cards = [card]
        for a in self.adapters.values():   # serving_models.py::show_available_models: root = path, parent = base
            cards.append({**card, "id": a.name, "root": a.path, "parent": a.parent, "max_model_len": None,
                          "permission": [{**card["permission"][0], "id": f"modelperm-{uuid.uuid4().hex}"}]})
        await _respond(send, 200, orjson.dumps({"object": "list", "data": cards}))

    async def _health(self, scope: dict, receive: Receive, send: Send) -> None:
        await _respond(send, 503 if self.faults.health_fail else 200, b"", headers=[])

    async def _version(self, scope: dict, receive: Receive, send: Send) -> None:
        await _respond(send, 200, orjson.dumps({"version": VLLM_VERSION}))

    async def _load(self, scope: dict, receive: Receive, send: Send) -> None:
        # As with --enable-server-load-tracking: in-flight generation requests (vllm-interface §1.3 GET /load).
        await _respond(send, 200, orjson.dumps({"server_load": self._inflight}))

    async def _metrics(self, scope: dict, receive: Receive, send: Send) -> None:
        accept = dict(scope["headers"]).get(b"accept", b"").decode()
        data, content_type = self.driver.render_metrics(accept)
        await _respond(send, 200, data, headers=[(b"content-type", content_type.encode())])

    async def _tokenize(self, scope: dict, receive: Receive, send: Send) -> None:
        req = _parse(TokenizeRequest, await _read_body(receive))
        self._resolve(req.model)
        if req.messages is not None:
            text = tokenizer.render_chat([m.model_dump() for m in req.messages], req.add_generation_prompt)
        elif req.prompt is not None:
            text = req.prompt
        else:
            raise ApiError(400, "Either 'prompt' or 'messages' must be given.", "Bad Request")
        ids = tokenizer.encode(text)
        strs = None
        if req.return_token_strs:
            raw = text.encode()
            strs = [raw[i:i + tokenizer.BYTES_PER_TOKEN].decode(errors="replace")
                    for i in range(0, len(raw), tokenizer.BYTES_PER_TOKEN)]
        await _respond(send, 200, orjson.dumps(
            {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}))

    async def _detokenize(self, scope: dict, receive: Receive, send: Send) -> None:
        req = _parse(DetokenizeRequest, await _read_body(receive))
        self._resolve(req.model)
        bad = [t for t in req.tokens if not 0 <= t < tokenizer.VOCAB_SIZE]
        if bad:
            raise ApiError(400, f"Token id {bad[0]} is out of vocabulary")
        # The tokenizer hashes bytes, so ids cannot be inverted: return filler text of the same token count.
        text = tokenizer.synthetic_text(len(req.tokens), key=",".join(map(str, req.tokens[:64])))
        await _respond(send, 200, orjson.dumps({"prompt": text}))

    async def _embeddings(self, scope: dict, receive: Receive, send: Send) -> None:
        """A generate model's /v1/embeddings in vLLM 0.11: the error object sent with HTTP 200 (ref §1.1, §1.2)."""
        await _read_body(receive)
        await _respond(send, 200, orjson.dumps({"error": {
            "message": "The model does not support Embeddings API", "type": "BadRequestError", "param": None,
            "code": 400}}))

    async def _sleep(self, scope: dict, receive: Receive, send: Send) -> None:
        """0.11 (`?level=1|2`, no mode): 200 with an empty body. 0.33 (`mode` given, or level 0): pause with
        `mode=abort|wait|keep` (default abort), then sleep; `{"status":"sleeping","level":L}`."""
        query = parse_qs(scope.get("query_string", b"").decode())
        try:
            level = int(query.get("level", ["1"])[0])
        except ValueError:
            raise ApiError(400, "level must be an integer") from None
        mode = query.get("mode", [None])[0]
        if mode is None and level in (1, 2):
            self.driver.sleep(level)
            await _respond(send, 200, b"", headers=[])
            return
        if level not in (0, 1, 2):
            raise ApiError(400, f"level must be 0, 1 or 2, got {level}")
        mode = mode or "abort"
        if mode not in SLEEP_MODES:
            raise ApiError(400, f"mode must be one of {', '.join(SLEEP_MODES)}, got {mode!r}")
        if mode == "wait":
            await self.driver.sleep_after_drain(level)
        else:
            self.driver.sleep(level, mode)
        self._sleep_api_033 = True
        await _respond(send, 200, orjson.dumps({"status": "sleeping", "level": level}))

    async def _wake_up(self, scope: dict, receive: Receive, send: Send) -> None:
        tags = parse_qs(scope.get("query_string", b"").decode()).get("tags") or None
        await self.driver.wake_up(tags)
        if not self._sleep_api_033 and tags is None:
            await _respond(send, 200, b"", headers=[])
            return
        awake = not self.driver.is_sleeping
        if awake:
            self._sleep_api_033 = False
        await _respond(send, 200, orjson.dumps({"status": "awake" if awake else "sleeping", "tags": tags}))

    async def _is_sleeping(self, scope: dict, receive: Receive, send: Send) -> None:
        await _respond(send, 200, orjson.dumps({"is_sleeping": self.driver.is_sleeping}))

    async def _kv_event_sources(self, scope: dict, receive: Receive, send: Send) -> None:
        publisher = self.driver.publisher
        await _respond(send, 200, orjson.dumps({"0": publisher.source()} if publisher is not None else {}))

    async def _reset_prefix_cache(self, scope: dict, receive: Receive, send: Send) -> None:
        self.driver.reset_prefix_cache()
        await _respond(send, 200, b"", headers=[])

    async def _get_faults(self, scope: dict, receive: Receive, send: Send) -> None:
        await _respond(send, 200, orjson.dumps(self.faults.to_dict()))

    async def _post_faults(self, scope: dict, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        try:
            spec = orjson.loads(body) if body.strip() else {}
        except orjson.JSONDecodeError as exc:
            raise _json_error(exc) from None
        try:
            self.faults.update(spec)
        except FaultConfigError as exc:
            raise ApiError(400, str(exc)) from None
        self.driver.faults_changed()
        await _respond(send, 200, orjson.dumps(self.faults.to_dict()))

    async def _delete_faults(self, scope: dict, receive: Receive, send: Send) -> None:
        self.faults.reset()
        self.driver.faults_changed()
        await _respond(send, 200, orjson.dumps(self.faults.to_dict()))

    async def _state(self, scope: dict, receive: Receive, send: Send) -> None:
        state = self.driver.state()
        state.update(name=self.name, model=self.model, profile=self.profile.name, role=self.config.role,
                     scheduling_policy=self.config.scheduling_policy, engine_id=self.engine_id,
                     inflight_http=self._inflight, faults=self.faults.to_dict(),
                     traceparents=list(self.traceparents))
        core = self.driver.core
        if core.max_loras:   # sim-only view: which adapters are served, and where their weights are
            by_id = {a.lora_id: a.name for a in self.adapters.values()}
            cached = [i for i in by_id if core.has_lora(i)[0]]
            state["lora"] = {"adapters": {a.name: {"path": a.path, "lora_int_id": a.lora_id}
                                          for a in self.adapters.values()},
                             "in_host_memory": [by_id[i] for i in cached],
                             "in_gpu_slots": [by_id[i] for i in cached if core.has_lora(i)[1]],
                             "disk_loads": core.stats.lora_disk_loads, "activations": core.stats.lora_activations}
        await _respond(send, 200, orjson.dumps(state))


def _kv_setup(config: ServerConfig, profile: Profile) -> tuple[Any, BlockHasher]:
    """The server's KV-events config and the block hasher its engine uses (ref §5.2), or ConfigError."""
    if config.kv_events_format not in WIRE_FORMATS:
        raise ConfigError(f"kv_events_format must be one of {WIRE_FORMATS}, got {config.kv_events_format!r}")
    if config.prefix_caching_hash_algo not in HASH_ALGOS:
        raise ConfigError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, "
                          f"got {config.prefix_caching_hash_algo!r}")
    try:
        kv = parse_kv_events_config(config.kv_events_config)
    except KvEventsError as exc:
        raise ConfigError(str(exc)) from None
    seed = config.hash_seed if config.hash_seed is not None else engine_seed(config.kv_events_format)
    style = "0.11" if config.kv_events_format == "0.11" else "0.32"
    return kv, BlockHasher(profile.block_size, config.prefix_caching_hash_algo, seed, style)


@dataclass(slots=True)
class _Plan:
    response_id: str
    prompt_len: int
    max_tokens: int
    target_tokens: int
    block_hashes: list[int]
    include_usage: bool
    continuous_usage: bool
    remote_decode: bool
    remote_kv_delay: float | None
    word_offset: int
    created: int
    continued: int | None = None    # the text ends with filler word number `continued`: go on after it
    token_ids: list[int] | None = None
    adapter: Adapter | None = None  # the LoRA adapter serving it; None: the base model


def _finish_only(head: bytes, chat: bool, reason: str | None, usage: bytes | None) -> bytes:
    tail = (usage + b"}\n\n") if usage is not None else (b"}\n\n" if chat else b',"usage":null}\n\n')
    r = (reason or "abort").encode()
    if chat:
        return head + b'{"index":0,"delta":{},"logprobs":null,"finish_reason":"' + r + \
            b'","stop_reason":null,"token_ids":null}]' + tail
    return head + b'{"index":0,"text":"","logprobs":null,"finish_reason":"' + r + \
        b'","stop_reason":null,"prompt_token_ids":null,"token_ids":null}]' + tail


def _word(plan: _Plan, i: int) -> bytes:
    """Output token i: the filler words in their cycle, from a random start; when the prompt's text (a completion
    prompt, or the assistant message a chat continues) ends with a filler word, from the word after it, so a
    prompt of the original prompt plus the text generated so far goes on as the first answer would have."""
    if plan.continued is not None:
        return _NEXT[(plan.continued + 1 + i) % len(_WORDS)]
    return _FIRST[plan.word_offset % len(_WORDS)] if i == 0 else _NEXT[(plan.word_offset + i) % len(_WORDS)]


def _text(plan: _Plan, start: int, end: int) -> bytes:
    return b"".join(_word(plan, i) for i in range(start, end))


def _continued_word(text: str) -> int | None:
    """The cycle position of the filler word `text` ends with, or None."""
    return _WORD_INDEX.get(text[-3:]) if len(text) >= 3 and (len(text) == 3 or not text[-4].isalpha()) else None


def _base_id(headers: dict[bytes, bytes], body_id: str | None) -> str:
    # serving_engine.py::_base_request_id: X-Request-Id header, else the body's request_id, else a uuid.
    hdr = headers.get(b"x-request-id")
    if hdr:
        return hdr.decode(errors="replace")
    return body_id or uuid.uuid4().hex


def _completion_prompt_tokens(prompt: str | list) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, f"The simulator serves one prompt per request; got a batch of {len(prompt)}.")
        return _completion_prompt_tokens(prompt[0])
    bad = [t for t in prompt if not 0 <= t < tokenizer.VOCAB_SIZE]
    if bad:
        raise ApiError(400, f"Token id {bad[0]} is out of vocabulary")
    return list(prompt)


def _parse(model: type[BaseModel], body: bytes) -> Any:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _json_error(exc) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            break
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            break
    return b"".join(chunks)


async def _respond(send: Send, status: int, body: bytes, headers: list | None = None) -> None:
    hdrs = list(_JSON if headers is None else headers)
    hdrs.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


async def _hang(receive: Receive, send: Send, closed: asyncio.Event) -> None:
    """The hang fault: hold the connection, answer nothing, until the client or the server goes away."""

    async def until_disconnect() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    waiters = {asyncio.ensure_future(until_disconnect()), asyncio.ensure_future(closed.wait())}
    try:
        done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
    if closed.is_set():  # server shutting down: hang up without an answer rather than let uvicorn send a 500
        await send({"type": "http.response.start", "status": 200, "headers": _JSON})
        _dropping.set(True)


class _DisconnectWatcher:
    """Marks the request's handle when the client hangs up, so the engine can abort it."""

    __slots__ = ("_task",)

    def __init__(self, receive: Receive, h: RequestHandle):
        async def watch() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    h.client_gone = True
                    h.event.set()
                    return

        self._task = asyncio.get_running_loop().create_task(watch())

    def cancel(self) -> None:
        self._task.cancel()
