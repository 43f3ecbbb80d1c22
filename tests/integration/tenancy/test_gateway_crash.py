"""A gateway SIGKILLed mid-request leaks nothing: every limiter key keeps a TTL and the tenant's
concurrency returns within the lease TTL. A live gateway renews the leases of its long streams."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from support.gateways import GatewayProcess, start_gateways

from tessera.engine.host import EngineHost
from tessera.tenancy.admission import Admission

from .conftest import GATEWAY_ENV, LEASE_TTL_S, RestartableRedis, completion_body, create_tenant, error_of

# Sampled (not greedy): n-gram speculation cannot shortcut it, so 4000 tokens take seconds on a CPU.
LONG_STREAM = completion_body(max_tokens=4000, prompt=list(range(200, 220)), stream=True, ignore_eos=True,
                              temperature=1.0)


@pytest.fixture
def doomed_gateway(tenancy_redis: RestartableRedis, tenancy_engine: EngineHost,
                   tmp_path: Path) -> Iterator[GatewayProcess]:
    (gateway,) = start_gateways(1, tenancy_redis.url, tmp_path, GATEWAY_ENV)
    yield gateway
    gateway.stop()


async def assert_every_limiter_key_has_a_ttl(redis: aioredis.Redis) -> int:
    keys = [k async for k in redis.scan_iter(match="tessera:rl:*", count=1000)]
    keys += [k async for k in redis.scan_iter(match="tessera:usage:*", count=1000)]
    without = [(k, await redis.ttl(k)) for k in keys]
    without = [(k, ttl) for k, ttl in without if ttl <= 0 and ttl != -2]  # -2: expired meanwhile
    assert not without, f"keys without a TTL: {without}"
    return len(keys)


async def test_sigkilled_gateway_leaks_no_concurrency(doomed_gateway: GatewayProcess,
                                                      gateways: list[GatewayProcess], tenancy_engine: EngineHost,
                                                      redis_client: aioredis.Redis) -> None:
    tenant = create_tenant(gateways[0], {"maxConcurrentRequests": 1})
    survivor = gateways[1]
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", f"{doomed_gateway.url}/v1/completions", json=LONG_STREAM,
                                 headers=tenant.headers) as stream:
            assert stream.status_code == 200
            chunks = stream.aiter_bytes()
            await chunks.__anext__()
            held = await client.post(f"{survivor.url}/v1/completions", json=completion_body(),
                                     headers=tenant.headers)
            assert held.status_code == 429 and error_of(held)["code"] == "max_concurrent_requests", held.text
            doomed_gateway.kill()
            killed_at = time.monotonic()
        assert await assert_every_limiter_key_has_a_ttl(redis_client) > 0
        assert await Admission(redis_client).in_flight(tenant.name) == 1  # the dead gateway's lease, still live

        while True:
            response = await client.post(f"{survivor.url}/v1/completions", json=completion_body(),
                                         headers=tenant.headers)
            if response.status_code == 200:
                break
            assert response.status_code == 429, response.text
            assert time.monotonic() - killed_at < LEASE_TTL_S + 2.0, "the dead gateway's lease did not expire"
            await asyncio.sleep(0.1)
        recovered_s = time.monotonic() - killed_at
        # The lease was renewed at most LEASE_TTL_S / 3 before the kill, so it ends within LEASE_TTL_S.
        assert recovered_s <= LEASE_TTL_S + 0.5, recovered_s

        # The engine noticed the dropped connection and aborted the orphaned request.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            running = (await client.get(f"{tenancy_engine.url}/requests")).json()
            if not any(r["tenant"] == tenant.name for r in running):
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the engine kept generating for a dead gateway")
    await assert_every_limiter_key_has_a_ttl(redis_client)


async def test_a_long_stream_keeps_its_lease_past_the_ttl(gateways: list[GatewayProcess],
                                                          redis_client: aioredis.Redis) -> None:
    tenant = create_tenant(gateways[0], {"maxConcurrentRequests": 1})
    probes: list[int] = []
    async with httpx.AsyncClient(timeout=120) as client:
        started = time.monotonic()
        async with client.stream("POST", f"{gateways[0].url}/v1/completions", json=LONG_STREAM,
                                 headers=tenant.headers) as stream:
            assert stream.status_code == 200
            async for _ in stream.aiter_bytes():
                if time.monotonic() - started > 2.5 * LEASE_TTL_S:
                    break
                if len(probes) < (time.monotonic() - started) / 0.5:
                    probe = await client.post(f"{gateways[1].url}/v1/completions", json=completion_body(),
                                              headers=tenant.headers)
                    probes.append(probe.status_code)
                    print("PROBE", probe.status_code, probe.text[:300])
            streamed_s = time.monotonic() - started
    assert streamed_s > 2 * LEASE_TTL_S, f"the stream ended after {streamed_s:.1f} s: too short to test renewal"
    assert probes and set(probes) == {429}, (probes, gateways[1].log_tail(3000))
    # The client left: the lease is freed (not left to expire).
    deadline = time.monotonic() + 2
    while await Admission(redis_client).in_flight(tenant.name) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert await Admission(redis_client).in_flight(tenant.name) == 0
