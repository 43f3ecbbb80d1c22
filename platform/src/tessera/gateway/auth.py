"""Bearer key → tenant, with a short per-process cache.

The cache TTL (``TESSERA_KEY_CACHE_TTL_S``, default 1 s) bounds how long a revoked key keeps working on a
gateway replica; negative results are cached too, so a flood of bad keys costs one Redis call per second.
Malformed keys never reach Redis nor the cache.

Keys in use are re-validated in the background every half TTL, all of them in two pipelined round trips
(key records, then their tenants), so a request finds its key fresh instead of paying two Redis round trips
whenever its entry has just expired. Only keys that authenticated are refreshed (a flood of bad keys gets no
background work), and only while used within ``REFRESHER_IDLE_S``. A revoked key stops working at the next
refresh, within half the TTL.

When Redis is unreachable the lookup raises (the gateway answers 503), except in fail-open mode, where a
key this process has seen authenticate keeps its last known tenant: failing open is the operator's
explicit choice to keep serving known tenants through a Redis outage.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tessera.refresher import REFRESHER_IDLE_S, UsageRefresher
from tessera.tenancy.keys import parse_key_id
from tessera.tenancy.store import Tenant, TenantStore

MAX_CACHE_ENTRIES = 100_000
# A TTL this short leaves nothing to refresh ahead of (0 disables the cache, as tests do).
MIN_REFRESH_INTERVAL_S = 0.05


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
        # key -> when a request last used it; only keys that authenticated.
        self._active: dict[str, float] = {}
        self.refresher: UsageRefresher | None = None
        if ttl_s / 2 >= MIN_REFRESH_INTERVAL_S:
            self.refresher = UsageRefresher("key cache", self.refresh_active, ttl_s / 2)

    async def tenant_for(self, authorization: str | None) -> Tenant | None:
        key = bearer_key(authorization)
        if key is None or parse_key_id(key) is None:
            return None
        now = time.monotonic()
        entry = self._cache.get(key)
        if entry is not None and entry.expires_at > now:
            if entry.tenant is not None:
                self._mark_used(key, now)
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
            self._active.clear()
        self._cache[key] = _Entry(tenant, now + self._ttl_s)
        if tenant is not None:
            self._mark_used(key, now)
        return tenant

    def _mark_used(self, key: str, now: float) -> None:
        if self.refresher is not None:
            self._active[key] = now
            self.refresher.used()

    async def refresh_active(self) -> None:
        """Re-validates every key used within ``REFRESHER_IDLE_S``: two round trips however many."""
        started = time.monotonic()
        for key in [k for k, used_at in self._active.items() if started - used_at >= REFRESHER_IDLE_S]:
            del self._active[key]
        keys = list(self._active)
        if not keys:
            return
        owners = await self._store.authenticate_many(keys)
        tenants = await self._store.get_tenants(sorted({name for name in owners.values() if name}))
        for key in keys:
            name = owners[key]
            tenant = tenants.get(name) if name else None
            self._cache[key] = _Entry(tenant, started + self._ttl_s)
            if tenant is None:
                self._active.pop(key, None)  # revoked or deleted: nothing left to keep fresh

    async def close(self) -> None:
        if self.refresher is not None:
            await self.refresher.close()
