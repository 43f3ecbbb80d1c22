"""Through a real gateway and a real engine: per-tenant prefix-cache salts, priority classes as vLLM
priorities (and the controller's demotion), and billing of streams whose client went away."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import Any

import httpx
import orjson
import redis.asyncio as aioredis

from tessera.engine.host import EngineHost
from tessera.tenancy.admission import Admission
from tessera.tenancy.demotion import set_demoted
from tessera.tenancy.policy import DEMOTION_STEP, PRIORITY_VALUES
from tests.support.data_plane import ENGINE_AUTH
from tests.support.gateways import GatewayProcess
from tests.support.tenancy import TenantHandle, completion_body, create_tenant

BLOCK_SIZE = 32


def fresh_prompt(num_tokens: int = 200) -> list[int]:
    """Token ids no other test sends, so the first request of a prefix always misses the cache."""
    rng = random.Random(time.monotonic_ns())
    return [rng.randrange(3, 700) for _ in range(num_tokens)]  # the tokenizer has 717 ids


def cached_tokens(gateway: GatewayProcess, tenant: TenantHandle, prompt: list[int]) -> int:
    response = httpx.post(f"{gateway.url}/v1/completions", json=completion_body(max_tokens=1, prompt=prompt),
                          headers=tenant.headers, timeout=60)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def test_a_tenant_hits_only_its_own_prefix_cache(gateways: list[GatewayProcess]) -> None:
    a, b = create_tenant(gateways[0], prefix="cache-a"), create_tenant(gateways[0], prefix="cache-b")
    prompt = fresh_prompt()
    full_blocks = len(prompt) // BLOCK_SIZE * BLOCK_SIZE
    assert cached_tokens(gateways[0], a, prompt) == 0
    assert cached_tokens(gateways[1], a, prompt) == full_blocks  # A's repeat hits A's blocks
    assert cached_tokens(gateways[0], b, prompt) == 0  # B never sees A's blocks
    assert cached_tokens(gateways[1], b, prompt) == full_blocks  # B's own repeat does hit


def test_without_isolation_tenants_share_the_cache(gateways: list[GatewayProcess]) -> None:
    # What the salt prevents: two tenants that opted out hit each other's blocks (a timing side channel).
    c = create_tenant(gateways[0], {"prefixCacheIsolation": False}, prefix="shared-c")
    d = create_tenant(gateways[0], {"prefixCacheIsolation": False}, prefix="shared-d")
    prompt = fresh_prompt()
    assert cached_tokens(gateways[0], c, prompt) == 0
    assert cached_tokens(gateways[1], d, prompt) == len(prompt) // BLOCK_SIZE * BLOCK_SIZE


LONG_STREAM = completion_body(max_tokens=4000, prompt=list(range(300, 320)), stream=True, ignore_eos=True,
                              temperature=1.0)


async def engine_priorities(engine: EngineHost, tenants: list[str], timeout_s: float = 30.0) -> dict[str, int]:
    """The vLLM priority of each tenant's in-flight request, as the engine reports it."""
    seen: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=10) as client:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            running = (await client.get(f"{engine.url}/requests", auth=ENGINE_AUTH)).json()
            seen.update({r["tenant"]: int(r["priority"]) for r in running if r["tenant"] in tenants})
            if len(seen) == len(tenants):
                return seen
            await asyncio.sleep(0.02)
    raise AssertionError(f"only {seen} of {tenants} were seen in flight")


async def hold_streams(gateway: GatewayProcess, tenants: list[TenantHandle], engine: EngineHost) -> dict[str, int]:
    watcher = asyncio.ensure_future(engine_priorities(engine, [t.name for t in tenants]))
    async with httpx.AsyncClient(timeout=60) as client, contextlib.AsyncExitStack() as streams:
        try:
            for t in tenants:
                response = await streams.enter_async_context(client.stream(
                    "POST", f"{gateway.url}/v1/completions", json=LONG_STREAM, headers=t.headers))
                assert response.status_code == 200
            return await watcher
        finally:
            watcher.cancel()


async def test_priority_class_becomes_the_vllm_priority(gateways: list[GatewayProcess],
                                                        tenancy_engine: EngineHost) -> None:
    critical = create_tenant(gateways[0], {"priorityClass": "critical"}, prefix="prio-critical")
    batch = create_tenant(gateways[0], {"priorityClass": "batch"}, prefix="prio-batch")
    normal = create_tenant(gateways[0], prefix="prio-normal")
    seen = await hold_streams(gateways[0], [critical, batch, normal], tenancy_engine)
    assert seen == {critical.name: PRIORITY_VALUES["critical"], batch.name: PRIORITY_VALUES["batch"],
                    normal.name: PRIORITY_VALUES["normal"]}


async def test_a_demoted_tenant_runs_after_every_class(gateways: list[GatewayProcess], tenancy_engine: EngineHost,
                                                       redis_client: aioredis.Redis) -> None:
    demoted = create_tenant(gateways[1], {"priorityClass": "high"}, prefix="demoted")
    await set_demoted(redis_client, demoted.name, "kv quota exceeded", ttl_s=30)
    seen = await hold_streams(gateways[1], [demoted], tenancy_engine)
    assert seen == {demoted.name: PRIORITY_VALUES["high"] + DEMOTION_STEP}


def text_events(chunk: bytes) -> int:
    count = 0
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {"):
            choices: list[dict[str, Any]] = orjson.loads(line[6:]).get("choices") or []
            count += sum(1 for c in choices if c.get("text"))
    return count


async def test_a_stream_whose_client_leaves_is_billed_for_what_it_received(
        gateways: list[GatewayProcess], tenancy_engine: EngineHost, redis_client: aioredis.Redis) -> None:
    tenant = create_tenant(gateways[0], prefix="leaver")
    received = 0
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", f"{gateways[0].url}/v1/completions", json=LONG_STREAM,
                                 headers=tenant.headers) as stream:
            assert stream.status_code == 200
            async for chunk in stream.aiter_bytes():
                received += text_events(chunk)  # each text event carries at least one token
                if received >= 50:
                    break
        # The client is gone; the gateway aborts the engine request and reconciles what was generated.
        deadline = time.monotonic() + 15
        report: dict[str, Any] = {}
        while time.monotonic() < deadline:
            report = (await client.get(f"{gateways[1].url}/v1/usage", params={"period": "day"},
                                       headers=tenant.headers)).json()
            if report["requests"] == 1:
                break
            await asyncio.sleep(0.1)
    assert report["requests"] == 1, report
    assert report["prompt_tokens"] == 20
    assert received >= 50 and report["completion_tokens"] >= received
    assert await Admission(redis_client).in_flight(tenant.name) == 0
    running = httpx.get(f"{tenancy_engine.url}/requests", auth=ENGINE_AUTH).json()
    assert not any(r["tenant"] == tenant.name for r in running)
