"""The exact view of every worker's prefix cache, built from vLLM's KV-cache events (pure: no I/O, no clock).

An engine publishes `BlockStored` when full blocks enter its prefix cache, `BlockRemoved` when it evicts one and
`AllBlocksCleared` when the cache is reset (docs/reference/vllm-interface.md §5.1). `KvIndex.apply` folds these
into one map block hash -> workers holding it, bounded to `max_blocks` hashes (least recently stored first
out; a hash dropped for room is dropped for every worker, so the view errs towards "not cached").
`prefix_blocks` answers, for a request's chained block hashes, how many leading blocks each worker holds: the
prefix vLLM would find (`find_longest_cache_hit` stops at the first miss).

Two ways to key the index (`key_on`):
- "block_hash": the engines' own hashes. The gateway must hash requests exactly as the engines do
  (policies/kv_hash.py: same algorithm, seed and block size), e.g. vLLM 0.11 with `sha256_cbor` and a shared
  PYTHONHASHSEED, or >= 0.32 with any sha256 algorithm.
- "token_ids": recompute each stored block's hash from the event's `token_ids` with the gateway's own
  `BlockHasher`, chained from the parent block (llm-d's kv-cache-manager does this). Works whatever the
  engine's seed; an engine hash whose parent the index never saw cannot be chained and is skipped.

Like llm-d's and Dynamo's indexes this is per worker, not per data-parallel rank; a worker id may stand for one
rank of a DP deployment (the gateway gives each rank its own id).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from policies.kv_hash import BlockHasher, external_hash

MEDIUM_GPU = "GPU"
KEY_MODES = ("block_hash", "token_ids")


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int | bytes, ...]
    parent_block_hash: int | bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    # One entry per block (vLLM >= 0.32, untagged: e.g. (cache_salt,) on block 0), else None.
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int | bytes, ...]
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    """One published message: the engine step's events (vLLM's KVEventBatch)."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


def as_key(h: int | bytes) -> int:
    """Event hashes come as 64-bit ints (the default) or raw digests: one integer form for both."""
    return external_hash(h) if isinstance(h, bytes) else h


@dataclass(slots=True)
class IndexStats:
    stored: int = 0          # block hashes added
    removed: int = 0         # block hashes removed by events
    cleared: int = 0         # AllBlocksCleared / resyncs applied
    evicted: int = 0         # hashes dropped to stay within max_blocks
    unresolved: int = 0      # token_ids mode: blocks whose parent was unknown (skipped)
    skipped: int = 0         # events the index cannot use (LoRA, other media)


@dataclass(slots=True)
class _Worker:
    keys: set[int] = field(default_factory=set)
    # token_ids mode: engine hash -> (our key, our digest) so parents chain and removals map back.
    engine_keys: dict[int, tuple[int, bytes]] = field(default_factory=dict)


