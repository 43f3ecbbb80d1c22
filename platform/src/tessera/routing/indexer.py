"""Feeds the shared prefix index from one engine's KV events; runs inside that engine's host.

Only the engine itself writes its entries, in the order vLLM published its events, so the index invariant
(see prefix_index.py) holds per engine. Missing events are the one way it could go stale: a missed
BlockRemoved would leave the index claiming a block the engine evicted. The publisher numbers its batches
from 0, so a jump in ``seq`` — or a batch that failed to reach Redis — means some events are lost; the
feeder then forgets all of the engine's blocks rather than keep claims it cannot vouch for (a forgotten
block costs one missed cache hit; a stale claim sends requests to an engine that recomputes anyway).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, Awaitable, Callable
from dataclasses import dataclass

from redis.exceptions import RedisError

from tessera.routing.kv_events import DecodedBatch
from tessera.routing.prefix_index import PrefixIndex
from tessera.swallowed_cancel import raise_if_cancelled

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class FeedStats:
    num_batches: int = 0
    num_ops: int = 0
    num_gaps: int = 0
    num_failed_batches: int = 0


async def feed_index(index: PrefixIndex, engine_id: str, batches: AsyncIterable[DecodedBatch],
                     stats: FeedStats | None = None) -> FeedStats:
    """Applies every batch to the index until ``batches`` ends (or the task is cancelled)."""
    stats = stats or FeedStats()
    expected_seq: int | None = None
    must_clear = False
    raise_if_cancelled()  # one the caller's preparation lost (prepare_index; swallowed_cancel.py)
    async for batch in batches:
        # Before the first batch nothing was indexed (the host clears its entries at start), so batches
        # published before the subscription connected cost hits only, never correctness.
        if expected_seq is not None and batch.seq != expected_seq:
            logger.warning("engine %s: KV event batches %s..%s missed; dropping its index entries",
                           engine_id, expected_seq, batch.seq - 1)
            stats.num_gaps += 1
            must_clear = True
        expected_seq = batch.seq + 1
        try:
            if must_clear:
                await index.clear_engine(engine_id)
                must_clear = False
            await index.apply(engine_id, batch.ops, batch.ts)
            raise_if_cancelled()  # one the apply lost on the way: not another wait for the next batch
        except (RedisError, OSError) as exc:  # a Redis blip must not stop the replica's indexing
            logger.warning("engine %s: prefix index update failed (%s); its entries are dropped next", engine_id, exc)
            stats.num_failed_batches += 1
            must_clear = True
            continue
        stats.num_batches += 1
        stats.num_ops += len(batch.ops)
    return stats


async def prepare_index(index: PrefixIndex, engine_id: str, live_engine_ids: Callable[[], Awaitable[list[str]]],
                        retry_s: float = 1.0) -> None:
    """Before a feed applies its first batch: forget what the index held for ``engine_id`` (a restarted
    replica's claims from before) and sweep the leftovers of engines no longer live. A Redis error here is
    retried every ``retry_s``, never fatal to the feed (as the heartbeat's)."""
    while True:
        try:
            await index.clear_engine(engine_id)
            await index.sweep([*(await live_engine_ids()), engine_id])
            return
        except Exception as exc:
            logger.warning("preparing the prefix index failed, retrying: %s", exc)
            await asyncio.sleep(retry_s)
