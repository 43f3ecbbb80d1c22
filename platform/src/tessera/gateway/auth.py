"""Bearer key → tenant, with a short per-process cache.

The cache TTL (``TESSERA_KEY_CACHE_TTL_S``, default 1 s) bounds how long a revoked key keeps working on a
gateway replica; negative results are cached too, so a flood of bad keys costs one Redis call per second.
Malformed keys never reach Redis nor the cache.

When Redis is unreachable the lookup raises (the gateway answers 503), except in fail-open mode, where a
key this process has seen authenticate keeps its last known tenant: failing open is the operator's
explicit choice to keep serving known tenants through a Redis outage.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tessera.tenancy.keys import parse_key_id
from tessera.tenancy.store import Tenant, TenantStore

MAX_CACHE_ENTRIES = 100_000


@dataclass(slots=True)
class _Entry:
    tenant: Tenant | None
    expires_at: float


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, or None."""
    if not authorization:
        return None
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return None
    return key


class Authenticator:
    def __init__(self, store: TenantStore, ttl_s: float, fail_open: bool = False,
                 is_transient: Callable[[BaseException], bool] | None = None) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._fail_open = fail_open
        self._is_transient = is_transient or (lambda exc: isinstance(exc, OSError))
        self._cache: dict[str, _Entry] = {}

    async def tenant_for(self, authorization: str | None) -> Tenant | None:
        key = bearer_key(authorization)
        if key is None or parse_key_id(key) is None:
            return None
        now = time.monotonic()
        entry = self._cache.get(key)
        if entry is not None and entry.expires_at > now:
            return entry.tenant
        try:
            tenant_name = await self._store.authenticate(key)
            tenant = await self._store.get_tenant(tenant_name) if tenant_name else None
        except Exception as exc:
            if self._fail_open and self._is_transient(exc) and entry is not None and entry.tenant is not None:
                return entry.tenant
            raise
        if len(self._cache) >= MAX_CACHE_ENTRIES:
            self._cache.clear()
        self._cache[key] = _Entry(tenant, now + self._ttl_s)
        return tenant
