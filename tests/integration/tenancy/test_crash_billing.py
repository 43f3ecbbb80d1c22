"""Exact billing across crashes, with real gateway processes and the real engine:

- a gateway SIGKILLed mid-stream never finishes its request; once its lease has expired, a surviving gateway's
  settler bills it from the engine's own record of the tokens it generated, and no second path (another
  settlement, the dead gateway's finish arriving late) bills it again;
- a finish that could not reach Redis is kept in the gateway's journal and billed once Redis is back: by the
  live gateway itself, and by the next gateway started on a SIGKILLed one's journal.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio as aioredis

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

# The settlers here look every 0.5 s and bill 2 s after a lease expired; their own leases (120 s) outlive
# every outage below, so no settler bills a request these tests mean to be billed by its gateway's journal.
SETTLING_ENV = {**GATEWAY_ENV, "TESSERA_LEASE_TTL_S": "120", "TESSERA_SETTLE_INTERVAL_S": "0.5",
                "TESSERA_SETTLE_GRACE_S": "2.0"}
# The gateway that dies: its lease lapses 3 s after its last renewal.
DOOMED_ENV = {**GATEWAY_ENV, "TESSERA_LEASE_TTL_S": "3.0"}
PROMPT = list(range(300, 320))  # 20 prompt tokens, as token ids: the count is exact
# Sampled, ignoring EOS (n-gram speculation cannot shortcut it): long enough to be cut mid-stream, and to be
# still running when Redis stops.
STREAM = completion_body(max_tokens=4000, prompt=PROMPT, stream=True, ignore_eos=True, temperature=1.0)
OUTAGE_STREAM = {**STREAM, "max_tokens": 1500, "stream_options": {"include_usage": True}}
BILL_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def billing_gateways(tenancy_redis: RestartableRedis, tenancy_engine: EngineHost,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[GatewayProcess]]:
    """Two gateways started at once, each with its own journal directory (``journal_dir`` finds it)."""
    log_dir = tmp_path_factory.mktemp("billing-gateways")
    processes = [spawn_gateway(tenancy_redis.url, log_dir, SETTLING_ENV) for _ in range(2)]
    try:
        for process in processes:
            process.wait_healthy()
        yield processes
    finally:
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


async def stream_through_outage(gateway: GatewayProcess, tenant: TenantHandle, started: asyncio.Event,
                                redis_stopped: asyncio.Event) -> int:
    """Streams OUTAGE_STREAM; past its first line only once Redis is stopped. Returns the completion tokens of
    the stream's usage chunk (the gateway's count, which its finish bills)."""
    usage = None
    async with httpx.AsyncClient(timeout=120) as client, client.stream(
            "POST", f"{gateway.url}/v1/completions", json=OUTAGE_STREAM, headers=tenant.headers) as stream:
        assert stream.status_code == 200
        lines = stream.aiter_lines()
        await lines.__anext__()
        started.set()
        await redis_stopped.wait()
        async for line in lines:
            if line.startswith("data: {"):
                usage = orjson.loads(line[6:]).get("usage") or usage
    assert usage is not None, "no usage chunk"
    return int(usage["completion_tokens"])


async def test_finishes_redis_did_not_take_are_billed_from_the_journal(
        tenancy_redis: RestartableRedis, billing_gateways: list[GatewayProcess],
        redis_client: aioredis.Redis) -> None:
    live, victim = billing_gateways
    tenants = [create_tenant(live, {"tokenBudget": 100_000, "budgetPeriod": "day"}) for _ in range(2)]
    started, redis_stopped = [asyncio.Event(), asyncio.Event()], asyncio.Event()
    streams = [asyncio.ensure_future(stream_through_outage(gateway, tenant, event, redis_stopped))
               for gateway, tenant, event in zip((live, victim), tenants, started, strict=True)]
    await async_wait_until(lambda: all(e.is_set() for e in started) or any(s.done() for s in streams), 60.0,
                           "both streams to start")
    assert all(e.is_set() for e in started), [s.result() for s in streams if s.done()]
    tenancy_redis.stop()
    redis_stopped.set()
    try:
        counts = await asyncio.gather(*streams)
        # Each gateway's finish found Redis stopped: it waits in the gateway's journal.
        await async_wait_until(lambda: journaled(journal_dir(live)) and journaled(journal_dir(victim)), 30.0,
                               "both finishes to be journaled")
        victim.kill()  # its finish now lives on only in its journal
    finally:
        tenancy_redis.start()

    # The live gateway bills its own once Redis answers again.
    await async_wait_until(lambda: billed(redis_client, tenants[0].name), BILL_WITHIN_S, "the live gateway's replay")
    # The next gateway started on the killed one's journal adopts it and bills it.
    successor = spawn_gateway(tenancy_redis.url, victim.log_path.parent,
                              {**SETTLING_ENV, "TESSERA_FINISH_JOURNAL_DIR": str(journal_dir(victim))})
    billing_gateways[1] = successor  # the fixture stops it
    successor.wait_healthy()
    await async_wait_until(lambda: billed(redis_client, tenants[1].name), BILL_WITHIN_S, "the successor's replay")

    for tenant, count in zip(tenants, counts, strict=True):
        assert count == OUTAGE_STREAM["max_tokens"]
        # Billed by the gateways' own finishes, exactly once: no settler label, the gateway's count.
        assert await usage_of(redis_client, tenant.name) == {
            "requests": 1, "prompt_tokens": len(PROMPT), "completion_tokens": count,
            "total_tokens": len(PROMPT) + count, "settled_from_engine": 0, "charged_reservation": 0,
            "charged_reservation_tokens": 0}
        assert int(await redis_client.get(budget_key(tenant.name)) or -1) == len(PROMPT) + count
        assert await open_ticket(redis_client, tenant.name) is None
    await async_wait_until(lambda: not journaled(journal_dir(live)) and not journaled(journal_dir(victim)), 10.0,
                           "the journals to empty")


def time_of(ticket: Ticket) -> datetime:
    return datetime.fromtimestamp(ticket.admitted_at, UTC)
