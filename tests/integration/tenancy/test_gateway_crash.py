"""A gateway SIGKILLed mid-request leaks nothing: every limiter key keeps a TTL and the tenant's
concurrency returns within the lease TTL. A live gateway renews the leases of its long streams."""

from __future__ import annotations

import asyncio
import subprocess
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from tessera.engine.host import EngineHost
from tessera.tenancy.admission import Admission, leases_key
from tests.support.data_plane import ENGINE_AUTH
from tests.support.gateways import GatewayProcess, start_gateways
from tests.support.tenancy import (
    SHORT_LEASE_ENV,
    SHORT_LEASE_TTL_S,
    TenantHandle,
    completion_body,
    create_tenant,
    error_of,
)
from tests.support.valkey import RestartableRedis

# A client that leaves frees its slot within this (the lease TTL, 10 s, would free it anyway).
RELEASE_BOUND_S = 3.0
# Sampled (not greedy): n-gram speculation cannot shortcut it, so 4000 tokens take seconds on a CPU.
LONG_STREAM = completion_body(max_tokens=4000, prompt=list(range(200, 220)), stream=True, ignore_eos=True,
                              temperature=1.0)


@pytest.fixture
def short_lease_gateway(tenancy_redis: RestartableRedis, tenancy_engine: EngineHost,
                        tmp_path: Path) -> Iterator[GatewayProcess]:
    (gateway,) = start_gateways(1, tenancy_redis.url, tmp_path, SHORT_LEASE_ENV)
    yield gateway
    try:
        gateway.stop()
    except subprocess.TimeoutExpired:
        # Seen once while test gateways ran in sessions of their own (starved by the scheduler, see
        # support/gateways.py): even a SIGKILLed process needs CPU time to exit. Reported, not raised.
        warnings.warn(f"gateway {gateway.pid} did not exit within 20 s of SIGTERM + SIGKILL", stacklevel=1)


async def assert_every_limiter_key_has_a_ttl(redis: aioredis.Redis) -> int:
    keys = [k async for k in redis.scan_iter(match="tessera:rl:*", count=1000)]
    keys += [k async for k in redis.scan_iter(match="tessera:usage:*", count=1000)]
    ttls = [(k, await redis.ttl(k)) for k in keys]
    without = [(k, ttl) for k, ttl in ttls if ttl == -1]  # -1: no expiry (-2: expired meanwhile)
    assert not without, f"keys without a TTL: {without}"
    return len(keys)


async def redis_now(redis: aioredis.Redis) -> float:
    seconds, micros = await redis.time()
    return seconds + micros / 1e6


async def engine_requests_of(client: httpx.AsyncClient, engine: EngineHost, tenant: str,
                             within_s: float) -> list[dict[str, Any]]:
    """The tenant's requests still running on the engine, polled until there are none or ``within_s`` passes."""
    deadline = time.monotonic() + within_s
    while True:
        listing = (await client.get(f"{engine.url}/requests", auth=ENGINE_AUTH)).json()
        running = [r for r in listing if r["tenant"] == tenant]
        if not running or time.monotonic() > deadline:
            return running
        await asyncio.sleep(0.1)


async def stream_then_kill(gateway: GatewayProcess, survivor: GatewayProcess, tenant: TenantHandle,
                           redis: aioredis.Redis) -> tuple[float, float] | str:
    """Starts a long stream through ``gateway``, checks that it holds the tenant's only slot, SIGKILLs the
    gateway mid-stream. Returns the kill time (monotonic, Redis), or why the precondition failed."""
    async with httpx.AsyncClient(timeout=60) as client, client.stream(
            "POST", f"{gateway.url}/v1/completions", json=LONG_STREAM, headers=tenant.headers) as stream:
        assert stream.status_code == 200
        # NOTE: keep the iterator referenced: a dropped async generator is finalized, which closes the
        # response, and the gateway (rightly) ends the request and frees the slot.
        chunks = stream.aiter_bytes()
        await chunks.__anext__()
        held = await client.post(f"{survivor.url}/v1/completions", json=completion_body(), headers=tenant.headers)
        if held.status_code != 429 or error_of(held)["code"] != "max_concurrent_requests":
            return f"slot not held at the kill: {held.status_code} {held.text[:200]} {gateway.log_tail(500)!r}"
        gateway.kill()
        killed = time.monotonic(), await redis_now(redis)
        await chunks.aclose()
        return killed


