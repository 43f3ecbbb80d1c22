"""What the local index's lookup must answer, from a plain model of each engine's blocks (the tests of
test_local_index.py and test_local_index_layout.py share it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def plain_walk(held: Mapping[str, set[int]], chain: Sequence[int]) -> dict[str, int]:
    """Each engine's held prefix of ``chain``, block by block up to its first hole (vLLM's own walk)."""
    out = {}
    for engine, blocks in held.items():
        depth = 0
        while depth < len(chain) and chain[depth] in blocks:
            depth += 1
        if depth:
            out[engine] = depth
    return out


def assert_lookup_answer(found: Mapping[str, int], held: Mapping[str, set[int]], chain: Sequence[int]) -> None:
    """``found`` (``longest_prefixes``) against the live engines' blocks ``held``: exactly the plain walk for
    an engine whose blocks of the chain are prefix-closed (as vLLM's always are); for one with a hole, an
    answer at or past its first hole that ends on a held block followed by a block it does not hold."""
    walked = plain_walk(held, chain)
    assert set(found) == set(walked), (found, walked)
    for engine, depth in found.items():
        positions = [i for i, h in enumerate(chain) if h in held[engine]]
        if positions == list(range(len(positions))):  # prefix-closed
            assert depth == walked[engine], (engine, depth, walked[engine])
        else:
            assert walked[engine] <= depth <= len(chain), (engine, depth, walked[engine])
            assert chain[depth - 1] in held[engine], (engine, depth)
            assert depth == len(chain) or chain[depth] not in held[engine], (engine, depth)
