"""Streams that survive their worker: what the client already has of a broken stream, the continuation request
that asks another worker for the rest, and the continuation's events rewritten into the first answer's identity.

When a worker dies, errors or stalls after the client got bytes, the dispatcher (gateway/pipeline/dispatch.py) places the
request again (the same placement step, without the failed worker) as a continuation:

- completions: the prompt plus the text already sent (vLLM tokenizes it and goes on where the text stopped);
- chat: the messages plus an assistant message holding the text sent, with `continue_final_message: true` and
  `add_generation_prompt: false` (vLLM's chat template leaves that message open instead of starting a new turn;
  vllm/entrypoints/openai/protocol.py ChatCompletionRequest, "check_generation_prompt");
- `max_tokens` / `max_completion_tokens` (and `min_tokens`) less the tokens already sent; every other field,
  the sampling parameters and seed included, as the client sent it.

The client sees one stream: the continuation's chunks carry the first chunk's id, created and model, its role
chunk is dropped, and its usage (when the client asked for usage) reports the original prompt's tokens and the
completion tokens delivered over all legs. The relay keeps the bytes it forwarded (one list append per chunk:
no parsing on the hot path); they are parsed when a stream breaks, or folded into the text once they pass
FOLD_BYTES (so a long stream holds its text, not ~200 bytes of event framing per token).

Tool calls: a call half streamed cannot be continued exactly (vLLM's tool parser reads the model's raw output,
which the client never saw; an assistant message can hold the text sent, not half a call), so a chat stream's
tool-call events are held from the first one until the stream's finish (`finish_reason`), an error or [DONE],
then forwarded together. A worker that fails while the call is held has delivered none of it: the held events
are dropped, their tokens not counted as delivered, and the continuation asks the next worker for the turn from
the text the client has (for most tool turns none: the request again). The client sees the call's arguments
arrive at once at the end instead of token by token; a call that has reached the client is complete.

Requests that cannot be continued this way end with the OpenAI-shaped error event as before: n > 1, logprobs,
an echoed prompt, prompts given as token ids or several prompts, and structured output (a grammar would
restart).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from engine_adapters.base import Usage
from policies.tokens import content_text

EVENT_END = b"\n\n"
FOLD_BYTES = 1 << 20  # relayed bytes kept unparsed per stream (~4,000 tokens of vLLM chat events)
DONE = b"data: [DONE]\n\n"
_TOOL_DELTA = b'"tool_calls":[{'
_FINISHED = b'"finish_reason":"'   # a finish_reason that is not null
_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def resumable(body: dict[str, Any], chat: bool) -> bool:
    """Whether a streamed request can be continued elsewhere should its worker fail mid-stream."""
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return False
    if body.get("logprobs") or body.get("top_logprobs") or body.get("prompt_logprobs"):
        return False
    if any(body.get(k) is not None for k in _STRUCTURED):
        return False
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return False
    if chat:
        return not body.get("continue_final_message") or body["messages"][-1].get("role") == "assistant"
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if len(prompt) == 1 else None
    return isinstance(prompt, str) and not body.get("echo") and body.get("suffix") is None


@dataclass(slots=True)
class Delivered:
    """What the client has of the stream so far, read from the bytes relayed to it."""

    parts: list[str] = field(default_factory=list)  # the text, in pieces
    id: str | None = None
    created: int | None = None
    model: str | None = None
    role_sent: bool = False
    finish_reason: str | None = None
    tool_calls: bool = False

    @property
    def text(self) -> str:
        if len(self.parts) > 1:
            self.parts[:] = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""


def sse_objects(data: bytes) -> Iterator[dict[str, Any]]:
    """The JSON objects of the complete `data: {...}` events in `data` (malformed ones skipped)."""
    for ev in data.split(EVENT_END):
        if not ev.startswith(b"data: {"):
            continue
        try:
            obj = orjson.loads(ev[6:])
        except orjson.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            yield obj


def read_delivered(data: bytes, d: Delivered | None = None) -> Delivered:
    """Parse relayed events (complete events only: the relay forwards nothing else) into `d` (or a new one)."""
    d = d if d is not None else Delivered()
    parts = d.parts
    for obj in sse_objects(data):
        if "error" in obj:
            continue
        if d.id is None:
            d.id, d.created, d.model = obj.get("id"), obj.get("created"), obj.get("model")
        for choice in obj.get("choices") or ():
            delta = choice.get("delta")
            if isinstance(delta, dict):  # chat
                d.role_sent = d.role_sent or "role" in delta
                d.tool_calls = d.tool_calls or bool(delta.get("tool_calls"))
                content = delta.get("content")
            else:
                content = choice.get("text")
            if isinstance(content, str):
                parts.append(content)
            if choice.get("finish_reason") is not None:
                d.finish_reason = choice["finish_reason"]
    return d


_PIECE = re.compile(rb'"(?:content|text)":"((?:[^"\\]|\\.)*)"')
_FINISH = b'"finish_reason":"'


def fold_delivered(data: bytes, d: Delivered) -> None:
    """read_delivered without JSON per event, for the bulk of a long stream: one regex pass collects the text
    pieces (still JSON-escaped, decoded together); the first event is parsed whole for the identity."""
    if d.id is None:
        end = data.find(EVENT_END) + len(EVENT_END)
        read_delivered(data[:end], d)
        data = data[end:]
    pieces = _PIECE.findall(data)
    if pieces:
        d.parts.append(orjson.loads(b'"' + b"".join(pieces) + b'"'))
    d.role_sent = d.role_sent or b'"role":"assistant"' in data
    d.tool_calls = d.tool_calls or b'"tool_calls":[{' in data
    at = data.rfind(_FINISH)
    if at >= 0:
        at += len(_FINISH)
        d.finish_reason = data[at:data.find(b'"', at)].decode()


def continuation_body(body: dict[str, Any], chat: bool, text: str, tokens_sent: int) -> dict[str, Any] | None:
    """The request for the rest of the answer, or None when nothing remains to generate."""
    out = dict(body)
    for key in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        limit = body.get(key, None if chat else 16)  # vLLM's completions default is 16 (vllm-interface §1.3)
        if isinstance(limit, int):
            if limit - tokens_sent < 1:
                return None
            out[key] = limit - tokens_sent
    if isinstance(body.get("min_tokens"), int):
        out["min_tokens"] = max(0, body["min_tokens"] - tokens_sent)
    if not text:
        return out
    if chat:
        messages = list(body["messages"])
        if body.get("continue_final_message"):  # the client's own continuation: extend its final message
            last = dict(messages[-1])
            last["content"] = content_text(last.get("content")) + text
            messages[-1] = last
        else:
            messages.append({"role": "assistant", "content": text})
        out["messages"] = messages
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
    else:
        prompt = body["prompt"]
        out["prompt"] = (prompt[0] if isinstance(prompt, list) else prompt) + text
    return out


def tokenize_body(body: dict[str, Any], chat: bool) -> bytes:
    """A POST /tokenize body counting the original request's prompt (vLLM's tokenize endpoint)."""
    if chat:
        req = {"messages": body["messages"], "add_generation_prompt": body.get("add_generation_prompt", True)}
        if body.get("continue_final_message"):
            req["continue_final_message"] = True
    else:
        prompt = body["prompt"]
        req = {"prompt": prompt[0] if isinstance(prompt, list) else prompt}
    if body.get("model"):
        req["model"] = body["model"]
    return orjson.dumps(req)


def text_tokenize_body(text: str, model: str | None) -> bytes:
    """A POST /tokenize body counting the tokens of text already generated (no special tokens added)."""
    req: dict[str, Any] = {"prompt": text, "add_special_tokens": False}
    if model:
        req["model"] = model
    return orjson.dumps(req)


class StreamResume:
    """One resumable stream: the bytes delivered to the client, and the rewriting of continuation legs.

    The relay calls `note(out)` for every chunk it forwards; `legs` counts continuation legs (0: the first
    answer). `tokens_before` is what the client had when the current leg started."""

    __slots__ = ("chat", "client_usage", "continuous_usage", "sent", "legs", "delivered", "tokens_before",
                 "prompt_tokens", "first_token_at", "_leg_usage", "_size", "_held", "_held_tokens", "elsewhere")

    def __init__(self, chat: bool, client_usage: bool, continuous_usage: bool) -> None:
        self.chat = chat
        self.client_usage = client_usage
        self.continuous_usage = continuous_usage
        self.sent: list[bytes] = []
        self.legs = 0
        self.delivered = Delivered()
        self.tokens_before = 0
        self.prompt_tokens: int | None = None  # the original prompt's tokens (POST /tokenize), once known
        self.first_token_at: float | None = None
        self._leg_usage: Usage | None = None
        self._size = 0
        self._held: list[bytes] | None = None   # tool-call events not yet forwarded (None: nothing held)
        self._held_tokens = 0
        # the workers a continuation could go to now (the dispatcher's); the relay's stall judge keeps a silent
        # stream that has none progressing (policies/pace.py FleetPace.judge)
        self.elsewhere: Callable[[StreamResume], list[str]] | None = None

    def note(self, out: bytes) -> bytes:
        """The relay has `out` (complete events) for the client: what of it to forward now. Tool-call events wait
        until the call is complete (module docstring)."""
        if self._held is not None or (self.chat and _TOOL_DELTA in out):
            out = self._hold(out)
            if not out:
                return out
        self.sent.append(out)
        self._size += len(out)
        if self._size > FOLD_BYTES:
            self._fold()
        return out

    def _hold(self, out: bytes) -> bytes:
        """Hold events from the first tool-call delta on; release them all at a finish, an error or [DONE]."""
        ready: list[bytes] = []
        for ev in out.split(EVENT_END):
            if not ev:
                continue
            ev += EVENT_END
            if self._held is None:
                if _TOOL_DELTA not in ev:
                    ready.append(ev)
                    continue
                self._held, self._held_tokens = [], 0
            self._held.append(ev)
            if _is_token(ev):
                self._held_tokens += 1
            if _FINISHED in ev or ev.startswith((b'data: {"error"', DONE)):
                ready += self._held
                self._held = None
        return b"".join(ready)

    def drop_held(self) -> int:
        """The leg broke: forget the events held back (the client never saw them); the output tokens they held."""
        tokens, self._held, self._held_tokens = self._held_tokens, None, 0
        return tokens

    def _fold(self) -> None:
        fold_delivered(b"".join(self.sent), self.delivered)
        self.sent.clear()
        self._size = 0

    def broke(self, tokens_delivered: int) -> Delivered:
        """The current leg broke: read what the client has."""
        self._fold()
        self.tokens_before = tokens_delivered
        return self.delivered

    def rewrite(self, complete: bytes) -> bytes:
        """A continuation leg's complete events in the first answer's identity (see the module docstring)."""
        out: list[bytes] = []
        d = self.delivered
        for ev in complete.split(EVENT_END):
            if not ev:
                continue
            if not ev.startswith(b"data: {"):
                out.append(ev + EVENT_END)
                continue
            try:
                obj = orjson.loads(ev[6:])
            except orjson.JSONDecodeError:
                out.append(ev + EVENT_END)
                continue
            if not isinstance(obj, dict) or "error" in obj:
                out.append(ev + EVENT_END)
                continue
            choices = obj.get("choices")
            usage = obj.get("usage")
            if isinstance(usage, dict):
                self._leg_usage = Usage(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))
                if not choices and not self.client_usage:
                    continue  # the usage event the gateway asked for: the client did not
                if choices and not self.continuous_usage:
                    obj.pop("usage")
                else:
                    obj["usage"] = self._usage(usage)
            if self.chat and choices and _role_only(choices[0]):
                if d.role_sent:
                    continue
                d.role_sent = True
            if d.id is None:
                d.id, d.created, d.model = obj.get("id"), obj.get("created"), obj.get("model")
            else:
                obj["id"], obj["created"], obj["model"] = d.id, d.created, d.model
            out.append(b"data: " + orjson.dumps(obj) + EVENT_END)
        return b"".join(out)

    def _usage(self, leg: dict[str, Any]) -> dict[str, Any]:
        completion = self.tokens_before + int(leg.get("completion_tokens") or 0)
        prompt = self.prompt_tokens if self.prompt_tokens is not None else max(
            1, int(leg.get("prompt_tokens") or 0) - self.tokens_before)
        out = dict(leg)
        out.update(prompt_tokens=prompt, total_tokens=prompt + completion, completion_tokens=completion)
        return out

    def total_usage(self) -> Usage | None:
        """The whole answer's usage after the last leg: the original prompt, every completion token delivered."""
        leg = self._leg_usage
        if leg is None:
            return None
        u = self._usage({"prompt_tokens": leg.prompt_tokens, "completion_tokens": leg.completion_tokens})
        return Usage(u["prompt_tokens"], u["completion_tokens"])

    def closing_events(self) -> bytes:
        """End the stream without another leg (everything was delivered but the end): usage if asked, [DONE]."""
        d = self.delivered
        if not self.client_usage:
            return DONE
        prompt = self.prompt_tokens or 0
        obj = {"id": d.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": d.created, "model": d.model, "choices": [],
               "usage": {"prompt_tokens": prompt, "total_tokens": prompt + self.tokens_before,
                         "completion_tokens": self.tokens_before}}
        return b"data: " + orjson.dumps(obj) + EVENT_END + DONE


def _is_token(ev: bytes) -> bool:
    """Whether an event counts as an output token, as the stream scanner counts them (engine_adapters/vllm/sse.py):
    a data object with choices whose delta is neither the role preamble nor empty."""
    if not ev.startswith(b"data: {") or b'"choices":[]' in ev:
        return False
    try:
        obj = orjson.loads(ev[6:])
    except orjson.JSONDecodeError:
        return False
    choices = obj.get("choices") if isinstance(obj, dict) else None
    return bool(choices) and not _role_only(choices[0]) and bool(choices[0].get("delta"))


def _role_only(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    return isinstance(delta, dict) and "role" in delta and not delta.get("content") and not delta.get("tool_calls")
