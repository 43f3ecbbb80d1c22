"""The controller's KV-event subscriber: one engine's batches in vLLM's wire format, decoded for the ledger
(``tessera/routing/kv_wire.py``'s chains view) and taken off the socket in bursts.

Two differences from ``routing.kv_events.KVEventSubscriber``, both for a controller that follows tens of
engines in one process (bench_kvcontrol.py --engines 64 measured the difference; docs/routing.md):

* the ledger reads a stored block's hash, parent and cache salt (the salt on a chain's root names its
  tenant), never its token ids: ``decode_chains`` declares only those fields, so msgspec skips each block's
  token ids without building a Python list of them (vLLM's own types build a list of ``block_size`` ints
  per block);
* after one awaited receive, every batch already queued on the socket is taken without awaiting (a
  non-blocking receive on the same socket), so a busy engine costs one event-loop wake-up per burst, not
  one per batch.

The decoded batch has the same ``ops`` and ``stored_blocks`` as the full decoder's, except that each stored
block's token ids are an empty list (tests/unit/kvcontrol/test_events.py checks the decoders agree on the
sim's wire bytes, which tests/unit/sim/test_kv_wire.py checks against vLLM's own encoder).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from tessera.routing.kv_wire import DecodedBatch, chains_decoder, decode_chains

# The most batches taken in one burst before the loop yields to the other engines and the polls.
MAX_BURST = 256


class LedgerDecoder:
    """Payload bytes -> ``DecodedBatch`` for the ledger (no token ids)."""

    def __init__(self) -> None:
        self._decoder = chains_decoder()

    def decode(self, seq: int, payload: bytes) -> DecodedBatch:
        return decode_chains(seq, self._decoder.decode(payload))


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
