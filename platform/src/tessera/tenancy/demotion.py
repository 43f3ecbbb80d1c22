"""Over-quota demotion flags, set by the KV-eviction controller and read by the gateway.

``tessera:demoted:<tenant>`` exists (with a TTL the controller refreshes) while the tenant holds more KV
than its quota on some engine; the gateway then adds ``DEMOTION_STEP`` to its new requests' priority.
The TTL means a dead controller cannot leave a tenant demoted forever.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

_CACHE_S = 0.5
_cache: dict[str, tuple[bool, float]] = {}


def demoted_key(tenant: str) -> str:
    return f"tessera:demoted:{tenant}"


async def set_demoted(redis: aioredis.Redis, tenant: str, reason: str, ttl_s: int) -> None:
    await redis.set(demoted_key(tenant), reason, ex=ttl_s)


async def clear_demoted(redis: aioredis.Redis, tenant: str) -> None:
    await redis.delete(demoted_key(tenant))


async def is_demoted(redis: aioredis.Redis, tenant: str) -> bool:
    """Cached per process for half a second: the flag changes on the controller's cadence, not per request."""
    now = time.monotonic()
    cached = _cache.get(tenant)
    if cached is not None and cached[1] > now:
        return cached[0]
    value = bool(await redis.exists(demoted_key(tenant)))
    _cache[tenant] = (value, now + _CACHE_S)
    return value
