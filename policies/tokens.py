"""The prompt-token estimate: what a request's prompt counts, in tokens, before any tokenizer saw it.

One rule for the gateway (gateway/request/parse.py reads a request's prompt with it; placement and reservations use
the count) and the simulator (simulator/tokenizer.py tokenizes with it): one token per `BYTES_PER_TOKEN` bytes
of UTF-8 text, and a chat prompt is its messages rendered by a minimal chat template (each message
`<|role|>\\n` + text + `\\n`, then the generation prompt `<|assistant|>\\n`). Exact against the simulator's
tokenizer, close (~4 bytes per token) for English text with Llama-3-class vocabularies. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

BYTES_PER_TOKEN = 4
CHAT_ROLE_PREFIX = "<|{role}|>\n"
CHAT_TURN_END = "\n"
CHAT_GENERATION_PROMPT = "<|assistant|>\n"
DEFAULT_ROLE = "user"        # what the template renders for a message without a role

_ROLE_FRAMING = len(CHAT_ROLE_PREFIX.format(role="")) + len(CHAT_TURN_END)   # bytes around each message's role


def tokens_of_bytes(n: int) -> int:
    """Tokens of `n` bytes of UTF-8 text: ceil(n / BYTES_PER_TOKEN)."""
    return -(-n // BYTES_PER_TOKEN)


def utf8_len(s: str) -> int:
    return len(s) if s.isascii() else len(s.encode("utf-8", "surrogatepass"))


def content_text(content: Any) -> str:
    """A chat message's content as text: a string as it is, OpenAI's list of parts by their `text`, else ''."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def chat_bytes(messages: Iterable[Mapping[str, Any]], add_generation_prompt: bool = True) -> int:
    """UTF-8 bytes of the messages rendered by the chat template (module docstring), without rendering them."""
    size = utf8_len(CHAT_GENERATION_PROMPT) if add_generation_prompt else 0
    for m in messages:
        role = m.get("role")
        size += utf8_len(content_text(m.get("content"))) + utf8_len(role if isinstance(role, str) else DEFAULT_ROLE)
        size += _ROLE_FRAMING
    return size


def estimate_chat_tokens(messages: Iterable[Mapping[str, Any]]) -> int:
    """Prompt tokens of a chat request: its rendered template (generation prompt included), in tokens."""
    return tokens_of_bytes(chat_bytes(messages))


def estimate_prompt_tokens(prompt: Any) -> int:
    """Prompt tokens of a completions request: text in tokens of its bytes (each string of a list on its own),
    token-id prompts exactly."""
    if isinstance(prompt, str):
        return tokens_of_bytes(utf8_len(prompt))
    if prompt and isinstance(prompt[0], str):
        return sum(tokens_of_bytes(utf8_len(p)) for p in prompt)
    if prompt and isinstance(prompt[0], list):
        return sum(len(p) for p in prompt)
    return len(prompt)
