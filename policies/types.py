"""Plain data that flows into and out of every policy.

A policy sees a request's features and an immutable view of the candidate workers, plus `now`
(seconds, from whatever clock the caller runs: wall time in the gateway, virtual time in
`fleetgate simulate`). It returns a `Decision`. Policies do no I/O and never read a clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

ROLE_MIXED = "mixed"
ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
ROLES = (ROLE_MIXED, ROLE_PREFILL, ROLE_DECODE)

CLASS_INTERACTIVE = "interactive"
CLASS_BATCH = "batch"
NO_CACHED_PREFIX: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """What the gateway knows about one request when it has to place it."""

    request_id: str
    model: str
    prompt_tokens: int
    max_tokens: int | None = None
    # Expected output length; the gateway's predictor (or max_tokens, or a default) fills it in.
    predicted_output_tokens: float = 128.0
    session_id: str | None = None
    # Chained hashes of the prompt's leading chunks (see policies.prefix); equal prefixes share a head.
    prefix_hashes: tuple[int, ...] = ()
    # Chained hashes of EVERY full chunk of the prompt (policies.prefix.prompt_chain; the simulator's block keys),
    # for policies that declare `needs_prefix_chain` (aladdin infers a conversation from it: affinity.py).
    prefix_chain: tuple[int, ...] = ()
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    priority: int = 0
    request_class: str = CLASS_INTERACTIVE
    arrival: float = 0.0
    # Exact prefix-cache view (policies/kv_index.py): worker id -> prompt tokens that worker's prefix cache
    # holds for this request, from the engines' KV events; workers holding none are absent (read with
    # .get(id, 0)). Filled by the gateway / simulator only for policies with `needs_kv_blocks = True`.
    cached_prefix_tokens: Mapping[str, int] = field(default_factory=lambda: NO_CACHED_PREFIX)
    adapter: str | None = None   # the LoRA adapter the request names (its `model`); None: the base model


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as a policy sees it at decision time.

    `inflight` and `inflight_tokens` are the gateway's own reservations (summed over all gateway
    replicas when state is shared); `running`, `waiting` and `kv_usage` come from the engine's last
    scraped /metrics (or straight from the engine model in the simulator) and lag a little.
    """

    id: str
    role: str = ROLE_MIXED
    inflight: int = 0
    inflight_tokens: int = 0
    cap: int | None = None
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    profile: str = ""
    weight: float = 1.0
    labels: Mapping[str, str] = field(default_factory=dict)
    max_model_len: int | None = None   # the engine's context limit (from /v1/models); None: not known
    adapters: frozenset[str] = frozenset()   # LoRA adapters it serves now (policies/adapters.py)
    max_loras: int | None = None       # its GPU slots for adapters (vLLM --max-loras); None: not known

    @property
    def load(self) -> int:
        """Best single load number: the larger of what we sent and what the engine reports."""
        return max(self.inflight, self.running + self.waiting)


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's answer: the worker to use, or None with a reason (the caller queues or refuses)."""

    worker_id: str | None
    reason: str = ""
    # For P/D: the prefill worker chosen alongside the decode worker in `worker_id`.
    prefill_worker_id: str | None = None
    # With worker_id None: the earliest time (the caller's clock) it is worth asking again even if no capacity
    # is freed meanwhile (e.g. aladdin's risk-mode deadline); None: only when capacity changes.
    retry_at: float | None = None


@dataclass(frozen=True, slots=True)
class Move:
    """A rebalancing proposal (Aladdin's Algorithm 2): run `request_id`, placed on `src` but not started
    there, on `dst` instead."""

    request_id: str
    src: str
    dst: str
