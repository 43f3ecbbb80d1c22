"""finish.lua decides, once, who bills a lease (real Redis, no gateway): the gateway's own finish, the settler
(the gateway died: from the engine's record, or the whole reservation, labelled), or a void (the admission's
reply was lost). Whichever comes first bills; every later call, by any path, changes nothing."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import redis.asyncio as aioredis

from tessera.engine.protocol import encode_usage, usage_record_key
from tessera.gateway.settler import Settler
from tessera.tenancy.admission import (
    FINISH_MARKER_TTL_S,
    OPEN_TICKETS_KEY,
    TICKETS_KEY,
    Admission,
    Lease,
    Rejection,
    finish_marker_key,
    leases_key,
)
from tessera.tenancy.policy import TenantPolicy
from tessera.tenancy.settlement import Charge, SettleKind, Ticket, parse_ticket, ticket_member
from tests.support.poll import async_wait_until

POLICY = TenantPolicy(token_budget=100_000, budget_period="day", tokens_per_minute=100_000)
PROMPT, RESERVE = 20, 120  # max_tokens 100


async def admit(admission: Admission, redis: aioredis.Redis) -> tuple[Lease, Ticket]:
    tenant = f"stl-{uuid.uuid4().hex[:10]}"
    lease = await admission.admit(tenant, POLICY, RESERVE, PROMPT, f"{tenant}/cmpl-{uuid.uuid4().hex[:8]}")
    assert isinstance(lease, Lease)
    member = ticket_member(tenant, lease.lease_id)
    value = await redis.hget(TICKETS_KEY, member)
    assert isinstance(value, bytes), value
    return lease, parse_ticket(member, value.decode())


async def is_due(admission: Admission, lease: Lease) -> bool:
    return any(t.lease_id == lease.lease_id for t in await admission.due_tickets(0.0, 10_000))


def ticket_time(ticket: Ticket) -> datetime:
    return datetime.fromtimestamp(ticket.admitted_at, UTC)


async def state(admission: Admission, redis: aioredis.Redis, lease: Lease) -> dict[str, Any]:
    """What billing left: usage of the day, the budget, whether the lease, ticket and TPM charge remain."""
    usage = await admission.usage(lease.tenant, "day")
    return {"usage": {k: v for k, v in usage.items() if k not in ("period", "period_id")},
            "budget": int(await redis.get(lease.keys[4]) or 0),
            "tpm": int(await redis.hget(lease.keys[2], "_total") or 0),
            "leased": await redis.zscore(leases_key(lease.tenant), lease.lease_id) is not None,
            "open": await redis.zscore(OPEN_TICKETS_KEY, lease.ticket) is not None}


async def test_an_expired_ticket_is_billed_from_the_engine_record_once(redis_client: aioredis.Redis) -> None:
    admission = Admission(redis_client, lease_ttl_s=0.2)  # the gateway "dies": nothing renews
    lease, ticket = await admit(admission, redis_client)
    assert ticket.engine_request_id.startswith(f"{lease.tenant}/cmpl-") and ticket.prompt_tokens == PROMPT
    rid = ticket.engine_request_id
    # The engine's record: attempt 0 made 30 tokens and was cut; the continuation got them and made 7 more.
    await redis_client.hset(usage_record_key(rid), mapping={rid: encode_usage(PROMPT, 30),
                                                            f"{rid}-r1": encode_usage(PROMPT + 30, 7)})
    settler = Settler(redis_client, admission, interval_s=1.0, grace_s=0.0)
    await async_wait_until(lambda: is_due(admission, lease), 10.0, "the lease to expire")
    report = await settler.settle_due()
    assert report.num_from_engine >= 1
    billed = await state(admission, redis_client, lease)
    assert billed["usage"] == {"requests": 1, "prompt_tokens": PROMPT, "completion_tokens": 37, "total_tokens": 57,
                               "settled_from_engine": 1, "charged_reservation": 0, "charged_reservation_tokens": 0}
    assert (billed["budget"], billed["tpm"], billed["leased"], billed["open"]) == (57, 57, False, False)
    # A settled lease's marker outlives any journal the dead gateway may replay later (billing.replayable).
    assert await redis_client.ttl(finish_marker_key(lease.tenant, lease.lease_id)) > FINISH_MARKER_TTL_S

    # Every second path is a no-op: another pass, the same settlement again, the gateway's late finish.
    await settler.settle_due()
    assert not await admission.settle(ticket, Charge(SettleKind.ENGINE, PROMPT, 37), ticket_time(ticket))
    assert not await admission.settle(ticket, Charge(SettleKind.RESERVATION, PROMPT, 100), ticket_time(ticket))
    assert not await admission.finish(lease, PROMPT, 35)
    assert await state(admission, redis_client, lease) == billed


async def test_a_lease_its_gateway_finished_is_never_settled(redis_client: aioredis.Redis) -> None:
    admission = Admission(redis_client)
    lease, ticket = await admit(admission, redis_client)
    assert await admission.finish(lease, PROMPT, 10)
    billed = await state(admission, redis_client, lease)
    assert (billed["budget"], billed["open"], billed["usage"]["total_tokens"]) == (30, False, 30)
    # A settler that read the ticket just before the finish: finish.lua refuses it, also once the finish's
    # done marker has expired (a settler stalled for longer than it lives): the ticket is closed.
    assert not await admission.settle(ticket, Charge(SettleKind.RESERVATION, PROMPT, 100), ticket_time(ticket))
    await redis_client.delete(finish_marker_key(lease.tenant, lease.lease_id))
    assert not await admission.settle(ticket, Charge(SettleKind.RESERVATION, PROMPT, 100), ticket_time(ticket))
    assert await state(admission, redis_client, lease) == billed


async def test_without_an_engine_record_the_reservation_is_charged_and_labelled(redis_client: aioredis.Redis) -> None:
    admission = Admission(redis_client, lease_ttl_s=0.2)
    lease, _ = await admit(admission, redis_client)
    await async_wait_until(lambda: is_due(admission, lease), 10.0, "the lease to expire")
    await Settler(redis_client, admission, interval_s=1.0, grace_s=0.0).settle_due()
    billed = await state(admission, redis_client, lease)
    assert billed["usage"] == {"requests": 1, "prompt_tokens": PROMPT, "completion_tokens": RESERVE - PROMPT,
                               "total_tokens": RESERVE, "settled_from_engine": 0, "charged_reservation": 1,
                               "charged_reservation_tokens": RESERVE}
    assert (billed["budget"], billed["open"]) == (RESERVE, False)
    assert not await admission.finish(lease, PROMPT, 3)  # the gateway was only partitioned: too late


async def test_a_renewal_pushes_the_settle_by_time_forward(redis_client: aioredis.Redis) -> None:
    admission = Admission(redis_client, lease_ttl_s=30.0)
    lease, _ = await admit(admission, redis_client)
    before = await redis_client.zscore(OPEN_TICKETS_KEY, lease.ticket)
    assert await admission.renew(lease)
    after = await redis_client.zscore(OPEN_TICKETS_KEY, lease.ticket)
    assert before is not None and after is not None and after > before
    assert await admission.finish(lease, PROMPT, 1)


async def test_a_void_undoes_an_admission_whose_reply_was_lost(redis_client: aioredis.Redis) -> None:
    admission = Admission(redis_client)
    lease, _ = await admit(admission, redis_client)
    assert await admission.void(lease)
    voided = await state(admission, redis_client, lease)
    assert voided["usage"]["requests"] == 0 and voided["usage"]["total_tokens"] == 0
    assert (voided["budget"], voided["tpm"], voided["leased"], voided["open"]) == (0, 0, False, False)
    assert await redis_client.zscore(lease.keys[0], lease.lease_id) is None  # not counted in requests/min
    assert not await admission.void(lease) and not await admission.finish(lease, PROMPT, 5)
    assert await state(admission, redis_client, lease) == voided


async def test_a_void_that_overtakes_its_admission_keeps_it_out(redis_client: aioredis.Redis) -> None:
    admission = Admission(redis_client)
    await admit(admission, redis_client)  # the script is loaded
    tenant = f"stl-{uuid.uuid4().hex[:10]}"
    call = admission.prepare(tenant, POLICY, RESERVE, PROMPT, f"{tenant}/cmpl-1")
    assert await admission.void(call.lease)  # sent after the lost reply, but Redis runs it first
    outcome = call.outcome(await redis_client.evalsha(admission.admit_sha, len(call.keys), *call.keys, *call.args))
    assert isinstance(outcome, Rejection) and outcome.limit == "voided"
    assert await redis_client.get(call.lease.keys[4]) is None  # nothing reserved
    assert await redis_client.zscore(OPEN_TICKETS_KEY, call.lease.ticket) is None


async def test_a_void_after_the_finish_changes_nothing(redis_client: aioredis.Redis) -> None:
    admission = Admission(redis_client)
    lease, _ = await admit(admission, redis_client)
    assert await admission.finish(lease, PROMPT, 10)
    billed = await state(admission, redis_client, lease)
    assert not await admission.void(lease)
    assert await state(admission, redis_client, lease) == billed
