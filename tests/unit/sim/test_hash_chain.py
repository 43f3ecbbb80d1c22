"""A grown chain equals the gateway's chain of the whole sequence (hash_chain.py)."""

from __future__ import annotations

import pytest

from tessera.engine.sim.hash_chain import BlockHashChain
from tessera.routing.hashing import block_hash_chain


@pytest.mark.parametrize("salt", [None, "tenant-salt"])
@pytest.mark.parametrize("prompt_len", [3, 8, 13])
def test_growing_token_by_token_gives_the_gateways_chain(prompt_len: int, salt: str | None) -> None:
    tokens = list(range(100, 100 + prompt_len))
    chain = BlockHashChain(tokens, 4, salt)
    for token in range(7, 7 + 11):
        tokens.append(token)
        chain.extend(tokens)
        assert tuple(chain.hashes) == block_hash_chain(tokens, 4, salt)
