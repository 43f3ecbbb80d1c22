"""Keeps a gateway worker's ``LocalPrefixIndex`` in step with the shared one: warm start from a snapshot,
then the event stream the engines' feeders append to in the same Lua call that updates Redis
(prefix_index.py: ``tessera:pfx-events``). docs/routing.md argues this source over subscribing to every
engine's ZMQ publisher.

Exactness rests on the per-engine sequence number ``n`` that each batch (and each clear) gets in Redis:
- Warm start: note the stream's last entry id, then snapshot each indexed engine (its hashes and ``n``,
  atomically), then read the stream from the noted id on: an entry whose ``n`` the snapshot already
  covers is skipped, so every batch counts exactly once.
- Gap: an entry whose ``n`` is not the engine's previous one plus 1 (the stream was trimmed past this
  reader, Redis restarted, or the engine is new to this reader mid-life) makes the feed snapshot that
  engine again — a *resync* — instead of applying events on top of a state it cannot vouch for. A Redis that
  restarted without its data numbers each engine's batches from 1 again: a batch 1 after batch 2 or later
  resyncs the engine too (right after a warm start, a batch 1 the snapshot already covers may cost one
  resync more).
- Departed engines: the router hands the registry's live engines to ``retain`` on every registry read;
  one absent for ``FORGET_GRACE_S`` is forgotten, and comes back by a resync if it publishes again.
Between those, the local index trails the engines by the engine-host feeder's write plus one stream read
(``lag_p99_s``). A stale entry costs hit rate only: lookups count only the live engines the router passes.

Reads that ride in admission's round trip (``ride``/``take_ride``): while requests come, each admission's one
Redis round trip also reads the stream from where the feed stands (gateway/request/admit.py), so the route
right after it sees every batch published before its admission, and the feed's own reads pause (it reads,
not blocking, only where a ``RIDE_GAP_S`` period passed without a ride reaching the stream's end). Without
them a busy worker paid one more wake-up and round trip per engine batch (~0.2 ms of CPU a request:
docs/performance.md, "The index feed's reads ride in admission").
A ride applies entries in place and never calls Redis on the request path: an entry that needs a resync, or
a ride that comes back full (a backlog), stops there and wakes the feed's own loop, which reads on from it.
Rides and the feed's reads may bring the same entries: an entry at or before the feed's position is skipped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tessera.redis_wire import Command, RedisWire
from tessera.refresher import REFRESHER_IDLE_S
from tessera.routing.local_index import LocalPrefixIndex
from tessera.routing.prefix_index import EVENTS_STREAM, SWEEP_GRACE_S, PrefixIndex, unpack_hashes
from tessera.routing.stream_read import read_stream, stream_entries

logger = logging.getLogger(__name__)

# One XREAD waits at most this long for new entries, ms. Redis answers as soon as an entry arrives, so the block
# sets only how often a quiet stream is asked again: at 50 ms (twenty reads a second) the ten seconds after
# each route cost a worker 7-10 ms/s of CPU (stream_read.py). The read's timeout covers the block
# (``read_stream``), so the gateway's short Redis timeout does not bound it.
READ_BLOCK_MS = 1000
# Entries per XREAD: a backlog is applied in slices, so the worker's requests wait at most one slice.
READ_COUNT = 512
# After a Redis error the feed retries after this long, seconds.
RETRY_S = 1.0
# An engine absent from the registry this long is forgotten, seconds (as the shared index's SWEEP_GRACE_S).
FORGET_GRACE_S = SWEEP_GRACE_S
# Lags kept for the p99 (the most recent ones).
LAG_SAMPLES = 4096
# Idle mode: a worker that has routed nothing for IDLE_AFTER_S reads the stream every IDLE_READ_S instead of
# back to back (when a read blocked 50 ms, twenty reads a second cost an idle worker 10.5 ms/s of CPU and Redis 3
# ms/s: docs/routing.md). The first route after it wakes the feed at once (``used``); that route and any in
# the read's round trip see an index up to IDLE_READ_S old, which costs hit rate, never a wrong engine. A read
# that comes back full (a busy stream: other gateways' traffic) is followed by the next at once, idle or not,
# so the feed never falls behind the stream's trim. Idle means what it means for the gateway's background
# refreshers (refresher.py), which stop after the same time without a read; the feed cannot stop (the stream
# is trimmed), so it slows down instead.
IDLE_AFTER_S = REFRESHER_IDLE_S
IDLE_READ_S = 2.0
# Entries one ride reads (it runs on the request path before the route): more waiting means a backlog, which
# the feed's own reads take in READ_COUNT slices.
RIDE_COUNT = 128
# While reads ride in admissions, the feed looks at whole multiples of this period of the monotonic clock (the
# instants the registry's and key cache's refreshers wake at, refresher.py, so it adds no wake-up of its own),
# and reads only where no ride reached the stream's end since it last looked: a pause in traffic, whose batches
# it then catches; it does not wait on the stream, so an engine batch wakes no one until the next admission.
# (Read every 0.5 s whatever the rides did, it cost a paced gateway four wake-ups a second: a timer and a
# reply, twice; docs/performance.md section 9.)
RIDE_GAP_S = 1.0


class LocalIndexFeed:
    """Feeds ``index`` from Redis until cancelled (``run``); ``ready`` once the warm start has loaded."""

    def __init__(self, redis: aioredis.Redis, index: LocalPrefixIndex, store: PrefixIndex, *,
                 idle_after_s: float = IDLE_AFTER_S, idle_read_s: float = IDLE_READ_S,
                 read_block_ms: int = READ_BLOCK_MS, ride_gap_s: float = RIDE_GAP_S,
                 wire: RedisWire | None = None) -> None:
        """``wire``: a lean connection of the feed's own for its blocking reads (stream_read.py; the gateway
        gives one); None: they take a connection from ``redis``'s pool."""
        self._redis = redis
        self._reader: RedisWire | aioredis.Redis = redis if wire is None else wire
        self.read_block_ms = read_block_ms
        self.idle_after_s = idle_after_s
        self.idle_read_s = idle_read_s
        self.ride_gap_s = ride_gap_s
        self._used = False  # a route read the index since the feed last looked (``used``)
        self._rode = False  # a ride applied the stream up to its end since the feed last looked (``take_ride``)
        self._wake: asyncio.Event | None = None  # set while the feed waits between its own reads
        self._wake_on_use = False  # ...and a route ends that wait (idle), else only a backlog, a gap or stop
        self.index = index
        self._store = store
        self._seq: dict[str, int] = {}  # engine_id -> last sequence number applied (or snapshot)
        self._absent_since: dict[str, float] = {}  # engine_id -> when a registry read first missed it
        self._last_id: bytes | str = "0-0"
        self._last_position = (0, 0)  # ``_last_id`` as numbers, for ordering entries read twice
        self._resyncing: set[str] = set()  # engines whose snapshot is being read (a ride leaves them alone)
        self.ready = False
        self._stopping = False
        self._task: asyncio.Task[None] | None = None  # the task in ``run`` (``stop`` cancels its read)
        self.lags_s: deque[float] = deque(maxlen=LAG_SAMPLES)
        self.num_entries = 0
        self.num_ops = 0
        self.num_resyncs = 0
        self.num_reads = 0
        self.num_rides = 0

    def used(self) -> None:
        """A route read the index (the router calls this on every plan): the feed follows the stream back to
        back again, at once if it is waiting between idle reads. A flag and a check: the request path's cost."""
        self._used = True
        if self._wake is not None and self._wake_on_use:
            self._wake.set()

    def ride(self) -> Command | None:
        """The stream read for admission's round trip (``take_ride`` applies its reply); None until the warm
        start has loaded."""
        if not self.ready:
            return None
        return ("XREAD", "COUNT", RIDE_COUNT, "STREAMS", EVENTS_STREAM, self._last_id)

    def take_ride(self, reply: Any) -> None:
        """Applies a ride's reply on the request path, without a Redis call: an entry that needs a resync stops
        it and wakes the feed's loop (which reads on from that entry), as does a full ride (a backlog) or an
        error reply. A ride that reached the stream's end lets the feed's loop pause its own reads."""
        if isinstance(reply, Exception):
            self._wake_now()
            return
        entries = stream_entries(reply)
        self.num_rides += 1
        for entry_id, fields in entries:
            position = _position(entry_id)
            if position <= self._last_position:
                continue  # the feed's own read applied it meanwhile
            if not self._apply_now(fields):
                self._wake_now()
                return
            self._last_id, self._last_position = entry_id, position
        if len(entries) >= RIDE_COUNT:
            self._wake_now()
        else:
            self._rode = True

    def _wake_now(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def warm_start(self) -> None:
        """Loads every indexed engine's snapshot; the stream is read from just before them."""
        newest: Any = await self._redis.xrevrange(EVENTS_STREAM, "+", "-", count=1)
        self._last_id = newest[0][0] if newest else "0-0"
        self._last_position = _position(self._last_id)
        for engine_id in await self._store.indexed_engines():
            await self._resync(engine_id)
        self.num_resyncs = 0
        self.ready = True

    async def _resync(self, engine_id: str) -> None:
        self._resyncing.add(engine_id)
        try:
            seq, hashes = await self._store.snapshot(engine_id)
        finally:
            self._resyncing.discard(engine_id)
        self.index.load_engine(engine_id, hashes)
        self._seq[engine_id] = seq
        self.num_resyncs += 1

    async def poll(self, block_ms: int | None = None) -> int:
        """One stream read (waiting up to ``block_ms``, ``read_block_ms`` by default; 0: no wait), applied;
        returns the entries read."""
        block_ms = self.read_block_ms if block_ms is None else block_ms
        entries = await read_stream(self._reader, EVENTS_STREAM, self._last_id, READ_COUNT, block_ms)
        self.num_reads += 1
        for entry_id, fields in entries:
            position = _position(entry_id)
            if position <= self._last_position:
                continue  # a ride applied it meanwhile
            if not self._apply_now(fields):
                engine_id = _text(fields[b"e"])
                logger.info("prefix index: engine %s's batch %s does not follow batch %s here; re-reading it",
                            engine_id, int(fields[b"n"]), self._seq.get(engine_id))
                await self._resync(engine_id)  # the snapshot includes this entry (its n >= seq)
            if position > self._last_position:  # unless a ride took it further while the resync waited
                self._last_id, self._last_position = entry_id, position
        return len(entries)

    def _apply_now(self, fields: dict[Any, Any]) -> bool:
        """Applies one entry, or skips it when the engine's snapshot covers it; False, having changed nothing,
        when it needs the engine's snapshot first (a gap in its sequence, or a resync under way)."""
        engine_id = _text(fields[b"e"])
        seq = int(fields[b"n"])
        last = self._seq.get(engine_id)
        if last is not None and seq <= last:
            # Already in the engine's snapshot; but a first batch after several is the engine's numbering begun
            # again (a Redis that restarted without its data): its state here is no longer Redis's.
            return not (seq == 1 and last > 1)
        if seq != (last or 0) + 1 or engine_id in self._resyncing:
            return False
        ops = _text(fields[b"o"])
        self.index.apply(engine_id, ops, unpack_hashes(fields[b"h"]) if ops != "c" else (0,))
        self._seq[engine_id] = seq
        self.num_entries += 1
        self.num_ops += len(ops)
        self.lags_s.append(time.time() - float(fields[b"t"]))
        return True

    def retain(self, live_engine_ids: Iterable[str], now: float | None = None) -> list[str]:
        """Forgets engines absent from the registry for ``FORGET_GRACE_S`` (and their sequence numbers: they
        resync if they publish again); returns them. Until then their entries cost memory only: lookups
        count live engines alone. The grace keeps a replica whose heartbeat is merely late from losing its
        whole cache here, which only its next batch (a resync) would bring back."""
        now = time.monotonic() if now is None else now
        live = set(live_engine_ids)
        for engine_id in live:
            self._absent_since.pop(engine_id, None)
        gone = []
        for engine_id in self.index.engines:
            if engine_id not in live and now - self._absent_since.setdefault(engine_id, now) >= FORGET_GRACE_S:
                gone.append(engine_id)
        for engine_id in gone:
            self.index.forget_engine(engine_id)
            self._seq.pop(engine_id, None)
            del self._absent_since[engine_id]
        return gone

    def stop(self) -> None:
        """Ends ``run`` now: a blocking read in progress is cancelled (``read_stream`` drops its connection)."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()

    def lag_p99_s(self) -> float | None:
        """Event-to-visible lag p99 over the recent entries: engine publication to applied here, seconds."""
        if not self.lags_s:
            return None
        ordered = sorted(self.lags_s)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]

    async def run(self) -> None:
        """Warm start, then follow the stream until ``stop``; Redis errors are retried, never fatal (the
        router falls back to the Redis lookup until the warm start has loaded)."""
        self._task = asyncio.current_task()
        try:
            await self._follow()
        except asyncio.CancelledError:
            if not self._stopping:
                raise  # cancelled by someone else: not a stop
        finally:
            self._task = None

    async def _follow(self) -> None:
        while not self.ready and not self._stopping:
            try:
                await self.warm_start()
            except (RedisError, OSError) as exc:
                logger.warning("prefix index warm start failed, retrying: %s", exc)
                await asyncio.sleep(RETRY_S)
        last_used = time.monotonic()
        while not self._stopping:
            num_read = 0
            block_ms = None
            if self._rode:  # admissions read the stream: a read of its own only once they stop, and not blocking
                while self._rode and not self._stopping:
                    self._rode = False
                    gap = self.ride_gap_s
                    if await self._wait(gap - time.monotonic() % gap, wake_on_use=False):
                        break  # a ride asked for a read (a backlog, an entry to resync, an error)
                block_ms = 0
            try:
                num_read = await self.poll(block_ms)
            except (RedisError, OSError) as exc:
                logger.warning("prefix index stream read failed, retrying: %s", exc)
                await asyncio.sleep(RETRY_S)
            if self.index.num_retired_slots:
                for _ in self.index.compact():
                    await asyncio.sleep(0)  # the worker's requests run between chunks
            if self._used:
                self._used = False
                last_used = time.monotonic()
            elif num_read < READ_COUNT and time.monotonic() - last_used >= self.idle_after_s:
                await self._wait(self.idle_read_s, wake_on_use=True)

    async def _wait(self, seconds: float, *, wake_on_use: bool) -> bool:
        """Waits ``seconds`` before the next read, or less if a ride asks for one (a backlog, a gap) or, with
        ``wake_on_use`` (idle), a route comes first; True when woken before the time was up."""
        self._wake, self._wake_on_use = asyncio.Event(), wake_on_use
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except TimeoutError:
            return False
        finally:
            self._wake = None
        return True


def _position(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id (``<ms>-<seq>``) as numbers, in the stream's order."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _text(raw: object) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)
