"""Limits through two real gateway processes and a real engine, under bursts of concurrent requests."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import redis.asyncio as aioredis

from tessera.engine.host import EngineHost
from tessera.tenancy.admission import Admission
from tests.support.data_plane import ENGINE_AUTH
from tests.support.gateways import GatewayProcess
from tests.support.tenancy import MODEL, completion_body, create_tenant, error_of, post_all, post_burst

STORE_RETRIES = 5  # 503 store_unavailable answers a client retries (Retry-After) before giving up

PROMPT_IDS = list(range(100, 110))  # exactly 10 prompt tokens


async def test_rpm_admits_exactly_the_limit_across_two_gateways(gateways: list[GatewayProcess]) -> None:
    tenant = create_tenant(gateways[0], {"requestsPerMinute": 50})
    responses, retried = await post_burst([g.url for g in gateways], "/v1/completions", tenant,
                                          [completion_body(max_tokens=1) for _ in range(200)])
    statuses = [r.status_code for r in responses]
    assert 50 - retried <= statuses.count(200) <= 50, (retried, [r.text for r in responses
                                                                 if r.status_code not in (200, 429)][:3])
    assert statuses.count(200) + statuses.count(429) == 200
    for response in responses:
        if response.status_code == 429:
            error = error_of(response)
            assert error["code"] == "requests_per_minute" and error["type"] == "rate_limit_error"
            assert "requests_per_minute" in error["message"]
            assert 1 <= int(response.headers["retry-after"]) <= 60
        else:
            assert response.json()["usage"]["completion_tokens"] == 1


async def test_tpm_reserves_max_tokens_across_two_gateways(gateways: list[GatewayProcess]) -> None:
    # Each request reserves 10 prompt + 90 max_tokens = 100 tokens and (ignore_eos) uses exactly that.
    tenant = create_tenant(gateways[0], {"tokensPerMinute": 1000})
    body = completion_body(max_tokens=90, prompt=PROMPT_IDS, ignore_eos=True)
    responses, retried = await post_burst([g.url for g in gateways], "/v1/completions", tenant, [body] * 200)
    admitted = [r for r in responses if r.status_code == 200]
    assert 10 - retried <= len(admitted) <= 10, retried
    assert all(r.status_code == 429 and error_of(r)["code"] == "tokens_per_minute"
               for r in responses if r.status_code != 200)
    assert sum(r.json()["usage"]["total_tokens"] for r in admitted) == 100 * len(admitted)


async def test_budget_holds_under_twenty_concurrent_requests(gateways: list[GatewayProcess],
                                                             redis_client: aioredis.Redis) -> None:
    # Sampled lengths (EOS may come early): reconciliation returns unused reservation as requests end.
    tenant = create_tenant(gateways[0], {"tokenBudget": 1000, "budgetPeriod": "day"})
    body = completion_body(max_tokens=90, prompt=PROMPT_IDS, temperature=1.0)
    responses = await post_all([g.url for g in gateways], "/v1/completions", tenant, [body] * 20)
    admitted = [r for r in responses if r.status_code == 200]
    assert admitted and all(error_of(r)["code"] == "token_budget" for r in responses if r.status_code != 200), [
        r.text for r in responses if r.status_code != 200]
    used = sum(r.json()["usage"]["total_tokens"] for r in admitted)
    assert used <= 1000, f"budget overshot: {used} tokens of 1000"
    # Each gateway reconciles a request right after its last byte: wait for the counter to settle.
    budget_keys = [k async for k in redis_client.scan_iter(match=f"tessera:rl:{tenant.name}:budget:*")]
    assert len(budget_keys) == 1
    deadline = time.monotonic() + 5
    while int(await redis_client.get(budget_keys[0])) != used and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert int(await redis_client.get(budget_keys[0])) == used
    report = httpx.get(f"{gateways[1].url}/v1/usage", params={"period": "day"}, headers=tenant.headers).json()
    assert (report["requests"], report["total_tokens"], report["token_budget"]) == (len(admitted), used, 1000)


async def test_concurrency_limit_holds_across_two_gateways(gateways: list[GatewayProcess], tenancy_engine: EngineHost,
                                                           redis_client: aioredis.Redis) -> None:
    limit = 4
    tenant = create_tenant(gateways[0], {"maxConcurrentRequests": limit})
    body = completion_body(max_tokens=4000, prompt=PROMPT_IDS, stream=True, ignore_eos=True, temperature=1.0)
    statuses: list[int] = []
    release = asyncio.Event()
    peak = {"leases": 0, "engine": 0}
    admission = Admission(redis_client)

    async def one(client: httpx.AsyncClient, url: str) -> None:
        # NOTE: a gateway starved of CPU for seconds on this 2-core machine (the engine generates beside it)
        # may time out on Redis and fail closed with 503 + Retry-After; a client retries those, as here.
        for _ in range(STORE_RETRIES):
            async with client.stream("POST", f"{url}/v1/completions", json=body, headers=tenant.headers) as response:
                if response.status_code == 503:
                    await response.aread()
                    assert error_of(response)["code"] == "store_unavailable", response.text
                    await asyncio.sleep(float(response.headers["retry-after"]))
                    continue
                statuses.append(response.status_code)
                if response.status_code == 200:
                    await release.wait()  # hold the stream open: its lease stays taken
                else:
                    await response.aread()
                    assert error_of(response)["code"] == "max_concurrent_requests"
                return
        pytest.fail(f"the store stayed unavailable for {STORE_RETRIES} tries")

    async def sample(engine_client: httpx.AsyncClient) -> None:
        while not release.is_set():
            peak["leases"] = max(peak["leases"], await admission.in_flight(tenant.name))
            running = (await engine_client.get(f"{tenancy_engine.url}/requests", auth=ENGINE_AUTH)).json()
            peak["engine"] = max(peak["engine"], sum(r["tenant"] == tenant.name for r in running))
            await asyncio.sleep(0.02)

    limits = httpx.Limits(max_connections=260, max_keepalive_connections=260)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client, httpx.AsyncClient(timeout=10) as engine:
        sampler = asyncio.ensure_future(sample(engine))
        tasks = [asyncio.ensure_future(one(client, gateways[i % 2].url)) for i in range(200)]
        deadline = time.monotonic() + 120
        while len(statuses) < 200 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        admitted_while_held = statuses.count(200)
        release.set()
        await asyncio.gather(*tasks)
        await sampler
    assert len(statuses) == 200
    assert admitted_while_held == limit, (peak, [g.log_tail(2000) for g in gateways])
    assert statuses.count(429) == 200 - limit
    assert peak["leases"] <= limit and peak["engine"] <= limit, peak
    # The streams were dropped by the client: the gateways free the leases as they notice.
    deadline = time.monotonic() + 10
    while await admission.in_flight(tenant.name) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert await admission.in_flight(tenant.name) == 0


async def test_limits_are_per_tenant(gateways: list[GatewayProcess]) -> None:
    limited = create_tenant(gateways[0], {"requestsPerMinute": 2})
    other = create_tenant(gateways[0], {"requestsPerMinute": 100})
    urls = [g.url for g in gateways]
    first = await post_all(urls, "/v1/completions", limited, [completion_body()] * 4)
    second = await post_all(urls, "/v1/completions", other, [completion_body()] * 4)
    assert sorted(r.status_code for r in first) == [200, 200, 429, 429]
    assert [r.status_code for r in second] == [200] * 4
    assert {r.json()["model"] for r in second} == {MODEL}
