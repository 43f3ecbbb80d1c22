"""A request's block-hash chain, grown as its tokens grow.

The prompt's chain is ``routing/hashing.py``'s (the gateway's), so the blocks a simulated engine announces
are the ones the gateway looks up. Output tokens extend it a block at a time with the same step
(``h_i = sha256(pickle((h_{i-1}, tokens_i, extra_i)))``) instead of rehashing the whole sequence each
time a block fills; ``tests/unit/sim/test_hash_chain.py`` checks the grown chain equals
``block_hash_chain`` of the whole sequence.
"""

from __future__ import annotations

import hashlib
import pickle

from tessera.routing.hashing import block_hashes_bytes, none_hash, to_event_hash


class BlockHashChain:
    """The int hashes of every full block of a token sequence that only grows."""

    __slots__ = ("_block_size", "_cache_salt", "_parent", "hashes")

    def __init__(self, prompt_token_ids: list[int], block_size: int, cache_salt: str | None) -> None:
        self._block_size = block_size
        self._cache_salt = cache_salt
        raw = block_hashes_bytes(prompt_token_ids, block_size, cache_salt)
        self._parent = raw[-1] if raw else none_hash()
        self.hashes: list[int] = [to_event_hash(h) for h in raw]

    def extend(self, token_ids: list[int]) -> None:
        """Hashes the full blocks of ``token_ids`` (the whole sequence so far) not hashed yet."""
        size = self._block_size
        for start in range(len(self.hashes) * size, len(token_ids) - size + 1, size):
            # The salt is an extra key of the first block only, which the prompt's chain already covers
            # unless the prompt was shorter than a block.
            extra = (("cache_salt", self._cache_salt),) if start == 0 and self._cache_salt else None
            payload = (self._parent, tuple(token_ids[start:start + size]), extra)
            self._parent = hashlib.sha256(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)).digest()
            self.hashes.append(to_event_hash(self._parent))
