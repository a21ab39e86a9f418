"""Per-key rate limits: requests per minute, tokens per minute, requests in flight.

Each limited key has two token buckets (requests, tokens), each holding at most its per-minute limit and
refilled continuously at limit/60 per second, and a concurrency count. A request is admitted when the
requests bucket holds 1, the tokens bucket holds its cost (prompt tokens + `max_tokens`, or the predicted
output length when the request sets none) and fewer than `max_concurrency` of the key's requests run.
When it finishes, the difference between the cost reserved and the tokens it used (its usage) goes back
to the bucket ("settle"). This is OpenAI's model: the `x-ratelimit-reset-*` headers give the time until a
bucket is full again, `x-ratelimit-remaining-*` what it holds now (OpenAI API reference, "Rate limits").

Where it runs: the check is part of the worker reservation (`StateStore.try_reserve`), so it costs no call
of its own. The dispatcher opens a `Ticket` for each request of a limited key (gateway/tenancy/tickets.py `open_ticket`) and
closes it at the end (`close_ticket`); the store charges the ticket on the request's first reservation, atomically
with it: in Redis one Lua script checks the worker's cap, the key's buckets and concurrency and reserves
(gateway/state/redis_store.py), so replicas share the buckets exactly; in memory (`LocalBuckets`) the same
arithmetic runs in the process. Settlements ride along with this replica's next Redis call (the next
reservation or the 0.1 s refresh). Keys without limits open no ticket: nothing changes for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gateway.wire import errors
from gateway.wire.errors import GatewayError

WINDOW_MS = 60_000.0


@dataclass(frozen=True, slots=True)
class KeyLimits:
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None


@dataclass(slots=True, eq=False)
class Ticket:
    """One request of a limited key, from its first reservation to its end."""

    request_id: str
    tenant_id: str
    limits: KeyLimits
    cost: int                         # tokens reserved in the tokens bucket (0 without a tpm limit)
    client_headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # x-ratelimit-* go here
    charged: bool = False             # rpm/tpm taken (once per request, whatever the retries)
    holds: int = 0                    # worker reservations held now (concurrency counts while > 0)

    def note(self, remaining_requests: float, remaining_tokens: float) -> None:
        """Charged: tell the client where its buckets are (OpenAI sends these on every answer)."""
        self.client_headers += ratelimit_headers(self.limits, remaining_requests, remaining_tokens)


class RateLimited(GatewayError):
    """429 with Retry-After and the x-ratelimit-* headers."""

    __slots__ = ("extra",)

    def __init__(self, message: str, retry_after: float, extra: list[tuple[bytes, bytes]],
                 code: str = "rate_limit_exceeded") -> None:
        super().__init__(429, message, "rate_limit_error", None, code, retry_after)
        self.extra = extra

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers(), *self.extra]


def refused(ticket: Ticket, reason: str, wait_ms: float, remaining_requests: float,
            remaining_tokens: float) -> RateLimited:
    """The 429 for a ticket the buckets refused (`reason`: requests | tokens | concurrency | too_large)."""
    lim = ticket.limits
    extra = ratelimit_headers(lim, remaining_requests, remaining_tokens)
    if reason == "too_large":
        return RateLimited(f"Request too large: it needs {ticket.cost} tokens (prompt + max_tokens) and this key "
                           f"is limited to {lim.tpm} tokens per minute. Lower max_tokens.", 60.0, extra,
                           "request_too_large")
    if reason == "concurrency":
        return RateLimited(f"Too many requests in flight for this key (limit {lim.max_concurrency}).",
                           max(1.0, wait_ms / 1000), extra)
    what = f"requests per minute (limit {lim.rpm})" if reason == "requests" else f"tokens per minute (limit {lim.tpm})"
    return RateLimited(f"Rate limit reached for this key: {what}. Retry in {format_reset(wait_ms)}.",
                       wait_ms / 1000, extra)


def ratelimit_headers(lim: KeyLimits, remaining_requests: float, remaining_tokens: float) -> list[tuple[bytes, bytes]]:
    out: list[tuple[bytes, bytes]] = []
    for kind, limit, left in (("requests", lim.rpm, remaining_requests), ("tokens", lim.tpm, remaining_tokens)):
        if limit is None:
            continue
        left = max(0.0, min(float(limit), left))
        out += [(b"x-ratelimit-limit-" + kind.encode(), b"%d" % limit),
                (b"x-ratelimit-remaining-" + kind.encode(), b"%d" % math.floor(left)),
                (b"x-ratelimit-reset-" + kind.encode(), format_reset((limit - left) * WINDOW_MS / limit).encode())]
    return out


def format_reset(ms: float) -> str:
    """OpenAI's duration format: `20ms`, `1s`, `1.5s`, `6m0s`."""
    if ms < 1000:
        return f"{max(0, math.ceil(ms))}ms"
    s = ms / 1000
    if s < 60:
        return f"{math.ceil(s * 10) / 10:g}s"
    m, rest = divmod(math.ceil(s), 60)
    return f"{m}m{rest}s"


