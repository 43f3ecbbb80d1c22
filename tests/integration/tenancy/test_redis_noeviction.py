"""At maxmemory, the chart's Redis refuses writes and evicts nothing (issue #16, ``maxmemory-policy
noeviction``): a prefix index that filled the server costs new writes an OOM error, never a tenant, a key
hash, a budget or usage; a finish refused that way waits in the billing queue, over redis-py and over the
gateway's lean wire alike, and is recorded once memory is freed. A real valkey-server with the chart's
flags; the real index, tenancy and billing code fill and read it.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tessera.redis_conn import EmbeddedRedis, check_eviction_policy, connect
from tessera.redis_wire import RedisWire
from tessera.routing.prefix_index import PrefixIndex
from tessera.tenancy.admission import Admission, Lease
from tessera.tenancy.billing import FinishQueue
from tessera.tenancy.policy import TenantPolicy
from tessera.tenancy.store import TenantStore

# Room above what the server already uses: enough for the tenants, small enough to fill in a moment.
HEADROOM_BYTES = 2 * 1024 * 1024
BATCH_BLOCKS = 500
POLICY = TenantPolicy(token_budget=1_000_000, budget_period="day")


def _is_store_error(exc: BaseException) -> bool:
    """The gateway's classification (gateway/errors.py STORE_ERRORS): Redis did not answer."""
    return isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError)


@pytest.fixture
async def server() -> AsyncIterator[EmbeddedRedis]:
    with EmbeddedRedis() as embedded:
        yield embedded


@pytest.fixture
async def client(server: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    redis = connect(server.url, timeout_s=5.0)
    used = int((await redis.info("memory"))["used_memory"])
    # The chart's flags (templates/redis.yaml): a ceiling, and noeviction at it.
    await redis.config_set("maxmemory", str(used + HEADROOM_BYTES))
    await redis.config_set("maxmemory-policy", "noeviction")
    yield redis
    await redis.aclose()


async def _fill(redis: aioredis.Redis) -> int:
    """An engine's index feed fills the server; then the server is pinned just over its ceiling (the fill
    stops within a batch of it, where freed buffers can take it under again). Returns the ceiling it had."""
    ceiling = int((await redis.config_get("maxmemory"))["maxmemory"])
    index, rng = PrefixIndex(redis), random.Random(0)
    with pytest.raises(OutOfMemoryError):
        for _ in range(10_000):
            await index.apply("engine-a", [("store", rng.getrandbits(63)) for _ in range(BATCH_BLOCKS)])
    used = int((await redis.info("memory"))["used_memory"])
    await redis.config_set("maxmemory", str(used - 64 * 1024))
    return ceiling


@pytest.mark.parametrize("over_wire", [False, True], ids=["redis-py", "lean-wire"])
async def test_a_full_redis_refuses_writes_keeps_every_tenant_and_billing_waits(
        server: EmbeddedRedis, client: aioredis.Redis, over_wire: bool) -> None:
    assert await check_eviction_policy(client) is None
    store = TenantStore(client)
    wire = RedisWire(server.url, timeout_s=5.0) if over_wire else None
    admission = Admission(client, wire=wire)
    keys = {}
    for i in range(20):
        await store.create_tenant(f"t{i}", POLICY)
        keys[f"t{i}"] = (await store.issue_key(f"t{i}")).plaintext
    leases = [await admission.admit("t0", POLICY, 100) for _ in range(2)]
    assert all(isinstance(lease, Lease) for lease in leases)
    queue = FinishQueue(admission, _is_store_error)
    await queue.finish(leases[0], 40, 60)  # type: ignore[arg-type]

    await _fill(client)

    # A write is refused, loudly, and leaves nothing behind...
    with pytest.raises(OutOfMemoryError):
        await store.create_tenant("late", POLICY)
    assert await store.get_tenant("late") is None
    # ...nothing was evicted: every tenant, key hash and usage record reads back...
    for name, key in keys.items():
        assert await store.authenticate(key) == name
    assert (await admission.usage("t0", "day"))["total_tokens"] == 100
    assert int((await client.info("stats"))["evicted_keys"]) == 0
    # ...and a finish the full server refuses waits in the billing queue instead of being dropped.
    await queue.finish(leases[1], 30, 20)  # type: ignore[arg-type]
    await queue.read_replies()  # over the lean wire an unhurried finish: its OOM reply read now
    assert queue.num_parked == 1
    await client.config_set("maxmemory", str(1024 ** 3))  # memory freed (or the ceiling raised)
    await queue.close(timeout_s=10.0)
    assert queue.num_parked == 0
    assert (await admission.usage("t0", "day"))["total_tokens"] == 150
    if wire is not None:
        await wire.close()


async def test_without_the_queue_the_refused_finish_is_an_error_not_a_silent_loss(
        client: aioredis.Redis) -> None:
    """What the queue guards against: the finish itself raises (both clients raise the same type)."""
    await TenantStore(client).create_tenant("t", POLICY)
    admission = Admission(client)
    lease = await admission.admit("t", POLICY, 100)
    assert isinstance(lease, Lease)
    await _fill(client)
    with pytest.raises(OutOfMemoryError):
        await admission.finish(lease, 10, 10)
