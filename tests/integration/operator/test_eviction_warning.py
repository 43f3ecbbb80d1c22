"""The operator says at start when its Redis would evict (a managed Redis often defaults to volatile-lru,
which drops budgets and usage): read from a real server, as the operator reads it."""

from __future__ import annotations

import logging

import pytest
import redis.asyncio as aioredis

from tessera.redis_conn import check_eviction_policy
from tessera_operators.operator._main import _warn_if_redis_evicts


async def test_an_evicting_redis_is_reported_and_a_safe_one_is_not(
    redis_client: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    assert await check_eviction_policy(redis_client) is None, "valkey's default is noeviction"
    await redis_client.config_set("maxmemory-policy", "volatile-lru")
    try:
        problem = await check_eviction_policy(redis_client)
        assert problem is not None and "volatile-lru" in problem
        with caplog.at_level(logging.ERROR):
            await _warn_if_redis_evicts(redis_client)
        assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [problem]
    finally:
        await redis_client.config_set("maxmemory-policy", "noeviction")
