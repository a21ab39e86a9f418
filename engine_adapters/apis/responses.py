"""OpenAI's Responses API (`POST /v1/responses`) translated to and from chat completions. Pure: no I/O.

The gateway's front door (gateway/api/responses.py) and the simulated worker (simulator/) both serve Responses
by running the translated chat request; this module holds every rule of the translation, once:

    parse_request     check a Responses body (OpenAI API reference, "Create a model response") into a
                      `ResponsesRequest`; what cannot be served is a 400 (`ResponsesRequestError`)
    chat_body         the chat-completions body for it, after the earlier turns of its conversation (the items
                      of the response named by `previous_response_id`, rebuilt by the caller from its store)
    items_to_messages input/output items -> chat messages (text parts, `function_call` -> an assistant message's
                      `tool_calls`, `function_call_output` -> a `tool` message)
    ResponsesTranslator  the chat answer -> the Responses answer: a whole chat completion -> a response object,
                      or chat SSE chunks, one at a time -> the Responses event stream (`response.created`,
                      `response.in_progress`, `response.output_item.added`, `response.content_part.added`,
                      `response.output_text.delta` ... `response.completed`, tool calls as `function_call`
                      items with `response.function_call_arguments.delta` / `.done`), each `event: <type>` with
                      an increasing `sequence_number`; a stream that breaks: `error` then `response.failed`

Shapes follow the `openai` Python SDK's types (openai.types.responses), which must parse all of it. Supported:
`input` as a string or items (messages with input_text/output_text/input_image parts, `function_call`,
`function_call_output`; `reasoning` items are accepted and dropped), `instructions` (not carried over by
`previous_response_id`, as OpenAI documents), function `tools` and `tool_choice`, `parallel_tool_calls`,
`max_output_tokens`, `temperature`, `top_p`, `text.format` (json_schema / json_object), `reasoning` (accepted and
echoed: the chat request does not carry it), `metadata`, `user`, `prompt_cache_key`, `store`,
`previous_response_id`; vLLM's sampling extras (`seed`, `top_k`, `ignore_eos`, ... VLLM_EXTRAS) as vLLM takes
them; `namespace` tools are flattened into their function tools (a call names its namespace). A reasoning
parser's output becomes a `reasoning` item with `reasoning_text` (`response.reasoning_text.delta` / `.done` when
streamed). Hosted tools (web search, file search, ...) are dropped: no worker runs them. Not supported (400): a
`tool_choice` naming a hosted tool, `background`, `conversation`, `prompt` templates.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from engine_adapters.openai_errors import error_body

RESPONSE_PREFIX = "resp_"
DELETED_OBJECT = "response.deleted"
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# vLLM's sampling extras, passed on as vLLM's own /v1/responses takes them (serving_responses.py's request model)
VLLM_EXTRAS = ("seed", "top_k", "min_p", "min_tokens", "ignore_eos", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "stop")
_UNSUPPORTED = {"background": "background responses", "conversation": "the Conversations API",
                "prompt": "prompt templates"}


class ResponsesRequestError(ValueError):
    """A Responses request the translation refuses: OpenAI's 400 (invalid_request_error) with the parameter."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


def new_id(prefix: str) -> str:
    """An id like OpenAI's (`resp_...`, `msg_...`, `fc_...`): the prefix and 48 random hex digits."""
    return prefix + secrets.token_hex(24)


@dataclass(slots=True)
class ResponsesRequest:
    """A checked Responses request: its body as sent, and the parts the translation and the store use."""

    body: dict[str, Any]
    input_items: list[dict[str, Any]]     # this turn's input, as items with ids (GET .../input_items lists them)
    model: str | None
    stream: bool
    store: bool
    previous_response_id: str | None
    max_output_tokens: int | None
    prompt_cache_key: str | None
    tools: list[dict[str, Any]] = field(default_factory=list)
    namespaces: dict[str, str] = field(default_factory=dict)   # function name -> its `namespace` tool's name


