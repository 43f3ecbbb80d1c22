"""A failed admission round trip may have admitted (the script ran, only its reply was lost): the admit phase
hands that lease to the finish queue to be voided once Redis answers, whichever the fail mode. (What a void
does in Redis: tests/integration/tenancy/test_settlement.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import TimeoutError as RedisTimeoutError

from tessera.gateway.errors import APIError
from tessera.gateway.failopen import FailOpen
from tessera.gateway.request.admit import Admitter
from tessera.tenancy.admission import Admission, Lease
from tessera.tenancy.policy import TenantPolicy
from tessera.tenancy.store import Tenant

TENANT = Tenant("acme", TenantPolicy(), "salt", 0.0)


class LostReply:
    """A lean connection whose write went out and whose reply never came."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    async def execute(self, commands: list[Any]) -> list[Any]:
        self.sent.append(commands)
        raise RedisTimeoutError("no reply")


class Voids:
    def __init__(self) -> None:
        self.voided: list[Lease] = []

    def void(self, lease: Lease) -> None:
        self.voided.append(lease)


class Metrics:
    def fail_open(self, tenant: str) -> None:
        pass


@pytest.mark.parametrize("fail_open", [False, True])
async def test_the_admission_a_lost_reply_may_have_made_is_voided(fail_open: bool) -> None:
    admission = Admission(aioredis.Redis())  # never connected: the wire carries the trip
    wire, voids = LostReply(), Voids()
    admitter = Admitter(admission, wire, None, Metrics(), FailOpen(fail_open), voids)  # type: ignore[arg-type]
    if fail_open:
        admitted = await admitter.admit(TENANT, 120, None, 20, "acme/cmpl-1")
        assert isinstance(admitted.decision, Lease) and admitted.decision.detached
    else:
        with pytest.raises(APIError) as info:
            await admitter.admit(TENANT, 120, None, 20, "acme/cmpl-1")
        assert info.value.status == 503
    # The lease the script would have granted: its id is ARGV[6] of the EVALSHA that went out.
    evalsha = wire.sent[0][0]
    assert [lease.lease_id for lease in voids.voided] == [evalsha[3 + int(evalsha[2]) + 5]]
    assert voids.voided[0].reserved_tokens == 120 and not voids.voided[0].detached
