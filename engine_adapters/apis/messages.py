"""Anthropic's Messages API (`POST /v1/messages`) as chat completions, and back: pure translation, no I/O.

The gateway's front door (gateway/api/messages.py) and the simulated worker imitating vLLM 0.32/0.33
(simulator/vllm_api.py) both serve Messages by translating a request into a chat completions request, running
that, and translating its answer (a JSON body, or its SSE chunks one by one) into Messages' shapes. One copy of
each rule, here:

- `to_chat(body)`: the request (Anthropic API reference, "Messages": `system` as a string or text blocks;
  `messages` of text, image, `tool_use` and `tool_result` blocks; `tools` with `input_schema`; `tool_choice`
  auto / any / tool / none; `stop_sequences`; `max_tokens` (required); `temperature` / `top_p` / `top_k`;
  `metadata.user_id`; `thinking` and `cache_control` accepted and ignored) as a chat body, plus the
  conversation id (`metadata.user_id`). A `system` message among the turns stays one; a text `document` is text.
  A `tool_result` block becomes a `tool` message (is_error: its text is
  prefixed "Error: ", chat has no flag for it); a `tool_use` block an assistant `tool_calls` entry whose
  `arguments` are its `input` as JSON.
- `to_message(chat)`: a chat completion as a Message (`msg_` id, text and `tool_use` content blocks,
  `stop_reason` end_turn / max_tokens / stop_sequence / tool_use, `usage`).
- `MessageStream`: chat completion chunks in, Messages events out (`message_start`, `content_block_start`,
  `content_block_delta` with `text_delta` or `input_json_delta`, `content_block_stop`, `message_delta`,
  `message_stop`, a `ping` after the start), each `event: <type>\\ndata: <json>\\n\\n`; an error chunk becomes an
  `error` event.
- `anthropic_error` / `error_from_openai`: errors in Anthropic's shape `{"type": "error", "error": {"type",
  "message"}}` with its statuses: an OpenAI-shaped error of the pipeline keeps its status except a fleet that
  is full or has no worker (429 `capacity_exceeded`, 503), which Anthropic calls 529 `overloaded_error`, and a
  worker's failure (502, 504), which it calls 500 `api_error`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

import orjson

# Anthropic's error types by status (Anthropic API reference, "Errors").
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               529: "overloaded_error"}
OVERLOADED = 529
# The pipeline's codes for "the fleet is full" (gateway/wire/errors.py `overloaded`): a 429 that is not the key's own
# limit, so Anthropic's 529 rather than its 429.
_FLEET_FULL_CODES = ("capacity_exceeded", "slo_unattainable")   # slo_unattainable: policies/shedding.py
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn",
                "error": "end_turn", "repetition": "end_turn"}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_CUSTOM_TOOL_TYPES = (None, "custom")
# vLLM's own sampling fields (vllm-interface §1.3), passed on as given: Anthropic's API has none of them, a client
# of a vLLM fleet may still want them (tests: `ignore_eos` for answers of an exact length).
VLLM_EXTRAS = ("ignore_eos", "min_tokens", "seed", "repetition_penalty", "min_p", "priority")


class MessagesError(Exception):
    """A request Messages refuses: `status` and Anthropic's error `type`."""

    def __init__(self, message: str, status: int = 400, type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or ERROR_TYPES.get(status, "api_error")

    def body(self) -> bytes:
        return anthropic_error(self.type, self.message)


def anthropic_error(type: str, message: str) -> bytes:
    """An error body in Anthropic's shape."""
    return orjson.dumps({"type": "error", "error": {"type": type, "message": message}})


def error_from_openai(status: int, body: bytes) -> tuple[int, bytes]:
    """An OpenAI-shaped error answer of the pipeline (or a worker) as Anthropic's: (status, body)."""
    message, code = f"HTTP {status}", None
    try:
        err = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        err = None
    if isinstance(err, dict):
        message = str(err.get("message") or message)
        code = err.get("code")
    elif isinstance(err, str):
        message = err
    if status == 503 or (status == 429 and code in _FLEET_FULL_CODES):
        status = OVERLOADED
    elif status >= 500:
        status = 500
    elif status not in ERROR_TYPES:
        status = 400 if status < 500 else 500
    return status, anthropic_error(ERROR_TYPES[status], message)


# --- request ----------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class ChatRequest:
    """A Messages request as chat completions: the body, and the conversation id it names (or None)."""

    body: dict[str, Any]
    conversation: str | None = None


def _text_of_blocks(blocks: Any, where: str) -> str:
    """The text of a string or a list of text blocks (system prompts, tool results)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise MessagesError(f"{where}: expected a string or a list of content blocks")
    parts = []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict):
            raise MessagesError(f"{where}.{i}: expected a content block object")
        if b.get("type") == "text":
            if not isinstance(b.get("text"), str):
                raise MessagesError(f"{where}.{i}.text: expected a string")
            parts.append(b["text"])
        elif b.get("type") != "image":
            raise MessagesError(f"{where}.{i}.type: expected 'text' or 'image', got {b.get('type')!r}")
    return "\n".join(parts)


def _image_part(b: dict[str, Any], where: str) -> dict[str, Any]:
    src = b.get("source")
    if not isinstance(src, dict):
        raise MessagesError(f"{where}.source: expected an object")
    if src.get("type") == "base64":
        if not (isinstance(src.get("data"), str) and isinstance(src.get("media_type"), str)):
            raise MessagesError(f"{where}.source: a base64 image needs `media_type` and `data`")
        url = f"data:{src['media_type']};base64,{src['data']}"
    elif src.get("type") == "url":
        if not isinstance(src.get("url"), str):
            raise MessagesError(f"{where}.source.url: expected a string")
        url = src["url"]
    else:
        raise MessagesError(f"{where}.source.type: expected 'base64' or 'url'")
    return {"type": "image_url", "image_url": {"url": url}}


def _document_text(b: dict[str, Any], where: str) -> str:
    """A document block's text: a plain-text source, or a source of content blocks (a PDF needs a model that
    reads it, which a chat template cannot give a text model)."""
    src = b.get("source")
    if not isinstance(src, dict):
        raise MessagesError(f"{where}.source: expected an object")
    if src.get("type") == "text":
        if not isinstance(src.get("data"), str):
            raise MessagesError(f"{where}.source.data: expected a string")
        return src["data"]
    if src.get("type") == "content":
        return _text_of_blocks(src.get("content"), f"{where}.source.content")
    raise MessagesError(f"{where}.source.type: only 'text' and 'content' documents are served, "
                        f"not {src.get('type')!r}")


def _tool_result(b: dict[str, Any], where: str) -> dict[str, Any]:
    if not (isinstance(b.get("tool_use_id"), str) and b["tool_use_id"] != ""):
        raise MessagesError(f"{where}.tool_use_id: expected a string")
    content = b.get("content", "")
    if isinstance(content, list):   # a tool message holds text: its other blocks (images, ...) are left out
        content = [c for c in content if not isinstance(c, dict) or c.get("type") == "text"]
    text = _text_of_blocks(content, f"{where}.content")
    if b.get("is_error"):
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": b["tool_use_id"], "content": text}


def _tool_call(b: dict[str, Any], where: str) -> dict[str, Any]:
    if not (isinstance(b.get("id"), str) and b["id"] != ""):
        raise MessagesError(f"{where}.id: expected a string")
    if not (isinstance(b.get("name"), str) and b["name"] != ""):
        raise MessagesError(f"{where}.name: expected a string")
    if not isinstance(b.get("input"), dict):
        raise MessagesError(f"{where}.input: expected an object")
    return {"id": b["id"], "type": "function",
            "function": {"name": b["name"], "arguments": orjson.dumps(b["input"]).decode()}}


def _message(m: Any, i: int) -> list[dict[str, Any]]:
    """One Messages message as chat messages (a user message's tool results come first, as `tool` messages)."""
    where = f"messages.{i}"
    if not isinstance(m, dict):
        raise MessagesError(f"{where}: expected an object")
    role = m.get("role")
    if role not in ("user", "assistant", "system"):
        raise MessagesError(f"{where}.role: expected 'user', 'assistant' or 'system', got {role!r}")
    content = m.get("content")
    if role == "system":   # a system message among the turns (text only), as chat has them
        return [{"role": "system", "content": _text_of_blocks(content, f"{where}.content")}]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise MessagesError(f"{where}.content: expected a string or a list of content blocks")
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        bw = f"{where}.content.{j}"
        if not isinstance(b, dict):
            raise MessagesError(f"{bw}: expected a content block object")
        kind = b.get("type")
        if kind == "text":
            if not isinstance(b.get("text"), str):
                raise MessagesError(f"{bw}.text: expected a string")
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image" and role == "user":
            parts.append(_image_part(b, bw))
        elif kind == "document" and role == "user":
            parts.append({"type": "text", "text": _document_text(b, bw)})
        elif kind == "tool_result" and role == "user":
            out.append(_tool_result(b, bw))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(b, bw))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue   # accepted; the worker's chat template has no place for the reasoning of earlier turns
        else:
            raise MessagesError(f"{bw}.type: a {role} message cannot hold a block of type {kind!r}")
    if parts or calls or not out:
        msg: dict[str, Any] = {"role": role}
        if all(p["type"] == "text" for p in parts):
            msg["content"] = "".join(p["text"] for p in parts) if parts else ("" if not calls else None)
        else:
            msg["content"] = parts
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise MessagesError("tools: expected a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise MessagesError(f"tools.{i}: expected an object")
        if t.get("type") not in _CUSTOM_TOOL_TYPES:
            raise MessagesError(f"tools.{i}.type: only custom tools (with `input_schema`) are served, "
                                f"not {t.get('type')!r}")
        if not (isinstance(t.get("name"), str) and t["name"] != ""):
            raise MessagesError(f"tools.{i}.name: expected a string")
        if not isinstance(t.get("input_schema"), dict):
            raise MessagesError(f"tools.{i}.input_schema: expected an object")
        fn: dict[str, Any] = {"name": t["name"], "parameters": t["input_schema"]}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any, body: dict[str, Any]) -> None:
    if not isinstance(choice, dict):
        raise MessagesError("tool_choice: expected an object")
    kind = choice.get("type")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise MessagesError("tool_choice.name: expected a string")
        body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in _TOOL_CHOICES:
        body["tool_choice"] = _TOOL_CHOICES[kind]
    else:
        raise MessagesError(f"tool_choice.type: expected 'auto', 'any', 'tool' or 'none', got {kind!r}")
    if choice.get("disable_parallel_tool_use") is True:
        body["parallel_tool_calls"] = False


