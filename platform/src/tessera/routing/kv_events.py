"""Subscribes to one engine's KV events (vLLM's ZMQ publisher) and decodes them into plain values.

Wire format (vLLM 0.32): multipart ``[topic, seq (8 bytes big-endian), msgpack(KVEventBatch)]``; events
are tagged structs BlockStored / BlockRemoved / AllBlocksCleared. The decoder is vLLM's own struct types,
so a format change in vLLM fails loudly here rather than silently mis-indexing. ``seq`` counts published
batches from 0 per engine, so a subscriber can tell when it missed some (see indexer.py).

Only blocks in the engine's own KV cache (medium GPU, or unset) are decoded: blocks a connector offloads
to CPU memory or storage are announced too, but a request does not hit them the way it hits the cache.

Two decoders: the full one (vLLM's own types: hashes, parents, token ids, salts — the KV-eviction
controller's ledger needs them all), and ``with_blocks=False`` for a subscriber that needs the hashes only
(the engine host's prefix-index feed): its types declare just the fields it reads, so msgspec skips each
block's token ids and the other fields without building a Python object for them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec


@dataclass(slots=True)
class DecodedBatch:
    seq: int
    ts: float
    # In event order: ("store", hash), ("remove", hash), ("clear", 0). Order matters: a block can be
    # removed and stored again within one batch.
    ops: list[tuple[str, int]] = field(default_factory=list)
    # One entry per stored block: (hash, parent hash, token ids, cache salt or None).
    stored_blocks: list[tuple[int, int | None, list[int], str | None]] = field(default_factory=list)


def _as_int(value: Any) -> int:
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & ((1 << 64) - 1)
    return int(value)


def _salt(extra: Any) -> str | None:
    if not extra:
        return None
    for key in extra:
        if isinstance(key, str):
            return key
    return None


# Media whose blocks a request's prefix-cache lookup finds directly (None: publisher did not say).
CACHE_MEDIA = (None, "GPU")


def decode_batch(seq: int, batch: Any) -> DecodedBatch:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    out = DecodedBatch(seq=seq, ts=float(batch.ts))
    for event in batch.events:
        if isinstance(event, BlockStored | BlockRemoved) and event.medium not in CACHE_MEDIA:
            continue
        if isinstance(event, BlockStored):
            size = event.block_size
            extras = event.extra_keys or [None] * len(event.block_hashes)
            parent = _as_int(event.parent_block_hash) if event.parent_block_hash is not None else None
            for i, raw in enumerate(event.block_hashes):
                h = _as_int(raw)
                out.ops.append(("store", h))
                out.stored_blocks.append((h, parent, list(event.token_ids[i * size:(i + 1) * size]),
                                          _salt(extras[i] if i < len(extras) else None)))
                parent = h
        elif isinstance(event, BlockRemoved):
            out.ops.extend(("remove", _as_int(h)) for h in event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            out.ops.append(("clear", 0))
    return out


# The hashes-only view of vLLM's event types (same tags and field names; fields not declared are skipped).
class _StoredHashes(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[Any]
    medium: str | None = None


class _RemovedHashes(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[Any]
    medium: str | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class _HashesBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_StoredHashes | _RemovedHashes | _Cleared]


def hashes_decoder() -> msgspec.msgpack.Decoder[_HashesBatch]:
    return msgspec.msgpack.Decoder(type=_HashesBatch)


def decode_hashes(seq: int, batch: _HashesBatch) -> DecodedBatch:
    """``decode_batch`` for the hashes-only decoder: ops in event order, no ``stored_blocks``."""
    out = DecodedBatch(seq=seq, ts=batch.ts)
    ops = out.ops
    for event in batch.events:
        if isinstance(event, _StoredHashes):
            if event.medium in CACHE_MEDIA:
                ops.extend(("store", _as_int(h)) for h in event.block_hashes)
        elif isinstance(event, _RemovedHashes):
            if event.medium in CACHE_MEDIA:
                ops.extend(("remove", _as_int(h)) for h in event.block_hashes)
        else:
            ops.append(("clear", 0))
    return out


class KVEventSubscriber:
    """An async iterator of decoded batches from a ZMQ PUB endpoint. The SUB socket connects when the
    subscriber is made, so batches published from then on queue up until iteration starts.
    ``with_blocks=False``: the batches carry ``ops`` only (see the module docstring)."""

    def __init__(self, endpoint: str, topic: str = "", with_blocks: bool = True) -> None:
        import zmq
        import zmq.asyncio
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder: msgspec.msgpack.Decoder[Any] = (msgspec.msgpack.Decoder(type=KVEventBatch) if with_blocks
                                                        else hashes_decoder())
        self._decode = decode_batch if with_blocks else decode_hashes
        self._sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.connect(endpoint)

    def __aiter__(self) -> KVEventSubscriber:
        return self

    async def __anext__(self) -> DecodedBatch:
        _, seq_bytes, payload = await self._sock.recv_multipart()
        return self._decode(int.from_bytes(seq_bytes, "big"), self._decoder.decode(payload))

    def close(self) -> None:
        self._sock.close(linger=0)


async def subscribe(endpoint: str, topic: str = "") -> AsyncIterator[DecodedBatch]:
    """Yields decoded batches from a ZMQ PUB endpoint until cancelled."""
    subscriber = KVEventSubscriber(endpoint, topic)
    try:
        async for batch in subscriber:
            yield batch
    finally:
        subscriber.close()