class KvIndex:
    def __init__(self, block_size: int = 16, max_blocks: int = 1_000_000, key_on: str = "block_hash",
                 hasher: BlockHasher | None = None) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        if key_on not in KEY_MODES:
            raise ValueError(f"key_on must be one of {KEY_MODES}, got {key_on!r}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.key_on = key_on
        self.hasher = hasher or BlockHasher(block_size)
        if self.hasher.block_size != block_size:
            raise ValueError("the hasher's block size differs from the index's")
        self._holders: OrderedDict[int, set[str]] = OrderedDict()
        self._workers: dict[str, _Worker] = {}
        self.stats = IndexStats()

    # ---- events -------------------------------------------------------------------------------------
    def apply(self, worker_id: str, events: Iterable[KvEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(worker_id, ev)
            elif isinstance(ev, BlockRemoved):
                self._removed(worker_id, ev)
            elif isinstance(ev, AllBlocksCleared):
                self.clear_worker(worker_id)

    def _stored(self, wid: str, ev: BlockStored) -> None:
        if ev.lora_id is not None or (ev.medium is not None and ev.medium != MEDIUM_GPU) \
                or ev.block_size != self.block_size:
            self.stats.skipped += 1
            return
        w = self._workers.get(wid)
        if w is None:
            w = self._workers[wid] = _Worker()
        if self.key_on == "block_hash":
            hashes = ev.block_hashes
            self._add(wid, w, hashes if all(type(h) is int for h in hashes) else [as_key(h) for h in hashes])
            return
        # token_ids: recompute the chain from the parent's digest with our own hasher.
        parent = None
        if ev.parent_block_hash is not None:
            known = w.engine_keys.get(as_key(ev.parent_block_hash))
            if known is None:
                self.stats.unresolved += len(ev.block_hashes)
                return
            parent = known[1]
        salt = None
        if parent is None and ev.extra_keys and ev.extra_keys[0]:
            first = ev.extra_keys[0]
            salt = first[-1] if isinstance(first[-1], str) else None
        digests = self.hasher.digests(ev.token_ids, salt, parent, start_block=0 if parent is None else 1)
        keys = []
        for h, d in zip(ev.block_hashes, digests, strict=False):
            k = external_hash(d)
            w.engine_keys[as_key(h)] = (k, d)
            keys.append(k)
        self._add(wid, w, keys)

    def _add(self, wid: str, w: _Worker, keys: Sequence[int]) -> None:
        holders = self._holders
        for k in keys:
            s = holders.get(k)
            if s is None:
                holders[k] = {wid}
            else:
                s.add(wid)
                holders.move_to_end(k)
            w.keys.add(k)
        self.stats.stored += len(keys)
        while len(holders) > self.max_blocks:
            k, ws = holders.popitem(last=False)
            for other in ws:
                self._workers[other].keys.discard(k)
            self.stats.evicted += 1

    def _removed(self, wid: str, ev: BlockRemoved) -> None:
        w = self._workers.get(wid)
        if w is None:
            return
        keys, holders = w.keys, self._holders
        by_tokens = self.key_on == "token_ids"
        removed = 0
        for h in ev.block_hashes:
            k = h if type(h) is int else as_key(h)
            if by_tokens:
                mapped = w.engine_keys.pop(k, None)
                if mapped is None:
                    continue
                k = mapped[0]
            if k in keys:
                keys.discard(k)
                s = holders.get(k)
                if s is not None:
                    s.discard(wid)
                    if not s:
                        del holders[k]
                removed += 1
        self.stats.removed += removed

    def _drop_holder(self, k: int, wid: str) -> None:
        s = self._holders.get(k)
        if s is not None:
            s.discard(wid)
            if not s:
                del self._holders[k]

    def clear_worker(self, worker_id: str) -> None:
        """Forget everything a worker holds (AllBlocksCleared, a restart, an unrecoverable gap)."""
        w = self._workers.pop(worker_id, None)
        self.stats.cleared += 1
        if w is None:
            return
        for k in w.keys:
            self._drop_holder(k, worker_id)

    # ---- queries -------------------------------------------------------------------------------------
    def prefix_blocks(self, block_hashes: Sequence[int], workers: Iterable[str] | None = None) -> dict[str, int]:
        """Leading blocks of `block_hashes` each worker holds (workers holding none are left out).

        One pass over the hashes, narrowing the set of workers still matching; once one is left, its own key
        set answers the rest. O(longest match), set operations in C."""
        out: dict[str, int] = {}
        if not block_hashes:
            return out
        holders = self._holders
        first = holders.get(block_hashes[0])
        if not first:
            return out
        alive = set(first) if workers is None else first.intersection(workers)
        n = len(block_hashes)
        i = 0
        while i < n and len(alive) > 1:
            s = holders.get(block_hashes[i])
            if s is None:
                break
            if not alive <= s:
                gone = alive - s
                for w in gone:
                    out[w] = i
                alive -= gone
            i += 1
        if len(alive) == 1:
            (only,) = alive
            keys = self._workers[only].keys
            while i < n and block_hashes[i] in keys:
                i += 1
        for w in alive:
            out[w] = i
        return {w: k for w, k in out.items() if k}

    def cached_tokens(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        """Prompt tokens of a request (given as its block hashes) that `worker_id` holds in its prefix cache."""
        w = self._workers.get(worker_id)
        if w is None:
            return 0
        keys = w.keys
        n = 0
        for h in block_hashes:
            if h not in keys:
                break
            n += 1
        return n * self.block_size

    def view(self, block_hashes: Sequence[int], max_cacheable_blocks: int | None = None) -> CachedPrefix:
        """A request's read-only worker -> cached tokens mapping (see `CachedPrefix`)."""
        hashes = block_hashes if max_cacheable_blocks is None else block_hashes[:max_cacheable_blocks]
        return CachedPrefix(self, tuple(hashes))

    def blocks_of(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return len(w.keys) if w is not None else 0

    def workers(self) -> list[str]:
        return sorted(self._workers)

    def __len__(self) -> int:
        return len(self._holders)


class CachedPrefix(Mapping[str, int]):
    """worker id -> prompt tokens of one request that the worker's prefix cache holds, read from the live index
    when asked (a request that waits sees the cache as it is when it is placed). Workers holding nothing are
    absent; `.get(worker_id, 0)` is the usual read. Computed once per index change at most."""

    __slots__ = ("_index", "block_hashes", "_memo", "_at")

    def __init__(self, index: KvIndex, block_hashes: tuple[int, ...]) -> None:
        self._index = index
        self.block_hashes = block_hashes
        self._memo: dict[str, int] = {}
        self._at = -1

    def _lengths(self) -> dict[str, int]:
        idx = self._index
        stamp = idx.stats.stored + idx.stats.removed + idx.stats.cleared + idx.stats.evicted
        if stamp != self._at:
            bs = idx.block_size
            self._memo = {w: n * bs for w, n in idx.prefix_blocks(self.block_hashes).items()}
            self._at = stamp
        return self._memo

    def __getitem__(self, worker_id: str) -> int:
        return self._lengths()[worker_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._lengths())

    def __len__(self) -> int:
        return len(self._lengths())

    def __repr__(self) -> str:
        return f"CachedPrefix({dict(self._lengths())!r})"


EMPTY_PREFIX: Mapping[str, int] = {}
