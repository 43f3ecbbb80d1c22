"""Subscribes to one engine's KV events (vLLM's ZMQ publisher) and decodes them into plain values.

The wire format, the hashes-only read view and ``DecodedBatch`` are ``kv_wire.py``'s, shared with the
simulated engine's publisher and the KV-eviction controller; this module adds the subscriber and the
full decoder.

Two decoders: ``with_blocks=False`` for a subscriber that needs the hashes only (the engine host's
prefix-index feed, on every replica's hot path): its types declare just the fields it reads, so msgspec
skips each block's token ids and the other fields without building a Python object for them; and the full
one (``decode_batch`` over vLLM's own struct types: hashes, parents, token ids, salts), which imports vLLM —
tests and probes use it as the reference the lean decoders are checked against, so a format change in vLLM
fails loudly there rather than silently mis-indexing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from tessera.routing.kv_wire import CACHE_MEDIA, DecodedBatch, block_hash_key, cache_salt, decode_hashes, hashes_decoder

if TYPE_CHECKING:
    import zmq.asyncio

__all__ = ["CACHE_MEDIA", "DecodedBatch", "KVEventSubscriber", "decode_batch", "decode_hashes", "hashes_decoder"]


def decode_batch(seq: int, batch: Any) -> DecodedBatch:
    """A batch decoded with vLLM's own ``KVEventBatch`` type -> ``DecodedBatch`` with token ids."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    out = DecodedBatch(seq=seq, ts=float(batch.ts))
    for event in batch.events:
        if isinstance(event, BlockStored | BlockRemoved) and event.medium not in CACHE_MEDIA:
            continue
        if isinstance(event, BlockStored):
            size = event.block_size
            extras = event.extra_keys or ()
            parent = block_hash_key(event.parent_block_hash) if event.parent_block_hash is not None else None
            for i, raw in enumerate(event.block_hashes):
                h = block_hash_key(raw)
                out.ops.append(("store", h))
                out.stored_blocks.append((h, parent, list(event.token_ids[i * size:(i + 1) * size]),
                                          cache_salt(extras[i]) if i < len(extras) else None))
                parent = h
        elif isinstance(event, BlockRemoved):
            out.ops.extend(("remove", block_hash_key(h)) for h in event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            out.ops.append(("clear", 0))
    return out


class KVEventSubscriber:
    """An async iterator of decoded batches from a ZMQ PUB endpoint. The SUB socket connects when the
    subscriber is made, so batches published from then on queue up until iteration starts.
    ``with_blocks=False``: the batches carry ``ops`` only, and vLLM is not imported (see the module
    docstring). ``context``: the ZMQ context to open the socket in (default: the process's shared one)."""

    def __init__(self, endpoint: str, topic: str = "", with_blocks: bool = True,
                 context: zmq.asyncio.Context | None = None) -> None:
        import zmq
        import zmq.asyncio

        self._decoder: msgspec.msgpack.Decoder[Any]
        self._decode: Callable[[int, Any], DecodedBatch]
        if with_blocks:
            from vllm.distributed.kv_events import KVEventBatch

            self._decoder, self._decode = msgspec.msgpack.Decoder(type=KVEventBatch), decode_batch
        else:
            self._decoder, self._decode = hashes_decoder(), decode_hashes
        self._sock = (context or zmq.asyncio.Context.instance()).socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.connect(endpoint)

    def __aiter__(self) -> KVEventSubscriber:
        return self

    async def __anext__(self) -> DecodedBatch:
        _, seq_bytes, payload = await self._sock.recv_multipart()
        return self._decode(int.from_bytes(seq_bytes, "big"), self._decoder.decode(payload))

    def close(self) -> None:
        self._sock.close(linger=0)

