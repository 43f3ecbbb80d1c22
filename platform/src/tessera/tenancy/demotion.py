"""Over-quota demotion flags, set by the KV-eviction controller and read by the gateway.

``tessera:demoted:<tenant>`` exists (with a TTL the controller refreshes) while the tenant holds more KV
than its quota on some engine; the gateway then adds ``DEMOTION_STEP`` to its new requests' priority.
The TTL means a dead controller cannot leave a tenant demoted forever. The gateway reads the flag in
admission's round trip (``gateway/request/admit.py``, ``Admitter``), so a demotion applies from the next request on.

With the engines shared among several controller processes (``kvcontrol_shards``), each shard has a flag of
its own (shard 0 keeps the unsuffixed key): a shard clears only what it set, so one shard's restore never
lifts another's demotion, and the gateway's one ``EXISTS`` over every shard's key says whether any demotes.
"""

from __future__ import annotations

import redis.asyncio as aioredis


def demoted_key(tenant: str, shard: int = 0) -> str:
    return f"tessera:demoted:{tenant}" if shard == 0 else f"tessera:demoted:{tenant}:{shard}"


def demoted_keys(tenant: str, num_shards: int) -> list[str]:
    """Every shard's flag of ``tenant``: ``EXISTS`` over them counts the shards that demote it."""
    return [demoted_key(tenant, shard) for shard in range(num_shards)]


async def set_demoted(redis: aioredis.Redis, tenant: str, reason: str, ttl_s: int, shard: int = 0) -> None:
    await redis.set(demoted_key(tenant, shard), reason, ex=ttl_s)


async def clear_demoted(redis: aioredis.Redis, tenant: str, shard: int = 0) -> None:
    await redis.delete(demoted_key(tenant, shard))
