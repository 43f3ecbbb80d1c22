"""The gateway worker's local prefix index fed from real Redis (routing/local_feed.py): a warm start loads
what the engines' feeders wrote, the event stream brings stores, removes and clears, a gap (trimmed
stream) resyncs the engine, and a Router on the local index routes with no Redis lookup at all."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from tessera.redis_conn import EmbeddedRedis, connect
from tessera.redis_wire import RedisWire
from tessera.registry import EngineRecord, EngineRegistry
from tessera.routing.local_feed import FORGET_GRACE_S, RIDE_COUNT, LocalIndexFeed
from tessera.routing.local_index import LocalPrefixIndex
from tessera.routing.prefix_index import ENGINE_BLOCKS_PREFIX, EVENTS_STREAM, SEQ_KEY, PrefixIndex
from tessera.routing.router import Router
from tessera.routing.snapshot import RouteRequest


@pytest.fixture
async def redis(redis_server: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    client = connect(redis_server.url, timeout_s=5.0)
    yield client
    await client.aclose()


@pytest.fixture
def names() -> list[str]:
    tag = uuid.uuid4().hex[:8]
    return [f"lf-{tag}-{n}" for n in ("a", "b", "c")]


def chain(n: int) -> list[int]:
    base = uuid.uuid4().int & ((1 << 60) - 1)
    return [base + i for i in range(n)]


async def drain(feed: LocalIndexFeed) -> None:
    while await feed.poll(block_ms=0):
        pass


async def test_warm_start_then_the_stream_keeps_the_local_index_equal_to_redis(
        redis: aioredis.Redis, names: list[str]) -> None:
    store = PrefixIndex(redis)
    a, b, _ = names
    hashes = chain(8)
    await store.apply(a, [("store", h) for h in hashes[:6]])
    await store.apply(b, [("store", h) for h in hashes[:2]])
    feed = LocalIndexFeed(redis, LocalPrefixIndex(100_000), store)
    await feed.warm_start()
    assert feed.ready
    live = feed.index.live_mask([a, b])
    assert feed.index.longest_prefixes(hashes, live) == {a: 6, b: 2}

    await store.apply(b, [("store", h) for h in hashes[2:5]], ts=None)
    await store.apply(a, [("remove", h) for h in reversed(hashes[3:6])])  # tail first, as vLLM evicts
    await drain(feed)
    assert feed.index.longest_prefixes(hashes, feed.index.live_mask([a, b])) == {a: 3, b: 5}
    assert feed.index.blocks_of(a) == set((await store.blocks_of(a)).keys())

    await store.apply(b, [("clear", 0), ("store", hashes[0])])
    await drain(feed)
    assert feed.index.longest_prefixes(hashes, feed.index.live_mask([a, b])) == {a: 3, b: 1}
    assert feed.num_resyncs == 0 and feed.lag_p99_s() is not None


async def test_a_second_feed_started_later_sees_the_same_index(redis: aioredis.Redis, names: list[str]) -> None:
    store = PrefixIndex(redis)
    a, b, _ = names
    hashes = chain(5)
    first = LocalIndexFeed(redis, LocalPrefixIndex(100_000), store)
    await first.warm_start()
    await store.apply(a, [("store", h) for h in hashes])
    await store.apply(a, [("remove", hashes[4])])
    await store.apply(b, [("store", hashes[0])])
    await drain(first)
    later = LocalIndexFeed(redis, LocalPrefixIndex(100_000), store)
    await later.warm_start()  # a gateway starting now: snapshot, then only what came after it
    await store.apply(a, [("remove", hashes[3])])
    await drain(first)
    await drain(later)
    expected = {a: 3, b: 1}
    assert first.index.longest_prefixes(hashes, first.index.live_mask([a, b])) == expected
    assert later.index.longest_prefixes(hashes, later.index.live_mask([a, b])) == expected


async def test_a_gap_in_an_engines_events_resyncs_it_from_redis(redis: aioredis.Redis, names: list[str]) -> None:
    store = PrefixIndex(redis)
    a = names[0]
    hashes = chain(6)
    feed = LocalIndexFeed(redis, LocalPrefixIndex(100_000), store)
    await feed.warm_start()
    await store.apply(a, [("store", h) for h in hashes])
    await drain(feed)
    await store.apply(a, [("remove", h) for h in reversed(hashes[2:])])
    await redis.xtrim(EVENTS_STREAM, maxlen=0)  # this reader fell behind a trim: the removes are lost to it
    await store.apply(a, [("store", hashes[2] + 10_000)])
    await drain(feed)
    assert feed.num_resyncs == 1
    assert feed.index.blocks_of(a) == set((await store.blocks_of(a)).keys())
    assert feed.index.longest_prefixes(hashes, feed.index.live_mask([a])) == {a: 2}


async def test_an_engine_whose_numbering_began_again_is_read_again(redis: aioredis.Redis, names: list[str]) -> None:
    # A Redis restarted without its data numbers every engine's batches from 1 again: this reader must not take
    # them for batches it applied (the engine's state here would then stay the one Redis lost).
    store = PrefixIndex(redis)
    a = names[0]
    feed = LocalIndexFeed(redis, LocalPrefixIndex(10_000), store)
    await feed.warm_start()
    old = chain(3)
    for h in old:
        await store.apply(a, [("store", h)])  # batches 1, 2, 3
    await drain(feed)
    assert feed.index.blocks_of(a) == set(old)
    await redis.hdel(SEQ_KEY, a)  # what Redis lost of the engine: its numbering and its claims
    await redis.delete(ENGINE_BLOCKS_PREFIX + a)
    new = chain(2)
    await store.apply(a, [("store", h) for h in new])  # batch 1 again
    await drain(feed)
    assert feed.index.blocks_of(a) == set(new) and feed.num_resyncs == 1


async def test_a_router_on_the_local_index_routes_without_a_redis_lookup(
        redis: aioredis.Redis, names: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    store = PrefixIndex(redis)
    model = f"m-{names[0]}"
    registry = EngineRegistry(redis)
    for name in names:
        await registry.heartbeat(EngineRecord(name, f"http://{name}", model, 16, 100, 2048))
    hashes = chain(6)
    await store.apply(names[1], [("store", h) for h in hashes[:5]])
    await store.apply("lf-dead-engine", [("store", h) for h in hashes])  # not in the registry
    router = Router(redis, "prefix_affinity", store, index_source="local")
    await router.start_local_index()

    async def no_lookup(*_: object) -> None:
        raise AssertionError("the local index made a Redis lookup")
    monkeypatch.setattr(store, "lookup", no_lookup)
    request = RouteRequest(tenant="t", model=model, num_prompt_tokens=16 * 6 + 3, block_hashes=tuple(hashes))
    plan = await router.plan(request)
    assert plan.lookup is None and plan.local  # admission's round trip carries no lookup
    decision, _ = router.decide(plan, {})
    assert decision.ranked[0] == names[1] and decision.expected_cached_tokens == 80
    assert set(decision.ranked) == set(names)

    # A block the engine evicts reaches the router through the stream.
    await store.apply(names[1], [("remove", h) for h in reversed(hashes[1:5])])  # tail first, as vLLM evicts
    for _ in range(200):
        decision, _ = await router.route(request)
        if decision.expected_cached_tokens == 16:
            break
        await asyncio.sleep(0.01)  # the router's own feed task reads the stream
    assert decision.ranked[0] == names[1] and decision.expected_cached_tokens == 16
    await router.close()


def test_an_unknown_index_source_is_refused(redis: aioredis.Redis) -> None:
    with pytest.raises(ValueError, match="valid: local, redis"):
        Router(redis, "prefix_affinity", PrefixIndex(redis), index_source="memory")


async def test_an_engine_is_forgotten_only_after_the_grace_and_resyncs_when_it_publishes(
        redis: aioredis.Redis, names: list[str]) -> None:
    store = PrefixIndex(redis)
    a, b, _ = names
    hashes = chain(4)
    await store.apply(a, [("store", h) for h in hashes])
    feed = LocalIndexFeed(redis, LocalPrefixIndex(100_000), store)
    await feed.warm_start()
    assert feed.retain([b], now=100.0) == []  # a's heartbeat is late: kept
    assert a in feed.retain([b], now=100.0 + FORGET_GRACE_S)  # (with other tests' engines)
    assert feed.index.blocks_of(a) == set()
    await store.apply(a, [("remove", hashes[3])])  # it publishes again: re-read whole from Redis
    await drain(feed)
    assert feed.index.blocks_of(a) == set(hashes[:3]) and feed.num_resyncs == 1


async def wait_for_prefix(feed: LocalIndexFeed, engine_id: str, hashes: list[int], timeout_s: float) -> float:
    """Seconds until the local index holds all of ``hashes`` for the engine (fails past ``timeout_s``)."""
    started = asyncio.get_running_loop().time()
    while feed.index.longest_prefixes(hashes, feed.index.live_mask([engine_id])).get(engine_id) != len(hashes):
        elapsed = asyncio.get_running_loop().time() - started
        assert elapsed < timeout_s, f"the feed had not applied the engine's blocks after {elapsed:.2f} s"
        await asyncio.sleep(0.01)
    return asyncio.get_running_loop().time() - started


async def test_an_idle_feed_reads_seldom_and_the_next_route_wakes_it(
        redis: aioredis.Redis, names: list[str]) -> None:
    # Followed back to back, the stream costs an idle worker twenty blocking reads a second; idle, it is read
    # every idle_read_s, and a route (Router.plan -> feed.used) brings the feed back at once.
    store = PrefixIndex(redis)
    model = f"m-{names[0]}"
    registry = EngineRegistry(redis)
    await registry.heartbeat(EngineRecord(names[0], f"http://{names[0]}", model, 16, 100, 2048))
    router = Router(redis, "prefix_affinity", store, index_source="local")
    feed = router.local_feed
    assert feed is not None
    # Blocking reads of 50 ms, as before READ_BLOCK_MS grew: back to back they would be ~20 in a second.
    feed.idle_after_s, feed.idle_read_s, feed.read_block_ms = 0.3, 30.0, 50
    await router.start_local_index()
    await asyncio.sleep(0.8)  # past idle_after_s without a route: idle
    reads = feed.num_reads
    await asyncio.sleep(1.0)
    assert feed.num_reads - reads <= 1  # back to back: ~20 in a second

    hashes = chain(4)
    await store.apply(names[0], [("store", h) for h in hashes])
    await router.route(RouteRequest(tenant="t", model=model, num_prompt_tokens=16 * 4 + 3,
                                    block_hashes=tuple(hashes)))
    assert await wait_for_prefix(feed, names[0], hashes, timeout_s=5.0) < 5.0  # not the 30 s idle read
    await router.close()


async def test_an_idle_feed_still_follows_a_busy_stream_without_falling_behind(
        redis: aioredis.Redis, names: list[str]) -> None:
    # Another gateway's traffic fills the stream while this worker routes nothing: a read that comes back full
    # is followed at once, so the backlog is applied without waiting out an idle read per slice.
    store = PrefixIndex(redis)
    feed = LocalIndexFeed(redis, LocalPrefixIndex(100_000), store, idle_after_s=0.0, idle_read_s=30.0)
    task = asyncio.get_running_loop().create_task(feed.run())
    while not feed.ready:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # idle from the start: waiting out its 30 s read
    hashes = chain(1100)  # > 2 x READ_COUNT entries, one store each
    for h in hashes:
        await store.apply(names[0], [("store", h)])
    feed.used()  # one route wakes it, as the first request after idle does; the backlog's slices need no more
    await wait_for_prefix(feed, names[0], hashes, timeout_s=10.0)
    feed.stop()
    await asyncio.wait_for(task, 5.0)  # stop ends an idle wait at once


@pytest.fixture(params=["wire", "pool"])
async def feed_wire(request: pytest.FixtureRequest, redis_server: EmbeddedRedis) -> AsyncIterator[RedisWire | None]:
    """The feed's blocking reads on a lean connection of its own (the gateway's way), or on a redis-py
    client's pool (None)."""
    if request.param == "pool":
        yield None
        return
    wire = RedisWire(redis_server.url, 0.25)
    yield wire
    await wire.close()


