"""KV events in vLLM's own wire format, and the ZMQ publisher that sends them.

vLLM 0.32 (``vllm/distributed/kv_events.py``): a batch is ``KVEventBatch(ts, events)``, a msgspec struct
encoded as a msgpack *array* ``[ts, events]``; each event is a msgpack *map* tagged ``{"type": "<class
name>", ...}`` with default-valued optional fields omitted. ``ZmqEventPublisher`` sends every batch as one
multipart message ``[topic, seq as 8 bytes big-endian, payload]``, ``seq`` counting batches from 0.

NOTE: the structs below mirror vLLM's field names, tags and defaults instead of importing vLLM's, so a
fleet of simulated engines never imports vLLM (and torch) at all. ``tests/unit/sim/test_kv_wire.py``
decodes what they encode with vLLM's own ``KVEventBatch`` decoder, so a drift in vLLM fails there.
"""

from __future__ import annotations

from typing import Any

import msgspec
import zmq

MEDIUM_GPU = "GPU"


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    # The fields without a default are required in vLLM's struct too, so they are always on the wire.
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    # vLLM's batch ends with this field, and encodes it (as nil) even when unset.
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(ts: float, events: list[KVEvent]) -> bytes:
    return _ENCODER.encode(KVEventBatch(ts=ts, events=events))


class KVEventPublisher:
    """One engine's PUB socket, bound to ``endpoint`` (``tcp://*:PORT`` or ``ipc://…``).

    Sends are non-blocking: a PUB socket drops messages for a subscriber past its high-water mark, as
    vLLM's does, and the numbered batches let the subscriber notice (``routing/indexer.py``)."""

    def __init__(self, context: zmq.Context[Any], endpoint: str, topic: str = "") -> None:
        self._sock = context.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self.endpoint = str(self._sock.getsockopt_string(zmq.LAST_ENDPOINT))
        self._topic = topic.encode()
        self.num_batches = 0

    def publish(self, ts: float, events: list[KVEvent]) -> None:
        if not events:
            return
        seq = self.num_batches.to_bytes(8, "big")
        self._sock.send_multipart((self._topic, seq, encode_batch(ts, events)), flags=zmq.NOBLOCK)
        self.num_batches += 1

    def close(self) -> None:
        self._sock.close(linger=0)