# --- the bucket arithmetic (the Redis script does the same; see redis_store._KEY_LIMITS) ---------------------
def refill(level: float | None, last_ms: float | None, now_ms: float, limit: int) -> float:
    """A bucket's level now: full when new, else its level plus limit/60 s since `last_ms`, at most `limit`."""
    if level is None or last_ms is None:
        return float(limit)
    return min(float(limit), level + max(0.0, now_ms - last_ms) * limit / WINDOW_MS)


@dataclass(slots=True)
class _Bucket:
    level: float
    at_ms: float


class LocalBuckets:
    """The limits in this process: MemoryStore's, and RedisStore's while Redis is unreachable (then each
    replica enforces them alone)."""

    def __init__(self) -> None:
        self._req: dict[str, _Bucket] = {}
        self._tok: dict[str, _Bucket] = {}
        self._running: dict[str, set[str]] = {}   # tenant -> request ids holding a reservation

    def charge(self, t: Ticket, now_ms: float) -> None:
        """Take the ticket's request and tokens, or raise RateLimited (nothing taken)."""
        lim = t.limits
        run = self._running.get(t.tenant_id)
        if lim.max_concurrency is not None and run is not None and len(run) >= lim.max_concurrency:
            raise refused(t, "concurrency", 1000, self._level(self._req, t.tenant_id, lim.rpm, now_ms),
                          self._level(self._tok, t.tenant_id, lim.tpm, now_ms))
        r = self._level(self._req, t.tenant_id, lim.rpm, now_ms)
        k = self._level(self._tok, t.tenant_id, lim.tpm, now_ms)
        if lim.tpm is not None and t.cost > lim.tpm:
            raise refused(t, "too_large", 0, r, k)
        wait, why = 0.0, ""
        if lim.rpm is not None and r < 1:
            wait, why = (1 - r) * WINDOW_MS / lim.rpm, "requests"
        if lim.tpm is not None and k < t.cost:
            w = (t.cost - k) * WINDOW_MS / lim.tpm
            if w > wait:
                wait, why = w, "tokens"
        if why:
            raise refused(t, why, wait, r, k)
        if lim.rpm is not None:
            self._req[t.tenant_id] = _Bucket(r - 1, now_ms)
        if lim.tpm is not None:
            self._tok[t.tenant_id] = _Bucket(k - t.cost, now_ms)
        t.note(r - 1 if lim.rpm is not None else 0, k - t.cost if lim.tpm is not None else 0)

    def hold(self, t: Ticket) -> None:
        if t.limits.max_concurrency is not None:
            self._running.setdefault(t.tenant_id, set()).add(t.request_id)

    def unhold(self, t: Ticket) -> None:
        run = self._running.get(t.tenant_id)
        if run is not None:
            run.discard(t.request_id)
            if not run:
                del self._running[t.tenant_id]

    def settle(self, tenant_id: str, tpm: int, delta: float, now_ms: float) -> None:
        b = self._tok.get(tenant_id)
        if b is not None:
            self._tok[tenant_id] = _Bucket(min(float(tpm), refill(b.level, b.at_ms, now_ms, tpm) + delta), now_ms)

    @staticmethod
    def _level(buckets: dict[str, _Bucket], tid: str, limit: int | None, now_ms: float) -> float:
        if limit is None:
            return 0.0
        b = buckets.get(tid)
        return refill(b.level if b else None, b.at_ms if b else None, now_ms, limit)


def limits_from(data: dict[str, Any]) -> KeyLimits | None:
    """KeyLimits from an admin API body (rpm, tpm, max_concurrency: positive integers or absent)."""
    vals = {}
    for k in ("rpm", "tpm", "max_concurrency"):
        v = data.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise errors.bad_request(f"`{k}` must be a positive integer or null.", k)
        vals[k] = v
    if all(v is None for v in vals.values()):
        return None
    return KeyLimits(vals["rpm"], vals["tpm"], vals["max_concurrency"])


__all__ = ["KeyLimits", "LocalBuckets", "RateLimited", "Ticket", "format_reset", "limits_from", "ratelimit_headers",
           "refill", "refused"]
