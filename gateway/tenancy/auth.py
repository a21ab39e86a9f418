"""Who is calling: inference keys (tenants), the admin key, the metrics key. The one place keys are checked.

A key is known by the SHA-256 of its text; the gateway keeps only that digest for keys given as
`sha256:<hex>` in the config and for keys made through the admin API (`POST /admin/keys` returns the key
once). Looking a presented key up is one SHA-256 (~0.5 us for a 50-byte key) and a dict lookup: no loop of
comparisons, nothing that takes longer for a nearly right key.

Tenants:
- `auth.keys` from the config (limits: rpm, tpm, max_concurrency; `models` allow-list);
- the top-level `api_keys` (and FLEETGATE_API_KEYS): keys without limits;
- keys made through the admin API, kept in the state store (Redis when configured) as documents
  `apikey:<id>` and read back by every replica each second;
- no key configured at all: the gateway is open and every request is the anonymous tenant.

A tenant's `id` (the first 24 hex digits of the digest) names it in the store: its rate-limit buckets, and
the owner of its files and batches. The name is for people (logs, the admin API).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.config.keys import digest
from gateway.state.outage import quiet_loop, stop_task
from gateway.state.ratelimit import KeyLimits
from gateway.wire import errors

if TYPE_CHECKING:
    from gateway.config import ApiKeyConfig, GatewayConfig
    from gateway.state.base import StateStore

log = logging.getLogger("fleetgate.auth")

KEY_DOC_PREFIX = "apikey:"
SYNC_S = 1.0
SCOPE_TENANT = "fleetgate.tenant"  # ASGI scope key the batch runner sets: the batch owner, already authenticated


@dataclass(frozen=True, slots=True)
class Tenant:
    """The caller of one request: who (id, name), how much (limits), which models (empty: all)."""

    id: str
    name: str
    limits: KeyLimits | None = None
    models: frozenset[str] = frozenset()
    source: str = "config"  # config | api_keys | admin | open

    def may_use(self, model: str) -> bool:
        return not self.models or model in self.models


ANONYMOUS = Tenant("", "anonymous", source="open")


def tenant_id(key_digest: str) -> str:
    return key_digest[:24]


def new_key() -> str:
    return "sk-fg-" + secrets.token_urlsafe(32)


def bearer(value: bytes | str | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header value, or None."""
    if not value:
        return None
    if isinstance(value, str):
        value = value.encode("latin-1", "replace")
    if value[:7].lower() != b"bearer ":
        return None
    token = value[7:].strip()
    return token or None


def _limits(rpm: int | None, tpm: int | None, conc: int | None) -> KeyLimits | None:
    if rpm is None and tpm is None and conc is None:
        return None
    return KeyLimits(rpm, tpm, conc)


def tenant_from_config(k: ApiKeyConfig) -> tuple[str, Tenant]:
    d = digest(k.key)
    tid = tenant_id(d)
    return d, Tenant(tid, k.name or f"key-{tid[:8]}", _limits(k.rpm, k.tpm, k.max_concurrency),
                     frozenset(k.models), "config")


def tenant_doc(d: str, name: str, limits: KeyLimits | None, models: list[str]) -> dict[str, Any]:
    """An admin-made key as stored: the digest, never the key."""
    return {"digest": d, "id": tenant_id(d), "name": name, "models": sorted(models), "created_at": int(time.time()),
            "rpm": limits.rpm if limits else None, "tpm": limits.tpm if limits else None,
            "max_concurrency": limits.max_concurrency if limits else None}


def tenant_from_doc(doc: dict[str, Any]) -> tuple[str, Tenant]:
    d = doc["digest"]
    return d, Tenant(tenant_id(d), doc.get("name") or f"key-{d[:8]}",
                     _limits(doc.get("rpm"), doc.get("tpm"), doc.get("max_concurrency")),
                     frozenset(doc.get("models") or ()), "admin")


def describe(t: Tenant) -> dict[str, Any]:
    lim = t.limits
    return {"id": t.id, "name": t.name, "source": t.source, "models": sorted(t.models),
            "rpm": lim.rpm if lim else None, "tpm": lim.tpm if lim else None,
            "max_concurrency": lim.max_concurrency if lim else None}