async def test_a_quiet_stream_is_read_once_a_block_and_an_entry_ends_the_block_at_once(
        redis_server: EmbeddedRedis, names: list[str], caplog: pytest.LogCaptureFixture,
        feed_wire: RedisWire | None) -> None:
    # The gateway's clients time a reply out after 0.25 s; the feed's 1 s blocking read must outlast that
    # (stream_read.py), and a quiet stream is asked once a block, not twenty times a second.
    client = connect(redis_server.url, timeout_s=0.25)
    store = PrefixIndex(client)
    feed = LocalIndexFeed(client, LocalPrefixIndex(1000), store, idle_after_s=60.0, wire=feed_wire)
    assert feed.read_block_ms >= 1000
    task = asyncio.get_running_loop().create_task(feed.run())
    try:
        while not feed.ready:
            await asyncio.sleep(0.01)
        reads = feed.num_reads
        await asyncio.sleep(2.0)
        assert feed.num_reads - reads <= 3  # ~40 with 50 ms blocks
        hashes = chain(3)
        await store.apply(names[0], [("store", h) for h in hashes])
        assert await wait_for_prefix(feed, names[0], hashes, timeout_s=0.5) < 0.5  # not the block's end
        assert "stream read failed" not in caplog.text  # no read timed out at the client's 0.25 s
    finally:
        feed.stop()
        await asyncio.wait_for(task, 1.0)
        await client.aclose()


