"""The gateway-side adapter around the pure policies: reads the registry and prefix index from Redis,
counts the requests in flight (its pod's shared table, or one of its own), and asks the configured policy for a
ranking.

Redis cost per request: one Lua call for the prefix lookup (only for policies that use it), which the
gateway sends in the same round trip as the admission (see ``plan``/``decide``). The registry
is re-read off the request path every ``refresh_s`` (``TESSERA_REGISTRY_REFRESH_S``) by a refresher that runs
while requests come (it stops after ``REFRESHER_IDLE_S`` without one), over the gateway's lean Redis
connection when it has one; a request reads it itself only when the copy is older than ``max_age_s``
(``TESSERA_REGISTRY_MAX_AGE_S``: the first request, or a refresher that Redis stalls).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tessera.redis_wire import Command, RedisWire
from tessera.refresher import REFRESHER_IDLE_S, UsageRefresher
from tessera.registry import EngineRecord, EngineRegistry
from tessera.routing.local_feed import LocalIndexFeed
from tessera.routing.local_index import LocalPrefixIndex
from tessera.routing.pod_in_flight import PodInFlight
from tessera.routing.pod_view import PodEngines
from tessera.routing.policies import make_policy, prepare_policy
from tessera.routing.prefill_clock import PrefillClock
from tessera.routing.prefix_index import PrefixIndex
from tessera.routing.snapshot import EngineView, RouteDecision, RouteRequest, RouteSnapshot

logger = logging.getLogger(__name__)

# The defaults of ``refresh_s``/``max_age_s`` for a Router built without them (tests, benches); the gateway
# passes its settings, whose defaults these equal. Engine load changes fast, but heartbeats come once a
# second (registry.py): a copy re-read more often holds nothing newer and costs a Redis round trip and an
# idle gateway's CPU each time. Between heartbeats, the policies see this process's own in-flight counts,
# which are current. The max age is twice the refresh period: a refresher on time never leaves a request
# to read inline.
REGISTRY_CACHE_S = 1.0
REGISTRY_MAX_AGE_S = 2.0
# How often one gateway process garbage-collects index entries of engines that left the registry.
SWEEP_INTERVAL_S = 30.0
# Policies that read the prefix index; the others skip the lookup round trip.
INDEX_POLICIES = frozenset({"prefix_affinity"})
# Where the prefix lookup is answered: "local", this process's LocalPrefixIndex (no Redis call; fed by
# local_feed.py), or "redis", the Lua lookup that rides in admission's round trip (the fallback).
INDEX_SOURCES = ("local", "redis")
# The local index's default cap, blocks (see local_index.py for the eviction order; ~120 bytes a block at
# 1,000 engines, docs/routing.md).
LOCAL_INDEX_MAX_BLOCKS = 2_000_000


def engine_view(record: EngineRecord) -> EngineView:
    return EngineView(record.engine_id, record.url, record.num_running, record.num_waiting, record.kv_cache_usage,
                      record.num_gpu_blocks, record.block_size, record.under_pressure,
                      record.pending_prefill_tokens)


class RoutePlan(NamedTuple):
    """A request's route before the prefix lookup: the live engines of its model, and the lookup as one Redis
    command (None when the policy or the prompt needs none), for a caller that sends it in a round trip of
    its own making (the gateway sends it with admission). ``lookup_args`` are that command's arguments. A
    NamedTuple, as the routing values made per request are (snapshot.py)."""

    request: RouteRequest
    records: list[EngineRecord]
    lookup_args: list[str | int] | None
    lookup: Command | None
    # The lookup is answered by the local index, at ``decide`` (which takes the live engines' mask then).
    local: bool = False


@dataclass(frozen=True, slots=True)
class _ModelView:
    """One model's live engines as of a registry read: the records, the policies' views, records by id."""

    records: list[EngineRecord]
    views: tuple[EngineView, ...]
    by_id: dict[str, EngineRecord]


def _model_views(engines: list[EngineRecord]) -> dict[str, _ModelView]:
    """Every model's view of a registry read, built as it is read (by the refresher, off the request path):
    at 1,000 engines the views cost about a millisecond, which the first request after each read paid."""
    by_model: dict[str, list[EngineRecord]] = {}
    for record in engines:
        by_model.setdefault(record.model, []).append(record)
    return {model: _ModelView(records, tuple(engine_view(r) for r in records), {r.engine_id: r for r in records})
            for model, records in by_model.items()}


# A model no live engine serves.
_EMPTY_VIEW = _ModelView([], (), {})

# A route: the policy's decision and the records of the engines it ranks (by engine id).
Routed = tuple[RouteDecision, dict[str, EngineRecord]]


class InFlight:
    """``with router.in_flight(engine_id, prefill_tokens) as flight:`` counts a request this process sent to
    an engine until it ends, and its prompt tokens to prefill there until ``flight.prefilled()`` (its first
    token) or its end, in ``loads`` (pod_in_flight.py: the pod's table, whose other workers see them too, or a
    one-worker gateway's private one), which the policies read (fresher than heartbeats). The prompt's
    dispatch and first token also go to ``clock`` (prefill_clock.py: the engine's prefill wait and the fit),
    and its wait to ``loads``. A plain class: the request path pays no generator frame for it."""

    __slots__ = ("_clock", "_engine_id", "_isolated", "_loads", "_ticket", "_tokens")

    def __init__(self, loads: PodInFlight, engine_id: str, tokens: int = 0, clock: PrefillClock | None = None,
                 isolated: bool = False) -> None:
        """``isolated``: the engine had nothing of the pod's to prefill as last seen (the fit's samples)."""
        self._loads = loads
        self._engine_id = engine_id
        self._tokens = tokens
        self._clock = clock
        self._isolated = isolated
        self._ticket = -1

    def __enter__(self) -> InFlight:
        clock, engine_id, tokens = self._clock, self._engine_id, self._tokens
        if clock is not None and tokens:
            self._ticket = clock.dispatch(engine_id, tokens, time.monotonic(), self._isolated)
        self._loads.add(engine_id, 1, tokens, clock.done_at(engine_id) if clock is not None and tokens else None)
        return self

    def prefilled(self) -> None:
        """The request's first token came: its prompt is no longer in the engine's prefill backlog (once)."""
        self._settle(True)

    def _settle(self, first_token: bool) -> None:
        """The prompt leaves the engine's backlog: at its first token, or at the request's end without one (whose
        time is no sample of a prefill)."""
        if not self._tokens:
            return
        clock = self._clock
        if clock is not None:
            if first_token:
                clock.first_token(self._engine_id, self._ticket, time.monotonic())
            else:
                clock.drop(self._engine_id, self._ticket)
        self._loads.add(self._engine_id, 0, -self._tokens,
                        clock.done_at(self._engine_id) if clock is not None else None)
        self._tokens = 0

    def __exit__(self, *_: object) -> None:
        self._settle(False)
        self._loads.add(self._engine_id, -1, 0)


class Router:
    def __init__(self, redis: aioredis.Redis, policy_name: str, prefix_index: PrefixIndex | None = None, *,
                 refresh_s: float | None = None, max_age_s: float | None = None,
                 wire: RedisWire | None = None, index_source: str = "redis",
                 local_index_max_blocks: int = LOCAL_INDEX_MAX_BLOCKS, feed_wire: RedisWire | None = None,
                 pod: PodInFlight | None = None) -> None:
        """``refresh_s``/``max_age_s``: the registry copy's refresh period and the age past which a request
        reads it itself (default ``REGISTRY_CACHE_S``/``REGISTRY_MAX_AGE_S``); ``wire``: the lean Redis
        connection the registry is read over (default: redis-py); ``index_source``: one of
        ``INDEX_SOURCES`` (the gateway passes ``TESSERA_PREFIX_INDEX``); ``local_index_max_blocks``: the
        local index's cap; ``feed_wire``: a lean connection for the local index feed's blocking reads alone
        (``LocalIndexFeed``'s ``wire``; never ``wire``, whose calls a blocking read would hold up); ``pod``: the
        pod's in-flight table (pod_in_flight.py), through which the policies see every worker's requests in
        flight, not this one's alone (None: a table of this process's own, ``PodInFlight.private``)."""
        if index_source not in INDEX_SOURCES:
            raise ValueError(f"unknown prefix index source {index_source!r}; valid: {', '.join(INDEX_SOURCES)}")
        self._registry = EngineRegistry(redis, wire=wire)
        self._max_age_s = REGISTRY_MAX_AGE_S if max_age_s is None else max_age_s
        self.policy_name = policy_name
        self._policy = make_policy(policy_name)
        self._prefix_index = prefix_index if policy_name in INDEX_POLICIES else None
        self._sweeper = prefix_index
        self._engines: list[EngineRecord] = []
        self._read_at = 0.0
        self._swept_at = time.monotonic()
        self._sweep_task: asyncio.Task[None] | None = None
        self._refresher = UsageRefresher("registry", self._read_registry,
                                         REGISTRY_CACHE_S if refresh_s is None else refresh_s, REFRESHER_IDLE_S)
        # Requests in flight per engine and their prompt tokens awaiting a first token: the pod's table, or this
        # process's own one-row table (no file: freed with the router, not closed, as a request ending after the
        # router's close still counts its end).
        self._loads = pod if pod is not None else PodInFlight.private()
        # This process's prompts awaiting their first token, with dispatch times, and the prefill-time fit
        # learned from them (prefill_clock.py); and the engines with the pod's prompts awaiting one as the last
        # decision read them (whether a dispatch is a sample of the fit: ``in_flight``).
        self._clock = PrefillClock()
        self._pending_tokens: Mapping[str, int] = {}
        self._counted_engines = PodEngines(())  # the counts' engines, at the last registry read
        self._feed: LocalIndexFeed | None = None
        self._feed_task: asyncio.Task[None] | None = None
        if self._prefix_index is not None and index_source == "local":
            self._feed = LocalIndexFeed(redis, LocalPrefixIndex(local_index_max_blocks), self._prefix_index,
                                        wire=feed_wire)
        # model -> (index generation, live mask), and model -> its engines, valid until the next registry read
        self._masks: dict[str, tuple[int, int]] = {}
        self._models: dict[str, _ModelView] = {}

    @property
    def local_feed(self) -> LocalIndexFeed | None:
        """The local index's feed (None when lookups go to Redis)."""
        return self._feed

    async def start_local_index(self) -> None:
        """Starts the local index's feed (the first ``plan`` does it otherwise); returns once it has loaded."""
        if self._feed is None:
            return
        self._ensure_feed()
        while not self._feed.ready:
            await asyncio.sleep(0.005)

    def _ensure_feed(self) -> None:
        if self._feed is not None and self._feed_task is None:
            self._feed_task = asyncio.get_running_loop().create_task(self._feed.run())

    async def engines(self, model: str) -> list[EngineRecord]:
        return (await self._model_view(model)).records

    async def _model_view(self, model: str) -> _ModelView:
        self._refresher.used()
        if time.monotonic() - self._read_at > self._max_age_s:
            await self._read_registry()
        return self._models.get(model) or _EMPTY_VIEW

    async def num_live_engines(self) -> int:
        """Live engines of every model, read from the registry now (readiness probes; not the request path)."""
        await self._read_registry()
        return len(self._engines)

    async def close(self) -> None:
        # The feed first: its stream read holds a pooled connection the refresher's last read may wait for.
        if self._feed is not None and self._feed_task is not None:
            self._feed.stop()
            await asyncio.gather(self._feed_task, return_exceptions=True)
        await self._refresher.close()
        if self._sweep_task is not None:
            self._sweep_task.cancel()
            await asyncio.gather(self._sweep_task, return_exceptions=True)

    async def _read_registry(self) -> None:
        started = time.monotonic()
        self._engines = await self._registry.live_engines()
        self._read_at = started
        self._counted_engines = PodEngines((e.engine_id for e in self._engines),
                                           {e.engine_id: e.load for e in self._engines})
        self._loads.use(self._counted_engines)
        self._models = _model_views(self._engines)
        # What each decision until the next read needs, built here (by the refresher, off the request path), not
        # by the first request after the read: the policy's fleets and the local index's live-engine masks.
        prepare_policy(self._policy, [view.views for view in self._models.values()])
        self._masks.clear()
        if self._feed is not None:
            self._feed.retain([e.engine_id for e in self._engines])
            index = self._feed.index
            self._masks.update((model, (index.generation, index.live_mask(view.by_id)))
                               for model, view in self._models.items())
        if started - self._swept_at > SWEEP_INTERVAL_S:
            self._start_sweep()

    # The seam: ``route`` = ``plan`` (the cached registry; no Redis call as a rule) → the prefix lookup
    # (``lookup``, its own round trip, or ``plan.lookup`` sent by the caller with other commands and its reply
    # read by ``parse_lookup``) → ``decide`` (the pure policy over a snapshot). ``in_flight`` counts the
    # request while an engine serves it.

    async def route(self, request: RouteRequest) -> Routed:
        plan = await self.plan(request)
        # A plan without a Redis lookup (a local index, a policy without one) skips the await of an empty one.
        return self.decide(plan, await self.lookup(plan) if plan.lookup_args is not None else {})

    async def plan(self, request: RouteRequest) -> RoutePlan:
        # _model_view's body, inline: the request path creates no coroutine for a registry copy it holds.
        self._refresher.used()
        if time.monotonic() - self._read_at > self._max_age_s:
            await self._read_registry()
        view = self._models.get(request.model) or _EMPTY_VIEW
        records = view.records
        if self._prefix_index is None or not request.block_hashes or not records:
            return RoutePlan(request, records, None, None)
        feed = self._feed
        if feed is not None:
            feed.used()
            if self._feed_task is None:
                self._ensure_feed()
            if feed.ready:  # until the warm start has loaded, the lookup goes to Redis
                return RoutePlan(request, records, None, None, local=True)
        args = PrefixIndex.lookup_args(request.block_hashes, [r.engine_id for r in records])
        return RoutePlan(request, records, args, ("EVALSHA", self._prefix_index.lookup_sha, 0, *args))

    parse_lookup = staticmethod(PrefixIndex.parse_lookup)

    def feed_ride(self, plan: RoutePlan | None) -> Command | None:
        """For a plan answered by the local index, the feed's stream read to send with admission's round trip
        (``LocalIndexFeed.ride``; its reply goes to ``take_feed_ride``); else None."""
        if plan is None or not plan.local or self._feed is None:
            return None
        return self._feed.ride()

    def take_feed_ride(self, reply: Any) -> None:
        """The reply of ``feed_ride``'s command (an exception object if it failed), for the feed to apply."""
        if self._feed is not None:
            self._feed.take_ride(reply)

    async def lookup(self, plan: RoutePlan) -> dict[str, int]:
        """The plan's prefix lookup in a round trip of its own (it loads the script when Redis lost it)."""
        if self._prefix_index is None or plan.lookup_args is None:
            return {}
        return await self._prefix_index.lookup(plan.lookup_args)  # arguments built once, in plan()

    def decide(self, plan: RoutePlan, cached: dict[str, int]) -> Routed:
        """The policy's ranking. A plan answered by the local index looks its prefix up here (``cached``,
        then empty, is ignored), with the live engines' mask as of now: admission's ride, after the plan, may
        have brought an engine's first blocks (a new slot in the index)."""
        model = plan.request.model
        view = self._models.get(model)
        current = view is not None and view.records is plan.records
        if view is None or not current:  # a plan made before the last registry read
            view = _ModelView(plan.records, tuple(engine_view(r) for r in plan.records),
                              {r.engine_id: r for r in plan.records})
        if plan.local and self._feed is not None:
            index = self._feed.index
            mask = self._live_mask(index, model, view) if current else index.live_mask(view.by_id)
            cached = index.longest_prefixes(plan.request.block_hashes, mask)
        # The table's live sums, not copies: the policy runs to its answer without yielding, so they cannot
        # change under it. Only the engines whose count is above their heartbeat's load (pod_view.py).
        in_flight, pending, waits = self._loads.totals(self._counted_engines, time.monotonic())
        self._pending_tokens = pending
        snapshot = RouteSnapshot(view.views, cached, in_flight, pending, waits, self._clock.fit)
        return self._policy(snapshot, plan.request), view.by_id

    def _live_mask(self, index: LocalPrefixIndex, model: str, view: _ModelView) -> int:
        cached = self._masks.get(model)
        if cached is not None and cached[0] == index.generation:
            return cached[1]
        mask = index.live_mask(view.by_id)
        self._masks[model] = (index.generation, mask)
        return mask

    def in_flight(self, engine_id: str, prefill_tokens: int = 0) -> InFlight:
        # A sample of the fit where neither this process nor (as the last decision read the table) the pod's
        # other workers have a prompt awaiting its first token there.
        isolated = self._clock.idle(engine_id) and engine_id not in self._pending_tokens
        return InFlight(self._loads, engine_id, prefill_tokens, self._clock, isolated)

    @property
    def prefill_clock(self) -> PrefillClock:
        """This process's prefill clock (the fit the policies see; benches report it)."""
        return self._clock

    def _start_sweep(self) -> None:
        # Off the request path: the sweep may walk a dead engine's whole block set.
        self._swept_at = time.monotonic()
        if self._sweeper is None or (self._sweep_task is not None and not self._sweep_task.done()):
            return
        self._sweep_task = asyncio.get_running_loop().create_task(
            self._sweep(self._sweeper, [e.engine_id for e in self._engines]))

    @staticmethod
    async def _sweep(index: PrefixIndex, live_ids: list[str]) -> None:
        try:
            swept = await index.sweep(live_ids)
        except (RedisError, OSError) as exc:
            logger.warning("prefix index sweep failed: %s", exc)
            return
        if swept:
            logger.info("dropped the prefix index entries of departed engines %s", swept)
