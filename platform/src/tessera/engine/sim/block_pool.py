"""A simulated GPU block pool with vLLM's prefix caching: what is cached, what is evicted first, and the KV
events that say so.

Follows vLLM 0.32 (``vllm/v1/core/block_pool.py``, ``kv_cache_utils.py``), one KV cache group:

* Block 0 is the null block and never handed out; usage is over the other ``num_gpu_blocks - 1``.
* Only full blocks are cached, under their chain hash (``routing/hashing.py``: the same ints the gateway
  computes and the KV events carry). Two blocks may hold the same hash (two requests prefilled the same
  prefix in one step): each is announced by its own ``BlockStored`` and each eviction by a ``BlockRemoved``.
* A block whose ref count drops to 0 stays cached and joins the free queue; it is evicted (its hash
  dropped, ``BlockRemoved``) only when the queue hands it out again, and a cache hit takes it back out.

**Eviction order** (the free queue, front = evicted first): at start, block ids in ascending order. A
request's blocks are freed in *reverse* order (its tail first); of those, blocks without a hash go to the
*front* (reused first, nothing to lose) and hashed blocks to the *back* (least recently used first, and
within one request the tail of its chain before its head). ``tests/unit/sim/test_block_pool.py`` asserts
exact orders.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tessera.engine.sim.kv_wire import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class BlockPool:
    """``num_gpu_blocks`` blocks of ``block_size`` tokens, block 0 reserved as vLLM's null block."""

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_gpu_blocks < 2 or block_size < 1:
            raise ValueError("a block pool needs num_gpu_blocks >= 2 (one is the null block) and block_size >= 1")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # NOTE: blocks are made when first handed out, and the free queue holds only blocks that were ever
        # used: a replica of a large GPU has ~10^5 blocks, and a thousand simulated engines share a process.
        # The queue is ``_front`` (blocks freed without a hash, prepended), then the never-used ids
        # ``[_next_fresh, num_gpu_blocks)`` in ascending order, then ``_back`` (cached blocks, appended) —
        # exactly vLLM's one queue, since never-used ids only leave from their low end, and only once
        # ``_front`` is empty. OrderedDicts keyed by block id give O(1) pops, appends and removals.
        self.blocks: dict[int, Block] = {}
        self._front: OrderedDict[int, None] = OrderedDict()
        self._next_fresh = 1  # block 0 is the null block
        self._back: OrderedDict[int, None] = OrderedDict()
        # hash -> block ids holding it, oldest first (a hit takes the first, as vLLM's map does).
        self._cached: dict[int, dict[int, None]] = {}
        self._events: list[KVEvent] = []

    # -- queries -------------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._front) + (self.num_gpu_blocks - self._next_fresh) + len(self._back)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / (self.num_gpu_blocks - 1)

    def free_queue_order(self) -> list[int]:
        """Block ids in eviction order, front first (for tests and /stats)."""
        return [*self._front, *range(self._next_fresh, self.num_gpu_blocks), *self._back]

    def num_cached_blocks(self) -> int:
        return sum(len(ids) for ids in self._cached.values())

    def longest_cache_hit(self, chain: tuple[int, ...] | list[int]) -> list[Block]:
        """The blocks holding the longest cached prefix of ``chain`` (stops at the first miss)."""
        hit: list[Block] = []
        if not self.enable_caching:
            return hit
        for block_hash in chain:
            ids = self._cached.get(block_hash)
            if not ids:
                break
            hit.append(self.blocks[next(iter(ids))])
        return hit

    # -- ref counts ------------------------------------------------------------------------------------------

    def touch(self, blocks: list[Block]) -> None:
        """A cache hit: the blocks gain a reference and, if they were free, leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                if block.block_id in self._back:
                    del self._back[block.block_id]
                else:
                    del self._front[block.block_id]
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[Block] | None:
        """``num_blocks`` from the front of the free queue, evicting their cached hashes; None when fewer
        are free."""
        if num_blocks > self.num_free_blocks:
            return None
        out = []
        for _ in range(num_blocks):
            if self._front:
                block = self.blocks[self._front.popitem(last=False)[0]]
            elif self._next_fresh < self.num_gpu_blocks:
                block = self.blocks[self._next_fresh] = Block(self._next_fresh)
                self._next_fresh += 1
            else:
                block = self.blocks[self._back.popitem(last=False)[0]]
            self._evict_hash(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            out.append(block)
        return out

    def free_blocks(self, ordered_blocks: list[Block]) -> None:
        """Drops one reference from each block, ``ordered_blocks`` in eviction priority (first evicted
        first): a request frees its blocks tail first."""
        to_front: list[int] = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    to_front.append(block.block_id)
                else:
                    self._back[block.block_id] = None
        # vLLM prepends the uncached ones as a group, keeping their order at the front.
        for block_id in reversed(to_front):
            self._front[block_id] = None
            self._front.move_to_end(block_id, last=False)

    # -- caching ------------------------------------------------------------------------------------------------

    def cache_full_blocks(self, blocks: list[Block], chain: list[int], num_cached: int, num_full: int,
                          token_ids: list[int], cache_salt: str | None) -> None:
        """Caches ``blocks[num_cached:num_full]`` under ``chain`` and announces them in one BlockStored
        (parent = the hash before them; the salt only on the request's first block, untagged)."""
        if num_cached >= num_full or not self.enable_caching:
            return
        new_hashes: list[int] = []
        for i in range(num_cached, num_full):
            block, block_hash = blocks[i], chain[i]
            if block.block_hash is None:
                block.block_hash = block_hash
                self._cached.setdefault(block_hash, {})[block.block_id] = None
            new_hashes.append(block_hash)
        size = self.block_size
        extra_keys: list[tuple[str, ...] | None] = [
            (cache_salt,) if i == 0 and cache_salt else None for i in range(num_cached, num_full)]
        self._events.append(BlockStored(
            block_hashes=new_hashes,
            parent_block_hash=chain[num_cached - 1] if num_cached > 0 else None,
            token_ids=token_ids[num_cached * size:num_full * size],
            block_size=size, lora_id=None, medium=MEDIUM_GPU, lora_name=None,
            extra_keys=extra_keys, group_idx=0,
        ))

    def _evict_hash(self, block: Block) -> None:
        if block.block_hash is None:
            return
        holders = self._cached.get(block.block_hash)
        if holders is not None:
            holders.pop(block.block_id, None)
            if not holders:
                del self._cached[block.block_hash]
        self._events.append(BlockRemoved(block_hashes=[block.block_hash], medium=MEDIUM_GPU, group_idx=0))
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Drops every hash (one AllBlocksCleared); refused, as vLLM refuses, while any block is in use."""
        if self.num_free_blocks != self.num_gpu_blocks - 1:
            return False
        self._cached.clear()
        for block in self.blocks.values():
            block.block_hash = None
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
