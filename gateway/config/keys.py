"""API keys as the gateway stores and compares them: SHA-256 digests, never the keys themselves.

The config checks (gateway/config/, a key given twice) and the authenticator (gateway/tenancy/auth.py) share this.
"""

from __future__ import annotations

import hashlib


def digest(key: str | bytes) -> str:
    """SHA-256 hex of a key as presented; a configured `sha256:<hex>` is that digest already."""
    if isinstance(key, str):
        if key.startswith("sha256:"):
            return key[7:].lower()
        key = key.encode()
    return hashlib.sha256(key).hexdigest()