def to_chat(req: Any) -> ChatRequest:
    """A Messages request body (parsed JSON) as a chat completions request; MessagesError when malformed."""
    if not isinstance(req, dict):
        raise MessagesError("The request body must be a JSON object.")
    max_tokens = req.get("max_tokens")
    if not (max_tokens is not None):
        raise MessagesError("max_tokens: Field required")
    if not (isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1):
        raise MessagesError("max_tokens: expected an integer of at least 1")
    messages = req.get("messages")
    if not (isinstance(messages, list) and len(messages) > 0):
        raise MessagesError("messages: expected a non-empty list")
    chat: list[dict[str, Any]] = []
    if req.get("system") is not None:
        system = _text_of_blocks(req["system"], "system")
        if system:
            chat.append({"role": "system", "content": system})
    for i, m in enumerate(messages):
        chat.extend(_message(m, i))
    body: dict[str, Any] = {"messages": chat, "max_tokens": max_tokens}
    if req.get("model") is not None:
        if not (isinstance(req["model"], str)):
            raise MessagesError("model: expected a string")
        body["model"] = req["model"]
    for key in ("temperature", "top_p", "top_k"):
        value = req.get(key)
        if value is not None:
            if not (isinstance(value, int | float) and not isinstance(value, bool)):
                raise MessagesError(f"{key}: expected a number")
            body[key] = value
    for key in VLLM_EXTRAS:
        if key in req:
            body[key] = req[key]
    stops = req.get("stop_sequences")
    if stops is not None:
        if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
            raise MessagesError("stop_sequences: expected a list of strings")
        if stops:
            body["stop"] = stops
    if req.get("tools"):
        body["tools"] = _tools(req["tools"])
    if req.get("tool_choice") is not None:
        _tool_choice(req["tool_choice"], body)
    stream = req.get("stream")
    if not (stream is None or isinstance(stream, bool)):
        raise MessagesError("stream: expected a boolean")
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    metadata = req.get("metadata")
    if not (metadata is None or isinstance(metadata, dict)):
        raise MessagesError("metadata: expected an object")
    user = (metadata or {}).get("user_id")
    if not (user is None or isinstance(user, str)):
        raise MessagesError("metadata.user_id: expected a string")
    return ChatRequest(body, user or None)


