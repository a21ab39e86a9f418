"""The one API-key check: `Authorization: Bearer <key>` against the configured keys, in constant time.

Used by the admin API (gateway/admin.py) and meant for every other route that checks keys (the request pipeline,
the Batch API), so the header rules live once.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence


def bearer_key_ok(authorization: bytes | str | None, keys: Sequence[bytes]) -> bool:
    """True when `authorization` is `Bearer <k>` (scheme case-insensitive) for one of `keys`; every key is
    compared, so the time taken does not say which one matched or how much of it."""
    if isinstance(authorization, str):
        authorization = authorization.encode("latin-1", errors="replace")
    if not authorization or authorization[:7].lower() != b"bearer ":
        return False
    given = authorization[7:].strip()
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(key, given)
    return ok


__all__ = ["bearer_key_ok"]
