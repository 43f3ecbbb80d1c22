"""The gateway's block-hash chain must equal vLLM's own, or precise routing routes on noise."""

from __future__ import annotations

import random

import pytest

from tessera.routing.hashing import block_hash_chain, block_hashes_bytes, to_event_hash


@pytest.fixture(scope="module")
def vllm_hasher():  # type: ignore[no-untyped-def]
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)

    def chain(tokens: list[int], block_size: int, salt: str | None) -> list[bytes]:
        parent = None
        out = []
        for start in range(0, len(tokens) - block_size + 1, block_size):
            extra = (("cache_salt", salt),) if start == 0 and salt else None
            parent = kv_cache_utils.hash_block_tokens(sha256, parent, tokens[start:start + block_size], extra)
            out.append(bytes(parent))
        return out

    return chain


@pytest.mark.parametrize("salt", [None, "tenant-a-salt", "b"])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_chain_equals_vllm(vllm_hasher, salt: str | None, block_size: int) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(block_size)
    tokens = [rng.randrange(50_000) for _ in range(300)]
    assert block_hashes_bytes(tokens, block_size, salt) == vllm_hasher(tokens, block_size, salt)


def test_only_full_blocks_are_hashed() -> None:
    assert len(block_hash_chain(list(range(95)), 32, None)) == 2
    assert block_hash_chain(list(range(31)), 32, None) == ()


def test_salt_changes_every_hash_of_the_chain() -> None:
    tokens = list(range(128))
    a, b = block_hash_chain(tokens, 32, "a"), block_hash_chain(tokens, 32, "b")
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_chain_is_parent_linked() -> None:
    tokens = list(range(128))
    changed = [999, *tokens[1:]]
    a, b = block_hash_chain(tokens, 32, None), block_hash_chain(changed, 32, None)
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_event_form_is_low_64_bits() -> None:
    digest = bytes(range(32))
    assert to_event_hash(digest) == int.from_bytes(digest[-8:], "big")
