"""The synthetic event mix bench_kvcontrol.py --engines replays (bench/kvcontrol_fleet_runner.py): vLLM's wire
format as Tessera's controller decodes it, the cache bounded, evictions announced before the stores that
caused them, chains salted at their root and extended by decode steps. Pure: no process started."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from kvcontrol_fleet_runner import SyntheticEvents

from tessera.engine.sim.kv_wire import BlockRemoved, BlockStored, encode_batch
from tessera.routing.kv_events import decode_hashes, hashes_decoder


def test_the_mix_stays_within_capacity_evicts_first_and_salts_each_chain_root() -> None:
    gen = SyntheticEvents(random.Random(1), ["s1", "s2"], capacity_blocks=200, prefill_share=0.2,
                          max_prefill_blocks=16, decode_blocks=4, num_running=8)
    stored: dict[int, tuple[int | None, str | None]] = {}
    resident: set[int] = set()
    num_ops = num_removed = 0
    for seq in range(2000):
        events, n = gen.next_batch()
        kinds = [type(e) for e in events]
        assert BlockRemoved not in kinds[1:], "an eviction comes before the stores of its batch"
        for event in events:
            if isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= resident
                resident -= set(event.block_hashes)
                num_removed += len(event.block_hashes)
            else:
                assert isinstance(event, BlockStored)
                parent = event.parent_block_hash
                assert parent is None or parent in stored
                keys = event.extra_keys or [None] * len(event.block_hashes)
                salt = keys[0][0] if keys[0] else None
                assert (parent is None) == (salt in ("s1", "s2"))  # a root is salted, a decode block is not
                for h in event.block_hashes:
                    stored[h] = (parent, salt)
                    parent, salt = h, None
                resident |= set(event.block_hashes)
        assert len(resident) <= 200
        num_ops += n
        if events:  # what the controller's decoder reads back: the same block operations
            decoded = decode_hashes(seq, hashes_decoder().decode(encode_batch(1.0, events)))
            assert len(decoded.ops) == n
    assert num_removed > 1000 and num_ops > 4000


def test_the_wire_format_carries_the_salt_where_the_ledger_reads_it() -> None:
    gen = SyntheticEvents(random.Random(2), ["salt-x"], capacity_blocks=100, prefill_share=1.0,
                          max_prefill_blocks=4, decode_blocks=1)
    events, _ = gen.next_batch()
    raw = msgspec.msgpack.decode(encode_batch(1.0, events))
    (event,) = raw[1]
    assert event["type"] == "BlockStored" and event["extra_keys"][0] == ["salt-x"]
    assert len(event["token_ids"]) == 16 * len(event["block_hashes"])
