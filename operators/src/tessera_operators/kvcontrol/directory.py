"""Process-wide state the per-engine loops share: who the tenants are, and who demotes whom."""

from __future__ import annotations

import time
from collections import defaultdict

from tessera.tenancy.store import TenantStore


class TenantDirectory:
    """Cache salts and KV quotas of every tenant, re-read from Redis at most every ``refresh_s``."""

    def __init__(self, store: TenantStore, refresh_s: float = 2.0) -> None:
        self._store = store
        self._refresh_s = refresh_s
        self._read_at = float("-inf")
        self.salt_to_tenant: dict[str, str] = {}
        self.kv_quota: dict[str, float] = {}

    async def refresh(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._read_at < self._refresh_s:
            return
        tenants = await self._store.list_tenants()
        self.salt_to_tenant = {t.cache_salt: t.name for t in tenants if t.policy.prefix_cache_isolation}
        self.kv_quota = {t.name: t.policy.kv_quota for t in tenants}
        self._read_at = time.monotonic()

    def quota_blocks(self, tenant: str, num_gpu_blocks: int) -> int | None:
        """The tenant's block quota on an engine of that size; None for owners that are not tenants."""
        quota = self.kv_quota.get(tenant)
        return None if quota is None else int(quota * num_gpu_blocks)


class DemotionBook:
    """Which engines' loops currently demote each tenant. The demotion flag in Redis is per tenant, so it
    is cleared only when the last engine that demoted the tenant restores it."""

    def __init__(self) -> None:
        self._by_tenant: dict[str, set[str]] = defaultdict(set)

    def demote(self, tenant: str, engine_id: str) -> None:
        self._by_tenant[tenant].add(engine_id)

    def restore(self, tenant: str, engine_id: str) -> bool:
        """Forgets this engine's demotion; True when no engine demotes the tenant any more."""
        engines = self._by_tenant.get(tenant)
        if engines is None:
            return True
        engines.discard(engine_id)
        if not engines:
            del self._by_tenant[tenant]
            return True
        return False

    def engines_demoting(self, tenant: str) -> frozenset[str]:
        return frozenset(self._by_tenant.get(tenant, ()))
