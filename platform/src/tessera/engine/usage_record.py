"""The replica's own record of what each request used, written to Redis when the request ends.

A gateway that dies mid-request never bills it; the settler (gateway/settler.py) then bills it from this
record (tenancy/settlement.py). Off the token path: ending a request only appends to a queue
(``UsageRecorder.add``, called by ``InFlightRequests.finish``); a background loop writes the queue every
``flush_interval_s`` in one pipelined round trip (``HSET`` + ``EXPIRE`` per request, key and format in
engine/protocol.py). Each record lives ``record_ttl_s``: longer than a lease, the settler's grace and its
interval together, so the settler finds it.

Bounds: while Redis does not answer, at most ``max_queued`` records wait (the oldest are dropped, logged:
their requests, if their gateway died too, are charged their whole reservation). A replica that dies loses
the records of its last ``flush_interval_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

from tessera.engine.protocol import encode_usage, usage_record_key
from tessera.redis_conn import connect
from tessera.swallowed_cancel import raise_if_cancelled

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class UsageRecord:
    request_id: str  # the attempt's id as the engine got it
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass(frozen=True, slots=True)
class RecorderConfig:
    flush_interval_s: float
    record_ttl_s: int
    max_queued: int = 100_000


class UsageRecorder:
    """Collects ended requests on the host's loop and writes them in batches (``run``)."""

    def __init__(self, config: RecorderConfig) -> None:
        if config.flush_interval_s <= 0 or config.record_ttl_s < 1 or config.max_queued < 1:
            raise ValueError(f"usage recorder needs positive settings, got {config}")
        self.config = config
        self._queue: deque[UsageRecord] = deque()
        self.num_written = 0
        self.num_dropped = 0

    def add(self, record: UsageRecord) -> None:
        if len(self._queue) >= self.config.max_queued:
            lost = self._queue.popleft()
            self.num_dropped += 1
            logger.error("usage record of %s dropped: %d records wait for Redis", lost.request_id,
                         self.config.max_queued)
        self._queue.append(record)

    async def flush(self, redis: Any) -> int:
        """Writes what waits in one round trip; on a Redis error the batch waits for the next flush."""
        batch, self._queue = self._queue, deque()
        if not batch:
            return 0
        pipe = redis.pipeline(transaction=False)
        for record in batch:
            key = usage_record_key(record.request_id)
            pipe.hset(key, record.request_id, encode_usage(record.num_prompt_tokens, record.num_output_tokens))
            pipe.expire(key, self.config.record_ttl_s)
        try:
            await pipe.execute()
        except BaseException:
            # Back in front of what ended meanwhile, within the bound (the oldest go first).
            batch.extend(self._queue)
            while len(batch) > self.config.max_queued:
                batch.popleft()
                self.num_dropped += 1
            self._queue = batch
            raise
        self.num_written += len(batch)
        return len(batch)

    async def run(self, redis_url: str) -> None:
        """Flushes every ``flush_interval_s`` until cancelled, then once more."""
        redis = connect(redis_url, timeout_s=5.0)
        try:
            while True:
                raise_if_cancelled()  # one lost on the way (swallowed_cancel.py: the second line)
                await asyncio.sleep(self.config.flush_interval_s)
                await self._flush_logged(redis)
        finally:
            await self._flush_logged(redis)
            await redis.aclose()

    async def _flush_logged(self, redis: Any) -> None:
        try:
            await self.flush(redis)
        except Exception as exc:
            logger.warning("usage records not written (%d wait): %s", len(self._queue), exc)
