"""Bearer key → tenant, with a short per-process cache.

The cache TTL (``TESSERA_KEY_CACHE_TTL_S``, default 1 s) bounds how long a revoked key keeps working on a
gateway replica; negative results are cached too, so a flood of bad keys costs one Redis call per second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tessera.tenancy.store import Tenant, TenantStore

TENANT_CACHE_TTL_S = 1.0
MAX_CACHE_ENTRIES = 100_000


@dataclass(slots=True)
class _Entry:
    tenant: Tenant | None
    expires_at: float


class Authenticator:
    def __init__(self, store: TenantStore, ttl_s: float) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._cache: dict[str, _Entry] = {}

    async def tenant_for(self, authorization: str | None) -> Tenant | None:
        if not authorization or not authorization.startswith("Bearer "):
            return None
        key = authorization[7:].strip()
        now = time.monotonic()
        entry = self._cache.get(key)
        if entry is not None and entry.expires_at > now:
            return entry.tenant
        tenant_name = await self._store.authenticate(key)
        tenant = await self._store.get_tenant(tenant_name) if tenant_name else None
        if len(self._cache) >= MAX_CACHE_ENTRIES:
            self._cache.clear()
        self._cache[key] = _Entry(tenant, now + self._ttl_s)
        return tenant
