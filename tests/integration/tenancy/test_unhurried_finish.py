"""The gateway's finish over the lean connection is an unhurried call (tenancy/billing.py, redis_wire.py): Redis
bills it on receipt, ``finish`` returns once it is written, and its reply, read later, parks it when it failed,
so nothing is lost; against a real Redis."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from tessera.gateway.errors import STORE_ERRORS
from tessera.redis_conn import EmbeddedRedis, connect
from tessera.redis_wire import RedisWire
from tessera.tenancy.admission import Admission, Lease
from tessera.tenancy.billing import FinishQueue
from tessera.tenancy.policy import TenantPolicy
from tessera.wake_grid import GRID_S, until_next
from tests.support.poll import async_wait_until

POLICY = TenantPolicy(token_budget=100_000, budget_period="day", tokens_per_minute=100_000)


@pytest.fixture
async def clients(own_redis: EmbeddedRedis) -> AsyncIterator[tuple[aioredis.Redis, RedisWire]]:
    redis, wire = connect(own_redis.url), RedisWire(own_redis.url, timeout_s=5.0)
    yield redis, wire
    await wire.close()
    await redis.aclose()


def is_store_error(exc: BaseException) -> bool:
    return isinstance(exc, STORE_ERRORS)


async def admitted(admission: Admission) -> Lease:
    lease = await admission.admit(f"t-{uuid.uuid4().hex[:8]}", POLICY, 100)
    assert isinstance(lease, Lease)
    return lease


async def warmed_up(redis: aioredis.Redis, wire: RedisWire) -> tuple[Admission, FinishQueue]:
    """An admission and its queue after their first finish, which waits for its reply (it loads the script
    where Redis may not have it); the finishes after it are unhurried."""
    admission = Admission(redis, wire=wire)
    queue = FinishQueue(admission, is_store_error)
    await queue.finish(await admitted(admission), 1, 1)
    assert queue.num_unanswered == 0
    return admission, queue


async def test_a_finish_is_billed_on_receipt_and_returns_before_its_reply(
        clients: tuple[aioredis.Redis, RedisWire]) -> None:
    redis, wire = clients
    admission, queue = await warmed_up(redis, wire)
    lease = await admitted(admission)
    await asyncio.sleep(until_next(GRID_S) + 0.01)  # the next whole second ~1 s away
    await queue.finish(lease, 10, 20)
    assert queue.num_unanswered == 1  # returned with its reply unread: the request ends without waiting for it
    await async_wait_until(lambda: _billed(admission, lease, 30), 2.0, "the finish billed")
    assert await admission.in_flight(lease.tenant) == 0  # its concurrency slot is free already
    await queue.read_replies()
    assert (queue.num_unanswered, queue.num_parked) == (0, 0)


async def test_a_finish_whose_script_redis_lost_is_parked_and_billed_once(
        clients: tuple[aioredis.Redis, RedisWire]) -> None:
    redis, wire = clients
    admission, queue = await warmed_up(redis, wire)
    lease = await admitted(admission)
    await redis.script_flush()  # a restarted Redis: the finish's EVALSHA answers NOSCRIPT, nothing billed
    await queue.finish(lease, 10, 20)
    await queue.read_replies()
    assert queue.num_parked == 1  # the reply said it did not run: sent again (which loads the script)
    await queue.close(timeout_s=5.0)
    assert queue.num_parked == 0
    assert await _total(admission, lease) == 30
    # The NOSCRIPT reply said the script is gone: the next finish waits for its reply again (and loads it).
    await queue.finish(await admitted(admission), 1, 1)
    assert queue.num_unanswered == 0


async def test_a_finish_whose_connection_dies_before_its_reply_is_parked(
        clients: tuple[aioredis.Redis, RedisWire]) -> None:
    redis, wire = clients
    admission, queue = await warmed_up(redis, wire)
    lease = await admitted(admission)
    name = f"wire-{uuid.uuid4().hex}"
    await wire.execute([("CLIENT", "SETNAME", name)])
    await redis.execute_command("CLIENT", "PAUSE", 400, "WRITE")  # the finish waits in Redis, unrun...
    await queue.finish(lease, 10, 20)
    wire_id = next(c["id"] for c in await redis.client_list() if c.get("name") == name)
    await redis.client_kill_filter(_id=wire_id)  # ...when its connection is cut: no reply will come
    await queue.read_replies()
    assert queue.num_parked == 1
    await queue.close(timeout_s=5.0)
    assert queue.num_parked == 0
    assert await _total(admission, lease) == 30  # billed once, by the retry


async def _billed(admission: Admission, lease: Lease, tokens: int) -> bool:
    return await _total(admission, lease) == tokens


async def _total(admission: Admission, lease: Lease) -> int:
    return int((await admission.usage(lease.tenant, "day"))["total_tokens"])