def parse_request(body: dict[str, Any]) -> ResponsesRequest:
    """Check a Responses body; raises `ResponsesRequestError` (400) for what cannot be served."""
    for key, what in _UNSUPPORTED.items():
        if body.get(key) not in (None, False):
            raise ResponsesRequestError(f"`{key}` ({what}) is not supported by this gateway.", key)
    if "input" not in body or body["input"] is None:
        raise ResponsesRequestError("`input` is required: a string or an array of input items.", "input")
    items = normalize_input(body["input"])
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ResponsesRequestError("`model` must be a string.", "model")
    stream = _bool(body, "stream", False)
    store = _bool(body, "store", True)
    _bool(body, "parallel_tool_calls", True)
    prev = body.get("previous_response_id")
    if prev is not None and (not isinstance(prev, str) or not prev):
        raise ResponsesRequestError("`previous_response_id` must be a response id (a string).",
                                    "previous_response_id")
    mot = body.get("max_output_tokens")
    if mot is not None and (isinstance(mot, bool) or not isinstance(mot, int) or mot < 1):
        raise ResponsesRequestError(f"`max_output_tokens` must be a positive integer, got {_short(mot)}.",
                                    "max_output_tokens", "integer_below_min_value")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ResponsesRequestError("`instructions` must be a string.", "instructions")
    pck = body.get("prompt_cache_key")
    if pck is not None and not isinstance(pck, str):
        raise ResponsesRequestError("`prompt_cache_key` must be a string.", "prompt_cache_key")
    meta = body.get("metadata")
    if meta is not None and (not isinstance(meta, dict) or len(meta) > 16
                             or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise ResponsesRequestError("`metadata` must be an object of at most 16 string values.", "metadata")
    for key in ("reasoning", "text"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise ResponsesRequestError(f"`{key}` must be an object.", key)
    tools, spaces = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") not in ("function", None):
        raise ResponsesRequestError(f"`tool_choice` of type {_short(choice.get('type'))} is not supported: only "
                                    "function tools are.", "tool_choice")
    if isinstance(choice, dict) and choice.get("name") not in {t["name"] for t in tools}:
        raise ResponsesRequestError(f"`tool_choice` names {_short(choice.get('name'))}, which is not in `tools`.",
                                    "tool_choice")
    return ResponsesRequest(body, items, model or None, stream, store, prev, mot, pck, tools, spaces)


def normalize_input(raw: Any) -> list[dict[str, Any]]:
    """`input` as items with ids: a string is one user message; each item is checked (400 with its index)."""
    if isinstance(raw, str):
        return [{"id": new_id("msg_"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": raw}]}]
    if not isinstance(raw, list) or not raw:
        raise ResponsesRequestError("`input` must be a string or a non-empty array of input items.", "input")
    return [_item(it, i) for i, it in enumerate(raw)]


def _item(it: Any, i: int) -> dict[str, Any]:
    where = f"input[{i}]"
    if not isinstance(it, dict):
        raise ResponsesRequestError(f"`{where}` must be an object.", where)
    kind = it.get("type", "message")
    if kind == "message":
        role = it.get("role")
        if role not in _ROLES:
            raise ResponsesRequestError(f"`{where}.role` must be one of user, assistant, system, developer.",
                                        f"{where}.role")
        content = it.get("content")
        if isinstance(content, str):
            parts = [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
        elif isinstance(content, list):
            parts = [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
        else:
            raise ResponsesRequestError(f"`{where}.content` must be a string or an array of content parts.",
                                        f"{where}.content")
        out = {"id": it.get("id") or new_id("msg_"), "type": "message", "role": role,
               "status": "completed", "content": parts}
        if role == "assistant":
            for p in parts:
                p.setdefault("annotations", [])
        return out
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(it.get(key), str):
                raise ResponsesRequestError(f"`{where}.{key}` must be a string.", f"{where}.{key}")
        return {"id": it.get("id") or new_id("fc_"), "type": "function_call", "call_id": it["call_id"],
                "name": it["name"], "arguments": it["arguments"], "status": "completed"}
    if kind == "function_call_output":
        out = it.get("output")
        if not isinstance(it.get("call_id"), str):
            raise ResponsesRequestError(f"`{where}.call_id` must be a string.", f"{where}.call_id")
        if not isinstance(out, (str, list)):
            raise ResponsesRequestError(f"`{where}.output` must be a string or an array of content parts.",
                                        f"{where}.output")
        return {"id": it.get("id") or new_id("fco_"), "type": "function_call_output", "call_id": it["call_id"],
                "output": out, "status": "completed"}
    if kind == "reasoning":
        return {"id": it.get("id") or new_id("rs_"), "type": "reasoning", "summary": it.get("summary") or []}
    raise ResponsesRequestError(f"`{where}.type` {_short(kind)} is not supported: use message, function_call, "
                                "function_call_output or reasoning.", f"{where}.type")


def _part(p: Any, where: str) -> dict[str, Any]:
    if not isinstance(p, dict):
        raise ResponsesRequestError(f"`{where}` must be an object.", where)
    kind = p.get("type")
    if kind in _TEXT_PARTS:
        if not isinstance(p.get("text", p.get("refusal")), str):
            raise ResponsesRequestError(f"`{where}.text` must be a string.", f"{where}.text")
        return dict(p)
    if kind == "input_image":
        if not isinstance(p.get("image_url"), str):
            raise ResponsesRequestError(f"`{where}.image_url` must be a URL (a string).", f"{where}.image_url")
        return dict(p)
    raise ResponsesRequestError(f"`{where}.type` {_short(kind)} is not supported: use input_text, output_text or "
                                "input_image.", f"{where}.type")


def _tools(raw: Any) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The function tools (those of a `namespace` tool flattened), and each namespaced function's namespace.
    Hosted tools (web_search, file_search, code_interpreter, ...) run on OpenAI's servers; a fleet has none to run,
    so they are dropped (the model is not offered them), as an agent offering them everywhere expects."""
    if raw is None:
        return [], {}
    if not isinstance(raw, list):
        raise ResponsesRequestError("`tools` must be an array.", "tools")
    out: list[dict[str, Any]] = []
    spaces: dict[str, str] = {}
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or not isinstance(t.get("type"), str):
            raise ResponsesRequestError(f"`tools[{i}]` must be an object with a `type`.", f"tools[{i}]")
        if t["type"] == "namespace" and isinstance(t.get("tools"), list):
            inner, _ = _tools(t["tools"])
            out += inner
            spaces.update({f["name"]: str(t.get("name") or "") for f in inner})
        elif t["type"] == "function":
            if not isinstance(t.get("name"), str) or not t["name"]:
                raise ResponsesRequestError(f"`tools[{i}].name` is required.", f"tools[{i}].name")
            out.append(t)
    return out, spaces


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ResponsesRequestError(f"`{key}` must be true or false.", key)
    return v


def _short(v: Any) -> str:
    text = orjson.dumps(v).decode()
    return text if len(text) <= 40 else text[:37] + "..."


# --- request -> chat completions --------------------------------------------------------------------------

def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses items (input and output, earlier turns first) as chat messages. Consecutive function calls (and
    the assistant text just before them) are one assistant message with `tool_calls`, as chat has them."""
    msgs: list[dict[str, Any]] = []
    for it in items:
        kind = it.get("type", "message")
        if kind == "message":
            msgs.append({"role": _ROLES[it["role"]], "content": _chat_content(it["content"])})
        elif kind == "function_call":
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out = it["output"]
            msgs.append({"role": "tool", "tool_call_id": it["call_id"],
                         "content": out if isinstance(out, str) else _text_of(out)})
    return msgs


def _one_leading_system(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system (and developer) messages a conversation starts with as one: many chat templates take a single
    leading system message and refuse roles that do not alternate after it."""
    n = 0
    while n < len(msgs) and msgs[n]["role"] == "system" and isinstance(msgs[n]["content"], str):
        n += 1
    if n < 2:
        return msgs
    return [{"role": "system", "content": "\n\n".join(m["content"] for m in msgs[:n])}, *msgs[n:]]


def _chat_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    if all(p.get("type") in _TEXT_PARTS for p in parts):
        return _text_of(parts)
    return [{"type": "image_url", "image_url": {"url": p["image_url"]}} if p.get("type") == "input_image"
            else {"type": "text", "text": p.get("text") or p.get("refusal") or ""} for p in parts]


def _text_of(parts: list[Any]) -> str:
    return "".join(p.get("text") or p.get("refusal") or "" for p in parts if isinstance(p, dict))


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    """The chat-completions request for `req` after the conversation's earlier items `history`."""
    b = req.body
    messages = items_to_messages([*history, *req.input_items])
    if b.get("instructions"):
        messages.insert(0, {"role": "system", "content": b["instructions"]})
    messages = _one_leading_system(messages)
    chat: dict[str, Any] = {"messages": messages}
    if req.model is not None:
        chat["model"] = req.model
    if req.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    if req.max_output_tokens is not None:
        chat["max_tokens"] = req.max_output_tokens
    for key in ("temperature", "top_p", "user", "service_tier", "parallel_tool_calls", *VLLM_EXTRAS):
        if b.get(key) is not None:
            chat[key] = b[key]
    if req.tools:
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                              "strict") if t.get(k) is not None}}
                         for t in req.tools]
    choice = b.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        chat["tool_choice"] = choice
    fmt = (b.get("text") or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    return chat


# --- chat completions -> the response ---------------------------------------------------------------------

def response_object(req: ResponsesRequest, rid: str, created_at: float, model: str, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None, incomplete: str | None = None) -> dict[str, Any]:
    """The response object (openai.types.responses.Response) for `req`."""
    b = req.body
    fmt = (b.get("text") or {}).get("format") or {"type": "text"}
    return {
        "id": rid, "object": "response", "created_at": int(created_at), "status": status, "background": False,
        "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": b.get("instructions"), "max_output_tokens": req.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": b.get("parallel_tool_calls", True),
        "previous_response_id": req.previous_response_id, "prompt_cache_key": req.prompt_cache_key,
        "reasoning": b.get("reasoning") or {"effort": None, "summary": None}, "store": req.store,
        "temperature": b.get("temperature", 1.0), "text": {"format": fmt},
        "tool_choice": b.get("tool_choice") or "auto",
        "tools": [{"type": "function", "name": t["name"], "description": t.get("description"),
                   "parameters": t.get("parameters"), "strict": t.get("strict", True)} for t in req.tools],
        "top_p": b.get("top_p", 1.0), "truncation": b.get("truncation") or "disabled", "usage": usage,
        "user": b.get("user"), "metadata": b.get("metadata") or {},
        **({"completed_at": int(time.time())} if status == "completed" else {}),
    }


def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat usage -> Responses usage."""
    if not isinstance(chat_usage, dict):
        return None
    inp, out = chat_usage.get("prompt_tokens") or 0, chat_usage.get("completion_tokens") or 0
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": inp, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": inp + out}


def _message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("msg_"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


TEXT, THOUGHT = "output_text", "reasoning_text"   # the two kinds of streamed text (their events' middle name)


def _piece_item(kind: str, text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return (_message_item if kind == TEXT else _reasoning_item)(text, status, item_id)


def _reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    """vLLM's reasoning text (a reasoning parser's `reasoning_content`, `reasoning` in newer versions)."""
    return {"id": item_id or new_id("rs_"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed",
               item_id: str | None = None, namespace: str | None = None) -> dict[str, Any]:
    item = {"id": item_id or new_id("fc_"), "type": "function_call", "call_id": call_id or new_id("call_"),
            "name": name, "arguments": arguments, "status": status}
    if namespace:
        item["namespace"] = namespace
    return item


def output_of_chat(chat: dict[str, Any], namespaces: dict[str, str] | None = None
                   ) -> tuple[list[dict[str, Any]], str | None]:
    """A chat completion's first choice as output items, and its finish reason."""
    choices = chat.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    msg = choice.get("message") or {}
    items = []
    thought = msg.get("reasoning_content") or msg.get("reasoning")
    if isinstance(thought, str) and thought:
        items.append(_reasoning_item(thought))
    if msg.get("content"):
        items.append(_message_item(msg["content"]))
    for call in msg.get("tool_calls") or ():
        fn = call.get("function") or {}
        name = fn.get("name") or ""
        items.append(_call_item(call.get("id") or "", name, fn.get("arguments") or "",
                                namespace=(namespaces or {}).get(name)))
    if not items:
        items.append(_message_item(""))
    return items, choice.get("finish_reason")


def failure(message: str) -> dict[str, Any]:
    """`response.error` of a response that failed after it started (a worker failure the gateway could not
    continue)."""
    return {"code": "server_error", "message": message}


class ResponsesTranslator:
    """The pipeline's chat answer -> the Responses answer (gateway/api/translated.py's `Translator`): a chat completion
    JSON -> the response object, or chat SSE chunks one at a time -> Responses events. When it is done,
    `response` holds the final response object (what `store` keeps) and `output` its items."""

    def __init__(self, req: ResponsesRequest, rid: str, model: str, created_at: float | None = None) -> None:
        self.req, self.rid, self.model = req, rid, model
        self.created_at = created_at if created_at is not None else time.time()
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.response: dict[str, Any] | None = None   # final
        self.status = "in_progress"
        self._usage: dict[str, Any] | None = None
        self._finish: str | None = None
        self._pieces: dict[str, dict[str, Any]] = {}   # TEXT or THOUGHT -> its open item, its text so far in "parts"
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> open function_call item
        self._error: dict[str, Any] | None = None

    # --- non-streamed ---
    def json_body(self, status: int, body: bytes) -> tuple[int, bytes]:
        if status != 200:
            return status, body   # the pipeline's errors are OpenAI's shape already
        try:
            chat = orjson.loads(body)
        except orjson.JSONDecodeError:
            return 502, error_body("The worker's answer was not JSON.", "upstream_error", None, "worker_failed")
        self.model = chat.get("model") or self.model
        self.output, self._finish = output_of_chat(chat, self.req.namespaces)
        self._usage = usage_of(chat.get("usage"))
        self.response = self._final()
        return 200, orjson.dumps(self.response)

    # --- streamed ---
    def stream_start(self) -> bytes:
        snap = self._snapshot("in_progress")
        return self._event("response.created", response=snap) + self._event("response.in_progress", response=snap)

    def stream_data(self, data: bytes) -> bytes:
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return b""
        if not isinstance(chunk, dict):
            return b""
        if "error" in chunk:
            err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
            self._error = err
            return b""
        if chunk.get("model"):
            self.model = chunk["model"]
        if chunk.get("usage"):
            self._usage = usage_of(chunk["usage"])
        out: list[bytes] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            thought = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(thought, str) and thought:
                out.append(self._piece(THOUGHT, thought))
            if delta.get("content"):
                out.append(self._piece(TEXT, delta["content"]))
            for call in delta.get("tool_calls") or ():
                out.append(self._call_delta(call))
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return b"".join(out)

    def stream_end(self) -> bytes:
        out = [self._close_pieces(), *(self._close_call(i) for i in sorted(self._calls))]
        self._calls.clear()
        if self._error is not None or self._finish is None:
            msg = (self._error or {}).get("message") or "the stream ended before the answer was complete"
            out.append(self._event("error", code=(self._error or {}).get("code") or "server_error", message=msg,
                                   param=None))
            self.response = self._snapshot("failed", error=failure(msg))
            self.status = "failed"
            out.append(self._event("response.failed", response=self.response))
            return b"".join(out)
        self.response = self._final()
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        out.append(self._event(kind, response=self.response))
        return b"".join(out)

    # --- helpers ---
    def _final(self) -> dict[str, Any]:
        incomplete = "max_output_tokens" if self._finish == "length" else None
        self.status = "incomplete" if incomplete else "completed"
        return self._snapshot(self.status, incomplete=incomplete)

    def _snapshot(self, status: str, error: dict[str, Any] | None = None,
                  incomplete: str | None = None) -> dict[str, Any]:
        usage = self._usage if status != "in_progress" else None
        return response_object(self.req, self.rid, self.created_at, self.model, status, list(self.output), usage,
                               error, incomplete)

    def _event(self, kind: str, **fields: Any) -> bytes:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(ev) + b"\n\n"

    def _open_item(self, item: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        """An in-progress item added to the output: its state (the item, its index, its pieces so far) and its
        `response.output_item.added` event."""
        state = {"item": item, "index": len(self.output), "parts": []}
        self.output.append(item)
        return state, self._event("response.output_item.added", output_index=state["index"], item=item)

    def _piece(self, kind: str, text: str) -> bytes:
        """A piece of the answer's text (TEXT) or reasoning (THOUGHT), its item opened first (closing any other)."""
        out = b""
        state = self._pieces.get(kind)
        if state is None:
            out += self._close_pieces() + self._close_calls()
            item = _piece_item(kind, "", "in_progress")
            item["content"] = []
            state, added = self._open_item(item)
            self._pieces[kind] = state
            out += added
            if kind == TEXT:
                out += self._event("response.content_part.added", item_id=item["id"], output_index=state["index"],
                                   content_index=0, part={"type": TEXT, "text": "", "annotations": [],
                                                          "logprobs": []})
        state["parts"].append(text)
        extra = {"logprobs": []} if kind == TEXT else {}
        return out + self._event(f"response.{kind}.delta", item_id=state["item"]["id"],
                                 output_index=state["index"], content_index=0, delta=text, **extra)

    def _close_pieces(self) -> bytes:
        out = b""
        for kind in list(self._pieces):
            state = self._pieces.pop(kind)
            text = "".join(state["parts"])
            done = _piece_item(kind, text, "completed", state["item"]["id"])
            iid, idx = done["id"], state["index"]
            self.output[idx] = done
            extra = {"logprobs": []} if kind == TEXT else {}
            out += self._event(f"response.{kind}.done", item_id=iid, output_index=idx, content_index=0, text=text,
                               **extra)
            if kind == TEXT:
                out += self._event("response.content_part.done", item_id=iid, output_index=idx, content_index=0,
                                   part=done["content"][0])
            out += self._event("response.output_item.done", output_index=idx, item=done)
        return out

    def _call_delta(self, call: dict[str, Any]) -> bytes:
        index = call.get("index", 0)
        fn = call.get("function") or {}
        out = b""
        open_call = self._calls.get(index)
        if open_call is None:
            out += self._close_pieces()
            name = fn.get("name") or ""
            item = _call_item(call.get("id") or "", name, "", "in_progress", namespace=self.req.namespaces.get(name))
            open_call, added = self._open_item(item)
            self._calls[index] = open_call
            out += added
        elif fn.get("name"):
            open_call["item"]["name"] += fn["name"]
        if fn.get("arguments"):
            open_call["parts"].append(fn["arguments"])
            out += self._event("response.function_call_arguments.delta", item_id=open_call["item"]["id"],
                               output_index=open_call["index"], delta=fn["arguments"])
        return out

    def _close_calls(self) -> bytes:
        out = b"".join(self._close_call(i) for i in sorted(self._calls))
        self._calls.clear()
        return out

    def _close_call(self, index: int) -> bytes:
        c = self._calls[index]
        args = "".join(c["parts"])
        it = c["item"]
        done = _call_item(it["call_id"], it["name"], args, item_id=it["id"],
                          namespace=self.req.namespaces.get(it["name"]))
        self.output[c["index"]] = done
        return (self._event("response.function_call_arguments.done", item_id=it["id"], output_index=c["index"],
                            arguments=args, name=it["name"])
                + self._event("response.output_item.done", output_index=c["index"], item=done))


def conversation_items(history: list[dict[str, Any]], req: ResponsesRequest,
                       output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a stored response keeps for the next turn: the earlier items, this turn's input, its output."""
    return [*history, *req.input_items, *output]
