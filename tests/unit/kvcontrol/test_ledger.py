"""The ledger's invariant, exactly (see operators/src/tessera_operators/kvcontrol/ledger.py)."""

from __future__ import annotations

import random
from collections import Counter

from tessera.routing.kv_events import DecodedBatch
from tessera_operators.kvcontrol.ledger import UNKNOWN, UNSALTED, KVLedger, tenant_of

SALTS = {"salt-a": "alice", "salt-b": "bob"}


def batch(seq: int, *ops: tuple) -> DecodedBatch:
    """ops: ("store", hash, parent, salt) | ("remove", hash) | ("clear",)."""
    out = DecodedBatch(seq=seq, ts=1000.0 + seq)
    for op in ops:
        if op[0] == "store":
            _, h, parent, salt = op
            out.ops.append(("store", h))
            out.stored_blocks.append((h, parent, [1, 2, 3], salt))
        elif op[0] == "remove":
            out.ops.append(("remove", op[1]))
        else:
            out.ops.append(("clear", 0))
    return out


def chain(start: int, n: int, salt: str | None, parent: int | None = None) -> list[tuple]:
    ops = []
    for i in range(n):
        h = start + i
        ops.append(("store", h, parent if i == 0 else start + i - 1, salt if i == 0 and parent is None else None))
    return ops


def test_owner_is_the_salt_on_the_chain_root_and_children_inherit_it() -> None:
    ledger = KVLedger()
    ledger.apply(batch(0, *chain(100, 3, "salt-a"), *chain(200, 2, "salt-b")))
    # A later batch continues alice's chain from block 102 (a request's next full blocks).
    ledger.apply(batch(1, *chain(103, 2, None, parent=102)))
    assert ledger.owner_blocks(SALTS) == {"alice": 5, "bob": 2}
    assert ledger.num_blocks == 7
    update = ledger.apply(batch(2, ("remove", 104)))
    (eviction,) = update.evictions
    assert (eviction.owner, eviction.root, eviction.depth) == ("salt-a", 100, 4)


def test_last_store_time_per_tenant() -> None:
    ledger = KVLedger()
    ledger.apply(batch(0, ("store", 1, None, "salt-a")))
    ledger.apply(batch(5, ("store", 2, None, "salt-b"), ("store", 3, 1, None)))
    assert ledger.last_store_by_tenant(SALTS) == {"alice": 1005.0, "bob": 1005.0}


def test_copies_are_counted_and_removed_one_at_a_time() -> None:
    ledger = KVLedger()
    # Two requests prefill the same salted block in one step: vLLM caches two copies.
    ledger.apply(batch(0, ("store", 7, None, "salt-a"), ("store", 7, None, "salt-a")))
    assert ledger.copies(7) == 2 and ledger.owner_blocks(SALTS) == {"alice": 2}
    ledger.apply(batch(1, ("remove", 7)))
    assert ledger.copies(7) == 1 and ledger.owner_of(7) == "salt-a" and ledger.num_blocks == 1
    ledger.apply(batch(2, ("remove", 7)))
    assert ledger.copies(7) == 0 and ledger.owner_of(7) is None and ledger.num_blocks == 0


def test_unknown_removal_is_counted_and_changes_nothing() -> None:
    ledger = KVLedger()
    ledger.apply(batch(0, ("store", 1, None, "salt-a")))
    update = ledger.apply(batch(1, ("remove", 999)))
    assert update.evictions == [] and ledger.num_unknown_removals == 1
    assert ledger.owner_blocks(SALTS) == {"alice": 1}


def test_clear_resets_everything() -> None:
    ledger = KVLedger()
    ledger.apply(batch(0, *chain(1, 4, "salt-a")))
    update = ledger.apply(batch(1, ("clear",), ("store", 50, None, "salt-b")))
    assert update.cleared and ledger.owner_blocks(SALTS) == {"bob": 1} and ledger.num_blocks == 1


def test_unsalted_unknown_and_forgotten_parents() -> None:
    ledger = KVLedger()
    ledger.apply(batch(0, ("store", 1, None, None), ("store", 2, 77, None)))
    assert ledger.owner_of(1) == UNSALTED and ledger.owner_of(2) == UNKNOWN
    # A parent evicted before its child is stored (an event lost on the way) still names the owner.
    ledger.apply(batch(1, ("store", 10, None, "salt-b"), ("remove", 10), ("store", 11, 10, None)))
    assert ledger.owner_of(11) == "salt-b"
    assert ledger.owner_blocks(SALTS) == {UNSALTED: 1, UNKNOWN: 1, "bob": 1}
    assert tenant_of("salt-zzzzzzzzzz", SALTS) == "salt:salt-zzz"


def test_evicted_by_names_the_owner_of_the_next_store_in_the_batch() -> None:
    ledger = KVLedger()
    ledger.apply(batch(0, *chain(1, 3, "salt-a")))
    update = ledger.apply(batch(1, ("remove", 3), ("remove", 2), *chain(20, 2, "salt-b"), ("remove", 1)))
    assert [(e.block_hash, e.evicted_by) for e in update.evictions] == [(3, "salt-b"), (2, "salt-b"), (1, None)]
    assert update.stored == Counter({"salt-b": 2})


def test_missed_batches_are_detected() -> None:
    ledger = KVLedger()
    ledger.apply(batch(0))
    assert ledger.apply(batch(3)).missed_batches == 2 and ledger.num_missed_batches == 2


def test_invariant_against_a_reference_model_on_random_event_streams() -> None:
    """copies(h) = stores − removes (never below 0, reset by clear); every resident hash is owned by the salt
    on its chain's root; the owners' block counts sum the copies."""
    rng = random.Random(42)
    for trial in range(30):
        ledger = KVLedger()
        copies: Counter[int] = Counter()
        # A hash fixes its content, so its parent and (for a root) its salt never change.
        shape: dict[int, tuple[int | None, str | None]] = {}
        root_owner: dict[int, str] = {}
        for seq in range(60):
            ops: list[tuple] = []
            for _ in range(rng.randrange(1, 12)):
                roll = rng.random()
                live = [h for h, c in copies.items() if c > 0]
                if roll < 0.45:
                    if live and rng.random() < 0.2:
                        h = rng.choice(live + list(shape))  # another copy, or a block stored again
                    else:
                        h = len(shape) + 1
                        parent = rng.choice(live) if live and rng.random() < 0.6 else None
                        salt = None if parent is not None else rng.choice(["salt-a", "salt-b", None])
                        shape[h] = (parent, salt)
                        root_owner[h] = root_owner[parent] if parent is not None else (salt or UNSALTED)
                    parent, salt = shape[h]
                    ops.append(("store", h, parent, salt))
                    copies[h] += 1
                elif roll < 0.97:
                    h = rng.choice([*live, 10_000 + seq])  # sometimes a hash that was never stored
                    ops.append(("remove", h))
                    copies[h] = max(0, copies[h] - 1)
                else:
                    ops.append(("clear",))
                    copies.clear()
            ledger.apply(batch(seq, *ops))
            expected: Counter[str] = Counter()
            for h, c in copies.items():
                assert ledger.copies(h) == c, f"trial {trial} seq {seq} hash {h}"
                if c:
                    assert ledger.owner_of(h) == root_owner[h]
                    expected[root_owner[h]] += c
            assert ledger.num_blocks == sum(copies.values())
            assert {k: v for k, v in ledger.blocks_by_owner.items() if v} == dict(expected)
            assert ledger.resident_hashes() == {h for h, c in copies.items() if c}
