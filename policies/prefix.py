"""Prompt prefix hashing and the per-worker approximate prefix index.

Approximate prefix routing (production-stack `prefixaware`, llm-d approx-prefix-cache scorer; see
docs/reference/peer-routers.md §1.1 and §2.1): the router hashes fixed-size character chunks of the prompt,
remembers which chunk hashes it recently sent to each worker, and prefers the worker holding the
longest run of the request's leading chunks, since that worker's engine likely still caches them.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Sequence

CHUNK_CHARS = 128  # production-stack hashes 128-character chunks (docs/reference/peer-routers.md §1.1)
MAX_CHUNKS = 64
# prompt_chain: every full chunk, up to 1 MiB of text (longer than any context window the gateway routes for).
CHAIN_MAX_CHUNKS = 8192


def prompt_chunk_hashes(text: str, chunk_chars: int = CHUNK_CHARS, max_chunks: int = MAX_CHUNKS) -> tuple[int, ...]:
    """Chained 64-bit hashes of the prompt's leading chunks: hash i covers text[: (i+1) * chunk_chars].

    Equal prefixes give equal leading hashes. Stable across processes (crc32 and adler32, each chained
    by passing the previous value as the start value; the two 32-bit halves make one 64-bit hash).
    The last, partial chunk is hashed too, so an identical short prompt still matches.
    """
    if chunk_chars <= 0:
        raise ValueError("chunk_chars must be positive")
    crc, adler = 0, 1
    out: list[int] = []
    head = text[: chunk_chars * max_chunks]
    data = head.encode("utf-8", "surrogatepass")
    crc32, adler32 = zlib.crc32, zlib.adler32
    if len(data) == len(head):  # ASCII: character chunks are byte chunks, slice without copying
        view = memoryview(data)
        for start in range(0, len(data), chunk_chars):
            chunk = view[start : start + chunk_chars]
            crc = crc32(chunk, crc)
            adler = adler32(chunk, adler)
            out.append((crc << 32) | adler)
        return tuple(out)
    for start in range(0, len(head), chunk_chars):
        chunk = head[start : start + chunk_chars].encode("utf-8", "surrogatepass")
        crc = crc32(chunk, crc)
        adler = adler32(chunk, adler)
        out.append((crc << 32) | adler)
    return tuple(out)


def prompt_chain(text: str, chunk_chars: int = CHUNK_CHARS, max_chunks: int = CHAIN_MAX_CHUNKS) -> tuple[int, ...]:
    """The chained hashes of every FULL chunk of the prompt (RequestFeatures.prefix_chain): a conversation's next
    turn starts with this turn's whole text, so it holds each of them, the deepest included (a partial last chunk
    would not recur: the next turn fills it with other text). Same hashes as `prompt_chunk_hashes` chunk for chunk.
    """
    if chunk_chars <= 0:
        raise ValueError("chunk_chars must be positive")
    full = min(len(text) // chunk_chars, max_chunks) * chunk_chars
    return prompt_chunk_hashes(text[:full], chunk_chars, max_chunks) if full else ()


class PrefixIndex:
    """Per worker, an LRU-bounded set of chunk hashes recently sent there.

    Invariant that makes lookups a binary search: a worker's set is prefix-closed per prompt (if chunk
    i of a prompt is present, chunks 0..i-1 are too). `record` touches a prompt's chunks deepest first,
    so the head chunks are the most recent and LRU eviction drops tails before heads.
    """

    def __init__(self, max_entries_per_worker: int = 20_000) -> None:
        if max_entries_per_worker <= 0:
            raise ValueError("max_entries_per_worker must be positive")
        self.max_entries = max_entries_per_worker
        self._by_worker: dict[str, OrderedDict[int, None]] = {}

    def record(self, worker_id: str, hashes: Sequence[int]) -> None:
        lru = self._by_worker.get(worker_id)
        if lru is None:
            lru = self._by_worker[worker_id] = OrderedDict()
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.max_entries:
            lru.popitem(last=False)

    def match_len(self, worker_id: str, hashes: Sequence[int]) -> int:
        """How many leading chunks of `hashes` the worker holds (0 if none)."""
        lru = self._by_worker.get(worker_id)
        if not lru or not hashes or hashes[0] not in lru:
            return 0
        lo, hi = 1, len(hashes)  # hashes[:lo] all present; find the largest such lo
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in lru:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def workers(self) -> list[str]:
        """The workers it holds chunks of."""
        return [w for w, lru in self._by_worker.items() if lru]

    def forget_worker(self, worker_id: str) -> None:
        self._by_worker.pop(worker_id, None)

    def size(self, worker_id: str) -> int:
        lru = self._by_worker.get(worker_id)
        return len(lru) if lru else 0
