"""Tool calls from the simulated vLLM server: deterministic, so tests and agents' round trips can rely on them.

vLLM answers with a tool call when the chat request forces one: `tool_choice` naming a function
(`{"type": "function", "function": {"name": ...}}`, which vLLM serves by guided decoding) or `"required"` (here:
the first of `tools`). The simulator does the same, and with `tool_choice` "auto" or absent it answers in text,
as if the model chose not to call. The call's arguments are a JSON object `{"input": "<the generated words>"}`:
the request's generated tokens are its pieces, so timing, token counts and `max_tokens` stay as for a text
answer. Streamed as vLLM's OpenAI server does it (serving_chat.py): one delta with the call's `id`, `type` and
`function.name` and empty arguments, then deltas of `function.arguments` pieces; the finish reason is
`tool_calls`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import orjson

ARGS_OPEN = b'{"input": "'
ARGS_CLOSE = b'"}'
FINISH = "tool_calls"
# a streamed token's choice, up to its arguments piece (ToolCall.token), and what closes the delta after it
TOKEN_OPEN = b'{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":'
TOKEN_CLOSE = b"}}]}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """The call a request is answered with: the function's name and the call's id."""

    name: str
    call_id: str

    def token(self, word: bytes, first: bool, last: bool) -> bytes:
        """A streamed token's arguments piece, as it goes into the chunk after TOKEN_OPEN (a JSON string, then
        the delta's closing brackets)."""
        piece = (ARGS_OPEN if first else b"") + word + (ARGS_CLOSE if last else b"")
        return orjson.dumps(piece.decode()) + TOKEN_CLOSE

    def arguments(self, text: bytes) -> str:
        return (ARGS_OPEN + text + ARGS_CLOSE).decode()

    def message(self, text: bytes) -> dict[str, Any]:
        """The non-streamed answer's message fields."""
        return {"content": None, "tool_calls": [{"id": self.call_id, "type": "function",
                                                 "function": {"name": self.name, "arguments": self.arguments(text)}}]}

    def opening_delta(self) -> bytes:
        """The stream's delta that opens the call (its id, type and name)."""
        return orjson.dumps({"tool_calls": [{"index": 0, "id": self.call_id, "type": "function",
                                             "function": {"name": self.name, "arguments": ""}}]})


def finish_reason(call: ToolCall | None, reason: str | None) -> str | None:
    """A tool call that ended by itself finishes with `tool_calls` (a length cap stays `length`)."""
    return FINISH if call is not None and reason == "stop" else reason


def forced_call(extra: dict[str, Any] | None) -> ToolCall | None:
    """The call a chat request's `tool_choice` forces (extra: the request's fields beyond the typed ones)."""
    extra = extra or {}
    tools = extra.get("tools")
    choice = extra.get("tool_choice")
    if not isinstance(tools, list) or not tools:
        return None
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
    elif choice == "required":
        first = tools[0] if isinstance(tools[0], dict) else {}
        name = (first.get("function") or {}).get("name")
    if not isinstance(name, str) or not name:
        return None
    return ToolCall(name, "chatcmpl-tool-" + secrets.token_hex(16))
