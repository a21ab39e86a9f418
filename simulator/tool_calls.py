"""Tool calls of the simulated model: a chat request with `tools` gets its filler answer as a function call.

vLLM answers a request with `tools` by a call when the model (its tool parser) or the request (`tool_choice`
"required" or a named function, which vLLM enforces by guided decoding) says so; the simulated model decides
by a rule a test can rely on:

- `tool_choice` "none", or no tools: text, as before;
- a named function, or "required": a call of that function (of the first tool);
- "auto" (the default): a call of the first tool when the conversation's last user or tool turn is the user's,
  and text when it is a tool's result, so an agent loop (ask, call, result, answer) ends.

The call's `arguments` are a JSON object with one string field (the schema's first required property, else its
first property, else "text") holding the filler words the engine generated: the same tokens, the same timing
and the same usage as the text answer, only framed as vLLM frames a call (vllm-interface §1.3 `tool_calls`, §2):
the first argument delta carries the call's `id`, `type` and `function.name`, each later token one
`function.arguments` delta, and the last chunk `finish_reason: "tool_calls"`. `ToolCallSend` rewrites the
server's own chat answer (a JSON body, or its SSE events) on the way out, so the hot path of plain requests is
untouched.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

Send = Callable[[dict], Awaitable[None]]
_EVENT_END = b"\n\n"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """The call the simulated model makes: the function's name and the argument its words fill."""

    name: str
    argument: str = "text"


def _argument(tool: dict[str, Any]) -> str:
    params = tool.get("function", {}).get("parameters")
    if not isinstance(params, dict):
        return "text"
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = params.get("required")
    for key in required if isinstance(required, list) else ():
        if isinstance(key, str) and key in props:
            return key
    return next(iter(props), "text")


def tool_call_for(body: dict[str, Any]) -> ToolCall | None:
    """The call the simulated model answers a chat request with (module docstring), None: it answers text."""
    tools = [t for t in body.get("tools") or () if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    choice = body.get("tool_choice", "auto")
    if not tools or choice == "none":
        return None
    by_name = {t["function"].get("name"): t for t in tools}
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        tool = by_name.get(name)
        return ToolCall(name, _argument(tool)) if tool is not None else None
    if choice != "required":
        roles = [m.get("role") for m in body.get("messages") or () if isinstance(m, dict)]
        last = next((r for r in reversed(roles) if r in ("user", "tool")), None)
        if last != "user":
            return None
    first = tools[0]
    return ToolCall(first["function"].get("name") or "tool", _argument(first))


class ToolCallSend:
    """An ASGI `send` that turns the server's chat answer into a tool call (module docstring)."""

    def __init__(self, send: Send, call: ToolCall) -> None:
        self._send = send
        self.call = call
        self._id = "chatcmpl-tool-" + uuid.uuid4().hex
        self._prefix = '{"' + call.argument + '": "'
        self._opened = False
        self._start: dict | None = None   # a JSON answer's start, held until its body is rewritten
        self._parts: list[bytes] = []

    async def __call__(self, msg: dict) -> None:
        if msg["type"] == "http.response.start":
            ctype = next((v for k, v in msg.get("headers", ()) if k == b"content-type"), b"")
            if msg["status"] == 200 and ctype.startswith(b"application/json"):
                self._start = msg
                return
            await self._send(msg)
            return
        if msg["type"] != "http.response.body":
            await self._send(msg)
            return
        if self._start is not None:
            self._parts.append(msg.get("body", b""))
            if msg.get("more_body"):
                return
            body = self._whole(b"".join(self._parts))
            headers = [(k, v) for k, v in self._start.get("headers", ()) if k != b"content-length"]
            await self._send({**self._start, "headers": [*headers, (b"content-length", b"%d" % len(body))]})
            await self._send({"type": "http.response.body", "body": body, "more_body": False})
            return
        await self._send({**msg, "body": self._events(msg.get("body", b""))})

    def _function(self, arguments: str) -> dict[str, Any]:
        if self._opened:
            return {"index": 0, "function": {"arguments": arguments}}
        self._opened = True
        return {"index": 0, "id": self._id, "type": "function",
                "function": {"name": self.call.name, "arguments": self._prefix + arguments}}

    def _whole(self, data: bytes) -> bytes:
        obj = orjson.loads(data)
        choice = obj["choices"][0]
        text = choice["message"].get("content") or ""
        choice["message"]["content"] = None
        call = self._function(text)
        call.pop("index")
        choice["message"]["tool_calls"] = [call]
        call["function"]["arguments"] += '"}'
        choice["finish_reason"] = "tool_calls"
        return orjson.dumps(obj)

    def _events(self, data: bytes) -> bytes:
        out: list[bytes] = []
        for ev in data.split(_EVENT_END):
            if not ev.startswith(b"data: {"):
                if ev:
                    out.append(ev + _EVENT_END)
                continue
            obj = orjson.loads(ev[6:])
            choices = obj.get("choices")
            if choices:
                self._chunk(choices[0])
            out.append(b"data: " + orjson.dumps(obj) + _EVENT_END)
        return b"".join(out)

    def _chunk(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta") or {}
        if "role" in delta:   # the role chunk stays as vLLM sends it
            return
        piece = delta.pop("content", None) or ""
        finish = choice.get("finish_reason") is not None
        if piece or finish:
            call = self._function(piece)
            if finish:
                call["function"]["arguments"] += '"}'
                choice["finish_reason"] = "tool_calls"
            delta["tool_calls"] = [call]
        choice["delta"] = delta