async def test_stop_ends_a_blocking_read_at_once_and_leaves_no_reply_behind(
        redis_server: EmbeddedRedis, names: list[str], feed_wire: RedisWire | None) -> None:
    # The connection the cancelled read used is the next command's (the wire's one, or a pool of one). Had
    # the read stayed on it, the next command would wait behind the 30 s XREAD (past its timeout), or read
    # the XREAD's reply once the entry below ends it.
    client = connect(redis_server.url, timeout_s=5.0, pool_size=1)
    store = PrefixIndex(client)
    feed = LocalIndexFeed(client, LocalPrefixIndex(1000), store, idle_after_s=60.0, read_block_ms=30_000,
                          wire=feed_wire)
    task = asyncio.get_running_loop().create_task(feed.run())
    while not feed.ready:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # inside the 30 s read
    feed.stop()
    await asyncio.wait_for(task, 1.0)
    key = f"k-{names[0]}"
    if feed_wire is None:
        await client.set(key, b"value")
        await store.apply(names[0], [("store", h) for h in chain(2)])
        assert await client.get(key) == b"value"
    else:
        await feed_wire.execute([("SET", key, "value")])
        await store.apply(names[0], [("store", h) for h in chain(2)])
        assert await feed_wire.execute([("GET", key)]) == [b"value"]
    await client.aclose()