async def test_sigkilled_gateway_leaks_no_concurrency(tenancy_redis: RestartableRedis, gateways: list[GatewayProcess],
                                                      tenancy_engine: EngineHost, redis_client: aioredis.Redis,
                                                      tmp_path: Path) -> None:
    tenant = create_tenant(gateways[0], {"maxConcurrentRequests": 1})
    survivor = gateways[1]
    # NOTE: on this shared, oversubscribed machine a process can stall for seconds: long enough for the
    # stream's lease to lapse before a renewal, or for the survivor's Redis call to time out. Then the
    # scenario's precondition is gone and it starts over (renewal itself is tested below).
    failures: list[str] = []
    for _ in range(3):
        (doomed,) = start_gateways(1, tenancy_redis.url, tmp_path, SHORT_LEASE_ENV)
        try:
            killed = await stream_then_kill(doomed, survivor, tenant, redis_client)
        finally:
            doomed.stop()
        if not isinstance(killed, str):
            break
        failures.append(killed)
        await asyncio.sleep(1.0)  # the stopped gateway released its lease on the way out
    assert not isinstance(killed, str), failures
    killed_at, killed_at_redis = killed

    assert await assert_every_limiter_key_has_a_ttl(redis_client) > 0
    # Exact, in Redis's own clock: the dead gateway's lease ends at most one TTL after the kill.
    leases = await redis_client.zrange(leases_key(tenant.name), 0, -1, withscores=True)
    assert len(leases) == 1, ([k async for k in redis_client.scan_iter(match=f"tessera:rl:{tenant.name}:*")],
                              await redis_client.hgetall(f"tessera:rl:{tenant.name}:tpm-tokens"), failures)
    assert leases[0][1] - killed_at_redis <= SHORT_LEASE_TTL_S

    async with httpx.AsyncClient(timeout=60) as client:
        while True:
            response = await client.post(f"{survivor.url}/v1/completions", json=completion_body(),
                                         headers=tenant.headers)
            # Admitted: served, or (the engine's heartbeat late on this busy machine) admitted and unroutable.
            if response.status_code == 200 or error_of(response)["code"] == "engine_unavailable":
                break
            assert response.status_code == 429, response.text
            assert time.monotonic() - killed_at < SHORT_LEASE_TTL_S + 5.0, "the dead gateway's lease never expired"
            await asyncio.sleep(0.1)
        # Client-side the bound carries this test's own polling and scheduling delays.
        assert time.monotonic() - killed_at <= SHORT_LEASE_TTL_S + 1.5

        # The engine noticed the dropped connection and aborted the orphaned request.
        running = await engine_requests_of(client, tenancy_engine, tenant.name, within_s=10.0)
        assert not running, f"the engine kept generating for a dead gateway: {running}"
    await assert_every_limiter_key_has_a_ttl(redis_client)


async def test_a_long_stream_keeps_its_lease_past_the_ttl(short_lease_gateway: GatewayProcess,
                                                          gateways: list[GatewayProcess], tenancy_engine: EngineHost,
                                                          redis_client: aioredis.Redis) -> None:
    tenant = create_tenant(gateways[0], {"maxConcurrentRequests": 1, "maxTokensCap": 8000})
    admission = Admission(redis_client)
    body = {**LONG_STREAM, "max_tokens": 8000}
    samples: list[tuple[float, int]] = []  # (seconds since start, live leases) while the engine generates

    async def drain(stream: httpx.Response) -> None:
        async for _ in stream.aiter_bytes():
            pass

    async with httpx.AsyncClient(timeout=120) as client:
        started = time.monotonic()
        async with client.stream("POST", f"{short_lease_gateway.url}/v1/completions", json=body,
                                 headers=tenant.headers) as stream:
            assert stream.status_code == 200
            reader = asyncio.ensure_future(drain(stream))
            while time.monotonic() - started < 1.7 * SHORT_LEASE_TTL_S:
                # Leases first, then the engine: a request still generating after the lease read was
                # generating during it (the other order races the stream's end and samples a rightly freed 0).
                leases = await admission.in_flight(tenant.name)
                running = (await client.get(f"{tenancy_engine.url}/requests", auth=ENGINE_AUTH)).json()
                if not any(r["tenant"] == tenant.name for r in running):
                    break  # generation ended: from here on the lease is rightly gone
                samples.append((time.monotonic() - started, leases))
                await asyncio.sleep(0.25)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        # The client left (its response is closed): the gateway releases the lease at once, well inside the
        # TTL that would free it anyway, and the engine stops generating for it.
        left_at = time.monotonic()
        while await admission.in_flight(tenant.name) and time.monotonic() - left_at < RELEASE_BOUND_S:
            await asyncio.sleep(0.05)
        released_after_s = time.monotonic() - left_at
        probe = await client.post(f"{gateways[1].url}/v1/completions", json=completion_body(),
                                  headers=tenant.headers)
        running = await engine_requests_of(client, tenancy_engine, tenant.name, within_s=5.0)
    covered_s = samples[-1][0] if samples else 0.0
    assert covered_s > 1.5 * SHORT_LEASE_TTL_S, f"generation ran {covered_s:.1f} s: too short to test renewal"
    assert {n for _, n in samples} == {1}, ([s for s in samples if s[1] != 1][:3], short_lease_gateway.log_tail(2000))
    assert released_after_s < RELEASE_BOUND_S, (released_after_s, short_lease_gateway.log_tail(2000))
    assert probe.status_code == 200 or error_of(probe)["code"] != "max_concurrent_requests", probe.text
    assert not running, running
