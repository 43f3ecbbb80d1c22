"""Figures the routing benchmarks share (bench_routing.py with routing_sim.py, and the fleet bench): the hits
of an ideal prefix cache, and a percentile. Pure: no I/O, no clock, no third-party import, so the benches'
pure parts and their unit tests import it without starting anything.

The ideal: one unbounded prefix cache that has seen every earlier request of the sequence — the longest
prefix of a request's block chain some earlier request held, capped as vLLM caps a hit (the last prompt
token is always computed). Concurrency is ignored (a request arriving while its prefix is still being
prefilled elsewhere counts as a hit), so it is an upper bound no router reaches exactly. Beside it, the fleet's
LRU: the same with one cache as large as the fleet's together (``fleet_lru_cached_tokens``), the reference
where the fleet cannot hold every prefix.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence


def ideal_cached_tokens(chains: Sequence[Sequence[int]], num_prompt_tokens: Sequence[int],
                        block_size: int) -> list[int]:
    """Per request, in order: the tokens one unbounded cache that saw every earlier request would hit."""
    if len(chains) != len(num_prompt_tokens):
        raise ValueError("one chain per request")
    seen: set[int] = set()
    out = []
    for chain, num_tokens in zip(chains, num_prompt_tokens, strict=True):
        hits = next((i for i, h in enumerate(chain) if h not in seen), len(chain))
        seen.update(chain)
        out.append(_reusable_tokens(hits, num_tokens, block_size))
    return out


def _reusable_tokens(hit_blocks: int, num_prompt_tokens: int, block_size: int) -> int:
    """The tokens a hit of ``hit_blocks`` leading blocks saves: vLLM always computes the last prompt token, so a
    hit stops a block short of a whole-block prompt."""
    return min(hit_blocks * block_size, max(0, (num_prompt_tokens - 1) // block_size * block_size))


def fleet_lru_cached_tokens(chains: Sequence[Sequence[int]], num_prompt_tokens: Sequence[int], block_size: int,
                            capacity_blocks: int) -> list[int]:
    """Per request, in order: the tokens one cache of ``capacity_blocks`` blocks (the fleet's KV cache pooled
    into one) would hit, least recently used blocks evicted, each request's blocks touched tail first as vLLM
    frees them (so its head is evicted last). Where the fleet cannot hold the workload's prefixes this is
    the reference a router can approach (the unbounded ideal is out of every router's reach there); it ignores
    concurrency (blocks a running request holds cannot be evicted), so it errs high."""
    if len(chains) != len(num_prompt_tokens):
        raise ValueError("one chain per request")
    cache: OrderedDict[int, None] = OrderedDict()
    out = []
    for chain, num_tokens in zip(chains, num_prompt_tokens, strict=True):
        hits = next((i for i, h in enumerate(chain) if h not in cache), len(chain))
        out.append(_reusable_tokens(hits, num_tokens, block_size))
        for h in reversed(chain):
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default, without numpy); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
