"""The local prefix index's lookup in C (routing/_chain_lookup.c) against its Python twin
(LocalPrefixIndex.longest_prefixes): the same answers, dict for dict, on fleets whose masks are big ints, with
holes, retired slots and stale masks; the same refusals."""

from __future__ import annotations

import random

import pytest

from tessera.native_steps import CHAIN_LOOKUP_STEP
from tessera.routing import local_index as local_index_module
from tessera.routing.local_index import LocalPrefixIndex

pytestmark = pytest.mark.skipif(local_index_module.NATIVE_LOOKUP is None, reason="the C lookup is not built")


def both(index: LocalPrefixIndex, chain: list[int], live: int) -> tuple[dict[str, int], dict[str, int]]:
    """(C's answer, Python's answer) for the same index, chain and live mask."""
    native = index.longest_prefixes(chain, live)
    index._native_lookup = None
    try:
        python = index.longest_prefixes(chain, live)
    finally:
        index._native_lookup = local_index_module.NATIVE_LOOKUP
    return native, python


def random_fleet(rng: random.Random, num_engines: int, chains: list[list[int]], holes: bool) -> LocalPrefixIndex:
    """Each chain cached, to a random depth, on a few random engines; with ``holes`` some blocks in the middle
    removed again (an index that missed events)."""
    index = LocalPrefixIndex(1_000_000)
    engines = [f"e{i}" for i in range(num_engines)]
    for chain in chains:
        for engine in rng.sample(engines, rng.randint(1, min(4, num_engines))):
            depth = rng.randint(1, len(chain))
            index.apply(engine, "s" * depth, chain[:depth])
            if holes and rng.random() < 0.3:
                index.apply(engine, "r", [chain[rng.randrange(depth)]])
    return index


@pytest.mark.parametrize(("num_engines", "holes"), [(3, False), (64, False), (1000, False), (64, True), (1000, True)])
def test_c_and_python_give_the_same_answers(num_engines: int, holes: bool) -> None:
    rng = random.Random(num_engines * 2 + holes)
    chains = [[rng.getrandbits(64) for _ in range(rng.randint(1, 70))] for _ in range(40)]
    index = random_fleet(rng, num_engines, chains, holes)
    engines = index.engines
    for _ in range(300):
        chain = rng.choice(chains)
        if rng.random() < 0.3:  # a prompt that goes on past what any engine holds, or starts somewhere else
            chain = [*chain, *(rng.getrandbits(64) for _ in range(rng.randint(1, 10)))]
        if rng.random() < 0.1:
            chain = [rng.getrandbits(64), *chain]
        live = index.live_mask(rng.sample(engines, rng.randint(1, len(engines))))
        native, python = both(index, chain, live)
        assert native == python, (chain, native, python)


def test_retired_slots_and_masks_made_before_a_removal_answer_alike() -> None:
    index = LocalPrefixIndex(1000)
    chain = list(range(500, 540))
    for i in range(130):  # slots past 128: masks of several machine words
        index.apply(f"e{i}", "s" * (i % 40 + 1), chain[:i % 40 + 1])
    live = index.live_mask(index.engines)
    index.retain_engines([f"e{i}" for i in range(0, 130, 3)])
    native, python = both(index, chain, live)
    assert native == python and set(native) == {f"e{i}" for i in range(0, 130, 3)}
    for _ in index.compact():
        pass
    index.apply("late", "s" * 7, chain[:7])  # a reused slot
    native, python = both(index, tuple(chain), index.live_mask(index.engines))
    assert native == python and native["late"] == 7


def test_a_mask_naming_a_slot_no_engine_holds_is_refused_as_in_python() -> None:
    lookup = CHAIN_LOOKUP_STEP.load()
    assert lookup is not None
    with pytest.raises(AssertionError, match="no engine holds"):
        lookup({7: 0b10}, [7], 0b10, ["a", None])
    with pytest.raises(TypeError, match="holders must be a dict"):
        lookup([], [7], 1, ["a"])
    with pytest.raises(TypeError, match="sequence of ints"):
        lookup({}, 7, 1, ["a"])
    assert lookup({}, [], 1, ["a"]) == {} and lookup({7: 1}, [7], 0, ["a"]) == {}
