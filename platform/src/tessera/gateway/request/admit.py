"""Phase ``admit``: shed under KV pressure (503), then admission in one Redis round trip (429 when a limit
is reached) that also brings the tenant's demotion flag and the route's prefix lookup.

Routing waits for admission's verdict. With the gateway's local prefix index (``TESSERA_PREFIX_INDEX=local``)
the plan carries no lookup and the round trip is admission, the demotion flag and the local index's read of the
engines' KV events since its last (``LocalIndexFeed.ride``: the route then sees every batch published before
this admission, with no wake-up of the feed's own per batch); with the Redis index
the prefix lookup rides in admission's round trip (``tenancy/admission_trip.py``): a rejected request costs no
routing work beyond that, an admitted one saves a round trip. So the route's plan (the cached registry, no
Redis call as a rule) is made here, before the trip. The lookup is left out for a tenant this process rejected
within ``REJECTED_HINT_S`` (a flood of over-limit requests then costs Redis no lookups); the route then does
its own.

While the request runs, its concurrency lease is renewed every third of its TTL (``LeaseKeeper``). The
admission also leaves the request's ticket (tenancy/settlement.py), naming its engine request id: the response
id is made here for that. A round trip that fails may still have admitted: that admission is voided as soon
as Redis answers (``FinishQueue.void``), so its reservation never outlives the error the client got.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, NamedTuple

from tessera.gateway.errors import STORE_ERRORS, APIError
from tessera.gateway.request.call import engine_request_id, new_response_id
from tessera.gateway.request.route import route_request
from tessera.redis_wire import RedisWire
from tessera.tenancy.admission import Admission, Lease, Rejection
from tessera.tenancy.admission_trip import build_trip, parse_trip
from tessera.tenancy.policy import PRIORITY_VALUES

if TYPE_CHECKING:
    from tessera.gateway.failopen import FailOpen
    from tessera.gateway.metrics import GatewayMetrics
    from tessera.gateway.request.context import RequestContext
    from tessera.routing.router import RoutePlan, Router
    from tessera.tenancy.billing import FinishQueue
    from tessera.tenancy.store import Tenant

logger = logging.getLogger(__name__)

# Admission under KV pressure: while every engine of the model carries the controller's pressure flag,
# requests of the low and batch classes get 503 + Retry-After (they are the deferrable ones); the others
# are admitted and queue in the engine by priority.
SHED_UNDER_PRESSURE_FROM = PRIORITY_VALUES["low"]
# A tenant rejected within this long gets its next admission without the prefix lookup riding along.
REJECTED_HINT_S = 1.0
MAX_REJECTION_HINTS = 10_000
# How soon a lease renewal that Redis did not answer is tried again.
LEASE_RETRY_S = 0.25


class Admitted(NamedTuple):
    """What admission's round trip brings back: the verdict, the prefix lookup's answer (None: it did not
    ride along or failed; the route then looks up itself) and whether the tenant is demoted."""

    decision: Lease | Rejection
    cached: dict[str, int] | None
    demoted: bool


class Admitter:
    def __init__(self, admission: Admission, wire: RedisWire, router: Router, metrics: GatewayMetrics,
                 fail_open: FailOpen, finishes: FinishQueue | None = None) -> None:
        self.admission = admission
        self._finishes = finishes
        self._wire = wire
        self._router = router
        self._metrics = metrics
        self._fail_open = fail_open
        # tenant -> when this process last rejected it
        self._rejected_at: dict[str, float] = {}

    async def run(self, ctx: RequestContext) -> None:
        tenant, body = ctx.tenant, ctx.body
        if tenant.policy.priority >= SHED_UNDER_PRESSURE_FROM and await self._all_engines_pressured(body.model):
            self._metrics.rejected(tenant.name, "engine_under_pressure")
            ctx.notes.attributes["tessera.rejected"] = "engine_under_pressure"
            raise APIError(503, f"Every engine serving {body.model!r} is short of KV cache; low and batch "
                           "priority requests wait until it frees.", "engine_under_pressure",
                           headers={"Retry-After": "1"})
        ctx.route_request = route_request(ctx, self._router.policy_name)
        # None when the registry cannot be read: the route tries again after admission (by the fail mode).
        ctx.plan = await self._fail_open.optional(self._router.plan(ctx.route_request), None)
        t_admit, t_admit_ns = time.monotonic(), time.time_ns()
        ctx.response_id = new_response_id(ctx.endpoint.id_prefix)
        decision, ctx.cached, ctx.demoted = await self.admit(tenant, ctx.num_prompt_tokens + ctx.max_tokens * body.n,
                                                             ctx.plan, ctx.num_prompt_tokens,
                                                             engine_request_id(tenant.name, ctx.response_id))
        ctx.notes.child("admission", t_admit_ns, {"tessera.admitted": isinstance(decision, Lease)})
        if isinstance(decision, Rejection):
            self.note_rejected(tenant.name)
            self._metrics.rejected(tenant.name, decision.limit)
            ctx.notes.attributes["tessera.rejected"] = decision.limit
            raise APIError(429, decision.message, decision.limit,
                           headers={"Retry-After": str(decision.retry_after_s or 1)})
        ctx.lease = decision
        ctx.notes.attributes["tessera.admission_wait_s"] = time.monotonic() - t_admit

    async def admit(self, tenant: Tenant, reserve_tokens: int, plan: RoutePlan | None, prompt_tokens: int = 0,
                    request_id: str = "") -> Admitted:
        """Admission with the demotion flag and, unless the tenant was rejected moments ago or the plan needs
        none, the plan's prefix lookup, in one round trip. Redis unreachable: by the fail mode, and the
        admission it may have made is voided. ``prompt_tokens`` and the engine ``request_id`` go on the ticket."""
        recently_rejected = time.monotonic() - self._rejected_at.get(tenant.name, -1e9) < REJECTED_HINT_S
        lookup = None if plan is None or recently_rejected else plan.lookup
        # On the local index the prefix index's event stream is read here instead (routing/local_feed.py).
        ride = self._router.feed_ride(plan) if lookup is None and plan is not None else None
        trip = build_trip(self.admission, tenant.name, tenant.policy, reserve_tokens,
                          lookup if ride is None else ride, prompt_tokens, request_id)
        try:
            reply = await parse_trip(self.admission, trip, await self._wire.execute(trip.commands))
        except STORE_ERRORS as exc:
            # The script may have run and only its reply been lost: undo it once Redis answers.
            if self._finishes is not None:
                self._finishes.void(trip.call.lease)
            self._fail_open.admit_without_store(exc)
            self._metrics.fail_open(tenant.name)
            return Admitted(self.admission.detached_lease(tenant.name, tenant.policy), None, False)
        if ride is not None:
            self._router.take_feed_ride(reply.extra)
        if plan is not None and plan.lookup is None:
            cached: dict[str, int] | None = {}  # nothing to look up: the route needs no lookup either
        elif lookup is None or isinstance(reply.extra, Exception):
            cached = None  # not sent, or failed (NOSCRIPT: the route's own lookup loads the script)
        else:
            cached = self._router.parse_lookup(reply.extra)
        return Admitted(reply.decision, cached, reply.demoted)

    def note_rejected(self, tenant: str) -> None:
        if len(self._rejected_at) >= MAX_REJECTION_HINTS:
            self._rejected_at.clear()
        self._rejected_at[tenant] = time.monotonic()

    async def _all_engines_pressured(self, model: str) -> bool:
        """True while the KV-eviction controller flags every live engine of the model (the router's cached
        registry view); a registry that cannot be read sheds nothing."""
        records = await self._fail_open.optional(self._router.engines(model), [])
        return bool(records) and all(r.under_pressure for r in records)

    def keep_lease(self, lease: Lease) -> LeaseKeeper | None:
        """Renews ``lease`` while the request runs (None for a detached lease: nothing to renew)."""
        if lease.detached:
            return None
        return LeaseKeeper(lambda: self._renew_loop(lease), self.admission.lease_ttl_s / 3)

    async def _renew_loop(self, lease: Lease) -> None:
        """Renews the concurrency lease every third of its TTL (long streams keep their slot; a dead gateway
        stops renewing and the lease expires). A failed renewal is retried soon rather than a third of a TTL
        later: by then the lease may be gone."""
        admission = self.admission
        while True:
            try:
                renewed = await admission.renew(lease)
            except STORE_ERRORS as exc:
                logger.warning("lease %s not renewed: %s", lease.lease_id, exc)
                await asyncio.sleep(min(admission.lease_ttl_s / 3, LEASE_RETRY_S))
                continue
            if not renewed:
                logger.warning("lease %s of tenant %s expired before renewal", lease.lease_id, lease.tenant)
                return
            await asyncio.sleep(admission.lease_ttl_s / 3)


class LeaseKeeper:
    """A coroutine run as a task from ``delay_s`` on, cancellable before and after it starts. Until then it
    is a timer: on the request path that is cheaper than a task whose first step only goes to sleep."""

    def __init__(self, start: Callable[[], Coroutine[Any, Any, None]], delay_s: float) -> None:
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(delay_s, self._start, start)

    def _start(self, start: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._task = asyncio.ensure_future(start())

    def cancel(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
