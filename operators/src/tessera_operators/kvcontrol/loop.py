"""One control loop per engine: the I/O around the ledger (ledger.py) and the decisions (policy.py).

Two tasks share the loop's state:

* ``_consume`` subscribes to the engine's KV events (``EngineRecord.kv_events_endpoint``) and applies every
  batch to the ledger the moment it arrives; evictions wait for the next poll to learn "free blocks after".
* ``_control`` polls ``GET /stats`` and ``GET /requests`` every ``poll_interval_s``, emits the pending
  eviction spans, ends the previous tick's action spans (their "free blocks after"), builds a snapshot,
  asks ``decide`` and applies the actions: demotion flags, the engine's pressure flag (both with a TTL it
  refreshes while they hold) and ``POST /abort``.

After lost KV events the ledger starts over and, until resync.py says it is whole again, the ticks hold
the actions it drives (``actions_while_stale``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import redis.asyncio as aioredis
from opentelemetry import trace
from opentelemetry.context import Context

from tessera.data_plane_auth import Signer
from tessera.registry import EngineRecord, pressure_key
from tessera.swallowed_cancel import raise_if_cancelled
from tessera.tenancy.demotion import clear_demoted, set_demoted

from .directory import DemotionBook, TenantDirectory
from .events import ledger_bursts
from .ledger import KVLedger, LedgerUpdate, tenant_of
from .metrics import ControllerMetrics
from .policy import (
    Abort,
    Action,
    ClearPressure,
    ControlSnapshot,
    Demote,
    InFlightRequest,
    PolicyConfig,
    Restore,
    SetPressure,
    TenantUsage,
    action_name,
    decide,
)
from .resync import ResyncView, actions_while_stale, is_stale
from .spans import links_to, parent_context, to_ns

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LoopContext:
    """What every loop of one controller process shares."""

    redis: aioredis.Redis
    http: aiohttp.ClientSession
    tenants: TenantDirectory
    demotions: DemotionBook
    metrics: ControllerMetrics
    policy: PolicyConfig
    poll_interval_s: float = 0.2
    flag_ttl_s: int = 10
    observe_only: bool = False
    shard: int = 0  # this process's controller shard: its demotion flags are its own (tenancy/demotion.py)
    # The live engines as the controller's discovery last read them (with their pressure flags): a tick
    # never waits on Redis to decide.
    live_engines: dict[str, EngineRecord] = field(default_factory=dict)
    # Signs every call to a replica with the data-plane key (the controller always has one; None only in
    # tests whose loops call no replica).
    signer: Signer | None = None

    def signed(self, method: str, path: str, body: bytes = b"") -> dict[str, str]:
        return self.signer.headers(method, path, body) if self.signer is not None else {}


@dataclass(slots=True)
class EngineState:
    num_gpu_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int


class EngineControlLoop:
    def __init__(self, record: EngineRecord, ctx: LoopContext) -> None:
        self.record = record
        self.engine_id = record.engine_id
        self.ctx = ctx
        self.ledger = KVLedger()
        self.tracer = trace.get_tracer("tessera.kvcontrol")
        self.state: EngineState | None = None
        self.requests: dict[str, InFlightRequest] = {}
        # Requests seen in a poll within the policy's active window (a demotion links to them).
        self.recent: dict[str, tuple[InFlightRequest, float]] = {}
        self.under_pressure = False
        self.demoting: set[str] = set()
        self._last_abort: float | None = None
        self._below_low_since: float | None = None
        self._starved_logged = float("-inf")
        self._flags_refreshed = 0.0
        self._pending_evictions: list[tuple[LedgerUpdate, int | None, dict[str, list[str]]]] = []
        self._open_spans: list[Any] = []
        self._reset_at: float | None = None  # time.monotonic() of the ledger's last reset on a gap, until whole

    # ---- lifecycle -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Runs until cancelled; then gives back its flags."""
        tasks = [asyncio.create_task(self._consume()), asyncio.create_task(self._control())]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.shield(self._release())

    async def _release(self) -> None:
        for span in self._open_spans:
            span.end()
        self._open_spans.clear()
        try:
            for tenant in list(self.demoting):
                if self.ctx.demotions.restore(tenant, self.engine_id):
                    await clear_demoted(self.ctx.redis, tenant, self.ctx.shard)
            if self.under_pressure:
                await self.ctx.redis.delete(pressure_key(self.engine_id))
        except Exception as exc:  # best effort; the flags' TTLs clean up anyway
            logger.warning("releasing flags of %s failed: %s", self.engine_id, exc)
        self.demoting.clear()
        self.under_pressure = False
        self.ctx.metrics.forget_engine(self.engine_id)

    # ---- KV events -------------------------------------------------------------------------------

    async def _consume(self) -> None:
        # Every batch already queued comes at once (events.py): one wake-up per burst, not per batch.
        async for burst in ledger_bursts(self.record.kv_events_endpoint):
            for batch in burst:
                self.on_batch(batch)
            # A queued message does not suspend the receive: yield, or a burst of events starves the polls.
            await asyncio.sleep(0)

    def on_batch(self, batch: Any) -> LedgerUpdate:
        unknown = self.ledger.num_unknown_removals
        update = self.ledger.apply(batch)
        metrics = self.ctx.metrics
        # The batch's ts is the engine's wall clock when it published (vLLM's, and the sim's): the lag includes
        # the time the batch waited in the socket and for this loop's turn.
        metrics.observe_batch(self.engine_id, len(batch.ops), time.time() - batch.ts)
        if self.ledger.num_unknown_removals > unknown:
            metrics.unknown_removals.labels(self.engine_id).inc(self.ledger.num_unknown_removals - unknown)
        if update.missed_batches:
            metrics.missed.labels(self.engine_id).inc(update.missed_batches)
            self._reset_at = time.monotonic()
            metrics.ledger_stale.labels(self.engine_id).set(1)
            logger.warning("%s: %d KV event batches lost before seq %d; the ledger starts over and holds its "
                           "decisions until it is whole again", self.engine_id, update.missed_batches, update.seq)
        if update.evictions:
            free_before = self.state.num_free_blocks if self.state else None
            evictors = {e.evicted_by for e in update.evictions if e.evicted_by is not None}
            salts = self.ctx.tenants.salt_to_tenant
            by_tenant: dict[str, list[str]] = defaultdict(list)
            for req in self.requests.values():
                by_tenant[req.tenant].append(req.traceparent)
            links = {tenant_of(o, salts): by_tenant.get(tenant_of(o, salts), []) for o in evictors}
            self._pending_evictions.append((update, free_before, links))
        return update

    def _emit_evictions(self, free_after: int) -> None:
        salts = self.ctx.tenants.salt_to_tenant
        for update, free_before, links in self._pending_evictions:
            groups: dict[str, list[Any]] = defaultdict(list)
            for eviction in update.evictions:
                groups[tenant_of(eviction.owner, salts)].append(eviction)
            for tenant, evictions in groups.items():
                evicted_by = sorted({tenant_of(e.evicted_by, salts) for e in evictions if e.evicted_by})
                cause = ("unattributed" if not evicted_by else
                         "same_tenant" if evicted_by == [tenant] else "cross_tenant")
                self.ctx.metrics.evictions.labels(self.engine_id, tenant, cause).inc(len(evictions))
                start = to_ns(update.ts)
                span = self.tracer.start_span(
                    "kvcontrol.eviction", context=Context(), start_time=start,
                    links=links_to([tp for t in evicted_by for tp in links.get(t, [])], "evictor"),
                    attributes={"tessera.engine": self.engine_id, "tessera.tenant": tenant,
                                "tessera.cause": cause, "tessera.kv.blocks": len(evictions),
                                "tessera.kv.evicted_by": ",".join(evicted_by),
                                "tessera.kv.free_blocks_before": -1 if free_before is None else free_before,
                                "tessera.kv.free_blocks_after": free_after,
                                "tessera.kv.block_size": self.record.block_size,
                                "tessera.kv.batch_seq": update.seq})
                chains: dict[int, list[int]] = defaultdict(list)
                for e in evictions:
                    chains[e.root].append(e.depth)
                for root, depths in chains.items():
                    span.add_event("evicted_prefix", timestamp=start, attributes={
                        "tessera.kv.prefix_root": f"{root:016x}", "tessera.kv.depth_min": min(depths),
                        "tessera.kv.depth_max": max(depths), "tessera.kv.blocks": len(depths)})
                span.end(end_time=start)
        self._pending_evictions.clear()

    # ---- polling and deciding --------------------------------------------------------------------

    async def _control(self) -> None:
        while True:
            raise_if_cancelled()  # one lost on the way (swallowed_cancel.py: the second line)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # one failed tick must not stop the loop
                self.ctx.metrics.errors.labels(self.engine_id, "tick").inc()
                logger.warning("control tick of %s failed: %s", self.engine_id, exc)
            await asyncio.sleep(self.ctx.poll_interval_s)

    async def _get(self, path: str) -> Any:
        # Generous: a busy replica answers late, and a late answer is still better than a failed tick.
        timeout = aiohttp.ClientTimeout(total=max(5.0, 10 * self.ctx.poll_interval_s))
        async with self.ctx.http.get(f"{self.record.url}{path}", timeout=timeout,
                                     headers=self.ctx.signed("GET", path)) as resp:
            resp.raise_for_status()
            return await resp.json()

    async def poll(self) -> EngineState:
        stats, entries = await asyncio.gather(self._get("/stats"), self._get("/requests"))
        now = time.time()
        self.requests = {
            e["request_id"]: InFlightRequest(e["request_id"], e.get("tenant", ""), int(e.get("priority", 0)),
                                             max(0.0, now - float(e.get("started_ts", now))),
                                             e.get("traceparent", "") or "")
            for e in entries if not e.get("abort_reason")
        }
        seen = time.monotonic()
        self.recent.update({rid: (req, seen) for rid, req in self.requests.items()})
        for rid in [r for r, (_, t) in self.recent.items() if seen - t > self.ctx.policy.active_window_s]:
            del self.recent[rid]
        # vLLM's usage excludes its one reserved null block.
        usable = max(1, int(stats["num_gpu_blocks"]) - 1)
        free = round(usable * (1.0 - float(stats["kv_cache_usage"])))
        if not entries:
            # NOTE: vLLM reports stats per step, so an idle engine's /stats still shows its last busy step.
            # The host serves every request the engine has; with none in flight no block is held.
            free = usable
        state = EngineState(usable, free, int(stats["num_running"]), int(stats["num_waiting"]))
        self.state = state
        return state

    async def tick(self) -> list[Action]:
        state = await self.poll()
        self.observe(state)
        if self.ctx.observe_only:
            return []
        snapshot = await self.snapshot(state)
        actions = decide(snapshot, self.ctx.policy)
        if self.ledger_stale(state):
            actions = actions_while_stale(actions)
        if logger.isEnabledFor(logging.DEBUG) and (snapshot.requests or actions):
            logger.debug("%s: free %d/%d, %d running, %d waiting, relief %d, pressure %s; tenants %s; "
                         "requests %s -> %s", self.engine_id, state.num_free_blocks, state.num_gpu_blocks,
                         state.num_running, state.num_waiting, snapshot.num_relief_engines, self.under_pressure,
                         [(t.tenant, t.num_blocks, t.quota_blocks, t.num_in_flight) for t in snapshot.tenants],
                         [(r.tenant, r.priority, round(r.age_s, 2)) for r in snapshot.requests], actions)
        for action in actions:
            await self.apply(action, snapshot)
        await self._refresh_flags()
        return actions

    def ledger_stale(self, state: EngineState) -> bool:
        """Whether the ledger, reset on a gap, is still short of the engine's pool (resync.py); the first
        tick that finds it whole forgets the reset."""
        if self._reset_at is None:
            return False
        ledger = self.ledger
        view = ResyncView(time.monotonic() - self._reset_at, ledger.stores_since_reset, ledger.cleared_since_reset)
        if is_stale(view, state.num_gpu_blocks, self.ctx.policy.resync_max_s):
            return True
        logger.info("%s: the ledger is whole again (%d blocks stored since its reset, cleared: %s)",
                    self.engine_id, ledger.stores_since_reset, ledger.cleared_since_reset)
        self._reset_at = None
        self.ctx.metrics.ledger_stale.labels(self.engine_id).set(0)
        return False

    def observe(self, state: EngineState) -> None:
        """A fresh poll: emit the eviction spans waiting for it, end the last tick's action spans (both learn
        "free blocks after" here) and export the gauges."""
        self._emit_evictions(state.num_free_blocks)
        for span in self._open_spans:
            span.set_attribute("tessera.kv.free_blocks_after", state.num_free_blocks)
            span.end()
        self._open_spans.clear()
        self._export_metrics(state)

    def _export_metrics(self, state: EngineState) -> None:
        m = self.ctx.metrics
        m.blocks_total.labels(self.engine_id).set(state.num_gpu_blocks)
        m.blocks_used.labels(self.engine_id).set(state.num_gpu_blocks - state.num_free_blocks)
        m.requests.labels(self.engine_id, "running").set(state.num_running)
        m.requests.labels(self.engine_id, "waiting").set(state.num_waiting)
        m.pressure.labels(self.engine_id).set(1 if self.under_pressure else 0)
        m.set_tenant_blocks(self.engine_id, self.ledger.owner_blocks(self.ctx.tenants.salt_to_tenant))

    async def snapshot(self, state: EngineState) -> ControlSnapshot:
        salts = self.ctx.tenants.salt_to_tenant
        blocks = self.ledger.owner_blocks(salts)
        last_store = self.ledger.last_store_by_tenant(salts)
        in_flight = Counter(r.tenant for r in self.requests.values())
        now = time.time()
        usages = []
        for tenant in sorted(set(blocks) | set(in_flight) | self.demoting):
            quota = self.ctx.tenants.quota_blocks(tenant, state.num_gpu_blocks)
            if quota is not None:
                since = now - last_store[tenant] if tenant in last_store else None
                usages.append(TenantUsage(tenant, blocks.get(tenant, 0), quota, in_flight.get(tenant, 0),
                                          tenant in self.demoting, since))
        relief = 0
        if state.num_free_blocks <= self.ctx.policy.abort_free_blocks and state.num_waiting:
            relief = self._relief_engines()
            if not relief and time.monotonic() - self._starved_logged > 10.0:
                self._starved_logged = time.monotonic()
                logger.info("%s: %d free blocks, %d waiting, and no other engine to continue a request on",
                            self.engine_id, state.num_free_blocks, state.num_waiting)
        mono = time.monotonic()
        since = None if self._last_abort is None else mono - self._last_abort
        usage = 1.0 - state.num_free_blocks / state.num_gpu_blocks
        if usage > self.ctx.policy.low_watermark:
            self._below_low_since = None
        elif self._below_low_since is None:
            self._below_low_since = mono
        below = 0.0 if self._below_low_since is None else mono - self._below_low_since
        return ControlSnapshot(self.engine_id, state.num_gpu_blocks, state.num_free_blocks, state.num_running,
                               state.num_waiting, self.under_pressure, tuple(usages),
                               tuple(self.requests.values()), relief, since, below)

    def _relief_engines(self) -> int:
        return sum(1 for e in self.ctx.live_engines.values() if e.model == self.record.model
                   and e.engine_id != self.engine_id and not e.under_pressure)

    # ---- acting ----------------------------------------------------------------------------------

    async def apply(self, action: Action, snapshot: ControlSnapshot) -> None:
        attributes: dict[str, Any] = {"tessera.engine": self.engine_id, "tessera.cause": action.cause,
                                      "tessera.kv.free_blocks_before": snapshot.num_free_blocks,
                                      "tessera.kv.block_size": self.record.block_size}
        context: Context | None = Context()
        traceparents: list[str] = []
        tenant = ""
        redis, ttl = self.ctx.redis, self.ctx.flag_ttl_s
        if isinstance(action, Demote | Restore):
            tenant = action.tenant
            attributes.update({"tessera.kv.blocks": action.num_blocks, "tessera.kv.quota_blocks": action.quota_blocks})
            traceparents = [r.traceparent for r, _ in self.recent.values() if r.tenant == tenant]
            if isinstance(action, Demote):
                self.ctx.demotions.demote(tenant, self.engine_id)
                self.demoting.add(tenant)
                await set_demoted(redis, tenant, f"{self.engine_id}: {action.cause}", ttl, self.ctx.shard)
            else:
                self.demoting.discard(tenant)
                if self.ctx.demotions.restore(tenant, self.engine_id):
                    await clear_demoted(redis, tenant, self.ctx.shard)
        elif isinstance(action, SetPressure | ClearPressure):
            attributes["tessera.kv.usage"] = round(action.usage, 4)
            traceparents = [r.traceparent for r in self.requests.values()]
            if isinstance(action, SetPressure):
                await redis.set(pressure_key(self.engine_id), action.cause, ex=ttl)
                self.under_pressure = True
            else:
                await redis.delete(pressure_key(self.engine_id))
                self.under_pressure = False
        elif isinstance(action, Abort):
            request = action.request
            tenant = request.tenant
            attributes.update({"tessera.engine_request_id": request.request_id, "tessera.priority": request.priority,
                               "tessera.kv.blocks": snapshot.num_gpu_blocks - snapshot.num_free_blocks})
            traceparents = [request.traceparent]
            context = parent_context(request.traceparent) or Context()
            self._last_abort = time.monotonic()
            attributes["tessera.abort.result"] = await self._abort(request.request_id, action.cause)
        attributes["tessera.tenant"] = tenant
        name = action_name(action)
        self.ctx.metrics.actions.labels(self.engine_id, name, tenant).inc()
        span = self.tracer.start_span(f"kvcontrol.{name}", context=context, attributes=attributes,
                                      links=links_to(traceparents, "affected"))
        self._open_spans.append(span)
        logger.info("%s on %s: %s %s", name, self.engine_id, tenant, action.cause)

    async def _abort(self, request_id: str, cause: str) -> str:
        body = orjson.dumps({"request_id": request_id, "reason": cause})
        async with self.ctx.http.post(f"{self.record.url}/abort", data=body,
                                      headers={"content-type": "application/json",
                                               **self.ctx.signed("POST", "/abort", body)},
                                      timeout=aiohttp.ClientTimeout(total=5)) as resp:
            if resp.status == 404:
                return "not_running"
            resp.raise_for_status()
            return "aborted"

    async def _refresh_flags(self) -> None:
        if time.monotonic() - self._flags_refreshed < self.ctx.flag_ttl_s / 3:
            return
        self._flags_refreshed = time.monotonic()
        for tenant in self.demoting:
            await set_demoted(self.ctx.redis, tenant, f"{self.engine_id}: over_kv_quota", self.ctx.flag_ttl_s,
                              self.ctx.shard)
        if self.under_pressure:
            await self.ctx.redis.set(pressure_key(self.engine_id), "kv_pressure", ex=self.ctx.flag_ttl_s)
