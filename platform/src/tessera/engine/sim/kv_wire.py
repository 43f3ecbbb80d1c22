"""The simulated engine's KV-event publisher: vLLM's ``ZmqEventPublisher`` socket, numbering and encoding.

The wire format itself (vLLM's structs, field for field, and ``encode_batch``) is ``routing/kv_wire.py``'s,
shared with the subscribers that decode it; it is re-exported here for the simulator's modules.
"""

from __future__ import annotations

from typing import Any

import zmq

from tessera.routing.kv_wire import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    encode_batch,
)

__all__ = ["MEDIUM_GPU", "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent", "KVEventBatch",
           "KVEventPublisher", "encode_batch"]


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