async def ride(feed: LocalIndexFeed, wire: RedisWire) -> None:
    """One admission's round trip as far as the feed is concerned: its ride's read, applied."""
    command = feed.ride()
    assert command is not None
    (reply,) = await wire.execute([command])
    feed.take_ride(reply)


RunningFeed = tuple[LocalIndexFeed, PrefixIndex, RedisWire]


@asynccontextmanager
async def running_feed(redis_server: EmbeddedRedis, ride_gap_s: float) -> AsyncIterator[RunningFeed]:
    """A feed following the stream (warm-started, its loop running, never idle) with the store that publishes
    to it and a wire for its rides; stopped and closed on the way out."""
    client = connect(redis_server.url, timeout_s=5.0)
    wire = RedisWire(redis_server.url, 5.0)
    store = PrefixIndex(client)
    feed = LocalIndexFeed(client, LocalPrefixIndex(10_000), store, idle_after_s=60.0, ride_gap_s=ride_gap_s)
    task = asyncio.get_running_loop().create_task(feed.run())
    try:
        while not feed.ready:
            await asyncio.sleep(0.01)
        yield feed, store, wire
    finally:
        feed.stop()
        await asyncio.wait_for(task, 1.0)
        await wire.close()
        await client.aclose()


async def test_while_admissions_ride_the_feed_reads_on_its_own_only_a_gap_apart(
        redis_server: EmbeddedRedis, names: list[str]) -> None:
    # Each engine batch used to end the feed's blocking read: one wake-up and round trip per batch in every
    # busy worker. While rides bring the stream, the feed's own read waits ride_gap_s and does not block.
    async with running_feed(redis_server, ride_gap_s=30.0) as (feed, store, wire):
        reads = feed.num_reads
        batches = [chain(3) for _ in range(20)]
        for hashes in batches:
            await store.apply(names[0], [("store", h) for h in hashes])
            await asyncio.sleep(0.02)  # the feed's blocking read, had it one outstanding, returns here
            await ride(feed, wire)
            live = feed.index.live_mask([names[0]])
            assert feed.index.longest_prefixes(hashes, live) == {names[0]: 3}  # seen by the route after it
        assert feed.num_reads - reads <= 2  # one per batch (20) when the feed reads back to back
        assert feed.num_entries == len(batches)  # an entry read by both a ride and the feed counts once
        assert feed.num_rides == len(batches)


