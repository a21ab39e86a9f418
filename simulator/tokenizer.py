"""The simulator's deterministic tokenizer: one token per 4 bytes of UTF-8 text.

The rule is simple on purpose: a gateway can estimate prompt tokens as ceil(bytes / 4) without a
vocabulary and be exact against the simulator (and close, ~4 bytes/token, for real English text).
Token ids depend on content, so equal prefixes give equal ids and equal block hashes, which is what
prefix caching needs. A trace replay makes a prompt of exactly n tokens with `synthetic_text(n, key)`.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence

BYTES_PER_TOKEN = 4
VOCAB_SIZE = 128_256  # Llama-3's, so ids look plausible
BLOCK_SIZE = 16

CHAT_ROLE_PREFIX = "<|{role}|>\n"
CHAT_TURN_END = "\n"
CHAT_GENERATION_PROMPT = "<|assistant|>\n"


def encode(text: str) -> list[int]:
    data = text.encode("utf-8")
    return [
        zlib.crc32(data[i : i + BYTES_PER_TOKEN]) % VOCAB_SIZE for i in range(0, len(data), BYTES_PER_TOKEN)
    ]


def count_tokens(text: str) -> int:
    return -(-len(text.encode("utf-8")) // BYTES_PER_TOKEN)


def render_chat(messages: Sequence[dict], add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> str:
    """Flatten chat messages into the prompt text the engine tokenizes (a minimal chat template).

    `content` may be a string or OpenAI's list of parts ({"type": "text", "text": ...}). With
    `continue_final_message` the last message stays open (no turn end), as transformers' apply_chat_template
    does: the model continues its text instead of starting a new turn.
    """
    parts: list[str] = []
    for m in messages:
        parts.append(CHAT_ROLE_PREFIX.format(role=m.get("role", "user")) + message_text(m) + CHAT_TURN_END)
    if continue_final_message and parts:
        parts[-1] = parts[-1][: -len(CHAT_TURN_END)]
    if add_generation_prompt:
        parts.append(CHAT_GENERATION_PROMPT)
    return "".join(parts)


def message_text(message: dict) -> str:
    """A chat message's text: its string content, or the text of its parts."""
    content = message.get("content") or ""
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def block_hashes(token_ids: Sequence[int], salt: str | None = None) -> list[int]:
    """Chained hashes of the full 16-token blocks: hash_i = H(hash_{i-1}, tokens of block i), as vLLM V1."""
    out: list[int] = []
    parent = b"fleetgate-none-hash" + (salt or "").encode()
    for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
        h = hashlib.blake2b(parent, digest_size=8)
        h.update(b"".join(t.to_bytes(4, "little") for t in token_ids[start : start + BLOCK_SIZE]))
        parent = h.digest()
        out.append(int.from_bytes(parent, "big"))
    return out


_WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "it", "an", "be", "this", "are", "or", "which", "have", "has", "not", "but", "were", "they", "been", "one", "their", "all", "more", "also", "can", "its", "new", "first", "two", "would", "other", "after", "into", "time"]


def synthetic_text(num_tokens: int, key: int | str = 0) -> str:
    """Readable filler text of exactly `num_tokens` tokens under this tokenizer; same key, same text."""
    if num_tokens <= 0:
        return ""
    seed = zlib.crc32(str(key).encode())
    words: list[str] = []
    size = 0
    target = num_tokens * BYTES_PER_TOKEN
    i = 0
    while size < target:
        w = _WORDS[(seed + i * 2654435761) % len(_WORDS)]
        words.append(w)
        size += len(w) + 1
        i += 1
    text = " ".join(words)[:target]
    return text.ljust(target, ".")
