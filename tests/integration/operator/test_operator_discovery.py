"""The operator's engine discovery endpoint against a real Redis: what replicas heartbeat is what
Prometheus is told to scrape, and a replica that stops heartbeating leaves the targets."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from tessera.registry import EngineRecord, EngineRegistry
from tessera_operators.operator.discovery import discovery_app
from tessera_operators.operator.scrape_targets import SCRAPE_TARGETS_PATH


@pytest.fixture
async def client(redis_client: aioredis.Redis) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(discovery_app(EngineRegistry(redis_client)))) as test_client:
        yield test_client


async def test_live_replicas_are_the_targets(client: TestClient, redis_client: aioredis.Redis) -> None:
    registry = EngineRegistry(redis_client)
    record = EngineRecord(engine_id="engine-1", url="http://10.1.2.3:40001", model="llama", block_size=16,
                          num_gpu_blocks=64, max_model_len=2048)
    await registry.heartbeat(record)
    response = await client.get(SCRAPE_TARGETS_PATH)
    assert response.status == 200
    assert await response.json() == [{"targets": ["10.1.2.3:40001"],
                                      "labels": {"__meta_tessera_engine_id": "engine-1",
                                                 "__meta_tessera_model": "llama"}}]
    await registry.deregister("engine-1")
    assert await (await client.get(SCRAPE_TARGETS_PATH)).json() == []


async def test_an_unreadable_registry_is_a_503_so_prometheus_keeps_its_targets() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    unreachable = aioredis.Redis(port=port, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    async with TestClient(TestServer(discovery_app(EngineRegistry(unreachable)))) as test_client:
        response = await test_client.get(SCRAPE_TARGETS_PATH)
        assert response.status == 503 and "registry unreadable" in (await response.json())["error"]
    await unreachable.aclose()
