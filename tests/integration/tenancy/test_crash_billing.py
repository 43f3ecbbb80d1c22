"""Exact billing across crashes, with real gateway processes and the real engine:

- a gateway SIGKILLed mid-stream never finishes its request; once its lease has expired, a surviving gateway's
  settler bills it from the engine's own record of the tokens it generated, and no second path (another
  settlement, the dead gateway's finish arriving late) bills it again;
- a finish that could not reach Redis (a request served failing open during an outage) is kept in the
  gateway's journal and billed once Redis is back: by the live gateway itself, and by the next gateway started
  on a SIGKILLed one's journal.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from tessera.engine.host import EngineHost
from tessera.engine.protocol import parse_usage, usage_record_key
from tessera.gateway.finish_journal import decode_entries
from tessera.gateway.settler import Settler
from tessera.tenancy.admission import OPEN_TICKETS_KEY, TICKETS_KEY, Admission, Lease, limiter_keys
from tessera.tenancy.settlement import Charge, SettleKind, Ticket, parse_ticket
from tests.support.gateways import GatewayProcess, spawn_gateway
from tests.support.poll import async_wait_until
from tests.support.tenancy import GATEWAY_ENV, TenantHandle, completion_body, create_tenant
from tests.support.valkey import RestartableRedis

# The settlers here look every 0.5 s and bill 2 s after a lease expired. Failing open, these gateways serve
# a known tenant through a Redis outage: each such request's finish can only wait for Redis.
SETTLING_ENV = {**GATEWAY_ENV, "TESSERA_SETTLE_INTERVAL_S": "0.5", "TESSERA_SETTLE_GRACE_S": "2.0",
                "TESSERA_REDIS_FAIL_OPEN": "1"}
# The gateway that dies: its lease lapses 3 s after its last renewal.
DOOMED_ENV = {**GATEWAY_ENV, "TESSERA_LEASE_TTL_S": "3.0"}
PROMPT = list(range(300, 320))  # 20 prompt tokens, as token ids: the count is exact
# Sampled, ignoring EOS (n-gram speculation cannot shortcut it): long enough to be cut mid-stream, and to be
# still running when Redis stops.
STREAM = completion_body(max_tokens=4000, prompt=PROMPT, stream=True, ignore_eos=True, temperature=1.0)
SHORT = completion_body(max_tokens=8, prompt=PROMPT, ignore_eos=True)
BILL_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def billing_gateways(tenancy_redis: RestartableRedis, tenancy_engine: EngineHost,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[GatewayProcess]]:
    """The surviving gateways: two, started at once."""
    log_dir = tmp_path_factory.mktemp("billing-gateways")
    processes = [spawn_gateway(tenancy_redis.url, log_dir, SETTLING_ENV) for _ in range(2)]
    try:
        for process in processes:
            process.wait_healthy()
        yield processes
    finally:
        for process in processes:  # SIGTERM to all, then wait for each: they drain side by side
            if process.alive():
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            process.stop()


def journal_dir(gateway: GatewayProcess) -> Path:
    """Where spawn_gateway puts a gateway's journal (tests/support/gateways.py)."""
    return gateway.log_path.parent / f"gateway-{gateway.port}-journal"


def journaled(directory: Path) -> list[Any]:
    return [item for path in directory.glob("finishes-*.jsonl") for item in decode_entries(path.read_bytes())]


async def open_ticket(redis: aioredis.Redis, tenant: str) -> Ticket | None:
    members: list[bytes] = await redis.zrange(OPEN_TICKETS_KEY, 0, -1)  # type: ignore[assignment]
    for member in members:
        name = member.decode()
        if name.startswith(f"{tenant}:"):
            value = await redis.hget(TICKETS_KEY, name)
            return parse_ticket(name, bytes(value).decode()) if value is not None else None  # type: ignore[arg-type]
    return None


async def usage_of(redis: aioredis.Redis, tenant: str) -> dict[str, int | str]:
    usage = await Admission(redis).usage(tenant, "day")
    return {k: v for k, v in usage.items() if k not in ("period", "period_id")}


async def billed(redis: aioredis.Redis, tenant: str) -> bool:
    return (await usage_of(redis, tenant))["requests"] == 1


def budget_key(tenant: str) -> str:
    return limiter_keys(tenant, time.strftime("%Y-%m-%d", time.gmtime()))[4]


