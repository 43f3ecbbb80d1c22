"""The controller's KV-event subscriber: one engine's batches in vLLM's wire format (routing/kv_events.py
describes it), decoded for the ledger and taken off the socket in bursts.

Two differences from ``routing.kv_events.subscribe`` (the full decoder), both for a controller that follows
tens of engines in one process (bench_kvcontrol.py --engines 64 measured the difference; docs/routing.md):

* the ledger reads a stored block's hash, parent and cache salt, never its token ids, so the decoder's types
  declare only those fields: msgspec skips each block's token ids without building a Python list of them
  (the full decoder builds a list of ``block_size`` ints per block, and slices it again per block);
* after one awaited receive, every batch already queued on the socket is taken without awaiting (a
  non-blocking receive on the same socket), so a busy engine costs one event-loop wake-up per burst, not
  one per batch.

The decoded batch is ``routing.kv_events.DecodedBatch`` with the same ``ops`` and ``stored_blocks`` as the
full decoder's, except that each stored block's token ids are an empty list (tests/unit/kvcontrol/
test_events.py checks both decoders agree on the sim's wire bytes, which tests/unit/sim/test_kv_wire.py checks
against vLLM's own encoder).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tessera.routing.kv_events import CACHE_MEDIA, DecodedBatch

# The most batches taken in one burst before the loop yields to the other engines and the polls.
MAX_BURST = 256
_NO_TOKENS: list[int] = []  # shared, never mutated: the ledger does not read token ids


class _Stored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[Any]
    parent_block_hash: Any = None
    medium: str | None = None
    extra_keys: list[Any] | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[Any]
    medium: str | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_Stored | _Removed | _Cleared]


_MASK_64 = (1 << 64) - 1


def _as_int(value: Any) -> int:
    # vLLM sends a block hash as an int, or as bytes (its big-endian digest), which routing keys by its low 64 bits.
    return value if isinstance(value, int) else int.from_bytes(value, "big") & _MASK_64


def _salt(extra: Any) -> str | None:
    if extra:
        for key in extra:
            if isinstance(key, str):
                return key
    return None


class LedgerDecoder:
    """Payload bytes -> ``DecodedBatch`` for the ledger (no token ids)."""

    def __init__(self) -> None:
        self._decoder = msgspec.msgpack.Decoder(type=_Batch)

    def decode(self, seq: int, payload: bytes) -> DecodedBatch:
        batch = self._decoder.decode(payload)
        out = DecodedBatch(seq=seq, ts=batch.ts)
        ops, stored = out.ops, out.stored_blocks
        for event in batch.events:
            if isinstance(event, _Stored):
                if event.medium not in CACHE_MEDIA:
                    continue
                extras = event.extra_keys
                parent = _as_int(event.parent_block_hash) if event.parent_block_hash is not None else None
                for i, raw in enumerate(event.block_hashes):
                    h = _as_int(raw)
                    ops.append(("store", h))
                    stored.append((h, parent, _NO_TOKENS, _salt(extras[i]) if extras and i < len(extras) else None))
                    parent = h
            elif isinstance(event, _Removed):
                if event.medium in CACHE_MEDIA:
                    ops.extend(("remove", _as_int(h)) for h in event.block_hashes)
            else:
                ops.append(("clear", 0))
        return out


class LedgerEvents:
    """One engine's KV events as bursts of decoded batches (an async iterator of lists, never empty). The SUB
    socket connects when this is made, so batches published from then on queue until iteration starts."""

    def __init__(self, endpoint: str, topic: str = "", max_burst: int = MAX_BURST) -> None:
        self._decoder = LedgerDecoder()
        self._sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.connect(endpoint)
        # The same socket without asyncio's futures, for the receives that must not wait.
        self._now: zmq.Socket[bytes] = zmq.Socket.shadow(self._sock.underlying)
        self._max_burst = max_burst

    def __aiter__(self) -> LedgerEvents:
        return self

    def _decode(self, frames: list[bytes]) -> DecodedBatch:
        _, seq_bytes, payload = frames
        return self._decoder.decode(int.from_bytes(seq_bytes, "big"), payload)

    async def __anext__(self) -> list[DecodedBatch]:
        burst = [self._decode(await self._sock.recv_multipart())]
        while len(burst) < self._max_burst:
            try:
                frames = self._now.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            burst.append(self._decode(frames))
        return burst

    def close(self) -> None:
        self._sock.close(linger=0)


async def ledger_bursts(endpoint: str, topic: str = "") -> AsyncIterator[list[DecodedBatch]]:
    """Yields bursts of decoded batches from a ZMQ PUB endpoint until cancelled."""
    events = LedgerEvents(endpoint, topic)
    try:
        async for burst in events:
            yield burst
    finally:
        events.close()
