"""The settler: bills the requests whose gateway died before it billed them (tenancy/settlement.py).

It runs in every gateway worker, on a slow timer (``settle_interval_s``); a Redis lock, held for the length
of a pass, keeps two workers from making the same pass at once. The lock only saves work: finish.lua bills each
lease once, whoever asks and however often.

A pass first asks whether anything is due (``Admission.any_due``: one round trip over the worker's lean
connection) and takes the lock only then, which is rarely: a ticket comes due only when its gateway died. Its
timer falls on the server tick's grid (``lean_server.SERVER_TICK_S``; the caches' refreshers wake on its instants
too), so an idle worker wakes once for all of them. Before both, each pass took the lock, read Redis's clock, read
the due set and released the lock, four redis-py round trips on a wake-up of its own every 2.5-5 s: ~0.5 ms/s of
an idle two-worker gateway's ~1.4 (docs/performance.md, section 9).

Why the gateways and not the KV-eviction controller: wherever requests are admitted gateways run, so a settler
runs too (the controller is optional, one replica, and absent from ``tessera up`` without KV control); a dead
gateway's requests are settled by any surviving one, or by the restarted one.

A pass: the open tickets ``settle_grace_s`` past their settle-by time (their gateway stopped renewing), the
engine's usage record of each (engine/usage_record.py; one pipelined read), ``settlement.decide``, and
finish.lua for each. The usage periods it counts in are those of the request's admission.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from tessera.engine.protocol import parse_usage, usage_record_key
from tessera.gateway.errors import STORE_ERRORS
from tessera.gateway.lean_server import SERVER_TICK_S
from tessera.swallowed_cancel import raise_if_cancelled
from tessera.tenancy.settlement import AttemptUsage, SettleKind, decide
from tessera.wake_grid import instant_at_or_after

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from tessera.tenancy.admission import Admission
    from tessera.tenancy.settlement import Ticket

logger = logging.getLogger(__name__)

LOCK_KEY = "tessera:billing:settler-lock"
# The lock frees itself after this even if its holder died mid-pass, milliseconds.
LOCK_TTL_MS = 60_000
_RELEASE_LUA = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
# Tickets read and billed per round trip; a pass goes on until fewer are due.
BATCH = 200


def next_pass_in(now: float, interval_s: float, fraction: float) -> float:
    """Seconds from ``now`` (monotonic) to the next pass: ``fraction`` of the interval (drawn from [0.5, 1.0), so
    the workers do not all ask at once), then on to the server tick's next instant (``SERVER_TICK_S`` on the
    monotonic clock, as lean_server.py sleeps; the interval itself where that is shorter)."""
    return instant_at_or_after(now + interval_s * fraction, min(SERVER_TICK_S, interval_s)) - now


@dataclass(slots=True)
class SettleReport:
    """What one pass billed: from engine records, whole reservations, and tickets billed by someone else
    meanwhile (their gateway after all, or another settler)."""

    num_from_engine: int = 0
    num_reservations: int = 0
    num_already_billed: int = 0

    @property
    def num_seen(self) -> int:
        return self.num_from_engine + self.num_reservations + self.num_already_billed


class Settler:
    def __init__(self, redis: aioredis.Redis, admission: Admission, interval_s: float, grace_s: float) -> None:
        if interval_s <= 0 or grace_s < 0:
            raise ValueError(f"settler needs interval_s > 0 and grace_s >= 0, got {interval_s}, {grace_s}")
        self._redis = redis
        self._admission = admission
        self.interval_s = interval_s
        self.grace_s = grace_s
        self._token = secrets.token_hex(8)

    async def run(self) -> None:
        """Tries a pass every ``interval_s`` or so (``next_pass_in``) until cancelled."""
        while True:
            raise_if_cancelled()  # one lost on the way (swallowed_cancel.py: the second line)
            await asyncio.sleep(next_pass_in(time.monotonic(), self.interval_s, random.uniform(0.5, 1.0)))
            try:
                if (await self._admission.any_due(self.grace_s)
                        and await self._redis.set(LOCK_KEY, self._token, nx=True, px=LOCK_TTL_MS)):
                    try:
                        await self.settle_due()
                    finally:
                        await self._redis.eval(_RELEASE_LUA, 1, LOCK_KEY, self._token)
            except STORE_ERRORS as exc:
                logger.warning("settler pass skipped: Redis did not answer (%s)", exc)
            except Exception:
                # A background loop outlives a bad pass; the next one tries again (and logs again).
                logger.exception("settler pass failed")

    async def settle_due(self) -> SettleReport:
        """Bills every ticket that is due now."""
        report = SettleReport()
        while True:
            tickets = await self._admission.due_tickets(self.grace_s, BATCH)
            for ticket, attempts in zip(tickets, await self._engine_records(tickets), strict=True):
                charge = decide(ticket, attempts)
                when = datetime.fromtimestamp(ticket.admitted_at, UTC)
                if not await self._admission.settle(ticket, charge, when):
                    report.num_already_billed += 1
                elif charge.kind is SettleKind.ENGINE:
                    report.num_from_engine += 1
                    logger.info("request %s of tenant %s (gateway gone) billed from the engine's record: %d + %d "
                                "tokens", ticket.engine_request_id, ticket.tenant, charge.prompt_tokens,
                                charge.completion_tokens)
                else:
                    report.num_reservations += 1
                    logger.warning("request %s of tenant %s (gateway gone, no engine record) charged its whole "
                                   "reservation: %d tokens", ticket.engine_request_id or ticket.lease_id,
                                   ticket.tenant, charge.total_tokens)
            if len(tickets) < BATCH:
                return report

    async def _engine_records(self, tickets: list[Ticket]) -> list[list[AttemptUsage]]:
        pipe = self._redis.pipeline(transaction=False)
        asked = [t for t in tickets if t.engine_request_id]
        for ticket in asked:
            pipe.hgetall(usage_record_key(ticket.engine_request_id))
        records = dict(zip((t.member for t in asked), await pipe.execute() if asked else [], strict=True))
        return [[AttemptUsage(prompt, output) for prompt, output in parse_usage(records.get(t.member) or {})]
                for t in tickets]
