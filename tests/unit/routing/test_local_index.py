"""The in-process prefix index (routing/local_index.py): its invariant against a reference model, the exact
eviction order, O(1) engine removal with compaction, and "stale never wrong" through the real policy."""

from __future__ import annotations

import random

import pytest

from tessera.routing import local_index as local_index_module
from tessera.routing.local_index import LocalPrefixIndex
from tessera.routing.policies import make_policy
from tessera.routing.snapshot import EngineView, RouteRequest, RouteSnapshot
from tests.support.lookup_reference import assert_lookup_answer

CHAIN = [1001, 1002, 1003, 1004, 1005, 1006]
native = pytest.mark.skipif(local_index_module.NATIVE_LOOKUP is None, reason="the C lookup is not built")


def stores(hashes: list[int]) -> tuple[str, list[int]]:
    return "s" * len(hashes), hashes


def test_lookup_returns_each_live_engines_matched_prefix() -> None:
    index = LocalPrefixIndex(1000)
    index.apply("a", *stores(CHAIN[:5]))
    index.apply("b", *stores(CHAIN[:2]))
    index.apply("c", *stores(CHAIN[1:4]))  # no first block: no prefix hit at all
    index.apply("d", *stores(CHAIN))
    live = index.live_mask(["a", "b", "c", "d", "never-seen"])
    assert index.longest_prefixes(CHAIN, live) == {"a": 5, "b": 2, "d": 6}
    assert index.longest_prefixes(CHAIN, index.live_mask(["a", "b"])) == {"a": 5, "b": 2}
    assert index.longest_prefixes([999, *CHAIN], live) == {}
    assert index.longest_prefixes([], live) == {}


def test_a_hole_in_the_chain_costs_at_most_a_longer_credit_ending_on_a_held_block() -> None:
    """vLLM never leaves a hole (it evicts a block before its parents); should the index show one, the
    search may credit past it, up to a block the engine holds that the next one does not."""
    index = LocalPrefixIndex(1000)
    index.apply("a", "ssssr", [*CHAIN[:4], CHAIN[2]])  # holds blocks 0, 1 and 3
    assert index.longest_prefixes(CHAIN, index.live_mask(["a"])) in ({"a": 2}, {"a": 4})
    index.apply("a", "r", [CHAIN[0]])  # no first block: no prefix at all, whatever follows
    assert index.longest_prefixes(CHAIN, index.live_mask(["a"])) == {}


class CountingDict(dict[int, int]):
    """The index's table, counting the lookup's probes."""

    probes = 0

    def get(self, key: int, default: int | None = None) -> int | None:  # type: ignore[override]
        self.probes += 1
        return super().get(key, default)


def probes_of(index: LocalPrefixIndex, chain: list[int], engines: list[str]) -> tuple[dict[str, int], int]:
    """The Python search's probes (the C one reads the dict directly; test_chain_lookup.py holds it to the
    Python one's answers)."""
    table = CountingDict(index._holders)
    index._holders = table
    index._native_lookup = None
    found = index.longest_prefixes(chain, index.live_mask(engines))
    return found, table.probes


def test_a_lookup_probes_a_handful_of_blocks_not_the_whole_chain() -> None:
    """At a million blocks every probe is a cache miss: a miss probes one block, a 62-block chain held to its
    end seven, one whose last blocks are new about twice that, and each extra prefix length a few more."""
    chain = list(range(10_000, 10_062))
    index = LocalPrefixIndex(1000)
    index.apply("a", *stores(chain))
    index.apply("b", *stores(chain[:20]))
    assert probes_of(index, chain, ["a"]) == ({"a": 62}, 7)
    assert probes_of(index, [1, *chain], ["a"]) == ({}, 1)
    found, probes = probes_of(index, [*chain, 1, 2, 3, 4], ["a"])
    assert found == {"a": 62} and probes <= 14
    found, probes = probes_of(index, chain, ["a", "b"])
    assert found == {"a": 62, "b": 20} and probes <= 20


def test_counts_copies_like_the_redis_index() -> None:
    index = LocalPrefixIndex(1000)
    index.apply("a", "ss", [CHAIN[0], CHAIN[0]])  # two copies of one block
    index.apply("a", "r", [CHAIN[0]])
    assert index.blocks_of("a") == {CHAIN[0]}
    index.apply("a", "rr", [CHAIN[0], CHAIN[0]])  # the second remove finds nothing: never below 0
    assert index.blocks_of("a") == set()
    index.apply("a", "s", [CHAIN[0]])
    assert index.blocks_of("a") == {CHAIN[0]}