async def test_a_sigkilled_gateways_request_is_billed_from_the_engines_count(
        tenancy_redis: RestartableRedis, billing_gateways: list[GatewayProcess], redis_client: aioredis.Redis,
        tmp_path: Path) -> None:
    tenant = create_tenant(billing_gateways[0], {"tokenBudget": 100_000, "budgetPeriod": "day"})
    doomed = spawn_gateway(tenancy_redis.url, tmp_path, DOOMED_ENV)
    try:
        doomed.wait_healthy()
        async with httpx.AsyncClient(timeout=60) as client, client.stream(
                "POST", f"{doomed.url}/v1/completions", json=STREAM, headers=tenant.headers) as stream:
            assert stream.status_code == 200
            chunks = stream.aiter_bytes()  # NOTE: referenced until the kill (a dropped one closes the stream)
            received = await chunks.__anext__()
            ticket = await open_ticket(redis_client, tenant.name)
            assert ticket is not None, "the running request has no open ticket"
            doomed.kill()
            with pytest.raises(httpx.HTTPError):
                async for chunk in chunks:
                    received += chunk
    finally:
        doomed.stop()
    assert b"[DONE]" not in received, "the stream ended before the kill: nothing to test"

    # The engine saw its caller go, aborted and recorded what it had generated; the settler bills that.
    await async_wait_until(lambda: billed(redis_client, tenant.name), BILL_WITHIN_S, "the settler to bill it")
    record = parse_usage(await redis_client.hgetall(usage_record_key(ticket.engine_request_id)))
    assert len(record) == 1, record
    engine_prompt, engine_output = record[0]
    assert engine_prompt == len(PROMPT) and 0 < engine_output < STREAM["max_tokens"], record
    usage = await usage_of(redis_client, tenant.name)
    assert usage == {"requests": 1, "prompt_tokens": len(PROMPT), "completion_tokens": engine_output,
                     "total_tokens": len(PROMPT) + engine_output, "settled_from_engine": 1,
                     "charged_reservation": 0, "charged_reservation_tokens": 0}
    assert int(await redis_client.get(budget_key(tenant.name)) or -1) == len(PROMPT) + engine_output
    assert await open_ticket(redis_client, tenant.name) is None

    # Second paths: a settler pass of this process, the same settlement again, and the dead gateway's finish
    # arriving late (as if it had only been cut off), with the count it had relayed.
    admission = Admission(redis_client)
    await Settler(redis_client, admission, interval_s=1.0, grace_s=0.0).settle_due()
    charge = Charge(SettleKind.ENGINE, len(PROMPT), engine_output)
    assert not await admission.settle(ticket, charge, time_of(ticket))
    lease = Lease(ticket.lease_id, tenant.name, ticket.reserved_tokens,
                  (*limiter_keys(tenant.name, "")[:4], ticket.budget_key))
    assert not await admission.finish(lease, len(PROMPT), 1)
    assert await usage_of(redis_client, tenant.name) == usage
    assert int(await redis_client.get(budget_key(tenant.name)) or -1) == len(PROMPT) + engine_output


async def test_finishes_redis_did_not_take_are_billed_from_the_journal(
        tenancy_redis: RestartableRedis, billing_gateways: list[GatewayProcess], redis_client: aioredis.Redis,
        tmp_path: Path) -> None:
    live = billing_gateways[0]
    victim = spawn_gateway(tenancy_redis.url, tmp_path, SETTLING_ENV)
    tenants = [create_tenant(live, {"tokenBudget": 100_000, "budgetPeriod": "day"}) for _ in range(2)]
    pairs = list(zip((live, victim), tenants, strict=True))
    try:
        victim.wait_healthy()
        # Each gateway serves its tenant once: it knows the key, the model and a route, and can fail open.
        async with httpx.AsyncClient(timeout=60) as client:
            for gateway, tenant in pairs:
                response = await client.post(f"{gateway.url}/v1/completions", json=SHORT, headers=tenant.headers)
                assert response.status_code == 200, response.text
            await async_wait_until(lambda: all_billed(redis_client, tenants, 1), BILL_WITHIN_S, "the warm-ups")
            tenancy_redis.stop()
            try:
                # Served without Redis (fail open): each finish finds Redis stopped, and waits in the journal.
                for gateway, tenant in pairs:
                    response = await client.post(f"{gateway.url}/v1/completions", json=SHORT,
                                                 headers=tenant.headers)
                    assert response.status_code == 200, response.text
                    assert response.json()["usage"]["completion_tokens"] == SHORT["max_tokens"]
                await async_wait_until(lambda: all(finish_journaled(g, t) for g, t in pairs), 30.0,
                                       "both finishes to be journaled")
                victim.kill()  # its finish now lives on only in its journal
            finally:
                tenancy_redis.start()
    finally:
        victim.stop()

    # The live gateway bills its own once Redis answers again; the next gateway started on the killed one's
    # journal adopts it and bills it.
    successor = spawn_gateway(tenancy_redis.url, victim.log_path.parent,
                              {**SETTLING_ENV, "TESSERA_FINISH_JOURNAL_DIR": str(journal_dir(victim))})
    try:
        successor.wait_healthy()
        await async_wait_until(lambda: all_billed(redis_client, tenants, 2), BILL_WITHIN_S, "both replays")
    finally:
        successor.stop()
    total = 2 * (len(PROMPT) + SHORT["max_tokens"])
    for tenant in tenants:
        # Billed by the gateways' own finishes, each exactly once: the gateway's count, no settler label.
        assert await usage_of(redis_client, tenant.name) == {
            "requests": 2, "prompt_tokens": 2 * len(PROMPT), "completion_tokens": 2 * SHORT["max_tokens"],
            "total_tokens": total, "settled_from_engine": 0, "charged_reservation": 0,
            "charged_reservation_tokens": 0}
        assert int(await redis_client.get(budget_key(tenant.name)) or -1) == total
    await async_wait_until(lambda: not journaled(journal_dir(live)) and not journaled(journal_dir(victim)), 10.0,
                           "the journals to empty")


async def all_billed(redis: aioredis.Redis, tenants: list[TenantHandle], num_requests: int) -> bool:
    try:
        for tenant in tenants:
            if (await usage_of(redis, tenant.name))["requests"] != num_requests:
                return False
    except RedisConnectionError:
        return False  # a connection this client held from before Redis restarted: the next poll reconnects
    return True


def finish_journaled(gateway: GatewayProcess, tenant: TenantHandle) -> bool:
    return any(p.kind is SettleKind.GATEWAY and p.lease.tenant == tenant.name for p in journaled(journal_dir(gateway)))


def time_of(ticket: Ticket) -> datetime:
    return datetime.fromtimestamp(ticket.admitted_at, UTC)
