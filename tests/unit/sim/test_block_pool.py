"""The simulated block pool against vLLM's eviction order and KV events (block_pool.py's docstring)."""

from __future__ import annotations

import pytest

from tessera.engine.sim.block_pool import BlockPool
from tessera.engine.sim.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored


def test_a_fresh_pool_hands_out_ascending_ids_and_keeps_the_null_block() -> None:
    pool = BlockPool(num_gpu_blocks=6, block_size=4)
    assert pool.free_queue_order() == [1, 2, 3, 4, 5]
    assert [b.block_id for b in pool.get_new_blocks(2) or []] == [1, 2]
    assert pool.num_free_blocks == 3
    assert pool.usage == pytest.approx(2 / 5)
    assert pool.get_new_blocks(4) is None  # does not fit: nothing taken
    assert pool.num_free_blocks == 3


def test_a_request_frees_its_tail_first_cached_to_the_back_uncached_to_the_front() -> None:
    pool = BlockPool(num_gpu_blocks=8, block_size=2)
    blocks = pool.get_new_blocks(4) or []  # ids 1..4; the first three full and cached, the fourth partial
    pool.cache_full_blocks(blocks, [101, 102, 103], 0, 3, list(range(7)), None)
    pool.free_blocks(blocks[::-1])
    # The uncached block 4 is reused first; the cached chain goes behind the never-used ids, tail first.
    assert pool.free_queue_order() == [4, 5, 6, 7, 3, 2, 1]
    assert pool.num_cached_blocks() == 3


def test_cached_free_blocks_stay_hits_until_handed_out_then_are_removed_in_lru_order() -> None:
    pool = BlockPool(num_gpu_blocks=5, block_size=2)
    a = pool.get_new_blocks(2) or []
    pool.cache_full_blocks(a, [11, 12], 0, 2, [0, 1, 2, 3], "salt")
    b = pool.get_new_blocks(2) or []
    pool.cache_full_blocks(b, [21, 22], 0, 2, [4, 5, 6, 7], None)
    pool.free_blocks(a[::-1])  # a freed first: least recently used
    pool.free_blocks(b[::-1])
    assert pool.free_queue_order() == [2, 1, 4, 3]
    stored = pool.take_events()
    assert stored == [
        BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=[0, 1, 2, 3], block_size=2,
                    lora_id=None, medium="GPU", lora_name=None, extra_keys=[("salt",), None], group_idx=0),
        BlockStored(block_hashes=[21, 22], parent_block_hash=None, token_ids=[4, 5, 6, 7], block_size=2,
                    lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=0),
    ]
    # A hit on the free chain b takes it out of the queue and does not evict it.
    hit = pool.longest_cache_hit([21, 22, 23])
    assert [blk.block_id for blk in hit] == [3, 4]
    pool.touch(hit)
    assert pool.free_queue_order() == [2, 1]
    # New blocks evict a's chain, tail first, each with its own BlockRemoved.
    assert [blk.block_id for blk in pool.get_new_blocks(2) or []] == [2, 1]
    assert pool.take_events() == [BlockRemoved(block_hashes=[12], medium="GPU", group_idx=0),
                                  BlockRemoved(block_hashes=[11], medium="GPU", group_idx=0)]
    assert pool.longest_cache_hit([11]) == []


def test_the_same_prefix_cached_twice_is_two_copies_each_announced() -> None:
    pool = BlockPool(num_gpu_blocks=4, block_size=2)
    first, second = pool.get_new_blocks(1) or [], pool.get_new_blocks(1) or []
    pool.cache_full_blocks(first, [7], 0, 1, [1, 2], None)
    pool.cache_full_blocks(second, [7], 0, 1, [1, 2], None)
    assert pool.num_cached_blocks() == 2
    assert [e.block_hashes for e in pool.take_events() if isinstance(e, BlockStored)] == [[7], [7]]
    pool.free_blocks(first)
    pool.get_new_blocks(2)  # the never-used id 3, then block 1: one copy evicted, the other still hits
    assert pool.take_events() == [BlockRemoved(block_hashes=[7], medium="GPU", group_idx=0)]
    assert [blk.block_id for blk in pool.longest_cache_hit([7])] == [2]


def test_a_parent_hash_links_a_later_stored_run_to_the_chain() -> None:
    pool = BlockPool(num_gpu_blocks=4, block_size=2)
    blocks = pool.get_new_blocks(2) or []
    pool.cache_full_blocks(blocks, [5, 6], 0, 1, [1, 2, 3, 4], None)
    pool.cache_full_blocks(blocks, [5, 6], 1, 2, [1, 2, 3, 4], None)
    second = pool.take_events()[1]
    assert isinstance(second, BlockStored)
    assert (second.block_hashes, second.parent_block_hash, second.token_ids) == ([6], 5, [3, 4])


def test_reset_clears_every_hash_only_when_nothing_is_in_use() -> None:
    pool = BlockPool(num_gpu_blocks=4, block_size=2)
    blocks = pool.get_new_blocks(1) or []
    pool.cache_full_blocks(blocks, [9], 0, 1, [1, 2], None)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    pool.take_events()
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.longest_cache_hit([9]) == []


def test_a_pool_needs_a_usable_block() -> None:
    with pytest.raises(ValueError, match="null block"):
        BlockPool(num_gpu_blocks=1, block_size=16)
