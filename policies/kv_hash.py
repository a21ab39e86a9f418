"""vLLM V1 prefix-cache block hashes, recomputed outside the engine (docs/reference/vllm-interface.md §5.2).

vLLM caches a prompt in full blocks of `block_size` tokens and names block i by a chained hash:

    hash_0 = H((NONE_HASH, tuple(tokens of block 0), extra_keys_0))
    hash_i = H((hash_{i-1}, tuple(tokens of block i), extra_keys_i))

so equal hashes mean equal prefixes. `H` is `--prefix-caching-hash-algo`: `sha256` (SHA-256 of the pickled tuple,
protocol 5; the default) or `sha256_cbor` (SHA-256 of the tuple as canonical CBOR, language independent).
`NONE_HASH = H(seed)`, where the seed is PYTHONHASHSEED when set; without it vLLM 0.11 draws 32 random bytes per
process (nobody else can reproduce its hashes) and vLLM >= 0.32 uses the fixed seed "vllm-none-hash".
`extra_keys` is None for a plain text request; `cache_salt` enters the first block only, as the bare string in
0.11 and tagged as ("cache_salt", salt) from 0.32 on (`KEY_STYLES`). LoRA and multimodal keys are not modelled:
a request using them simply finds nothing in the index (it is routed on load alone).

KV events carry a hash as the last 8 bytes of the digest read as an unsigned big-endian integer
(`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, the default): `external_hash`. Everything here is pure.
Source: vllm/v1/core/kv_cache_utils.py (`hash_block_tokens`, `init_none_hash`, `maybe_convert_block_hash`,
`generate_block_hash_extra_keys`) and vllm/utils/hashing.py, vLLM 0.11 and 0.32.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cbor2

HASH_ALGOS = ("sha256", "sha256_cbor")
KEY_STYLES = ("0.11", "0.32")      # how cache_salt enters the first block's extra keys
DEFAULT_SEED_032 = "vllm-none-hash"  # vLLM >= 0.32 without PYTHONHASHSEED (sha256 algorithms)
_M64 = (1 << 64) - 1


def sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def hash_function(algo: str) -> Callable[[Any], bytes]:
    if algo == "sha256":
        return sha256_pickle
    if algo == "sha256_cbor":
        return sha256_cbor
    raise ValueError(f"prefix-caching hash algorithm must be one of {HASH_ALGOS}, got {algo!r}")


def external_hash(digest: bytes) -> int:
    """The integer form of a block hash in KV events: the digest's last 8 bytes, big-endian."""
    return int.from_bytes(digest, "big") & _M64


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Computes a request's block hashes exactly as one vLLM engine configuration does.

    `seed` is the engine's PYTHONHASHSEED; None means vLLM >= 0.32's fixed default (`DEFAULT_SEED_032`), since
    a 0.11 engine without the variable cannot be reproduced at all (key the index on token ids instead).
    """

    block_size: int = 16
    algo: str = "sha256_cbor"
    seed: str | bytes | None = None   # bytes: NONE_HASH itself (a 0.11 engine's random draw)
    key_style: str = "0.11"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        hash_function(self.algo)
        if self.key_style not in KEY_STYLES:
            raise ValueError(f"key_style must be one of {KEY_STYLES}, got {self.key_style!r}")

    @property
    def none_hash(self) -> bytes:
        if isinstance(self.seed, bytes):
            return self.seed
        return _none_hash(self.algo, self.seed if self.seed is not None else DEFAULT_SEED_032)

    def first_extra_keys(self, cache_salt: str | None) -> tuple[Any, ...] | None:
        if not cache_salt:
            return None
        return (cache_salt,) if self.key_style == "0.11" else (("cache_salt", cache_salt),)

    def digests(self, token_ids: Sequence[int], cache_salt: str | None = None,
                parent: bytes | None = None, start_block: int = 0) -> list[bytes]:
        """Digests of every full block of `token_ids`, chained from `parent` (None: the start of a prompt).

        `start_block` is the index of the first block within its prompt (only block 0 carries the salt)."""
        h = hash_function(self.algo)
        bs = self.block_size
        prev = parent if parent is not None else self.none_hash
        first = self.first_extra_keys(cache_salt)
        out: list[bytes] = []
        for i, start in enumerate(range(0, len(token_ids) - bs + 1, bs)):
            extra = first if start_block + i == 0 else None
            prev = h((prev, tuple(token_ids[start:start + bs]), extra))
            out.append(prev)
        return out

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """The request's block hashes in the integer form KV events carry."""
        return [external_hash(d) for d in self.digests(token_ids, cache_salt)]


_NONE_HASHES: dict[tuple[str, str], bytes] = {}


def _none_hash(algo: str, seed: str) -> bytes:
    key = (algo, seed)
    v = _NONE_HASHES.get(key)
    if v is None:
        v = _NONE_HASHES[key] = hash_function(algo)(seed)
    return v


def engine_seed(version: str, env: dict[str, str] | None = None) -> bytes | str:
    """What an engine of `version` ("0.11" or "0.33") derives NONE_HASH from in this environment: the
    PYTHONHASHSEED string, the fixed 0.32+ seed, or (0.11 without the variable) 32 random bytes as vLLM draws."""
    seed = (env if env is not None else os.environ).get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    return DEFAULT_SEED_032 if version != "0.11" else os.urandom(32)
