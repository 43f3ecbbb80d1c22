"""The local index's memory layout (routing/local_index.py): a block held by one engine points at its slot's one
bit object, a multi-holder mask is interned, and the lookup's search finds what a per-block walk
finds. The invariant tests of test_local_index.py hold for this layout as well; these check what it adds."""

from __future__ import annotations

import random

import pytest

from tessera.routing import local_index as local_index_module
from tessera.routing.local_index import LocalPrefixIndex
from tests.support.lookup_reference import assert_lookup_answer

CHAIN = list(range(2001, 2013))


def values_of(index: LocalPrefixIndex, hashes: list[int]) -> list[int]:
    return [index._holders[h] for h in hashes]


def test_single_holder_blocks_share_their_slots_one_bit_object() -> None:
    index = LocalPrefixIndex(1000)
    for _ in range(70):  # slots past 64: multi-digit ints, which CPython would allocate per block
        index.apply(f"filler-{_}", "s", [10_000 + _])
    index.apply("a", "sss", CHAIN[:3])
    index.apply("a", "sss", CHAIN[3:6])  # a second batch: the same object, not an equal one
    first, *rest = values_of(index, CHAIN[:6])
    assert first == 1 << 70 and all(v is first for v in rest)


def test_a_block_moves_from_one_holder_to_shared_and_back() -> None:
    index = LocalPrefixIndex(1000)
    index.apply("a", "ssss", CHAIN[:4])
    a_bit = index._holders[CHAIN[0]]
    index.apply("b", "ss", CHAIN[:2])
    index.apply("c", "s", CHAIN[:1])
    shared_ab = values_of(index, CHAIN[:2])
    assert shared_ab[1] == 0b011 and index._holders[CHAIN[0]] == 0b111
    live = index.live_mask(["a", "b", "c"])
    assert index.longest_prefixes(CHAIN, live) == {"a": 4, "b": 2, "c": 1}
    index.apply("b", "rr", CHAIN[:2])
    index.apply("c", "r", CHAIN[:1])
    # Back to one holder: the slot's own bit object again, not a fresh int of the same value.
    assert all(v is a_bit for v in values_of(index, CHAIN[:4]))
    assert index.longest_prefixes(CHAIN, live) == {"a": 4}
    index.apply("a", "rrrr", CHAIN[:4])
    assert index.num_blocks == 0 and index.longest_prefixes(CHAIN, live) == {}


def test_equal_multi_holder_masks_are_one_object() -> None:
    index = LocalPrefixIndex(1000)
    index.apply("a", "ssssss", CHAIN[:6])
    index.apply("b", "ssss", CHAIN[:4])
    index.apply("b", "ss", CHAIN[4:6])
    first, *rest = values_of(index, CHAIN[:6])
    assert first == 0b11 and all(v is first for v in rest)


def test_the_intern_table_is_bounded_and_starting_afresh_changes_no_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_index_module, "MAX_INTERNED_MASKS", 4)
    index = LocalPrefixIndex(1000)
    engines = [f"e{i}" for i in range(6)]
    for i, engine in enumerate(engines):  # block i is held by engines 0..i: six distinct masks
        index.apply(engine, "s" * (6 - i), CHAIN[i:6])
    assert len(index._masks) <= 4
    live = index.live_mask(engines)
    assert index.longest_prefixes(CHAIN, live) == {"e0": 6}
    assert index.longest_prefixes(CHAIN[3:], live) == {"e0": 3, "e1": 3, "e2": 3, "e3": 3}
    assert [index._holders[h] for h in CHAIN[:6]] == [0b1, 0b11, 0b111, 0b1111, 0b11111, 0b111111]


def test_forgetting_the_only_holder_of_a_block_drops_it_and_compaction_frees_the_intern_table() -> None:
    index = LocalPrefixIndex(1000)
    index.apply("a", "ssss", CHAIN[:4])
    index.apply("b", "ss", CHAIN[:2])
    index.forget_engine("a")
    live = index.live_mask(["b"])
    assert index.longest_prefixes(CHAIN, live) == {"b": 2}
    for _ in index.compact():
        pass
    assert index.num_blocks == 2 and index.blocks_of("b") == set(CHAIN[:2])
    b_bit = index._holders[CHAIN[0]]
    assert b_bit == 0b10 and index._holders[CHAIN[1]] is b_bit
    assert not index._masks  # the {a, b} mask named a freed slot
    index.apply("c", "sss", CHAIN[:3])  # reuses a's slot, clean
    assert index.longest_prefixes(CHAIN, index.live_mask(["b", "c"])) == {"b": 2, "c": 3}


