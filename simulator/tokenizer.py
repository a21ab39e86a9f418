"""The simulator's deterministic tokenizer: one token per 4 bytes of UTF-8 text.

The rule is simple on purpose: a gateway can estimate prompt tokens as ceil(bytes / 4) without a
vocabulary and be exact against the simulator (and close, ~4 bytes/token, for real English text). The byte
rule and the chat template are policies/tokens.py's, the gateway's estimate.
Token ids depend on content, so equal prefixes give equal ids and equal block hashes, which is what
prefix caching needs. A trace replay makes a prompt of exactly n tokens with `synthetic_text(n, key)`.
"""

from __future__ import annotations

import hashlib
import random
import zlib
from collections.abc import Sequence

from policies.tokens import (
    BYTES_PER_TOKEN,
    CHAT_GENERATION_PROMPT,
    CHAT_ROLE_PREFIX,
    CHAT_TURN_END,
    DEFAULT_ROLE,
    content_text,
    tokens_of_bytes,
)

__all__ = ["BLOCK_SIZE", "BYTES_PER_TOKEN", "VOCAB_SIZE", "block_hashes", "count_tokens", "encode", "message_text",
           "render_chat", "synthetic_text"]

VOCAB_SIZE = 128_256  # Llama-3's, so ids look plausible
BLOCK_SIZE = 16


def encode(text: str) -> list[int]:
    data = text.encode("utf-8")
    return [
        zlib.crc32(data[i : i + BYTES_PER_TOKEN]) % VOCAB_SIZE for i in range(0, len(data), BYTES_PER_TOKEN)
    ]


def count_tokens(text: str) -> int:
    return tokens_of_bytes(len(text.encode("utf-8")))


def render_chat(messages: Sequence[dict], add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> str:
    """Flatten chat messages into the prompt text the engine tokenizes (a minimal chat template).

    `content` may be a string or OpenAI's list of parts ({"type": "text", "text": ...}). With
    `continue_final_message` the last message stays open (no turn end), as transformers' apply_chat_template
    does: the model continues its text instead of starting a new turn.
    """
    parts: list[str] = []
    for m in messages:
        parts.append(CHAT_ROLE_PREFIX.format(role=m.get("role", DEFAULT_ROLE)) + message_text(m) + CHAT_TURN_END)
    if continue_final_message and parts:
        parts[-1] = parts[-1][: -len(CHAT_TURN_END)]
    if add_generation_prompt:
        parts.append(CHAT_GENERATION_PROMPT)
    return "".join(parts)


def message_text(message: dict) -> str:
    """A chat message's text: its string content, or the text of its parts."""
    return content_text(message.get("content"))


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
    """Readable filler text of exactly `num_tokens` tokens under this tokenizer; same key, same text, and keys
    that differ give texts that differ from their first words on (a generator seeded by the key's hash picks the
    words: a fixed stride over the word list would give only len(_WORDS) distinct texts, whose shared prefixes
    the prefix caches would count as hits)."""
    if num_tokens <= 0:
        return ""
    rng = random.Random(zlib.crc32(str(key).encode()))
    target = num_tokens * BYTES_PER_TOKEN
    words = rng.choices(_WORDS, k=target // 2 + 1)     # no word is shorter than 2 bytes with its space
    text = " ".join(words)[:target]
    return text.ljust(target, ".")
