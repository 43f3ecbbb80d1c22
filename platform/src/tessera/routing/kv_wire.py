"""vLLM's KV-event wire format in one place: the structs that encode it, the read views that decode only what
a subscriber needs, and the decoded value (``DecodedBatch``) that every subscriber hands on.

Wire format (vLLM 0.32, ``vllm/distributed/kv_events.py``): ``ZmqEventPublisher`` sends each batch as one
multipart message ``[topic, seq as 8 bytes big-endian, payload]``, ``seq`` counting batches from 0 per engine
(so a subscriber can tell when it missed some: routing/indexer.py). The payload is ``KVEventBatch(ts,
events)``, a msgspec struct encoded as a msgpack *array* ``[ts, events, data_parallel_rank]``; each event is
a msgpack *map* tagged ``{"type": "<class name>", ...}`` with default-valued optional fields omitted:
BlockStored / BlockRemoved / AllBlocksCleared. A block hash is an int (vLLM's default) or its big-endian
digest as bytes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), keyed by its low 64 bits (``block_hash_key``).

Who uses what:

* the simulated engine encodes with ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` and
  ``encode_batch`` (its publisher: engine/sim/kv_wire.py);
* the prefix index's feed decodes the hashes only (``hashes_decoder`` + ``decode_hashes``, kv_events.py):
  it is on every replica's hot path;
* the KV-eviction controller's ledger adds each stored block's parent and cache salt (``chains_decoder`` +
  ``decode_chains``, kvcontrol/events.py): the salt on a chain's root block names its tenant.

A read view declares only the fields its subscriber reads, with vLLM's tags and field names; msgspec skips
every other field (each block's token ids above all) without building a Python object for it. Only blocks
in the engine's own KV cache (medium GPU, or unset) are decoded: blocks a connector offloads to CPU memory
or storage are announced too, but a request does not hit them the way it hits the cache.

NOTE: the structs mirror vLLM's instead of importing them, so neither the index feed, the controller nor a
fleet of simulated engines imports vLLM (and torch): seconds of CPU and hundreds of MB. The tests catch a
drift: tests/unit/sim/test_kv_wire.py compares these structs' bytes with vLLM's, and tests/unit/routing/
test_kv_wire.py checks every view's tags and field names against vLLM's structs (a misspelt field would
decode as its default, silently) and the views' decoding of vLLM's own bytes against vLLM's decoder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
# Media whose blocks a request's prefix-cache lookup finds directly (None: the publisher did not say).
CACHE_MEDIA = (None, MEDIUM_GPU)

# ---- encoding: vLLM's structs, field for field ------------------------------------------------------------


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


# ---- the decoded value -------------------------------------------------------------------------------------

# One stored block: (hash, parent hash, token ids, cache salt or None).
StoredBlock = tuple[int, int | None, list[int], str | None]


@dataclass(slots=True)
class DecodedBatch:
    seq: int
    ts: float
    # In event order: ("store", hash), ("remove", hash), ("clear", 0). Order matters: a block can be
    # removed and stored again within one batch.
    ops: list[tuple[str, int]] = field(default_factory=list)
    # One entry per stored block, in the order of the store ops (empty where the decoder reads hashes only).
    stored_blocks: list[StoredBlock] = field(default_factory=list)


_MASK_64 = (1 << 64) - 1


def block_hash_key(value: int | bytes) -> int:
    """A block hash as the index keys it: an int as sent, a digest by its low 64 bits (big-endian)."""
    return value if type(value) is int else int.from_bytes(value, "big") & _MASK_64  # type: ignore[arg-type]


def cache_salt(extra: tuple[Any, ...] | list[Any] | None) -> str | None:
    """The cache salt among a block's extra keys: its first string. vLLM lists a LoRA adapter's name first,
    then (identifier, offset) pairs of multimodal inputs, then the salt; Tessera serves no LoRA adapters."""
    if extra:
        for key in extra:
            if isinstance(key, str):
                return key
    return None


# ---- decoding: read views of the same structs --------------------------------------------------------------


class _StoredHashes(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[Any]  # int | bytes: Any spares msgspec a type check per hash
    medium: str | None = None


class _StoredChain(_StoredHashes, tag="BlockStored", gc=False):
    parent_block_hash: Any = None
    extra_keys: list[Any] | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[Any]
    medium: str | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class HashesBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_StoredHashes | _Removed | _Cleared]


class ChainsBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_StoredChain | _Removed | _Cleared]


def hashes_decoder() -> msgspec.msgpack.Decoder[HashesBatch]:
    return msgspec.msgpack.Decoder(type=HashesBatch)


def chains_decoder() -> msgspec.msgpack.Decoder[ChainsBatch]:
    return msgspec.msgpack.Decoder(type=ChainsBatch)


_CLEAR = ("clear", 0)


def decode_hashes(seq: int, batch: HashesBatch | ChainsBatch) -> DecodedBatch:
    """The ops of a batch in event order, no ``stored_blocks`` (the prefix index's feed)."""
    out = DecodedBatch(seq=seq, ts=batch.ts)
    ops = out.ops
    for event in batch.events:
        if isinstance(event, _Cleared):
            ops.append(_CLEAR)
        elif event.medium in CACHE_MEDIA:
            op = "store" if isinstance(event, _StoredHashes) else "remove"
            # NOTE: block_hash_key inlined for an int, vLLM's default: the feed's hot path, a call per hash.
            ops.extend([(op, h if type(h) is int else block_hash_key(h)) for h in event.block_hashes])
    return out


_NO_TOKENS: list[int] = []  # shared, never mutated: the chains view does not read token ids


def decode_chains(seq: int, batch: ChainsBatch) -> DecodedBatch:
    """``decode_hashes``' ops plus each stored block's parent and cache salt, token ids left empty (the
    ledger). NOTE: a pass of its own, stores first (most of a busy engine's events): a second pass over
    ``decode_hashes``' result cost the controller ~30 % more per batch."""
    out = DecodedBatch(seq=seq, ts=batch.ts)
    ops, stored = out.ops, out.stored_blocks
    for event in batch.events:
        if isinstance(event, _StoredChain):
            if event.medium not in CACHE_MEDIA:
                continue
            parent = event.parent_block_hash
            if parent is not None and type(parent) is not int:
                parent = block_hash_key(parent)
            extras = event.extra_keys
            for i, raw in enumerate(event.block_hashes):
                h = raw if type(raw) is int else block_hash_key(raw)
                ops.append(("store", h))
                stored.append((h, parent, _NO_TOKENS, cache_salt(extras[i]) if extras and i < len(extras) else None))
                parent = h
        elif isinstance(event, _Removed):
            if event.medium in CACHE_MEDIA:
                ops.extend([("remove", h if type(h) is int else block_hash_key(h)) for h in event.block_hashes])
        else:
            ops.append(_CLEAR)
    return out
