"""Admission: requests/min, tokens/min, concurrency and budget in one atomic Lua call on Redis.

Invariants (tested exactly in tests/integration/tenancy/test_admission.py):
- Across any number of gateway processes, at most ``requests_per_minute`` requests are admitted in any
  sliding 60 s window of Redis time, and at most ``max_concurrent_requests`` hold an unexpired lease.
- Tokens/min and budget are charged ``prompt + max_tokens`` at admission and corrected to the actual
  usage by ``finish``; a failed request is charged what it really consumed (possibly 0). Since actual
  usage never exceeds the reservation, the charged total never exceeds the limit.
- Every key written has a TTL: a gateway that dies mid-request leaks nothing past the lease TTL.
- ``finish`` counts a lease once, however often it is retried, and once only between its gateway's finish,
  the settler's (settlement.py: the gateway died) and a void (the admission's reply was lost).
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from tessera.redis_wire import RedisWire, run_script, unhurried_failure
from tessera.tenancy.periods import PERIODS, USAGE_RETENTION_S, check_period, period_window
from tessera.tenancy.policy import TenantPolicy
from tessera.tenancy.settlement import Charge, SettleKind, Ticket, parse_ticket, ticket_member
from tessera.unique_ids import UniqueIds

logger = logging.getLogger(__name__)

LEASE_TTL_S = 30.0
# A finished lease's marker outlives every retry of its finish (see ``billing.FinishQueue``).
FINISH_MARKER_TTL_S = 600
# A lease the settler billed keeps its marker longer: its gateway may come back (partitioned, or restarted
# with a journal of unrecorded finishes) much later, and must not bill it again. Few leases are settled.
SETTLED_MARKER_TTL_S = 7 * 86400
# The open-ticket set and the tickets hash (admission.lua) expire once no admission has touched them this long.
TICKET_RETENTION_S = 7 * 86400
# The usage fields finish.lua adds for the settler's charges (beside requests, prompt and completion tokens).
SETTLE_LABELS = ("settled_from_engine", "charged_reservation", "charged_reservation_tokens")
OPEN_TICKETS_KEY = "tessera:billing:open"
TICKETS_KEY = "tessera:billing:tickets"


# Period windows cached per (period, whole second): the budget TTL is whole seconds rounded up, so every
# instant of one second has the same window. Bounded: cleared past this many entries.
MAX_CACHED_WINDOWS = 64


def _lua(name: str) -> str:
    return resources.files("tessera.tenancy").joinpath(name).read_text()


def usage_key(tenant: str, period_id: str) -> str:
    return f"tessera:usage:{tenant}:{period_id}"


def limiter_keys(tenant: str, budget_period_id: str) -> list[str]:
    """KEYS[1..5] of admission.lua; every ``tessera:rl:*`` key has a TTL."""
    return [
        f"tessera:rl:{tenant}:rpm",
        f"tessera:rl:{tenant}:tpm",
        f"tessera:rl:{tenant}:tpm-tokens",
        f"tessera:rl:{tenant}:leases",
        f"tessera:rl:{tenant}:budget:{budget_period_id}",
    ]


def leases_key(tenant: str) -> str:
    return f"tessera:rl:{tenant}:leases"


def finish_marker_key(tenant: str, lease_id: str) -> str:
    return f"tessera:rl:{tenant}:done:{lease_id}"


@dataclass(frozen=True, slots=True)
class Lease:
    """An admitted request. ``detached``: admitted without Redis (fail-open), so nothing is held or reserved;
    its finish still charges the budget and the usage once Redis answers."""

    lease_id: str
    tenant: str
    reserved_tokens: int
    keys: tuple[str, ...]
    detached: bool = False

    @property
    def ticket(self) -> str:
        return ticket_member(self.tenant, self.lease_id)


@dataclass(frozen=True, slots=True)
class Rejection:
    limit: str
    retry_after_s: int
    current: int
    maximum: int

    @property
    def message(self) -> str:
        if self.limit in ("tokens_per_minute", "token_budget") and self.current > self.maximum:
            return (f"Request needs {self.current} tokens (prompt + max_tokens) but the tenant's "
                    f"{self.limit} limit is {self.maximum}: lower max_tokens.")
        return (f"Rate limit exceeded: {self.limit} is {self.maximum} (currently {self.current}); "
                f"retry after {self.retry_after_s} s.")


def rejection_from_script(result: list[object]) -> Rejection:
    """Decodes ``{0, limit_name, retry_after_ms, current, limit}`` from admission.lua."""
    limit = result[1].decode() if isinstance(result[1], bytes) else str(result[1])
    retry_ms = int(result[2])  # type: ignore[call-overload]
    return Rejection(limit, max(1, math.ceil(retry_ms / 1000)) if retry_ms > 0 else 0,
                     int(result[3]), int(result[4]))  # type: ignore[call-overload]


@dataclass(frozen=True, slots=True)
class AdmitCall:
    """One prepared admission: the lease it grants if the script admits it, and the script's KEYS and ARGV."""

    lease: Lease
    keys: list[str]
    args: list[str | int | float]

    def outcome(self, result: list[object]) -> Lease | Rejection:
        return self.lease if int(result[0]) == 1 else rejection_from_script(result)  # type: ignore[call-overload]


