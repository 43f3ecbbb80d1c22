"""Over-quota demotion flags, set by the KV-eviction controller and read by the gateway.

``tessera:demoted:<tenant>`` exists (with a TTL the controller refreshes) while the tenant holds more KV
than its quota on some engine; the gateway then adds ``DEMOTION_STEP`` to its new requests' priority.
The TTL means a dead controller cannot leave a tenant demoted forever. The gateway reads the flag in
admission's round trip (``gateway/request/admit.py``, ``Admitter``), so a demotion applies from the next request on.
"""

from __future__ import annotations

import redis.asyncio as aioredis


def demoted_key(tenant: str) -> str:
    return f"tessera:demoted:{tenant}"


async def set_demoted(redis: aioredis.Redis, tenant: str, reason: str, ttl_s: int) -> None:
    await redis.set(demoted_key(tenant), reason, ex=ttl_s)


async def clear_demoted(redis: aioredis.Redis, tenant: str) -> None:
    await redis.delete(demoted_key(tenant))
