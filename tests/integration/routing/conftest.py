"""Two real engines with tiny KV caches, the shared Redis index they feed, and two gateway processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.gateways import GatewayProcess, running_gateways

from tessera.engine.host import EngineHost
from tessera.redis_conn import EmbeddedRedis, connect
from tessera.tenancy.store import TenantStore

from ..platform.conftest import start_host

MODEL = "routing-small"
# 31 usable blocks of 32 tokens (vLLM keeps one null block): two 600-token prompts cannot both stay cached.
ENGINE_OVERRIDES = {
    "served_model_name": MODEL, "num_gpu_blocks_override": 32, "max_model_len": 640, "block_size": 32,
    "enable_prefix_caching": True, "speculative": None, "max_num_seqs": 8,
}


@dataclass
class RoutingStack:
    redis_url: str
    engines: list[EngineHost]
    gateways: list[GatewayProcess]
    api_key: str
    cache_salt: str


def create_tenant(redis_url: str, name: str) -> tuple[str, str]:
    async def run() -> tuple[str, str]:
        redis = connect(redis_url, timeout_s=5.0)
        try:
            store = TenantStore(redis)
            tenant = await store.get_tenant(name) or await store.create_tenant(name)
            return (await store.issue_key(name)).plaintext, tenant.cache_salt
        finally:
            await redis.aclose()

    return asyncio.run(run())


@pytest.fixture(scope="module")
def routing_stack(small_model_dir: Path, redis_server: EmbeddedRedis,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[RoutingStack]:
    engines: list[EngineHost] = []
    try:
        for _ in range(2):
            engines.append(start_host(small_model_dir, redis_server, **ENGINE_OVERRIDES))
        key, salt = create_tenant(redis_server.url, f"routing-{time.monotonic_ns()}")
        # NOTE: a 2 s Redis timeout: on this 2-core machine a gateway beside two engines can stall past the
        # default 250 ms and fail closed (the timeout's own behaviour is tested with the tenancy tests).
        env = {"TESSERA_ROUTING_POLICY": "prefix_affinity", "TESSERA_REDIS_TIMEOUT_S": "2.0"}
        with running_gateways(2, redis_server.url, tmp_path_factory.mktemp("routing-gw"), env) as gateways:
            yield RoutingStack(redis_server.url, engines, gateways, key, salt)
    finally:
        for host in engines:
            host.stop()