async def test_while_rides_reach_the_streams_end_the_feed_makes_no_read_of_its_own(
        redis_server: EmbeddedRedis, names: list[str]) -> None:
    # A read of its own every gap, whatever the rides did, was a timer and a reply each time in a worker that
    # serves steadily: it reads only once a gap passes without a ride that reached the stream's end.
    async with running_feed(redis_server, ride_gap_s=0.5) as (feed, store, wire):
        for _ in range(2):  # the first batches end the blocking reads it had outstanding when the rides began
            await store.apply(names[0], [("store", h) for h in chain(2)])
            await ride(feed, wire)
            await asyncio.sleep(0.05)
        reads = feed.num_reads
        for _ in range(30):  # 1.5 s of rides, three gaps (a ride every ~0.05 s: a pause of 0.45 s would be a gap)
            await store.apply(names[0], [("store", h) for h in chain(2)])
            await ride(feed, wire)
            await asyncio.sleep(0.05)
        assert feed.num_reads == reads
        hashes = chain(3)
        await store.apply(names[0], [("store", h) for h in hashes])  # after the last ride: the feed's to read
        assert await wait_for_prefix(feed, names[0], hashes, timeout_s=3.0) < 3.0
        assert feed.num_reads > reads


async def test_the_feed_reads_what_no_ride_brought_a_gap_later(redis_server: EmbeddedRedis, names: list[str]) -> None:
    # The batches published after the last admission (traffic pauses) reach the index by the feed's own read.
    async with running_feed(redis_server, ride_gap_s=0.3) as (feed, store, wire):
        await ride(feed, wire)
        hashes = chain(4)
        await store.apply(names[0], [("store", h) for h in hashes])
        assert await wait_for_prefix(feed, names[0], hashes, timeout_s=3.0) < 3.0


async def test_a_ride_stops_at_a_gap_and_the_feed_resyncs_from_that_entry(
        redis: aioredis.Redis, redis_server: EmbeddedRedis, names: list[str]) -> None:
    # A ride runs on the request path and never calls Redis: an engine's entry whose predecessor it never saw
    # stops it there, so the feed's own read (which resyncs) starts at that entry, and no later entry of
    # another engine is skipped on the way.
    store = PrefixIndex(redis)
    a, b, _ = names
    feed = LocalIndexFeed(redis, LocalPrefixIndex(10_000), store)
    await feed.warm_start()
    lost, kept, later = chain(2), chain(2), chain(2)
    await store.apply(a, [("store", h) for h in lost])
    await store.apply(a, [("store", h) for h in kept])
    await store.apply(b, [("store", h) for h in later])
    entries: Any = await redis.xrange(EVENTS_STREAM, "-", "+")
    first_of_a = next(entry_id for entry_id, fields in entries if fields[b"e"] == a.encode())
    await redis.xdel(EVENTS_STREAM, first_of_a)  # engine a's first batch never reaches this reader
    feed.take_ride(ResponseError("WRONGTYPE"))  # a ride that failed in the trip changes nothing
    wire = RedisWire(redis_server.url, 5.0)
    await ride(feed, wire)
    await wire.close()
    assert feed.index.blocks_of(a) == set() and feed.index.blocks_of(b) == set()  # stopped at a's entry
    await drain(feed)  # the feed's own read: a resyncs from Redis, b's batch follows
    assert feed.index.blocks_of(a) == set(lost + kept) and feed.index.blocks_of(b) == set(later)
    assert feed.num_resyncs == 1


async def test_a_full_ride_leaves_the_backlog_to_the_feed_at_once(redis_server: EmbeddedRedis,
                                                                 names: list[str]) -> None:
    # A ride reads at most RIDE_COUNT entries (it runs before the route); a full one wakes the feed, which takes
    # the rest in its own slices instead of waiting out its gap.
    async with running_feed(redis_server, ride_gap_s=30.0) as (feed, store, wire):
        for _ in range(2):  # the first batch ends the read the feed had outstanding; it then waits its gap
            await store.apply(names[1], [("store", h) for h in chain(1)])
            await asyncio.sleep(0.05)
            await ride(feed, wire)  # reached the stream's end
        hashes = chain(RIDE_COUNT + 40)
        for h in hashes:
            await store.apply(names[0], [("store", h)])
        await ride(feed, wire)
        assert feed.index.blocks_of(names[0]) == set(hashes[:RIDE_COUNT])
        assert await wait_for_prefix(feed, names[0], hashes, timeout_s=3.0) < 3.0  # not the 30 s gap