class Authenticator:
    """Resolves a presented key to its Tenant; keeps admin-made keys in step with the state store."""

    def __init__(self, config: GatewayConfig, store: StateStore) -> None:
        self.store = store
        self._static: dict[str, Tenant] = {}
        for i, key in enumerate(config.api_keys):
            d = digest(key)
            self._static[d] = Tenant(tenant_id(d), f"api_keys[{i}]", source="api_keys")
        for k in config.auth.keys:
            d, t = tenant_from_config(k)
            self._static[d] = t
        self._dynamic: dict[str, Tenant] = {}
        self._docs: dict[str, dict[str, Any]] = {}  # admin-made keys as stored (re-written after a store wipe)
        admin = config.auth.admin_key
        self._admin = digest(admin) if admin else None
        mkey = config.metrics.key
        self._metrics = digest(mkey) if mkey else None
        self.metrics_auth = config.metrics.auth
        self._task: asyncio.Task | None = None

    # --- inference keys ------------------------------------------------------------------------------
    @property
    def open(self) -> bool:
        """No inference key is configured anywhere: every request is the anonymous tenant."""
        return not self._static and not self._dynamic

    def authenticate(self, auth_header: bytes | str | None) -> Tenant:
        """The tenant of `Authorization: Bearer <key>`; 401 (OpenAI's invalid_api_key) if unknown."""
        if not self._static and not self._dynamic:
            return ANONYMOUS
        token = bearer(auth_header)
        if token is None:
            raise errors.unauthorized("Missing API key: send `Authorization: Bearer <key>`.")
        d = hashlib.sha256(token).hexdigest()
        t = self._static.get(d) or self._dynamic.get(d)
        if t is None:
            raise errors.unauthorized("Incorrect API key provided.")
        return t

    def tenant_of_scope(self, scope: dict, auth_header: bytes | None) -> Tenant:
        """The batch runner's requests carry their owner in the scope (they were authenticated at upload)."""
        t = scope.get(SCOPE_TENANT)
        return t if isinstance(t, Tenant) else self.authenticate(auth_header)

    def by_id(self, tid: str) -> Tenant | None:
        if not tid:
            return ANONYMOUS
        for t in (*self._static.values(), *self._dynamic.values()):
            if t.id == tid:
                return t
        return None

    def all(self) -> list[Tenant]:
        return sorted((*self._static.values(), *self._dynamic.values()), key=lambda t: (t.source, t.name))

    # --- admin and metrics keys ----------------------------------------------------------------------
    @property
    def admin_enabled(self) -> bool:
        return self._admin is not None

    def check_admin(self, auth_header: str | None) -> None:
        """404 while the admin API is off (no admin key), 401 for anything but the admin key."""
        if self._admin is None:
            raise errors.GatewayError(404, "The admin API is off: set auth.admin_key (or FLEETGATE_ADMIN_KEY).",
                                      "not_found_error", None, "admin_disabled")
        if not self._matches(auth_header, self._admin):
            raise errors.unauthorized("The admin API needs `Authorization: Bearer <admin key>`.")

    def is_admin(self, auth_header: str | None) -> bool:
        """The header carries the admin key (False while the admin API is off)."""
        return self._admin is not None and self._matches(auth_header, self._admin)

    def check_metrics(self, auth_header: str | None) -> None:
        if not self.metrics_auth:
            return
        if not any(self._matches(auth_header, d) for d in (self._metrics, self._admin) if d is not None):
            raise errors.unauthorized("/metrics needs `Authorization: Bearer <metrics key>`.")

    @staticmethod
    def _matches(auth_header: str | None, want: str) -> bool:
        token = bearer(auth_header)
        return token is not None and hmac.compare_digest(hashlib.sha256(token).hexdigest(), want)

    # --- admin-made keys ---------------------------------------------------------------------------------
    async def create(self, name: str, limits: KeyLimits | None, models: list[str], key: str | None = None
                     ) -> tuple[str | None, Tenant]:
        """Store a new key; returns (the key if generated here, its tenant). 409 if the key exists."""
        made = key is None
        key = key or new_key()
        d = digest(key)
        if d in self._static or d in self._dynamic:
            raise errors.GatewayError(409, "That key exists already.", "invalid_request_error", "key", "key_exists")
        doc = tenant_doc(d, name, limits, models)
        await self.store.put_doc(KEY_DOC_PREFIX + doc["id"], doc)
        _, t = tenant_from_doc(doc)
        self._dynamic[d] = t
        self._docs[doc["id"]] = doc
        return (key if made else None), t

    async def delete(self, tid: str) -> bool:
        doc = self._docs.pop(tid, None)
        if doc is None:
            return False
        self._dynamic.pop(doc["digest"], None)
        await self.store.delete_doc(KEY_DOC_PREFIX + tid)
        return True

    async def sync(self) -> None:
        """Adopt the store's admin-made keys; an empty answer after a store wipe re-writes ours instead."""
        docs = await self.store.get_docs(KEY_DOC_PREFIX)
        fresh = {d["id"]: d for d in docs.values() if isinstance(d, dict) and "digest" in d}
        self._docs = fresh
        self._dynamic = dict(tenant_from_doc(d) for d in fresh.values())

    async def republish(self) -> None:
        """The store came back empty: write the admin-made keys this replica knows."""
        for tid, doc in list(self._docs.items()):
            await self.store.put_doc(KEY_DOC_PREFIX + tid, doc)

    async def start(self) -> None:
        with contextlib.suppress(Exception):  # a store that cannot answer now: the loop retries
            await self.sync()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="fg-auth-sync")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)

    async def _loop(self) -> None:
        await quiet_loop(SYNC_S, self.sync, log, "API key sync")


def tenant_of_request(request: Any) -> Tenant:
    """The key check of the plain routes (model cards, passthrough, status page): the caller's tenant from a
    Starlette request's Authorization header; 401 when keys are set and the header names none of them."""
    return request.app.state.gateway.auth.authenticate(request.headers.get("authorization"))
