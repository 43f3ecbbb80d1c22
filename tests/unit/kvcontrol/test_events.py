"""The controller's lean KV-event subscriber (kvcontrol/events.py): the ledger's view of vLLM's wire format,
the same as the full decoder's but without token ids, and bursts taken off the socket in order with no batch
lost or stuck between bursts."""

from __future__ import annotations

import asyncio
import time

import zmq

from tessera.engine.sim import kv_wire
from tessera.routing.kv_events import decode_hashes, hashes_decoder
from tessera_operators.kvcontrol.events import LedgerDecoder, LedgerEvents
from tests.support.machine import free_port


def events() -> list[kv_wire.KVEvent]:
    return [
        kv_wire.BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                            lora_id=None, medium="GPU", lora_name=None, extra_keys=[("salt",), None]),
        kv_wire.BlockStored(block_hashes=[99], parent_block_hash=None, token_ids=[1, 2], block_size=2,
                            lora_id=None, medium="CPU", lora_name=None),  # offloaded: not the engine's cache
        kv_wire.BlockRemoved(block_hashes=[11], medium="GPU"),
        kv_wire.AllBlocksCleared(),
        kv_wire.BlockStored(block_hashes=[13], parent_block_hash=12, token_ids=[5, 6], block_size=2,
                            lora_id=None, medium=None, lora_name=None),
    ]


def test_the_ledger_decoder_reads_what_the_full_decoder_reads_but_token_ids() -> None:
    payload = kv_wire.encode_batch(2.5, events())
    batch = LedgerDecoder().decode(7, payload)
    assert (batch.seq, batch.ts) == (7, 2.5)
    assert batch.ops == [("store", 11), ("store", 12), ("remove", 11), ("clear", 0), ("store", 13)]
    assert batch.ops == decode_hashes(7, hashes_decoder().decode(payload)).ops
    assert batch.stored_blocks == [(11, None, [], "salt"), (12, 11, [], None), (13, 12, [], None)]


def test_bursts_arrive_in_order_and_a_later_batch_still_wakes_the_reader() -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    publisher = kv_wire.KVEventPublisher(context, f"tcp://127.0.0.1:{free_port()}")
    subscriber = LedgerEvents(publisher.endpoint, max_burst=16)
    one: list[kv_wire.KVEvent] = [kv_wire.BlockRemoved(block_hashes=[5], medium="GPU")]

    async def scenario() -> list[list[int]]:
        deadline = time.monotonic() + 5
        while True:  # a PUB socket drops what it sends before the subscription reached it
            publisher.publish(time.time(), one)
            try:
                async with asyncio.timeout(0.2):
                    await anext(subscriber)
                break
            except TimeoutError:
                assert time.monotonic() < deadline, "the subscription never reached the publisher"
        start = publisher.num_batches
        for _ in range(40):
            publisher.publish(time.time(), one)
        await asyncio.sleep(0.3)  # all 40 queued before the next receive
        bursts: list[list[int]] = []
        while sum(len(b) for b in bursts) < 40:
            async with asyncio.timeout(5):
                bursts.append([b.seq - start for b in await anext(subscriber) if b.seq >= start])
        await asyncio.sleep(0.1)
        publisher.publish(time.time(), one)  # the socket is empty now: this one must wake the reader
        async with asyncio.timeout(5):
            bursts.append([b.seq - start for b in await anext(subscriber)])
        return bursts

    try:
        bursts = asyncio.run(scenario())
    finally:
        subscriber.close()
        publisher.close()
        context.term()
    assert [seq for burst in bursts for seq in burst] == list(range(41))
    assert all(len(burst) <= 16 for burst in bursts) and len(bursts) <= 5  # bursts, not one wake-up per batch


def test_byte_hashes_are_keyed_as_the_gateway_keys_them() -> None:
    """vLLM sends a block hash as bytes unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: its low 64 bits, big-endian,
    as routing/kv_events.py reads them."""
    raw = [bytes(range(32)), b"\xff" * 32]
    payload = kv_wire.encode_batch(1.0, [
        kv_wire.BlockStored(block_hashes=raw, parent_block_hash=None, token_ids=[1] * 4,  # type: ignore[arg-type]
                            block_size=2, lora_id=None, medium="GPU", lora_name=None),
        kv_wire.BlockRemoved(block_hashes=raw[:1], medium="GPU")])  # type: ignore[arg-type]
    ops = LedgerDecoder().decode(0, payload).ops
    assert ops == decode_hashes(0, hashes_decoder().decode(payload)).ops
    assert ops[0] == ("store", int.from_bytes(raw[0], "big") & (2**64 - 1)) and ops[1] == ("store", 2**64 - 1)
