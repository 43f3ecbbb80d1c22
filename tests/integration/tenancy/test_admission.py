"""Admission's Lua scripts on a real Redis: the invariants documented in tenancy/admission.py, exactly.

Many concurrent callers on separate connection pools stand in for many gateway processes here; the
through-two-gateways versions are in test_limits_under_load.py.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from tessera.redis_conn import connect
from tessera.tenancy.admission import Admission, Lease, Rejection, leases_key
from tessera.tenancy.policy import TenantPolicy
from tests.support.valkey import RestartableRedis


def tenant_name() -> str:
    return f"adm-{uuid.uuid4().hex[:10]}"


async def admit_concurrently(redis_url: str, tenant: str, policy: TenantPolicy, reserve: int, num: int,
                             num_pools: int = 4, lease_ttl_s: float = 30.0) -> list[Lease | Rejection]:
    clients = [connect(redis_url, timeout_s=5.0) for _ in range(num_pools)]
    try:
        admissions = [Admission(c, lease_ttl_s) for c in clients]
        return list(await asyncio.gather(*(admissions[i % num_pools].admit(tenant, policy, reserve)
                                           for i in range(num))))
    finally:
        for client in clients:
            await client.aclose()


async def assert_every_key_has_a_ttl(redis: aioredis.Redis, tenant: str) -> None:
    keys = [k async for k in redis.scan_iter(match=f"tessera:*{tenant}*")]
    assert keys, "the scripts wrote no keys"
    for key in keys:
        assert await redis.ttl(key) > 0, f"{key!r} has no TTL"


async def test_requests_per_minute_is_exact_under_concurrency(tenancy_redis: RestartableRedis,
                                                              redis_client: aioredis.Redis) -> None:
    tenant = tenant_name()
    results = await admit_concurrently(tenancy_redis.url, tenant, TenantPolicy(requests_per_minute=50), 10, 200)
    admitted = [r for r in results if isinstance(r, Lease)]
    rejected = [r for r in results if isinstance(r, Rejection)]
    assert len(admitted) == 50 and len(rejected) == 150
    assert {r.limit for r in rejected} == {"requests_per_minute"}
    assert all(1 <= r.retry_after_s <= 60 and r.maximum == 50 for r in rejected)
    assert await redis_client.zcard(f"tessera:rl:{tenant}:rpm") == 50
    await assert_every_key_has_a_ttl(redis_client, tenant)


async def test_concurrency_leases_are_exact_and_freed_by_finish(tenancy_redis: RestartableRedis) -> None:
    tenant, policy = tenant_name(), TenantPolicy(max_concurrent_requests=4)
    results = await admit_concurrently(tenancy_redis.url, tenant, policy, 10, 50)
    leases = [r for r in results if isinstance(r, Lease)]
    assert len(leases) == 4
    assert {r.limit for r in results if isinstance(r, Rejection)} == {"max_concurrent_requests"}
    redis = connect(tenancy_redis.url, timeout_s=5.0)
    try:
        admission = Admission(redis)
        assert await admission.in_flight(tenant) == 4
        assert isinstance(await admission.admit(tenant, policy, 10), Rejection)
        assert await admission.finish(leases[0], 5, 5)
        assert await admission.in_flight(tenant) == 3
        assert isinstance(await admission.admit(tenant, policy, 10), Lease)
        assert isinstance(await admission.admit(tenant, policy, 10), Rejection)
    finally:
        await redis.aclose()


async def test_a_lease_that_is_not_renewed_expires(tenancy_redis: RestartableRedis) -> None:
    tenant, policy = tenant_name(), TenantPolicy(max_concurrent_requests=1)
    redis = connect(tenancy_redis.url, timeout_s=5.0)
    try:
        admission = Admission(redis, lease_ttl_s=0.5)
        held = await admission.admit(tenant, policy, 1)
        assert isinstance(held, Lease)
        assert isinstance(await admission.admit(tenant, policy, 1), Rejection)
        await asyncio.sleep(0.7)
        assert isinstance(await admission.admit(tenant, policy, 1), Lease)
        assert not await admission.renew(held), "an expired, pruned lease must not come back"
    finally:
        await redis.aclose()


async def test_renewal_keeps_a_lease_past_its_ttl(tenancy_redis: RestartableRedis) -> None:
    tenant, policy = tenant_name(), TenantPolicy(max_concurrent_requests=1)
    redis = connect(tenancy_redis.url, timeout_s=5.0)
    try:
        admission = Admission(redis, lease_ttl_s=0.6)
        held = await admission.admit(tenant, policy, 1)
        assert isinstance(held, Lease)
        for _ in range(6):  # 1.2 s, twice the TTL
            await asyncio.sleep(0.2)
            assert await admission.renew(held)
        assert isinstance(await admission.admit(tenant, policy, 1), Rejection)
        assert await admission.finish(held, 1, 0)
        assert not await admission.renew(held)
        assert isinstance(await admission.admit(tenant, policy, 1), Lease)
    finally:
        await redis.aclose()


async def test_tokens_per_minute_reserves_then_reconciles(tenancy_redis: RestartableRedis,
                                                          redis_client: aioredis.Redis) -> None:
    tenant, policy = tenant_name(), TenantPolicy(tokens_per_minute=1000)
    results = await admit_concurrently(tenancy_redis.url, tenant, policy, 300, 20)
    leases = [r for r in results if isinstance(r, Lease)]
    assert len(leases) == 3  # 3 x 300 <= 1000 < 4 x 300
    admission = Admission(redis_client)
    # Actual usage 100 instead of 300 returns 200 tokens: 300 + 300 + 100 + 300 = 1000 fits exactly.
    assert await admission.finish(leases[0], 40, 60)
    assert int(await redis_client.hget(f"tessera:rl:{tenant}:tpm-tokens", "_total")) == 700
    assert isinstance(await admission.admit(tenant, policy, 300), Lease)
    rejected = await admission.admit(tenant, policy, 1)
    assert isinstance(rejected, Rejection) and rejected.limit == "tokens_per_minute"
    await assert_every_key_has_a_ttl(redis_client, tenant)


async def test_a_request_larger_than_the_tpm_limit_is_told_so(redis_client: aioredis.Redis) -> None:
    rejected = await Admission(redis_client).admit(tenant_name(), TenantPolicy(tokens_per_minute=100), 101)
    assert isinstance(rejected, Rejection)
    assert (rejected.limit, rejected.current, rejected.maximum) == ("tokens_per_minute", 101, 100)
    assert "lower max_tokens" in rejected.message


async def test_a_failed_request_releases_its_reservation(redis_client: aioredis.Redis) -> None:
    tenant, policy = tenant_name(), TenantPolicy(tokens_per_minute=500, token_budget=500)
    admission = Admission(redis_client)
    lease = await admission.admit(tenant, policy, 500)
    assert isinstance(lease, Lease)
    assert isinstance(await admission.admit(tenant, policy, 1), Rejection)
    assert await admission.finish(lease, 0, 0)  # the engine never ran it
    assert isinstance(await admission.admit(tenant, policy, 500), Lease)


async def test_budget_holds_under_twenty_concurrent_requests(tenancy_redis: RestartableRedis,
                                                             redis_client: aioredis.Redis) -> None:
    tenant, policy = tenant_name(), TenantPolicy(token_budget=1000, budget_period="day")
    results = await admit_concurrently(tenancy_redis.url, tenant, policy, 150, 20)
    leases = [r for r in results if isinstance(r, Lease)]
    assert len(leases) == 6  # 6 x 150 <= 1000 < 7 x 150
    budget_keys = [k async for k in redis_client.scan_iter(match=f"tessera:rl:{tenant}:budget:*")]
    assert len(budget_keys) == 1
    assert int(await redis_client.get(budget_keys[0])) == 900
    assert 0 < await redis_client.ttl(budget_keys[0]) <= 86400
    admission = Admission(redis_client)
    for lease in leases:
        assert await admission.finish(lease, 50, 50)  # each used 100 of its 150
    assert int(await redis_client.get(budget_keys[0])) == 600
    rejection = next(r for r in results if isinstance(r, Rejection))
    assert rejection.limit == "token_budget" and rejection.retry_after_s > 0


async def test_finish_counts_once_however_often_it_is_retried(redis_client: aioredis.Redis) -> None:
    tenant, policy = tenant_name(), TenantPolicy(tokens_per_minute=10_000, max_concurrent_requests=2)
    admission = Admission(redis_client)
    lease = await admission.admit(tenant, policy, 100)
    assert isinstance(lease, Lease)
    assert await admission.finish(lease, 30, 20)
    assert not await admission.finish(lease, 30, 20)
    assert not await admission.finish(lease, 30, 70)
    for period in ("hour", "day", "month"):
        usage = await admission.usage(tenant, period)
        assert (usage["requests"], usage["prompt_tokens"], usage["completion_tokens"]) == (1, 30, 20), period
        assert usage["total_tokens"] == 50
    assert int(await redis_client.hget(f"tessera:rl:{tenant}:tpm-tokens", "_total")) == 50
    await assert_every_key_has_a_ttl(redis_client, tenant)


@pytest.mark.adversarial
async def test_the_charge_never_exceeds_the_reservation(redis_client: aioredis.Redis) -> None:
    tenant, policy = tenant_name(), TenantPolicy(token_budget=1000, budget_period="day", tokens_per_minute=10_000)
    admission = Admission(redis_client)
    lease = await admission.admit(tenant, policy, 100)  # prompt 10 + max_tokens 90
    assert isinstance(lease, Lease)
    assert await admission.finish(lease, 10, 180)  # a fault upstream reported twice what could be made
    usage = await admission.usage(tenant, "day")
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (10, 90)
    budget_key = next(k for k in lease.keys if ":budget:" in k)
    assert int(await redis_client.get(budget_key)) == 100
    assert int(await redis_client.hget(f"tessera:rl:{tenant}:tpm-tokens", "_total")) == 100


async def test_every_key_written_has_a_ttl_after_admit_renew_and_finish(redis_client: aioredis.Redis) -> None:
    tenant = tenant_name()
    policy = TenantPolicy(requests_per_minute=10, tokens_per_minute=10_000, max_concurrent_requests=3,
                          token_budget=100_000, budget_period="hour")
    admission = Admission(redis_client, lease_ttl_s=2.5)
    lease = await admission.admit(tenant, policy, 100)
    assert isinstance(lease, Lease)
    await assert_every_key_has_a_ttl(redis_client, tenant)
    assert await admission.renew(lease)
    assert 0 < await redis_client.ttl(leases_key(tenant)) <= 4
    await admission.finish(lease, 10, 10)
    await assert_every_key_has_a_ttl(redis_client, tenant)
