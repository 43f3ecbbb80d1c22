"""The simulated pool and vLLM's own ``BlockPool`` driven through the same random workload end in the same
state step by step: the same free-queue order (eviction order), the same blocks hit, and the same KV events."""

from __future__ import annotations

import random

import pytest
from vllm import SamplingParams
from vllm.distributed import kv_events as vllm_events
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
from vllm.v1.request import Request

from tessera.engine.sim.block_pool import Block, BlockPool
from tessera.engine.sim.hash_chain import BlockHashChain
from tessera.engine.sim.kv_wire import BlockRemoved, BlockStored, KVEvent

BLOCK = 4
NUM_BLOCKS = 24


def event_view(events: list[KVEvent] | list[vllm_events.KVCacheEvent]) -> list[tuple[str, list[int], object]]:
    out: list[tuple[str, list[int], object]] = []
    for event in events:
        if isinstance(event, BlockStored | vllm_events.BlockStored):
            out.append(("stored", [int(h) for h in event.block_hashes], event.parent_block_hash))
        elif isinstance(event, BlockRemoved | vllm_events.BlockRemoved):
            out.append(("removed", [int(h) for h in event.block_hashes], None))
        else:
            out.append(("cleared", [], None))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_same_workload_same_eviction_order_hits_and_events(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kv_cache_utils.init_none_hash(sha256)
    hasher = kv_cache_utils.get_request_block_hasher(BLOCK, sha256)
    rng = random.Random(seed)
    sim = BlockPool(NUM_BLOCKS, BLOCK)
    real = VllmBlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=BLOCK, enable_kv_cache_events=True)
    # A few shared prefixes so requests hit each other's blocks; prompts of varied length.
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([4, 8, 12]))] for _ in range(3)]
    live: list[tuple[list[Block], list[object]]] = []
    seen: list[tuple[str, list[int], object]] = []
    for step in range(60):
        if live and (rng.random() < 0.4 or sim.num_free_blocks < 6):
            sim_blocks, real_blocks = live.pop(rng.randrange(len(live)))
            sim.free_blocks(sim_blocks[::-1])
            real.free_blocks(reversed(real_blocks))
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
            salt = rng.choice([None, "tenant"])
            chain = BlockHashChain(tokens, BLOCK, salt).hashes
            request = Request(f"r{step}", tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                              block_hasher=hasher)
            max_hit = (len(tokens) - 1) // BLOCK
            sim_hit = sim.longest_cache_hit(chain[:max_hit])
            real_hit = []
            for block_hash in request.block_hashes[:max_hit]:
                found = real.get_cached_block(block_hash, [0])
                if not found:
                    break
                real_hit.append(found[0])
            assert [b.block_id for b in sim_hit] == [b.block_id for b in real_hit]
            num_new = -(-len(tokens) // BLOCK) - len(sim_hit)
            evictable = sum(1 for b in sim_hit if b.ref_cnt == 0)
            if num_new + evictable > sim.num_free_blocks:
                continue
            sim.touch(sim_hit)
            real.touch(real_hit)
            sim_blocks = sim_hit + (sim.get_new_blocks(num_new) or [])
            real_blocks = real_hit + real.get_new_blocks(num_new)
            num_full = len(tokens) // BLOCK
            sim.cache_full_blocks(sim_blocks, chain, len(sim_hit), num_full, tokens, salt)
            real.cache_full_blocks(request, real_blocks, len(real_hit), num_full, BLOCK, 0)
            live.append((sim_blocks, real_blocks))
        assert sim.free_queue_order() == [b.block_id for b in real.free_block_queue.get_all_free_blocks()]
        events = event_view(sim.take_events())
        assert events == event_view(real.take_events())
        seen += events
    # The workload exercised what it compares: hits, stores and evictions.
    assert {kind for kind, _, _ in seen} == {"stored", "removed"}
