"""The precise-routing tests' stack: two real engines with tiny KV caches, the Redis index they feed, and
two gateway processes routing by prefix affinity."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tessera.engine.host import EngineHost
from tessera.redis_conn import connect
from tessera.tenancy.store import TenantStore
from tests.support.gateways import GatewayProcess

MODEL = "routing-small"
# 31 usable blocks of 32 tokens (vLLM keeps one null block): two 600-token prompts cannot both stay cached.
ENGINE_OVERRIDES = {
    "served_model_name": MODEL, "num_gpu_blocks_override": 32, "max_model_len": 640, "block_size": 32,
    "enable_prefix_caching": True, "speculative": None, "max_num_seqs": 8,
}

# The gateways' registry max age in the routing stack (TESSERA_REGISTRY_MAX_AGE_S), seconds.
REGISTRY_MAX_AGE_S = 0.5


@dataclass
class RoutingStack:
    redis_url: str
    engines: list[EngineHost]
    gateways: list[GatewayProcess]
    api_key: str
    cache_salt: str


def issue_tenant_key(redis_url: str, name: str) -> tuple[str, str]:
    """(a new key, the tenant's cache salt) for tenant ``name``, created in the store when missing."""
    async def run() -> tuple[str, str]:
        redis = connect(redis_url, timeout_s=5.0)
        try:
            store = TenantStore(redis)
            tenant = await store.get_tenant(name) or await store.create_tenant(name)
            return (await store.issue_key(name)).plaintext, tenant.cache_salt
        finally:
            await redis.aclose()

    return asyncio.run(run())
