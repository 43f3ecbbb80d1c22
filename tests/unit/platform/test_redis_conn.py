"""The Redis client's pool: a burst larger than the pool queues for a connection instead of failing, and
the wait for a connection is bounded by the client's timeout (then a ConnectionError, which the gateway
answers with 503)."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from tessera.redis_conn import EmbeddedRedis, connect


async def test_a_burst_larger_than_the_pool_waits_for_connections(redis_server: EmbeddedRedis) -> None:
    client = connect(redis_server.url, timeout_s=5.0, pool_size=4)
    try:
        results = await asyncio.gather(*(client.incr("test:redis-conn:burst") for _ in range(200)))
        assert sorted(results)[-1] - sorted(results)[0] == 199  # every command ran, none failed
    finally:
        await client.delete("test:redis-conn:burst")
        await client.aclose()


async def test_waiting_for_a_connection_is_bounded_by_the_timeout(redis_server: EmbeddedRedis) -> None:
    holder = connect(redis_server.url, timeout_s=5.0, pool_size=1)
    try:
        blocked = asyncio.ensure_future(holder.blpop(["test:redis-conn:never"], timeout=2))  # holds the only one
        await asyncio.sleep(0.1)
        holder.connection_pool.timeout = 0.3  # the next command may wait this long for a connection
        started = time.monotonic()
        with pytest.raises(RedisConnectionError):
            await holder.get("test:redis-conn:x")
        assert time.monotonic() - started < 1.5
        await blocked
    finally:
        await holder.aclose()
