"""Bearer key → tenant, with a short per-process cache.

The cache TTL (``TESSERA_KEY_CACHE_TTL_S``, default 1 s) bounds how long a revoked key keeps working on a
gateway replica; negative results are cached too, so a flood of bad keys costs one Redis call per second.
Malformed keys never reach Redis nor the cache.

Keys in use are re-validated in the background once per TTL, all of them in one pipelined round trip (key
records and the tenants they last belonged to; over the gateway's lean Redis connection), so a request finds
its key fresh instead of paying two Redis round trips whenever its entry has just expired. Only keys that
authenticated are refreshed (a flood of bad keys gets no background work), and only while used within
``REFRESHER_IDLE_S``. The refresh runs on the refreshers' shared grid (``refresher.py``), and a refreshed
entry expires one TTL after the refresh started: the next refresh starts as it expires, and a request that
comes before that refresh's answer waits for it (one round trip at most) rather than reading Redis itself.
A revoked key stops working at the next refresh, within the TTL.

When Redis is unreachable the lookup raises (the gateway answers 503), except in fail-open mode, where a
key this process has seen authenticate keeps its last known tenant: failing open is the operator's
explicit choice to keep serving known tenants through a Redis outage.
"""

from __future__ import annotations

import asyncio
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
        self._refreshing: asyncio.Future[None] | None = None  # the refresh in flight, done when it ends
        self.refresher: UsageRefresher | None = None
        if ttl_s >= MIN_REFRESH_INTERVAL_S:
            self.refresher = UsageRefresher("key cache", self.refresh_active, ttl_s)

    async def tenant_for(self, authorization: str | None) -> Tenant | None:
        key = bearer_key(authorization)
        if key is None or parse_key_id(key) is None:
            return None
        now = time.monotonic()
        entry = self._cache.get(key)
        refreshing = self._refreshing
        if entry is not None and entry.expires_at <= now and refreshing is not None and key in self._active:
            # Expired as the refresh that renews it runs (they fall on the same instant): wait for it.
            await asyncio.shield(refreshing)
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
        """Re-validates every key used within ``REFRESHER_IDLE_S``: one round trip however many."""
        started = time.monotonic()
        for key in [k for k, used_at in self._active.items() if started - used_at >= REFRESHER_IDLE_S]:
            del self._active[key]
        keys = list(self._active)
        if not keys:
            return
        known = {entry.tenant.name for key in keys if (entry := self._cache.get(key)) and entry.tenant}
        self._refreshing = asyncio.get_running_loop().create_future()
        try:
            owners, tenants = await self._store.read_keys(keys, sorted(known))
            for key in keys:
                name = owners[key]
                tenant = tenants.get(name) if name else None
                self._cache[key] = _Entry(tenant, started + self._ttl_s)
                if tenant is None:
                    self._active.pop(key, None)  # revoked or deleted: nothing left to keep fresh
        finally:
            self._refreshing.set_result(None)  # a waiter then finds the entry renewed, or reads it itself
            self._refreshing = None

    async def close(self) -> None:
        if self.refresher is not None:
            await self.refresher.close()
