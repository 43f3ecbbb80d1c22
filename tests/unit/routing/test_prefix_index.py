"""The prefix index's invariant (prefix_index.py docstring), checked exactly against real Redis: after any
ordered sequence of store / remove / clear ops, every engine's copy count of every block equals the
reference model's, the per-engine block set agrees, and the lookup finds what vLLM would find."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from tessera.redis_conn import EmbeddedRedis, connect
from tessera.routing.prefix_index import (
    CLEAR_CHUNK,
    ENGINES_KEY,
    Op,
    PrefixIndex,
    block_key,
    engine_blocks_key,
)


class ReferenceIndex:
    """The invariant as plain Python: copies per (engine, block), floored at 0, reset by clear."""

    def __init__(self) -> None:
        self.copies: dict[str, dict[int, int]] = defaultdict(dict)

    def apply(self, engine_id: str, ops: list[Op]) -> None:
        held = self.copies[engine_id]
        for op, h in ops:
            if op == "clear":
                held.clear()
            elif op == "store":
                held[h] = held.get(h, 0) + 1
            elif held.get(h, 0) > 1:
                held[h] -= 1
            else:
                held.pop(h, None)


async def assert_matches(redis_url: str, index: PrefixIndex, model: ReferenceIndex, engines: list[str],
                         universe: list[int]) -> None:
    redis = connect(redis_url, timeout_s=5.0)
    try:
        for engine_id in engines:
            expected = model.copies[engine_id]
            assert await index.blocks_of(engine_id) == expected
            members = {int(h) for h in await redis.smembers(engine_blocks_key(engine_id))}
            assert members == set(expected)
        for h in universe:
            fields = {k.decode(): int(v) for k, v in (await redis.hgetall(block_key(h))).items()}
            assert fields == {e: model.copies[e][h] for e in engines if h in model.copies[e]}
    finally:
        await redis.aclose()


@pytest.mark.parametrize("seed", range(6))
async def test_random_op_sequences_keep_the_invariant_exactly(
        seed: int, index: PrefixIndex, redis_server: EmbeddedRedis, engine_ids: list[str], hashes: list[int]) -> None:
    rng = random.Random(seed)
    universe = hashes[:6]  # few blocks: stores, removes and duplicates of the same block collide often
    model = ReferenceIndex()
    for _ in range(40):
        engine_id = rng.choice(engine_ids)
        ops: list[Op] = []
        for _ in range(rng.randint(1, 12)):
            roll = rng.random()
            op = "clear" if roll < 0.04 else "store" if roll < 0.6 else "remove"
            ops.append((op, 0 if op == "clear" else rng.choice(universe)))
        await index.apply(engine_id, ops)
        model.apply(engine_id, ops)
        await assert_matches(redis_server.url, index, model, engine_ids, universe)


async def test_order_within_a_batch_matters(index: PrefixIndex, engine_ids: list[str], hashes: list[int]) -> None:
    a, h1, h2 = engine_ids[0], hashes[0], hashes[1]
    await index.apply(a, [("store", h1), ("remove", h1), ("remove", h2), ("store", h2)])
    assert await index.blocks_of(a) == {h2: 1}


async def test_a_second_copy_keeps_the_block_after_one_copy_is_evicted(
        index: PrefixIndex, engine_ids: list[str], hashes: list[int]) -> None:
    a, h = engine_ids[0], hashes[0]
    await index.apply(a, [("store", h), ("store", h)])
    await index.apply(a, [("remove", h)])
    assert await index.blocks_of(a) == {h: 1}
    assert await index.longest_prefixes([h], [a]) == {a: 1}
    await index.apply(a, [("remove", h), ("remove", h)])  # one remove more than stores: floors at 0
    assert await index.blocks_of(a) == {}
    await index.apply(a, [("store", h)])
    assert await index.blocks_of(a) == {h: 1}


async def test_clear_inside_a_batch_drops_only_what_came_before(
        index: PrefixIndex, engine_ids: list[str], hashes: list[int]) -> None:
    a, b = engine_ids[:2]
    await index.apply(b, [("store", hashes[0])])
    await index.apply(a, [("store", hashes[0]), ("store", hashes[1]), ("clear", 0), ("store", hashes[2])])
    assert await index.blocks_of(a) == {hashes[2]: 1}
    assert await index.blocks_of(b) == {hashes[0]: 1}


async def test_unknown_op_is_a_caller_error(index: PrefixIndex, engine_ids: list[str]) -> None:
    with pytest.raises(ValueError, match="valid: store, remove, clear"):
        await index.apply(engine_ids[0], [("evict", 1)])


async def test_clearing_a_large_engine_takes_several_chunks_and_leaves_nothing(
        index: PrefixIndex, redis_server: EmbeddedRedis, engine_ids: list[str]) -> None:
    a, b = engine_ids[:2]
    rng = random.Random(7)
    many = [rng.getrandbits(64) for _ in range(2 * CLEAR_CHUNK + 123)]
    await index.apply(a, [("store", h) for h in many])
    await index.apply(b, [("store", h) for h in many[:10]])
    await index.clear_engine(a)
    assert await index.blocks_of(a) == {}
    assert await index.longest_prefixes(many[:10], [a, b]) == {b: 10}
    redis = connect(redis_server.url, timeout_s=5.0)
    try:
        assert await redis.exists(*(block_key(h) for h in many[10:200])) == 0  # empty hashes are gone
        assert await redis.zscore(ENGINES_KEY, a) is None
    finally:
        await redis.aclose()


# ---- lookup semantics -----------------------------------------------------------------------------------


async def test_lookup_returns_each_engines_longest_leading_run(
        index: PrefixIndex, engine_ids: list[str], hashes: list[int]) -> None:
    a, b, c = engine_ids
    chain = hashes[:5]
    await index.apply(a, [("store", h) for h in chain[:3]])
    await index.apply(b, [("store", h) for h in (chain[0], chain[1], chain[3], chain[4])])  # gap at block 2
    await index.apply(c, [("store", h) for h in chain[1:]])  # lacks the first block: vLLM finds nothing
    assert await index.longest_prefixes(chain, [a, b, c]) == {a: 3, b: 2}


async def test_lookup_ignores_engines_not_passed_as_live(
        index: PrefixIndex, engine_ids: list[str], hashes: list[int]) -> None:
    a, dead = engine_ids[:2]
    chain = hashes[:4]
    await index.apply(dead, [("store", h) for h in chain])
    await index.apply(a, [("store", chain[0])])
    assert await index.longest_prefixes(chain, [a]) == {a: 1}
    assert await index.longest_prefixes(chain, [a, dead]) == {a: 1, dead: 4}


async def test_lookup_edge_cases(index: PrefixIndex, engine_ids: list[str], hashes: list[int]) -> None:
    a = engine_ids[0]
    await index.apply(a, [("store", hashes[0])])
    assert await index.longest_prefixes([], [a]) == {}
    assert await index.longest_prefixes(hashes[:1], []) == {}
    assert await index.longest_prefixes(hashes[1:3], [a]) == {}
    # A chain that repeats a block hash (cannot happen with parent-chained hashes, but must not confuse it).
    assert await index.longest_prefixes([hashes[0], hashes[0]], [a]) == {a: 2}


async def test_lookup_stops_at_the_first_level_nobody_holds(
        index: PrefixIndex, engine_ids: list[str], hashes: list[int]) -> None:
    a = engine_ids[0]
    await index.apply(a, [("store", hashes[0]), ("store", hashes[2])])
    assert await index.longest_prefixes(hashes[:3], [a]) == {a: 1}


# ---- dead engines ---------------------------------------------------------------------------------------


async def test_sweep_drops_only_engines_that_are_gone_and_quiet(
        index: PrefixIndex, engine_ids: list[str], hashes: list[int]) -> None:
    live, dead, late = engine_ids
    for engine_id in engine_ids:
        await index.apply(engine_id, [("store", hashes[0]), ("store", hashes[1])])
    # Engines of other tests in this session (real engine hosts among them) count as live here.
    others = [e for e in await index.indexed_engines() if e not in engine_ids]
    # `late` missed heartbeats but applied a batch within the grace period: it keeps its entries.
    swept = await index.sweep([*others, live], grace_s=30.0)
    assert dead not in swept and late not in swept
    swept = await index.sweep([*others, live, late], grace_s=0.0)
    assert swept == [dead]
    assert await index.blocks_of(dead) == {}
    assert await index.longest_prefixes(hashes[:2], [live, dead, late]) == {live: 2, late: 2}
    assert dead not in await index.indexed_engines()
    assert await index.sweep([*others, live, late], grace_s=0.0) == []  # idempotent