def test_cap_eviction_order_is_unchanged_by_sharing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_index_module, "EVICT_FRACTION", 4)
    index = LocalPrefixIndex(8)  # evicts 2 blocks at a time
    index.apply("a", "ssss", [1, 2, 3, 4])
    index.apply("b", "ssss", [1, 2, 5, 6])  # 1 and 2 become shared and keep their (oldest) places
    index.apply("b", "rr", [1, 2])  # and back to a alone: still the oldest
    index.apply("c", "sss", [7, 8, 9])
    assert index.num_evicted == 2 and index.blocks_of("a") == {3, 4}
    assert index.blocks_of("b") == {5, 6} and index.blocks_of("c") == {7, 8, 9}


def test_the_search_matches_a_per_block_walk_on_random_fleets() -> None:
    """Long chains, 100 engines (masks of several digits), partial prefixes and, on 30 % of the engines, a
    hole: the search finds each prefix-closed engine's exact prefix, and a bounded one past a hole, for any
    subset of live engines."""
    rng = random.Random(1717)
    engines = [f"e{i:03d}" for i in range(100)]
    chains = [[rng.getrandbits(64) for _ in range(40)] for _ in range(8)]
    for _ in range(30):
        index = LocalPrefixIndex(100_000)
        held: dict[str, set[int]] = {e: set() for e in engines}
        for engine in rng.sample(engines, 30):
            chain = rng.choice(chains)
            upto = rng.randint(1, len(chain))
            index.apply(engine, "s" * upto, chain[:upto])
            held[engine] |= set(chain[:upto])
            if rng.random() < 0.3:  # a hole
                gone = chain[rng.randrange(upto)]
                index.apply(engine, "r", [gone])
                held[engine].discard(gone)
        live = rng.sample(engines, rng.randint(1, len(engines)))
        live_held = {e: held[e] for e in live}
        for chain in chains:
            assert_lookup_answer(index.longest_prefixes(chain, index.live_mask(live)), live_held, chain)


def test_random_events_over_many_engines_keep_the_invariant_and_the_shared_objects() -> None:
    """Stores, removes, clears, snapshots, forgotten engines and compaction over 80 engines (masks of several
    digits): the index equals a reference model, and every single-holder block points at its slot's object."""
    rng = random.Random(4242)
    engines = [f"e{i:02d}" for i in range(80)]
    hashes = list(range(1, 25))
    index = LocalPrefixIndex(10_000)
    counts: dict[str, dict[int, int]] = {e: {} for e in engines}
    for step in range(3000):
        engine = rng.choice(engines)
        roll = rng.random()
        if roll < 0.01:
            index.forget_engine(engine)
            counts[engine].clear()
        elif roll < 0.02:
            snapshot = set(rng.sample(hashes, 5))
            index.load_engine(engine, snapshot)
            counts[engine] = dict.fromkeys(snapshot, 1)
        else:
            ops = "".join(rng.choice("sssrrc" if rng.random() < 0.05 else "sssrr") for _ in range(rng.randint(1, 8)))
            batch = [rng.choice(hashes) for _ in ops]
            index.apply(engine, ops, batch)
            own = counts[engine]
            for op, h in zip(ops, batch, strict=True):
                if op == "s":
                    own[h] = own.get(h, 0) + 1
                elif op == "r":
                    own[h] = max(own.get(h, 0) - 1, 0)
                else:
                    own.clear()
        if step % 250 == 0:
            for _ in index.compact():
                pass
    for engine in engines:
        assert index.blocks_of(engine) == {h for h, c in counts[engine].items() if c > 0}
    for mask in index._holders.values():
        if mask.bit_count() == 1:
            assert mask is index._bits[mask.bit_length() - 1]
    held = {e: {h for h, c in counts[e].items() if c > 0} for e in engines}
    live = rng.sample(engines, 40)
    for start in range(0, 20, 4):
        chain = hashes[start:start + 6]
        assert_lookup_answer(index.longest_prefixes(chain, index.live_mask(live)), {e: held[e] for e in live}, chain)
