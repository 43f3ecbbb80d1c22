"""Drives one process's share of a workload: open-loop arrivals, closed-loop users, multi-turn sessions.

Open loop: one dispatcher merges every open-loop tenant's arrival times (a heap ordered by ``t_sched``),
sleeps until the next one is due and then starts every request that is due, without waiting for any
answer. A request's ``t_sched`` is its arrival time, never the time the client got round to it, so any
lateness of the client or of a connection-limited pool stays visible as schedule lag and in user-view
latency. Closed loop: ``concurrency`` users per tenant, each sending when its previous request ended.
Sessions: each turn is scheduled at the previous answer's end plus a think time.

Sharding for ``--workers N``: every worker computes the same merged arrival sequence and keeps arrivals
whose index ``i`` has ``i % N == worker``; closed-loop users are dealt the same way; request budgets
are split evenly.
"""

from __future__ import annotations

import asyncio
import gc
import heapq
import math
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvloop

from tessera_loadgen.arrivals import make_arrival_process, repeat_every
from tessera_loadgen.client import Target, TenantClient, discover_model
from tessera_loadgen.factory import RequestFactory
from tessera_loadgen.progress import LiveStats
from tessera_loadgen.prompts import PromptLibrary
from tessera_loadgen.records import ERROR_INCOMPLETE, RequestRecord
from tessera_loadgen.tokenizer_spec import TokenizerSpec
from tessera_loadgen.workload import RequestClass, Tenant, Workload

_perf_counter = time.perf_counter

START_LEAD_S = 0.05
"""Seconds between building the run and its first arrival, so setup never counts as schedule lag."""


@dataclass(frozen=True, slots=True)
class Shard:
    """This process's share of the load: arrivals and users whose index is ``index`` modulo ``count``."""

    index: int = 0
    count: int = 1

    def owns(self, i: int) -> bool:
        return i % self.count == self.index

    def share(self, total: int) -> int:
        """This shard's part of ``total`` when it is split as evenly as possible."""
        return total // self.count + (1 if self.index < total % self.count else 0)


@dataclass(slots=True)
class RunResult:
    """What a run produced: the records (absolute times) and the clock origin ``t0``.

    ``interrupted``: the run was stopped (Ctrl-C) before its limits were reached.
    """

    records: list[RequestRecord]
    t0: float
    t0_unix: float
    t_end: float
    models: dict[str, str]
    interrupted: bool = False
    num_connects: int = 0


@dataclass(slots=True)
class _TenantCtx:
    tenant: Tenant
    client: TenantClient
    factory: RequestFactory


@dataclass(order=True, slots=True)
class _Arrival:
    t_sched: float
    order: int
    ctx: _TenantCtx = field(compare=False)
    offsets: Iterator[float] = field(compare=False)


_T = TypeVar("_T")


