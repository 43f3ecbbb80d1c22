"""The replica's feed of the shared prefix index from its own KV events (see routing/prefix_index.py).

One loop for every backend; what differs is how the replica subscribes to its events: a vLLM replica
(engine/host.py) with ``KVEventSubscriber``, a simulated one (engine/sim/serve_replica.py) with the fleet's
hashes-only subscriber, which needs no vLLM. Nothing this module imports loads vLLM.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from tessera.redis_conn import connect
from tessera.registry import EngineRegistry
from tessera.routing.indexer import FeedStats, feed_index, prepare_index
from tessera.routing.kv_events import DecodedBatch
from tessera.routing.prefix_index import PrefixIndex

__all__ = ["KVEventSource", "index_feed_loop"]


class KVEventSource(Protocol):
    """A subscription to one engine's KV events: their batches, decoded, until closed."""

    def __aiter__(self) -> AsyncIterator[DecodedBatch]: ...

    def close(self) -> None: ...


async def index_feed_loop(redis_url: str, engine_id: str, subscribe: Callable[[], KVEventSource],
                          stats: FeedStats) -> None:
    """Subscribes to the engine's KV events (``subscribe()``), clears what the index held for ``engine_id`` and
    sweeps dead engines' leftovers, then applies every batch until cancelled (``stats`` counts them)."""
    # Subscribe before clearing: events published from here on queue in the socket, none is lost.
    events = subscribe()
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
