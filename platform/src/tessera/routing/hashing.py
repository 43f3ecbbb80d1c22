"""Prompt → chain of block hashes, computed exactly as vLLM's prefix cache computes them, so the gateway
can ask the index "which engine holds this prompt's blocks" before any engine sees the request.

vLLM (0.32, ``prefix_caching_hash_algo="sha256"``): ``h_i = sha256(pickle((h_{i-1}, tokens_i, extra_i)))``
with ``h_{-1} = sha256(pickle("vllm-none-hash"))`` (or ``PYTHONHASHSEED`` when set), only full blocks
hashed, and ``extra_0 = (("cache_salt", salt),)`` on the first block when the request carries a salt.
KV events publish the low 64 bits of each hash as an int; the index stores that form.
tests/unit/test_hashing.py checks equality against vLLM's own functions.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from functools import lru_cache

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_MASK64 = (1 << 64) - 1


@lru_cache(maxsize=4)
def _none_hash(seed: str) -> bytes:
    return hashlib.sha256(pickle.dumps(seed, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash() -> bytes:
    return _none_hash(os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED))


def block_hashes_bytes(token_ids: list[int], block_size: int, cache_salt: str | None) -> list[bytes]:
    parent = none_hash()
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
        payload = (parent, tuple(token_ids[start:start + block_size]), extra)
        parent = hashlib.sha256(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)).digest()
        hashes.append(parent)
    return hashes


def to_event_hash(block_hash: bytes) -> int:
    """The int form KV events carry (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default)."""
    return int.from_bytes(block_hash, "big") & _MASK64


def block_hash_chain(token_ids: list[int], block_size: int, cache_salt: str | None) -> tuple[int, ...]:
    if block_size <= 0:
        return ()
    return tuple(to_event_hash(h) for h in block_hashes_bytes(token_ids, block_size, cache_salt))


def stable_hash64(text: str) -> int:
    """A 64-bit hash of ``text`` that every process and Python version agrees on (``hash()`` of a str is
    salted per process): BLAKE2b, 8 bytes, big-endian. Consistent and rendezvous hashing over engine ids
    (routing/policies.py) and the KV controller's shards (kvcontrol/sharding.py) use it."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
