"""The sim's KV events are vLLM's wire format: byte for byte what vLLM encodes, and what Tessera's
subscribers decode (kv_wire.py)."""

from __future__ import annotations

import msgspec
import zmq
from vllm.distributed import kv_events as vllm_events

from tessera.engine.sim import kv_wire
from tessera.routing.kv_events import decode_batch, decode_hashes, hashes_decoder
from tests.support.machine import free_port


def sim_events() -> list[kv_wire.KVEvent]:
    return [
        kv_wire.BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                            lora_id=None, medium="GPU", lora_name=None, extra_keys=[("salt",), None], group_idx=0),
        kv_wire.BlockRemoved(block_hashes=[11], medium="GPU", group_idx=0),
        kv_wire.AllBlocksCleared(),
        kv_wire.BlockStored(block_hashes=[13], parent_block_hash=12, token_ids=[5, 6], block_size=2,
                            lora_id=None, medium="GPU", lora_name=None, extra_keys=[None], group_idx=0),
    ]


def vllm_batch() -> vllm_events.KVEventBatch:
    return vllm_events.KVEventBatch(ts=2.5, events=[
        vllm_events.BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                                lora_id=None, medium="GPU", lora_name=None, extra_keys=[("salt",), None],
                                group_idx=0),
        vllm_events.BlockRemoved(block_hashes=[11], medium="GPU", group_idx=0),
        vllm_events.AllBlocksCleared(),
        vllm_events.BlockStored(block_hashes=[13], parent_block_hash=12, token_ids=[5, 6], block_size=2,
                                lora_id=None, medium="GPU", lora_name=None, extra_keys=[None], group_idx=0),
    ])


def test_a_batch_encodes_to_the_bytes_vllm_encodes() -> None:
    assert kv_wire.encode_batch(2.5, sim_events()) == msgspec.msgpack.encode(vllm_batch())


def test_vllms_decoder_and_tessera_subscribers_read_the_sims_batches() -> None:
    payload = kv_wire.encode_batch(2.5, sim_events())
    decoded = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch).decode(payload)
    assert decoded == vllm_batch()
    full = decode_batch(0, decoded)
    assert full.ops == [("store", 11), ("store", 12), ("remove", 11), ("clear", 0), ("store", 13)]
    assert [(h, parent, salt) for h, parent, _, salt in full.stored_blocks] == [
        (11, None, "salt"), (12, 11, None), (13, 12, None)]
    assert decode_hashes(0, hashes_decoder().decode(payload)).ops == full.ops


def test_the_publisher_numbers_batches_from_zero_on_its_topic() -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = kv_wire.KVEventPublisher(context, endpoint, topic="kv")
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(publisher.endpoint)
    try:
        received: list[list[bytes]] = []
        # A PUB socket drops what it sends before the subscription reaches it: resend until one arrives.
        while not received:
            publisher.publish(1.0, [kv_wire.AllBlocksCleared()])
            if sub.poll(100):
                received.append(sub.recv_multipart())
        publisher.publish(2.0, [])  # nothing to say: no batch, no sequence number used
        publisher.publish(3.0, [kv_wire.BlockRemoved(block_hashes=[5], medium="GPU")])
        while True:
            topic, seq, payload = sub.recv_multipart()
            batch = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch).decode(payload)
            if batch.ts == 3.0:
                break
        assert topic == b"kv"
        assert int.from_bytes(seq, "big") == publisher.num_batches - 1
        assert int.from_bytes(received[0][1], "big") < int.from_bytes(seq, "big")
    finally:
        sub.close(linger=0)
        publisher.close()
        context.term()
