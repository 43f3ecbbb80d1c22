"""KV events from vLLM's own publisher into the index: decoding, ordering, and what a lost batch does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import msgspec
import pytest
import zmq.asyncio
from redis.exceptions import ConnectionError as RedisConnectionError
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

from tessera.engine.sim import kv_wire
from tessera.routing.indexer import feed_index
from tessera.routing.kv_events import DecodedBatch, KVEventSubscriber, decode_batch, decode_hashes, hashes_decoder
from tessera.routing.prefix_index import Op, PrefixIndex
from tests.support.machine import free_port


def stored(hashes: list[bytes | int], parent: int | None = None, medium: str | None = "GPU",
           salt: str | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(range(4 * len(hashes))),
                       block_size=4, lora_id=None, medium=medium, lora_name=None,
                       extra_keys=[(salt,) if salt and i == 0 else None for i in range(len(hashes))])


def test_decode_keeps_event_order_and_parent_links() -> None:
    batch = KVEventBatch(ts=1.5, events=[
        stored([11, 12], salt="s"), BlockRemoved(block_hashes=[11], medium="GPU"), AllBlocksCleared(),
        stored([13], parent=12),
    ])
    out = decode_batch(7, batch)
    assert (out.seq, out.ts) == (7, 1.5)
    assert out.ops == [("store", 11), ("store", 12), ("remove", 11), ("clear", 0), ("store", 13)]
    assert [(h, parent, salt) for h, parent, _, salt in out.stored_blocks] == [
        (11, None, "s"), (12, 11, None), (13, 12, None)]
    assert out.stored_blocks[1][2] == [4, 5, 6, 7]


def test_decode_skips_blocks_outside_the_engines_own_cache() -> None:
    batch = KVEventBatch(ts=0.0, events=[stored([1], medium="CPU"), BlockRemoved(block_hashes=[1], medium="CPU"),
                                         stored([2], medium=None)])
    assert decode_batch(0, batch).ops == [("store", 2)]


def test_bytes_hashes_decode_to_the_low_64_bits() -> None:
    digest = bytes(range(32))
    batch = KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[digest], medium="GPU")])
    assert decode_batch(0, batch).ops == [("remove", int.from_bytes(digest[-8:], "big"))]


def test_the_hashes_only_decoder_gives_the_same_ops_from_vllms_own_encoding() -> None:
    digest = bytes(range(32))
    batch = KVEventBatch(ts=2.5, events=[
        stored([11, 12], salt="s"), stored([5], medium="CPU"), BlockRemoved(block_hashes=[11], medium="GPU"),
        BlockRemoved(block_hashes=[digest], medium="GPU"), AllBlocksCleared(), stored([13], parent=12, medium=None),
        BlockRemoved(block_hashes=[5], medium="STORAGE"),
    ])
    payload = msgspec.msgpack.Encoder().encode(batch)  # as vLLM's ZmqEventPublisher encodes it
    full = decode_batch(3, msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload))
    light = decode_hashes(3, hashes_decoder().decode(payload))
    assert (light.seq, light.ts, light.ops) == (full.seq, full.ts, full.ops)
    assert light.stored_blocks == []


async def test_subscriber_receives_vllms_own_publisher_in_order() -> None:
    port = free_port()
    publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{port}", topic="kv")
    subscriber = KVEventSubscriber(f"tcp://127.0.0.1:{port}", "kv")
    try:
        # ZMQ drops what is published before the subscription reaches the publisher: probe until it has.
        deadline = time.monotonic() + 10
        first: DecodedBatch | None = None
        while first is None and time.monotonic() < deadline:
            publisher.publish(KVEventBatch(ts=time.time(), events=[stored([99])]))
            try:
                first = await asyncio.wait_for(subscriber.__anext__(), 0.2)
            except TimeoutError:
                continue
        assert first is not None, "the subscription never connected"
        while True:  # drain the remaining probes
            try:
                first = await asyncio.wait_for(subscriber.__anext__(), 0.3)
            except TimeoutError:
                break
        publisher.publish(KVEventBatch(ts=time.time(), events=[stored([1, 2])]))
        publisher.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=[2], medium="GPU")]))
        a = await asyncio.wait_for(subscriber.__anext__(), 5)
        b = await asyncio.wait_for(subscriber.__anext__(), 5)
        assert (a.seq, b.seq) == (first.seq + 1, first.seq + 2)
        assert a.ops == [("store", 1), ("store", 2)] and b.ops == [("remove", 2)]
    finally:
        subscriber.close()
        publisher.shutdown()


async def test_the_hashes_only_subscriber_reads_the_sims_publisher_on_a_given_context() -> None:
    context = zmq.asyncio.Context()
    publisher = kv_wire.KVEventPublisher(context, f"tcp://127.0.0.1:{free_port()}")
    subscriber = KVEventSubscriber(publisher.endpoint, with_blocks=False, context=context)
    try:
        deadline = time.monotonic() + 10
        while True:  # a PUB socket drops what it sends before the subscription reached it
            publisher.publish(time.time(), [kv_wire.AllBlocksCleared()])
            try:
                await asyncio.wait_for(subscriber.__anext__(), 0.2)
                break
            except TimeoutError:
                assert time.monotonic() < deadline, "the subscription never connected"
        await asyncio.sleep(0.3)
        while True:  # drain the remaining probes
            try:
                await asyncio.wait_for(subscriber.__anext__(), 0.1)
            except TimeoutError:
                break
        publisher.publish(time.time(), [kv_wire.BlockRemoved(block_hashes=[7, 8], medium="GPU")])
        batch = await asyncio.wait_for(subscriber.__anext__(), 5)
        assert (batch.seq, batch.ops, batch.stored_blocks) == (publisher.num_batches - 1,
                                                               [("remove", 7), ("remove", 8)], [])
    finally:
        subscriber.close()
        publisher.close()
        context.term()


async def batches(*items: tuple[int, list[Op]]) -> AsyncIterator[DecodedBatch]:
    for seq, ops in items:
        yield DecodedBatch(seq=seq, ts=0.0, ops=list(ops))


async def test_feed_applies_batches_in_order(index: PrefixIndex, engine_ids: list[str], hashes: list[int]) -> None:
    a = engine_ids[0]
    h = hashes
    stats = await feed_index(index, a, batches((5, [("store", h[0]), ("store", h[1])]), (6, [("remove", h[1])]),
                                               (7, [("store", h[2])])))
    assert await index.blocks_of(a) == {h[0]: 1, h[2]: 1}
    assert (stats.num_batches, stats.num_ops, stats.num_gaps) == (3, 4, 0)


async def test_a_gap_in_the_sequence_drops_the_engines_entries(
        index: PrefixIndex, engine_ids: list[str], hashes: list[int]) -> None:
    a, h = engine_ids[0], hashes
    # Batch 1 is lost: it may have removed h[0], so the index must not keep claiming it.
    stats = await feed_index(index, a, batches((0, [("store", h[0])]), (2, [("store", h[1])])))
    assert await index.blocks_of(a) == {h[1]: 1}
    assert stats.num_gaps == 1


class FlakyIndex(PrefixIndex):
    """Fails the n-th apply the way a Redis blip does (hard to provoke on purpose with a real server)."""

    def __init__(self, index: PrefixIndex, fail_on: int) -> None:
        super().__init__(index._redis)
        self._calls = 0
        self._fail_on = fail_on

    async def apply(self, engine_id: str, ops: Sequence[Op], ts: float | None = None) -> None:
        self._calls += 1
        if self._calls == self._fail_on:
            raise RedisConnectionError("connection reset by peer")
        await super().apply(engine_id, ops, ts)


async def test_a_batch_that_failed_to_reach_redis_drops_the_entries_next_time(
        index: PrefixIndex, engine_ids: list[str], hashes: list[int]) -> None:
    a, h = engine_ids[0], hashes
    flaky = FlakyIndex(index, fail_on=2)
    stats = await feed_index(flaky, a, batches((0, [("store", h[0])]), (1, [("remove", h[0])]),
                                               (2, [("store", h[1])])))
    assert await index.blocks_of(a) == {h[1]: 1}
    assert (stats.num_failed_batches, stats.num_batches) == (1, 2)


@pytest.mark.parametrize("first_seq", [0, 41])
async def test_batches_before_the_subscription_are_not_a_gap(
        first_seq: int, index: PrefixIndex, engine_ids: list[str], hashes: list[int]) -> None:
    stats = await feed_index(index, engine_ids[0], batches((first_seq, [("store", hashes[0])])))
    assert stats.num_gaps == 0 and await index.blocks_of(engine_ids[0]) == {hashes[0]: 1}
