"""The replica's feed of the shared prefix index from its own KV events (see routing/prefix_index.py)."""

from __future__ import annotations

from tessera.redis_conn import connect
from tessera.registry import EngineRegistry
from tessera.routing.indexer import FeedStats, feed_index, prepare_index
from tessera.routing.kv_events import KVEventSubscriber
from tessera.routing.prefix_index import PrefixIndex


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
        async def live_engine_ids() -> list[str]:
            return [e.engine_id for e in await EngineRegistry(redis).live_engines()]

        await prepare_index(index, engine_id, live_engine_ids)
        await feed_index(index, engine_id, events, stats)
    finally:
        events.close()
        await redis.aclose()