# --- response ---------------------------------------------------------------------------------------------------
def message_id(chat_id: Any) -> str:
    """A Message id for a chat completion's id: `msg_` and its own part (vLLM's `chatcmpl-<request id>`)."""
    if isinstance(chat_id, str) and chat_id:
        return "msg_" + chat_id.removeprefix("chatcmpl-")
    return "msg_" + secrets.token_hex(12)


def _stop(choice: dict[str, Any], stops: list[str], tool_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice."""
    reason = choice.get("finish_reason")
    matched = choice.get("stop_reason")
    if tool_calls and reason in ("stop", "tool_calls"):
        return "tool_use", None
    if reason == "stop" and isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return STOP_REASONS.get(reason, "end_turn"), None


def _input(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments (JSON text) as the tool_use block's `input` (an object, {} if not one)."""
    try:
        value = orjson.loads(arguments) if isinstance(arguments, str) and arguments else {}
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _usage(usage: Any) -> dict[str, int]:
    usage = usage if isinstance(usage, dict) else {}
    return {"input_tokens": int(usage.get("prompt_tokens") or 0),
            "output_tokens": int(usage.get("completion_tokens") or 0)}


def to_message(chat: dict[str, Any], model: str | None = None, stop_sequences: list[str] | None = None
               ) -> dict[str, Any]:
    """A chat completion (JSON) as a Message."""
    choices = chat.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    msg = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    content: list[dict[str, Any]] = []
    if isinstance(msg.get("content"), str) and msg["content"]:
        content.append({"type": "text", "text": msg["content"]})
    calls = [c for c in msg.get("tool_calls") or () if isinstance(c, dict)]
    for c in calls:
        fn = c.get("function") if isinstance(c.get("function"), dict) else {}
        content.append({"type": "tool_use", "id": c.get("id") or "toolu_" + secrets.token_hex(12),
                        "name": fn.get("name") or "", "input": _input(fn.get("arguments"))})
    reason, sequence = _stop(choice, stop_sequences or [], bool(calls))
    return {"id": message_id(chat.get("id")), "type": "message", "role": "assistant",
            "model": chat.get("model") or model or "", "content": content, "stop_reason": reason,
            "stop_sequence": sequence, "usage": _usage(chat.get("usage"))}


# --- stream -----------------------------------------------------------------------------------------------------
def sse_event(obj: dict[str, Any]) -> bytes:
    """One Messages SSE event: `event: <type>`, then its JSON."""
    return b"event: " + obj["type"].encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


def error_event(message: str, type: str = "api_error") -> bytes:
    """A mid-stream error as Messages sends it."""
    return b"event: error\ndata: " + anthropic_error(type, message) + b"\n\n"


@dataclass(slots=True)
class MessageStream:
    """Chat completion chunks in (`feed`, one parsed `data:` object at a time), Messages events out.

    `input_tokens`: the prompt's estimate for `message_start` (the exact count comes with the chat stream's
    usage chunk, at its end, and is reported in `message_delta`)."""

    model: str = ""
    input_tokens: int = 0
    stop_sequences: list[str] = field(default_factory=list)
    started: bool = False
    finished: bool = False
    _block: int = -1             # index of the open content block, -1: none
    _kind: str | None = None     # its type: "text" | "tool_use"
    _tool_index: int | None = None   # the chat tool call it streams
    _tools_seen: bool = False
    _choice: dict[str, Any] = field(default_factory=dict)   # the finish_reason / stop_reason chunk's choice
    _usage: dict[str, int] | None = None

    def feed(self, chunk: dict[str, Any]) -> bytes:
        """The events for one chat chunk (maybe none)."""
        if "error" in chunk:
            err = chunk["error"]
            return self.error(err.get("message") if isinstance(err, dict) else str(err))
        out: list[bytes] = []
        if not self.started:
            out.append(self._start(chunk))
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            text = delta.get("content")
            if isinstance(text, str) and text:
                out.append(self._open("text", None))
                out.append(sse_event({"type": "content_block_delta", "index": self._block,
                                      "delta": {"type": "text_delta", "text": text}}))
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    out.append(self._tool_delta(call))
            if choice.get("finish_reason") is not None:
                self._choice = choice
        if isinstance(chunk.get("usage"), dict) and not chunk.get("choices"):
            self._usage = _usage(chunk["usage"])
        return b"".join(out)

    def _start(self, chunk: dict[str, Any]) -> bytes:
        self.started = True
        self.model = chunk.get("model") or self.model
        message = {"id": message_id(chunk.get("id")), "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}
        return sse_event({"type": "message_start", "message": message}) + sse_event({"type": "ping"})

    def _open(self, kind: str, tool_index: int | None, start: dict[str, Any] | None = None) -> bytes:
        """Open a block of `kind` unless it is the open one: the open block's stop and the new block's start."""
        if self._kind == kind and self._tool_index == tool_index:
            return b""
        out = self._close()
        self._block += 1
        self._kind, self._tool_index = kind, tool_index
        block = start if start is not None else {"type": "text", "text": ""}
        return out + sse_event({"type": "content_block_start", "index": self._block, "content_block": block})

    def _close(self) -> bytes:
        if self._kind is None:
            return b""
        self._kind = self._tool_index = None
        return sse_event({"type": "content_block_stop", "index": self._block})

    def _tool_delta(self, call: dict[str, Any]) -> bytes:
        self._tools_seen = True
        fn = call.get("function") if isinstance(call.get("function"), dict) else {}
        index = call.get("index", 0)
        out = b""
        if not (self._kind == "tool_use" and self._tool_index == index):
            block = {"type": "tool_use", "id": call.get("id") or "toolu_" + secrets.token_hex(12),
                     "name": fn.get("name") or "", "input": {}}
            out = self._open("tool_use", index, block)
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            out += sse_event({"type": "content_block_delta", "index": self._block,
                              "delta": {"type": "input_json_delta", "partial_json": args}})
        return out

    def end(self, usage: dict[str, Any] | None = None) -> bytes:
        """The chat stream ended ([DONE]): close the open block, `message_delta` and `message_stop`."""
        if self.finished:
            return b""
        self.finished = True
        out = b"" if self.started else self._start({})
        reason, sequence = _stop(self._choice, self.stop_sequences, self._tools_seen)
        counts = _usage(usage) if usage is not None else self._usage or {"input_tokens": self.input_tokens,
                                                                          "output_tokens": 0}
        return out + self._close() + sse_event(
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
             "usage": counts}) + sse_event({"type": "message_stop"})

    def error(self, message: str | None, type: str = "api_error") -> bytes:
        """The stream failed: an `error` event ends it."""
        self.finished = True
        return error_event(message or "the request failed", type)


class MessagesTranslator:
    """A chat answer of the pipeline (or a worker's chat route) as Messages' answer: the `Translator` of
    gateway/wire/translated.py. One per request."""

    def __init__(self, model: str = "", input_tokens: int = 0, stop_sequences: list[str] | None = None) -> None:
        self.model = model
        self.stop_sequences = list(stop_sequences or ())
        self.stream = MessageStream(model, input_tokens, self.stop_sequences)

    def json_body(self, status: int, body: bytes) -> tuple[int, bytes]:
        if status != 200:
            return error_from_openai(status, body)
        try:
            chat = orjson.loads(body)
        except orjson.JSONDecodeError:
            return 500, anthropic_error("api_error", "The worker's answer was not JSON.")
        if not isinstance(chat, dict):
            return 500, anthropic_error("api_error", "The worker's answer was not a chat completion.")
        return 200, orjson.dumps(to_message(chat, self.model, self.stop_sequences))

    def stream_start(self) -> bytes:
        return b""

    def stream_data(self, data: bytes) -> bytes:
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return b""
        return self.stream.feed(chunk) if isinstance(chunk, dict) else b""

    def stream_end(self) -> bytes:
        return self.stream.end()
