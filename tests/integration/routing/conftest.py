"""Two real engines with tiny KV caches, the shared Redis index they feed, and two gateway processes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera.engine.host import EngineHost
from tessera.redis_conn import EmbeddedRedis
from tests.support.engines import start_host
from tests.support.gateways import running_gateways
from tests.support.routing_stack import ENGINE_OVERRIDES, REGISTRY_MAX_AGE_S, RoutingStack, issue_tenant_key


@pytest.fixture(scope="module")
def routing_stack(small_model_dir: Path, redis_server: EmbeddedRedis,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[RoutingStack]:
    engines: list[EngineHost] = []
    try:
        for _ in range(2):
            engines.append(start_host(small_model_dir, redis_server, **ENGINE_OVERRIDES))
        key, salt = issue_tenant_key(redis_server.url, f"routing-{time.monotonic_ns()}")
        # NOTE: a 2 s Redis timeout: on this 2-core machine a gateway beside two engines can stall past the
        # default 250 ms and fail closed (the timeout's own behaviour is tested with the tenancy tests).
        env = {"TESSERA_ROUTING_POLICY": "prefix_affinity", "TESSERA_REDIS_TIMEOUT_S": "2.0",
               "TESSERA_REGISTRY_REFRESH_S": str(REGISTRY_MAX_AGE_S / 2),
               "TESSERA_REGISTRY_MAX_AGE_S": str(REGISTRY_MAX_AGE_S)}
        with running_gateways(2, redis_server.url, tmp_path_factory.mktemp("routing-gw"), env) as gateways:
            yield RoutingStack(redis_server.url, engines, gateways, key, salt)
    finally:
        for host in engines:
            host.stop()