def run_in_loop(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` to completion on a fresh uvloop event loop.

    NOTE: not ``asyncio.run``: on Python 3.11 its SIGINT bookkeeping formats ``repr`` of the main task,
    result included, which for a run's records costs seconds.
    """
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()


TIMER_RESOLUTION_S = 0.001
"""uvloop's timers count whole milliseconds (libuv), rounding to the nearest."""


def _timer_delay(delay_s: float) -> float:
    """``delay_s`` rounded up to a whole millisecond, so the timer is never rounded down to zero.

    NOTE: a sub-millisecond delay would round to 0 and the loop would spin until the arrival is due,
    burning a core that the server under test may need; waking up to a millisecond late instead bounds
    schedule lag at about 1 ms, far below what the metrics report as client-bound (5 ms).
    """
    return math.ceil(delay_s / TIMER_RESOLUTION_S) * TIMER_RESOLUTION_S


async def _sleep_until(t: float) -> None:
    """Sleep until the monotonic clock reads ``t`` (and not earlier)."""
    while (delay := t - _perf_counter()) > 0:
        await asyncio.sleep(_timer_delay(delay))


async def resolve_models(workload: Workload, target: Target) -> dict[str, str]:
    """Each tenant's model: its own, the workload's, or the first one the server lists for its key."""
    models: dict[str, str] = {}
    discovered: dict[str | None, str] = {}
    for tenant in workload.tenants:
        model = tenant.model or workload.model
        if model is None:
            key = tenant.resolved_api_key()
            if key not in discovered:
                discovered[key] = await discover_model(target, key)
            model = discovered[key]
        models[tenant.name] = model
    return models


def tenant_arrival_offsets(workload: Workload, tenant: Tenant) -> Iterator[float]:
    """An open-loop tenant's arrivals, seconds from the run's t0, forever (the run stops taking them at its end).

    Seeded by the workload's seed and the tenant's name only, so a bench can know the schedule before the run
    (the soak samples the platform between arrivals)."""
    arrival = tenant.arrival
    if arrival is None:
        raise ValueError(f"tenant {tenant.name!r} has no arrival process (it runs closed-loop)")
    seed = f"{workload.seed}:arrivals:{tenant.name}"
    offsets = make_arrival_process(arrival.process, arrival.rate_rps, seed, arrival.burstiness).offsets_s()
    return repeat_every(offsets, arrival.period_s) if arrival.period_s is not None else offsets


def build_library(workload: Workload, tokenizers: Mapping[str, TokenizerSpec] | None = None) -> PromptLibrary:
    """The prompt material of a run: the workload's corpus and prefix groups, in tokens where known."""
    groups = {n: (g.num_prefixes, g.prefix_tokens) for n, g in workload.prefix_groups.items()}
    return PromptLibrary(workload.seed, groups, tokenizers)


class Runner:
    """Runs a workload (or one shard of it) against a target; ``run()`` returns every request's record."""

    def __init__(
        self,
        workload: Workload,
        target: Target,
        *,
        models: dict[str, str] | None = None,
        shard: Shard = Shard(),
        stats: LiveStats | None = None,
        t0: float | None = None,
        tokenizers: Mapping[str, TokenizerSpec] | None = None,
        library: PromptLibrary | None = None,
    ) -> None:
        """``tokenizers`` (model -> spec) makes those models' prompt lengths exact; ``library`` is prompt
        material built in advance (``build_library``), so a worker that starts at a given ``t0`` has it
        ready."""
        self.workload = workload
        self.target = target
        self.shard = shard
        self.stats = stats if stats is not None else LiveStats()
        self._models = models
        self._t0 = t0
        self._tokenizers = tokenizers
        self._library = library
        self._records: list[RequestRecord] = []
        self._in_flight = 0
        self._drained = asyncio.Event()
        self._stopping = False
        self._stopped_early = False
        self._budget: float = shard.share(workload.num_requests) if workload.num_requests is not None else math.inf
        self._warmup_left = shard.share(workload.warmup_requests)
        self._sessions: set[asyncio.Task[None]] = set()
        self._ctxs: list[_TenantCtx] = []
        self.t0 = 0.0
        self._t_measure = 0.0
        self._t_stop = math.inf

    def stop(self) -> None:
        """Stop starting requests; those in flight still finish (or time out)."""
        self._stopping = True
        self._stopped_early = True

    async def run(self) -> RunResult:
        workload = self.workload
        models = self._models if self._models is not None else await resolve_models(workload, self.target)
        library = self._library or build_library(workload, self._tokenizers)
        for i, tenant in enumerate(workload.tenants):
            client = TenantClient(
                self.target,
                tenant.resolved_api_key(),
                timeout_s=workload.request_timeout_s,
                retry=workload.retry,
                max_connections=tenant.max_connections,
                extra_headers=tenant.extra_headers,
            )
            seed = f"{workload.seed}:{i}:{tenant.name}:{self.shard.index}"
            factory = RequestFactory(workload, tenant, models[tenant.name], library, seed)
            self._ctxs.append(_TenantCtx(tenant, client, factory))

        self.t0 = self._t0 if self._t0 is not None else _perf_counter() + START_LEAD_S
        t0_unix = time.time() + (self.t0 - _perf_counter())
        self._t_measure = self.t0 + workload.warmup_s
        if workload.duration_s is not None:
            self._t_stop = self._t_measure + workload.duration_s

        # NOTE: a full cyclic-GC pass over a few hundred thousand live records stalls the loop for tens of
        # milliseconds, which would show up as schedule lag; records hold no cycles, so pause the GC.
        gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.freeze()
        gc.disable()
        interrupted = False
        try:
            drivers: list[asyncio.Task[None]] = []
            open_loop = [c for c in self._ctxs if c.tenant.arrival is not None]
            if open_loop:
                drivers.append(asyncio.create_task(self._dispatch(open_loop)))
            user = 0
            for ctx in self._ctxs:
                for _ in range(ctx.tenant.concurrency or 0):
                    if self.shard.owns(user):
                        drivers.append(asyncio.create_task(self._user(ctx, user)))
                    user += 1
            await asyncio.gather(*drivers)
            while self._sessions:
                await asyncio.gather(*list(self._sessions))
            if self._in_flight:
                await self._drained.wait()
        except asyncio.CancelledError:
            interrupted = True
        finally:
            t_end = _perf_counter()
            for task in list(self._sessions):
                task.cancel()
            # Before closing the connections, whose loss would otherwise be recorded as broken streams.
            for record in self._records:
                if record.t_done is None:
                    record.fail(ERROR_INCOMPLETE, "the run ended before the request did", t_end)
            for ctx in self._ctxs:
                await ctx.client.close()
            gc.unfreeze()
            if gc_was_enabled:
                gc.enable()
        return RunResult(
            self._records,
            self.t0,
            t0_unix,
            t_end,
            models,
            interrupted or self._stopped_early,
            sum(c.client.pool.num_connects for c in self._ctxs),
        )

    # open loop ------------------------------------------------------------------------------------------
    async def _dispatch(self, ctxs: list[_TenantCtx]) -> None:
        t0 = self.t0
        heap: list[_Arrival] = []
        for order, ctx in enumerate(ctxs):
            offsets = tenant_arrival_offsets(self.workload, ctx.tenant)
            heap.append(_Arrival(t0 + next(offsets), order, ctx, offsets))
        heapq.heapify(heap)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        index = 0
        owns = self.shard.owns

        # NOTE: a timer callback rather than a coroutine awaiting asyncio.sleep: no future and no task
        # step per arrival, which is a tenth of the client's CPU at thousands of arrivals per second.
        def tick() -> None:
            nonlocal index
            if done.done():
                return
            try:
                while heap and not self._stopping:
                    head = heap[0]
                    t_sched = head.t_sched
                    delay = t_sched - _perf_counter()
                    if delay > 0:
                        loop.call_later(_timer_delay(delay), tick)
                        return
                    if t_sched >= self._t_stop:
                        heapq.heappop(heap)
                        continue
                    if owns(index):
                        if self._budget <= 0 and not self._is_warmup(t_sched, consume=False):
                            break
                        self._start_arrival(head.ctx, t_sched, index)
                    index += 1
                    head.t_sched = t0 + next(head.offsets)
                    heapq.heapreplace(heap, head)
            except BaseException as exc:
                done.set_exception(exc)
                return
            done.set_result(None)

        tick()
        await done

    def _start_arrival(self, ctx: _TenantCtx, t_sched: float, index: int) -> None:
        request_class = ctx.factory.pick_class()
        warmup = self._is_warmup(t_sched)
        if request_class.session is None:
            record, body = ctx.factory.single(request_class, f"{ctx.tenant.name}-{index}", t_sched, warmup)
            self._send(ctx, record, body, self._on_done)
        else:
            session_id = f"{ctx.tenant.name}-s{index}"
            task = asyncio.create_task(self._session(ctx, request_class, session_id, t_sched, warmup))
            self._sessions.add(task)
            task.add_done_callback(self._sessions.discard)

    # closed loop and sessions -----------------------------------------------------------------------------
    async def _user(self, ctx: _TenantCtx, user: int) -> None:
        num = 0
        await _sleep_until(self.t0)
        while not self._stopping:
            t_sched = _perf_counter()
            if t_sched >= self._t_stop:
                return
            warmup = self._is_warmup(t_sched)
            if not warmup and self._budget <= 0:
                return
            request_class = ctx.factory.pick_class()
            request_id = f"{ctx.tenant.name}-u{user}-{num}"
            num += 1
            if request_class.session is None:
                record, body = ctx.factory.single(request_class, request_id, t_sched, warmup)
                await self._send_and_wait(ctx, record, body)
            else:
                await self._session(ctx, request_class, request_id, t_sched, warmup)

    async def _session(
        self, ctx: _TenantCtx, request_class: RequestClass, session_id: str, t_sched: float, warmup: bool
    ) -> None:
        factory = ctx.factory
        state = factory.new_session(request_class, session_id)
        for turn in range(state.num_turns):
            if turn > 0:
                if self._stopping or t_sched >= self._t_stop:
                    return
                await _sleep_until(t_sched)
                warmup = self._is_warmup(t_sched)
            if not warmup and self._budget <= 0:
                return
            record, body = factory.turn(request_class, state, t_sched, warmup)
            done = await self._send_and_wait(ctx, record, body, collect_text=True)
            if not done.ok or done.t_done is None:
                return
            factory.end_turn(state, done.text or "")
            done.text = None
            t_sched = done.t_done + factory.think_time_s(request_class)

    async def _send_and_wait(
        self, ctx: _TenantCtx, record: RequestRecord, body: dict[str, Any], collect_text: bool = False
    ) -> RequestRecord:
        future: asyncio.Future[RequestRecord] = asyncio.get_running_loop().create_future()

        def on_done(done: RequestRecord) -> None:
            self._on_done(done)
            if not future.done():
                future.set_result(done)

        self._send(ctx, record, body, on_done, collect_text)
        return await future

    # bookkeeping ----------------------------------------------------------------------------------------
    def _is_warmup(self, t_sched: float, consume: bool = True) -> bool:
        if t_sched < self._t_measure:
            return True
        if self._warmup_left > 0:
            if consume:
                self._warmup_left -= 1
            return True
        return False

    def _send(
        self,
        ctx: _TenantCtx,
        record: RequestRecord,
        body: dict[str, Any],
        on_done: Callable[[RequestRecord], None],
        collect_text: bool = False,
    ) -> None:
        if not record.warmup:
            self._budget -= 1
        self._records.append(record)
        if self._in_flight == 0:
            self._drained.clear()
        self._in_flight += 1
        self.stats.on_sent()
        ctx.client.submit(record, body, on_done, collect_text)

    def _on_done(self, record: RequestRecord) -> None:
        self.stats.on_done(record)
        self._in_flight -= 1
        if self._in_flight == 0:
            self._drained.set()