class Admission:
    """``wire``: the request path's lean Redis connection (redis_wire.py), when the caller has one; every
    request's ``finish`` then goes over it (one write, hiredis parsing) instead of through redis-py."""

    def __init__(self, redis: aioredis.Redis, lease_ttl_s: float = LEASE_TTL_S, wire: RedisWire | None = None,
                 demotion_shards: int = 1) -> None:
        """``demotion_shards``: how many KV-controller shards set demotion flags (admission_trip.py reads
        every one's in the same round trip)."""
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be positive, got {lease_ttl_s}")
        if demotion_shards < 1:
            raise ValueError(f"demotion_shards must be at least 1, got {demotion_shards}")
        self._redis = redis
        self._wire = wire
        self.lease_ttl_s = lease_ttl_s
        self.demotion_shards = demotion_shards
        self._admit = redis.register_script(_lua("admission.lua"))
        self._finish = redis.register_script(_lua("finish.lua"))
        # Whether finish.lua is known loaded where the lean connection sends it (``send_finish``).
        self._finish_loaded = False
        self._renew = redis.register_script(_lua("renew.lua"))
        self._any_due = redis.register_script(_lua("any_due.lua"))
        self._lease_ids = UniqueIds()  # a random prefix per Admission and a counter
        self._windows: dict[tuple[str, int], tuple[str, int]] = {}

    def _window(self, period: str, when: datetime) -> tuple[str, int]:
        """``period_window``, computed once per period and second."""
        key = (period, int(when.timestamp()))
        window = self._windows.get(key)
        if window is None:
            if len(self._windows) >= MAX_CACHED_WINDOWS:
                self._windows.clear()
            window = self._windows[key] = period_window(period, when)
        return window

    def _lease_id(self) -> str:
        return self._lease_ids.next()

    async def admit(self, tenant: str, policy: TenantPolicy, reserve_tokens: int, prompt_tokens: int = 0,
                    engine_request_id: str = "") -> Lease | Rejection:
        call = self.prepare(tenant, policy, reserve_tokens, prompt_tokens, engine_request_id)
        return call.outcome(await self._admit(keys=call.keys, args=call.args))

    def prepare(self, tenant: str, policy: TenantPolicy, reserve_tokens: int, prompt_tokens: int = 0,
                engine_request_id: str = "") -> AdmitCall:
        """The admission as a script call, for a caller that sends it in one round trip with other commands
        (``admission_trip.build_trip`` and ``parse_trip``, which falls back to ``admit`` on NOSCRIPT).
        ``prompt_tokens`` and ``engine_request_id`` go on the request's ticket (settlement.py): the settler
        finds the engine's record by that id if the gateway dies."""
        period_id, budget_ttl = self._window(policy.budget_period, datetime.now(UTC))
        lease_id = self._lease_id()
        keys = [*limiter_keys(tenant, period_id), OPEN_TICKETS_KEY, TICKETS_KEY, finish_marker_key(tenant, lease_id)]
        args: list[str | int | float] = [
            policy.requests_per_minute or 0,
            policy.tokens_per_minute or 0,
            policy.max_concurrent_requests or 0,
            policy.token_budget or 0,
            reserve_tokens,
            lease_id,
            self.lease_ttl_s,
            budget_ttl,
            prompt_tokens,
            engine_request_id,
            ticket_member(tenant, lease_id),
            TICKET_RETENTION_S,
        ]
        return AdmitCall(Lease(lease_id, tenant, reserve_tokens, tuple(keys[:5])), keys, args)

    @property
    def admit_sha(self) -> str:
        return str(self._admit.sha)

    def detached_lease(self, tenant: str, policy: TenantPolicy) -> Lease:
        """The lease of a request admitted while Redis is unreachable (fail-open mode)."""
        period_id, _ = self._window(policy.budget_period, datetime.now(UTC))
        return Lease(self._lease_id(), tenant, 0, tuple(limiter_keys(tenant, period_id)), detached=True)

    async def renew(self, lease: Lease) -> bool:
        """Extends the lease by the TTL; False when it is already gone."""
        return bool(await self._renew(keys=[lease.keys[3], OPEN_TICKETS_KEY],
                                      args=[lease.lease_id, self.lease_ttl_s, lease.ticket]))

    async def finish(self, lease: Lease, prompt_tokens: int, completion_tokens: int,
                     now: datetime | None = None) -> bool:
        """Charges actual usage, frees the lease, adds to the usage of each period; False if already done
        (by this gateway, or by the settler after the lease expired)."""
        return await self._bill(lease, Charge(SettleKind.GATEWAY, prompt_tokens, completion_tokens),
                                now or datetime.now(UTC), FINISH_MARKER_TTL_S)

    async def void(self, lease: Lease) -> bool:
        """Undoes an admission whose reply was lost (the client got an error): its reservation, lease and
        ticket go, nothing is billed; if the admission has not run yet, it never will. False if the lease was
        billed already."""
        return await self._bill(lease, Charge(SettleKind.VOID, 0, 0), datetime.now(UTC), FINISH_MARKER_TTL_S)

    async def settle(self, ticket: Ticket, charge: Charge, when: datetime) -> bool:
        """Bills an expired ticket (the settler); False when its gateway or another settler billed it first.
        ``when``: the usage periods it counts in."""
        keys = (*limiter_keys(ticket.tenant, "")[:4], ticket.budget_key)
        lease = Lease(ticket.lease_id, ticket.tenant, ticket.reserved_tokens, keys)
        return await self._bill(lease, charge, when, SETTLED_MARKER_TTL_S)

    async def send_finish(self, lease: Lease, prompt_tokens: int, completion_tokens: int,
                          now: datetime) -> asyncio.Future[list[Any]] | None:
        """``finish`` as an unhurried call over the lean connection (redis_wire.py): returns once it is written,
        with the future of its reply ([1]: billed now, [0]: already billed, or an error reply such as
        NOSCRIPT in its place). Returns None having finished as ``finish`` does (reply awaited) where there is
        no lean connection, and where the script is not known to be loaded (the first finish, and the first
        after a NOSCRIPT reply: a Redis that restarted), so that one call loads it and the unhurried ones
        after it find it."""
        if self._wire is None or not self._finish_loaded:
            await self.finish(lease, prompt_tokens, completion_tokens, now)
            self._finish_loaded = self._wire is not None
            return None
        keys, args = self._bill_call(lease, Charge(SettleKind.GATEWAY, prompt_tokens, completion_tokens), now,
                                     FINISH_MARKER_TTL_S)
        reply = await self._wire.send_unhurried([("EVALSHA", self._finish.sha, len(keys), *keys, *args)])
        reply.add_done_callback(self._check_loaded)
        return reply

    def _check_loaded(self, reply: asyncio.Future[list[Any]]) -> None:
        if isinstance(unhurried_failure(reply), NoScriptError):
            self._finish_loaded = False

    def read_replies(self) -> None:
        """Has the lean connection read the unhurried calls' replies now (``send_finish``)."""
        if self._wire is not None:
            self._wire.read_replies()

    async def _bill(self, lease: Lease, charge: Charge, when: datetime, marker_ttl_s: int) -> bool:
        keys, args = self._bill_call(lease, charge, when, marker_ttl_s)
        return bool(await run_script(self._wire, self._finish, keys, args))

    def _bill_call(self, lease: Lease, charge: Charge, when: datetime, marker_ttl_s: int
                   ) -> tuple[list[str], list[str | int]]:
        """finish.lua's keys and arguments."""
        usage_keys = [usage_key(lease.tenant, self._window(p, when)[0]) for p in PERIODS]
        keys = [*lease.keys, *usage_keys, finish_marker_key(lease.tenant, lease.lease_id), OPEN_TICKETS_KEY,
                TICKETS_KEY]
        args: list[str | int] = [lease.lease_id, lease.reserved_tokens, charge.total_tokens, charge.prompt_tokens,
                                 charge.completion_tokens, *(USAGE_RETENTION_S[p] for p in PERIODS), marker_ttl_s,
                                 charge.kind.value, lease.ticket]
        return keys, args

    async def any_due(self, grace_s: float) -> bool:
        """Whether ``due_tickets`` would find one: a single round trip (over the lean connection when there is
        one), where the settler's pass before it made four through redis-py whatever it found."""
        return bool(await run_script(self._wire, self._any_due, [OPEN_TICKETS_KEY], [grace_s]))

    async def due_tickets(self, grace_s: float, limit: int) -> list[Ticket]:
        """At most ``limit`` open tickets ``grace_s`` past their settle-by time (Redis's clock), oldest first;
        a malformed one is dropped from the set and logged."""
        now_s, now_us = await self._redis.time()
        members = await self._redis.zrangebyscore(OPEN_TICKETS_KEY, "-inf", now_s + now_us / 1e6 - grace_s,
                                                  start=0, num=limit)
        if not members:
            return []
        names = [m.decode() if isinstance(m, bytes) else str(m) for m in members]
        values = await self._redis.hmget(TICKETS_KEY, names)
        tickets = []
        for name, value in zip(names, values, strict=True):
            try:
                if value is None:
                    raise ValueError(f"ticket {name!r} has no value")
                tickets.append(parse_ticket(name, value.decode() if isinstance(value, bytes) else str(value)))
            except ValueError as exc:
                # A ticket without its record cannot be billed: leaving it would make every pass find it.
                logger.error("open ticket dropped unbilled: %s", exc)
                await self._redis.zrem(OPEN_TICKETS_KEY, name)
        return tickets

    async def usage(self, tenant: str, period: str, when: datetime | None = None) -> dict[str, int | str]:
        """Requests and tokens of the tenant in the period containing ``when`` (default: now), with how many of
        the requests the settler billed after their gateway died: from the engine's record
        (``settled_from_engine``), or their whole reservation (``charged_reservation``, and its tokens)."""
        period_id, _ = period_window(check_period(period), when or datetime.now(UTC))
        raw = await self._redis.hgetall(usage_key(tenant, period_id))
        counts = {(k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in raw.items()}
        prompt, completion = counts.get("prompt_tokens", 0), counts.get("completion_tokens", 0)
        return {"period": period, "period_id": period_id, "requests": counts.get("requests", 0),
                "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                **{label: counts.get(label, 0) for label in SETTLE_LABELS}}

    async def in_flight(self, tenant: str) -> int:
        """Unexpired concurrency leases of the tenant (Redis's clock)."""
        now_s, now_us = await self._redis.time()
        return int(await self._redis.zcount(leases_key(tenant), f"({now_s + now_us / 1e6}", "+inf"))
