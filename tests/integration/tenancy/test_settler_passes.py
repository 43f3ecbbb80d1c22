"""The settler's timer against a Redis of its own (the open-ticket set is global: the session's shared Redis holds
other tests' tickets): a pass that finds nothing due is one round trip and takes no lock; one that finds a ticket
due bills it."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from tessera.gateway.settler import LOCK_KEY, Settler
from tessera.redis_conn import EmbeddedRedis, connect
from tessera.redis_wire import RedisWire
from tessera.tenancy.admission import Admission, Lease
from tessera.tenancy.policy import TenantPolicy
from tests.support.poll import async_wait_until

POLICY = TenantPolicy(token_budget=100_000, budget_period="day", tokens_per_minute=100_000)


@pytest.fixture
async def clients(own_redis: EmbeddedRedis) -> AsyncIterator[tuple[aioredis.Redis, RedisWire]]:
    redis, wire = connect(own_redis.url), RedisWire(own_redis.url, timeout_s=5.0)
    await redis.flushall()
    yield redis, wire
    await wire.close()
    await redis.aclose()


async def command_calls(redis: aioredis.Redis) -> dict[str, int]:
    stats = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(row["calls"]) for name, row in stats.items()}


@contextlib.asynccontextmanager
async def running(settler: Settler) -> AsyncIterator[None]:
    task = asyncio.create_task(settler.run())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_pass_with_nothing_due_is_one_round_trip_and_takes_no_lock(
        clients: tuple[aioredis.Redis, RedisWire]) -> None:
    redis, wire = clients
    admission = Admission(redis, lease_ttl_s=30.0, wire=wire)
    # An open ticket, not yet due (its lease lives 30 s): the set the probe reads is not empty.
    assert isinstance(await admission.admit(f"t-{uuid.uuid4().hex[:8]}", POLICY, 120, 20, "t/cmpl-1"), Lease)
    await admission.any_due(0.0)  # loads the probe's script (NOSCRIPT's fallback), before the count starts
    await redis.config_resetstat()
    async with running(Settler(redis, admission, interval_s=0.1, grace_s=0.0)):
        await asyncio.sleep(1.0)  # passes 0.05-0.1 s apart: ten or more
    calls = await command_calls(redis)
    passes = calls.get("evalsha", 0)
    assert passes >= 5, calls
    # Each pass was the probe alone (its script reads the clock and the set: counted as commands too): no lock
    # taken or released, no read of its own.
    assert calls.get("set", 0) == calls.get("eval", 0) == 0, calls
    assert calls.get("time") == calls.get("zrangebyscore") == passes, calls
    assert await redis.exists(LOCK_KEY) == 0


async def test_a_due_ticket_is_billed_by_the_running_settler(clients: tuple[aioredis.Redis, RedisWire]) -> None:
    redis, wire = clients
    admission = Admission(redis, lease_ttl_s=0.2, wire=wire)  # its gateway "dies": nothing renews the lease
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    assert isinstance(await admission.admit(tenant, POLICY, 120, 20, f"{tenant}/cmpl-1"), Lease)

    async def billed() -> bool:
        return int((await admission.usage(tenant, "day"))["charged_reservation"]) == 1

    async with running(Settler(redis, admission, interval_s=0.1, grace_s=0.0)):
        await async_wait_until(billed, 10.0, "the settler to bill the dead gateway's request")
    assert not await admission.any_due(0.0)
    assert await redis.exists(LOCK_KEY) == 0  # released after the pass
