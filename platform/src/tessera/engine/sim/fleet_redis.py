"""A fleet's Redis side: what each real replica's host writes — its registry record every heartbeat, its KV
events into the prefix index, its clean exit — done for every simulated replica over one small pool.

NOTE: a real replica runs its own heartbeat loop (``engine/heartbeat.py``) and index feed
(``engine/index_feed.py``), each on its own Redis connection, and each feed prepares the index at start
(clears its entries, reads the whole registry, sweeps dead engines' leftovers). A thousand of those in
one process is 2,000 connections and a thousand registry reads and sweeps at once: measured on this 2-core
machine, 1,000 replicas took 105 s to start, ~750 MB, and heartbeats timed out for a minute before the
registry held them all. The fleet writes the same things with the same functions (``EngineRegistry
.heartbeat``, ``feed_index``, ``PrefixIndex.clear_engine``/``sweep``) but shares the connections and
sweeps once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
import zmq
import zmq.asyncio

from tessera.redis_conn import connect
from tessera.registry import EngineRecord, EngineRegistry, ModelInfo, register_model
from tessera.routing.indexer import FeedStats, feed_index
from tessera.routing.kv_events import KVEventSubscriber
from tessera.routing.prefix_index import PrefixIndex
from tessera.swallowed_cancel import raise_if_cancelled

logger = logging.getLogger(__name__)

# Connections the whole fleet shares. Writes queue for one of REDIS_POOL_SIZE slots first (no deadline), so
# a thousand heartbeats never wait on the pool itself, whose wait is bounded by REDIS_TIMEOUT_S.
REDIS_POOL_SIZE = 16
REDIS_TIMEOUT_S = 5.0
# Replicas whose heartbeats share one round trip: a round trip each cost the fleet's one event loop ~220 us of
# redis-py a replica (a fifth of its time at 1,000 replicas, once a second), and a batch of 50 is ~1 ms of Redis.
HEARTBEAT_BATCH = 50


@dataclass(frozen=True, slots=True)
class FedEngine:
    """What the fleet's Redis side needs of one replica."""

    engine_id: str
    kv_events_endpoint: str
    record: Callable[[], EngineRecord]
    feed_stats: FeedStats


class FleetRedis:
    def __init__(self, redis_url: str, engines: Sequence[FedEngine], models: Sequence[ModelInfo],
                 heartbeat_interval_s: float) -> None:
        self._engines = list(engines)
        self._models = list(dict.fromkeys(models))
        self._interval_s = heartbeat_interval_s
        self._redis: aioredis.Redis = connect(redis_url, timeout_s=REDIS_TIMEOUT_S, pool_size=REDIS_POOL_SIZE)
        self._registry = EngineRegistry(self._redis, heartbeat_interval_s)
        self._index = PrefixIndex(self._redis)
        self._slots = asyncio.Semaphore(REDIS_POOL_SIZE)
        self._zmq = zmq.asyncio.Context()
        self._subscribers: list[KVEventSubscriber] = []

    async def _each(self, write: Callable[[FedEngine], Awaitable[object]]) -> int:
        """``write(engine)`` for every replica; returns how many failed (``_in_batches`` of one)."""
        return await self._in_batches(1, lambda batch: write(batch[0]))

    async def _in_batches(self, size: int, write: Callable[[Sequence[FedEngine]], Awaitable[object]]) -> int:
        """``write(batch)`` for the replicas in batches of ``size``, at most REDIS_POOL_SIZE at a time; returns
        how many replicas' writes failed (one failure must not abort the rest of a round)."""
        batches = [self._engines[i:i + size] for i in range(0, len(self._engines), size)]

        async def one(batch: Sequence[FedEngine]) -> None:
            async with self._slots:
                await write(batch)  # made only once a slot is held: a cancelled round leaves no coroutine

        results = await asyncio.gather(*(one(b) for b in batches), return_exceptions=True)
        failed = [(b, r) for b, r in zip(batches, results, strict=True) if isinstance(r, BaseException)]
        if failed:
            logger.warning("%d of %d Redis write batches failed, e.g.: %s", len(failed), len(batches), failed[0][1])
        return sum(len(b) for b, _ in failed)

    async def prepare_index(self) -> None:
        """Subscribes to every replica's events, then clears their old entries and sweeps dead engines'
        leftovers once; events published from the subscription on queue in the sockets, none is lost."""
        self._subscribers = [KVEventSubscriber(e.kv_events_endpoint, with_blocks=False, context=self._zmq)
                             for e in self._engines]
        while True:  # as the real feed: a Redis error at start-up is retried, never fatal
            try:
                for engine in self._engines:
                    await self._index.clear_engine(engine.engine_id)
                live = [e.engine_id for e in await self._registry.live_engines()]
                await self._index.sweep([*live, *(e.engine_id for e in self._engines)])
                return
            except Exception as exc:
                logger.warning("preparing the prefix index failed, retrying: %s", exc)
                await asyncio.sleep(1.0)

    async def feed_index(self) -> None:
        """Applies every replica's batches, in order per replica, until cancelled."""
        try:
            await asyncio.gather(*(feed_index(self._index, engine.engine_id, subscriber, engine.feed_stats)
                                   for engine, subscriber in zip(self._engines, self._subscribers, strict=True)))
        finally:
            for subscriber in self._subscribers:
                subscriber.close()

    async def heartbeat(self) -> None:
        """Registers the models once and every replica's record every interval, until cancelled."""
        models_registered = False
        while True:
            raise_if_cancelled()  # one lost on the way (swallowed_cancel.py: the second line)
            try:
                if not models_registered:
                    for model in self._models:
                        await register_model(self._redis, model)
                    models_registered = True
                await self._in_batches(HEARTBEAT_BATCH,
                                        lambda batch: self._registry.heartbeat_many([e.record() for e in batch]))
            except Exception as exc:
                logger.warning("fleet heartbeat to Redis failed: %s", exc)
            await asyncio.sleep(self._interval_s)

    async def deregister(self) -> None:
        """Every replica out of the registry, then out of the prefix index."""
        await self._each(lambda e: self._registry.deregister(e.engine_id))
        await self._each(lambda e: self._index.clear_engine(e.engine_id))

    async def close(self) -> None:
        await self._redis.aclose()
        self._zmq.term()