@pytest.mark.parametrize("lookup", [pytest.param("c", marks=native), "python"])
def test_matches_a_reference_model_on_random_op_sequences(lookup: str) -> None:
    rng = random.Random(17)
    engines = ["a", "b", "c"]
    hashes = list(range(1, 13))
    for _ in range(200):
        index = LocalPrefixIndex(10_000)
        if lookup == "python":
            index._native_lookup = None
        counts: dict[str, dict[int, int]] = {e: {} for e in engines}
        for _ in range(40):
            engine = rng.choice(engines)
            ops = "".join(rng.choice("ssrrc" if rng.random() < 0.1 else "ssrr") for _ in range(rng.randint(1, 6)))
            batch = [rng.choice(hashes) for _ in ops]
            index.apply(engine, ops, batch)
            for op, h in zip(ops, batch, strict=True):
                own = counts[engine]
                if op == "s":
                    own[h] = own.get(h, 0) + 1
                elif op == "r":
                    own[h] = max(own.get(h, 0) - 1, 0)
                else:
                    own.clear()
            if rng.random() < 0.1:
                for _ in index.compact():
                    pass
        for engine in engines:
            assert index.blocks_of(engine) == {h for h, c in counts[engine].items() if c > 0}
        chain = hashes[:6]
        held = {e: {h for h, c in counts[e].items() if c > 0} for e in engines}
        assert_lookup_answer(index.longest_prefixes(chain, index.live_mask(engines)), held, chain)


def test_evicts_the_oldest_first_stored_blocks_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_index_module, "EVICT_FRACTION", 4)
    index = LocalPrefixIndex(8)  # evicts 8 // 4 = 2 blocks at a time
    index.apply("a", *stores([1, 2, 3, 4, 5, 6]))
    index.apply("b", *stores([1, 7, 8]))  # 1 stored again by b keeps its place: still the oldest
    assert index.num_blocks == 8
    index.apply("b", *stores([9]))
    assert index.blocks_of("a") == {3, 4, 5, 6} and index.blocks_of("b") == {7, 8, 9}
    assert index.num_evicted == 2
    index.apply("a", *stores([10, 11]))
    assert index.blocks_of("a") == {5, 6, 10, 11} and index.blocks_of("b") == {7, 8, 9}
    index.apply("a", "r", [3])  # an evicted block's remove is a no-op
    assert index.num_blocks == 7


def test_a_forgotten_engine_is_gone_at_once_and_its_slot_is_reused_clean() -> None:
    index = LocalPrefixIndex(1000)
    index.apply("a", *stores(CHAIN))
    index.apply("b", *stores(CHAIN[:3]))
    live = index.live_mask(["a", "b"])
    assert index.retain_engines(["b"]) == ["a"]
    # Even a mask computed before the removal no longer counts the engine.
    assert index.longest_prefixes(CHAIN, live) == {"b": 3}
    assert index.num_retired_slots == 1
    for _ in index.compact():
        pass
    assert index.num_retired_slots == 0 and index.num_blocks == 3
    index.apply("c", *stores(CHAIN[:1]))  # takes a's freed slot
    assert index.longest_prefixes(CHAIN, index.live_mask(["b", "c"])) == {"b": 3, "c": 1}


def test_a_clear_drops_the_engines_blocks_and_later_stores_count() -> None:
    index = LocalPrefixIndex(1000)
    index.apply("a", "sssc" + "s", [*CHAIN[:3], 0, CHAIN[0]])
    assert index.blocks_of("a") == {CHAIN[0]}
    assert index.longest_prefixes(CHAIN, index.live_mask(["a"])) == {"a": 1}


def test_a_warm_start_snapshot_replaces_the_engines_claims() -> None:
    index = LocalPrefixIndex(1000)
    index.apply("a", *stores(CHAIN))
    index.load_engine("a", CHAIN[:2])
    assert index.blocks_of("a") == set(CHAIN[:2])


def test_rejects_a_mistaken_op_or_cap() -> None:
    with pytest.raises(ValueError, match="valid: s"):
        LocalPrefixIndex(10).apply("a", "x", [1])
    with pytest.raises(ValueError, match="at least 1"):
        LocalPrefixIndex(0)


def test_a_stale_claim_is_at_worst_a_miss_and_the_route_goes_to_a_live_engine() -> None:
    """Engine a evicted the prefix but its BlockRemoved has not arrived; engine d died holding it too. The
    route may credit a's stale claim (a miss there, nothing worse), never picks d, and ranks only live engines."""
    index = LocalPrefixIndex(1000)
    index.apply("a", *stores(CHAIN))  # stale: a has evicted these
    index.apply("d", *stores(CHAIN))  # dead engine's leftovers
    index.apply("b", *stores(CHAIN[:2]))
    live = ["a", "b", "c"]
    cached = index.longest_prefixes(CHAIN, index.live_mask(live))
    assert "d" not in cached
    engines = tuple(EngineView(e, f"http://{e}", 0, 0, 0.0, 100, 16) for e in live)
    request = RouteRequest(tenant="t", model="m", num_prompt_tokens=16 * len(CHAIN) + 5, block_hashes=tuple(CHAIN))
    decision = make_policy("prefix_affinity")(RouteSnapshot(engines, cached, {}), request)
    assert set(decision.ranked) == set(live) and decision.ranked[0] in live
