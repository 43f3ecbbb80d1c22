"""The replica's feed of the shared prefix index from its own KV events (see routing/prefix_index.py)."""

from __future__ import annotations

import asyncio
import logging

from tessera.redis_conn import connect
from tessera.registry import EngineRegistry
from tessera.routing.indexer import FeedStats, feed_index
from tessera.routing.kv_events import KVEventSubscriber
from tessera.routing.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)


async def index_feed_loop(redis_url: str, engine_id: str, kv_events_endpoint: str, topic: str,
                          stats: FeedStats) -> None:
    """Subscribes to the engine's KV events, clears what the index held for ``engine_id`` and sweeps dead
    engines' leftovers, then applies every batch until cancelled (``stats`` counts them)."""
    # Subscribe before clearing: events published from here on queue in the socket, none is lost. The feed
    # needs the block hashes only, not their token ids (those are for the KV-eviction controller's ledger).
    events = KVEventSubscriber(kv_events_endpoint, topic, with_blocks=False)
    redis = connect(redis_url, timeout_s=5.0)
    index = PrefixIndex(redis)
    try:
        while True:  # as the heartbeat: a Redis error at start-up is retried, never fatal to the feed
            try:
                await index.clear_engine(engine_id)
                live = [e.engine_id for e in await EngineRegistry(redis).live_engines()]
                await index.sweep([*live, engine_id])
                break
            except Exception as exc:
                logger.warning("preparing the prefix index failed, retrying: %s", exc)
                await asyncio.sleep(1.0)
        await feed_index(index, engine_id, events, stats)
    finally:
        events.close()
        await redis.aclose()
