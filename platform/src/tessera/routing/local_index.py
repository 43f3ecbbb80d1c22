"""The gateway worker's own prefix index: block hash -> engines holding it, in this process's memory, so a
route needs no Redis call to know where a prompt's prefix is cached. Pure data structure, no I/O; fed by
``local_feed.py`` from the events the engines' feeders also apply to Redis (prefix_index.py).

Layout, chosen for speed in CPython (``make bench-prefix-index`` measures it): each engine gets a *slot*
(a small int), and ``_holders`` maps a block hash to an int bitmask of the slots holding it — one dict
entry per block, and no per-block int: a block held by one engine points at its slot's one bit object
(``_bits``), and a mask of several holders is interned (``_masks``), so a 62-block chain cached on one or
two engines reads one or two mask objects, hot in the CPU cache, instead of 62 scattered 1,000-bit ints.
A lookup searches the chain (``longest_prefixes`` says why a search is exact): it probes O(log chain)
blocks per distinct prefix length among the holders, not every block — a miss is one probe, a 62-block
chain held to its end seven — so at a million blocks, where every probe is a cache miss, a hit costs a
handful of them whatever the fleet size.

Copies: vLLM may cache two copies of one block (prefix_index.py says why). The usual single copy is the
mask bit; extra copies are counted in ``_extra`` (hash -> slot -> copies beyond the first), which stays
empty in the common case, so a store or remove is a dict probe and a bit operation.

Forgetting an engine (AllBlocksCleared, a gap in its events, or its leaving the registry) is O(1): its slot
is *retired* — no longer anyone's — and a returning engine gets a fresh slot. A lookup ANDs with the live
engines' mask, so a retired slot's bits never attract a request; ``compact`` clears them in passes off the
request path and frees the slots for reuse.

Invariant (tests/unit/routing/test_local_index.py checks it against a reference model): for an engine with
a slot, block ``h`` has the engine's bit iff c(h) > 0 under prefix_index.py's counting (store +1, remove
-1 not below 0, clear resets) — except that the cap may drop a block, and a warm start counts one copy
per block. Both err toward forgetting: a stale index costs hit rate, never a request sent to a dead
engine (lookups only count the live engines the caller passes).

Bounded memory: at most ``max_blocks`` distinct hashes. Eviction order: when a store would exceed the cap,
the oldest-first-stored ``max(1, max_blocks // EVICT_FRACTION)`` blocks go, in the order their hash was
first stored (a block stored again by another engine keeps its place; re-use emits no KV event, so the
index cannot see recency). Evicting in batches keeps it amortised O(1): the dict's insertion order *is*
the eviction queue, and one pass over its head removes a whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice

from tessera.native_steps import CHAIN_LOOKUP_STEP

# The lookup in C (``_chain_lookup.c``: the same search, dict for dict; ``longest_prefixes`` below is its
# Python twin), or None where it is not built or ``TESSERA_NATIVE_CHAIN_LOOKUP=0`` keeps the Python one.
NativeLookup = Callable[[dict[int, int], Sequence[int], int, list[str | None]], dict[str, int]]
NATIVE_LOOKUP: NativeLookup | None = CHAIN_LOOKUP_STEP.load()

# A full index evicts this fraction of its cap at once (see the module docstring).
EVICT_FRACTION = 64
# compact() clears retired bits in chunks of this many blocks, so a caller can yield between chunks.
COMPACT_CHUNK = 20_000
# Distinct multi-holder masks interned at most; past it the table starts afresh (blocks keep their masks,
# equal in value: interning is a memory and cache saving, never a meaning). Bounds the table's memory to
# about this many entries of up to ~180 bytes (1,000-slot masks).
MAX_INTERNED_MASKS = 1 << 15


class LocalPrefixIndex:
    """Block hash -> holder engines, with per-engine matched-prefix lookup. Not thread-safe (one event loop)."""

    __slots__ = ("_bits", "_extra", "_free_slots", "_holders", "_masks", "_max_blocks", "_native_lookup", "_retired",
                 "_slot_engine", "_slots", "generation", "num_evicted")

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, got {max_blocks}")
        self._max_blocks = max_blocks
        self._holders: dict[int, int] = {}
        self._extra: dict[int, dict[int, int]] = {}
        self._slots: dict[str, int] = {}  # engine_id -> its current slot
        self._slot_engine: list[str | None] = []  # slot -> engine id (None: free or retired)
        self._bits: list[int] = []  # slot -> 1 << slot, the one object every block it alone holds points at
        self._masks: dict[int, int] = {}  # multi-holder mask -> its interned object
        self._free_slots: list[int] = []
        self._retired = 0  # mask of retired slots whose bits compact() has not cleared yet
        # Bumped whenever an engine's slot changes, so a caller's cached live mask knows it is stale.
        self.generation = 0
        self.num_evicted = 0
        self._native_lookup = NATIVE_LOOKUP  # None: the Python search below

    # ---- engines ---------------------------------------------------------------------------------------

    def _slot(self, engine_id: str) -> int:
        slot = self._slots.get(engine_id)
        if slot is None:
            if self._free_slots:
                slot = self._free_slots.pop()
                self._slot_engine[slot] = engine_id
            else:
                slot = len(self._slot_engine)
                self._slot_engine.append(engine_id)
                self._bits.append(1 << slot)
            self._slots[engine_id] = slot
            self.generation += 1
        return slot

    def forget_engine(self, engine_id: str) -> None:
        """Drops every claim of the engine, O(1): its slot is retired (see the module docstring)."""
        slot = self._slots.pop(engine_id, None)
        if slot is None:
            return
        self._slot_engine[slot] = None
        self._retired |= 1 << slot
        self.generation += 1

    def retain_engines(self, live_engine_ids: Iterable[str]) -> list[str]:
        """Forgets every engine not in ``live_engine_ids``; returns those forgotten."""
        live = set(live_engine_ids)
        gone = [e for e in self._slots if e not in live]
        for engine_id in gone:
            self.forget_engine(engine_id)
        return gone

    def live_mask(self, engine_ids: Iterable[str]) -> int:
        """The mask of those engines' slots (engines the index has never heard of hold nothing)."""
        slots = self._slots
        mask = 0
        for engine_id in engine_ids:
            slot = slots.get(engine_id)
            if slot is not None:
                mask |= 1 << slot
        return mask

    @property
    def engines(self) -> list[str]:
        return list(self._slots)

    @property
    def num_blocks(self) -> int:
        return len(self._holders)

    @property
    def num_retired_slots(self) -> int:
        return self._retired.bit_count()

    # ---- events ----------------------------------------------------------------------------------------

    def _interned(self, mask: int) -> int:
        """The shared object for ``mask`` (non-zero): its slot's bit when one slot holds it, else the
        interned multi-holder mask."""
        if mask.bit_count() == 1:
            return self._bits[mask.bit_length() - 1]
        masks = self._masks
        shared = masks.get(mask)
        if shared is None:
            if len(masks) >= MAX_INTERNED_MASKS:
                masks.clear()
            shared = masks[mask] = mask
        return shared

    def apply(self, engine_id: str, ops: str, hashes: Sequence[int]) -> None:
        """Applies one batch of the engine's events in order: ``ops[i]`` is ``s`` (store ``hashes[i]``),
        ``r`` (remove it) or ``c`` (clear the engine; its hash is ignored)."""
        slot = self._slot(engine_id)
        bit = self._bits[slot]
        holders, extra, interned = self._holders, self._extra, self._interned
        for op, h in zip(ops, hashes, strict=True):
            if op == "s":
                mask = holders.get(h)
                if mask is None:
                    if len(holders) >= self._max_blocks:
                        self._evict()
                    holders[h] = bit
                elif not mask & bit:
                    holders[h] = interned(mask | bit)
                else:
                    copies = extra.setdefault(h, {})
                    copies[slot] = copies.get(slot, 0) + 1
            elif op == "r":
                mask = holders.get(h)
                if mask is None or not mask & bit:
                    continue  # evicted by the cap, or never seen (warm start): nothing to forget
                held = extra.get(h)
                if held and slot in held:  # one of several copies: the bit stays
                    if held[slot] > 1:
                        held[slot] -= 1
                    else:
                        del held[slot]
                        if not held:
                            del extra[h]
                elif mask == bit:
                    del holders[h]
                else:
                    holders[h] = interned(mask & ~bit)
            elif op == "c":
                self.forget_engine(engine_id)
                slot = self._slot(engine_id)
                bit = self._bits[slot]
            else:
                raise ValueError(f"unknown index op {op!r}; valid: s (store), r (remove), c (clear)")

    def load_engine(self, engine_id: str, hashes: Iterable[int]) -> None:
        """Replaces the engine's claims by ``hashes`` (a snapshot; one copy each)."""
        self.forget_engine(engine_id)
        bit = self._bits[self._slot(engine_id)]
        holders, interned = self._holders, self._interned
        for h in hashes:
            mask = holders.get(h)
            if mask is None:
                if len(holders) >= self._max_blocks:
                    self._evict()
                holders[h] = bit
            elif not mask & bit:
                holders[h] = interned(mask | bit)

    def _evict(self) -> None:
        holders, extra = self._holders, self._extra
        oldest = list(islice(holders, max(1, self._max_blocks // EVICT_FRACTION)))
        for h in oldest:
            del holders[h]
            if extra:
                extra.pop(h, None)
        self.num_evicted += len(oldest)

    def compact(self) -> Iterator[int]:
        """Clears retired slots' bits, ``COMPACT_CHUNK`` blocks per step (a generator: the caller may yield to
        its event loop between steps; it yields the number of blocks left), then frees those slots."""
        retired = self._retired
        if not retired:
            return
        keep = ~retired
        holders, interned = self._holders, self._interned
        keys = list(holders)
        for start in range(0, len(keys), COMPACT_CHUNK):
            for h in keys[start:start + COMPACT_CHUNK]:
                mask = holders.get(h)
                if mask is not None and mask & retired:
                    if mask & keep:
                        holders[h] = interned(mask & keep)
                    else:
                        del holders[h]
            yield len(keys) - start - COMPACT_CHUNK
        for h in list(self._extra):
            copies = self._extra[h]
            for slot in [s for s in copies if retired >> s & 1]:
                del copies[slot]
            if not copies:
                del self._extra[h]
        # Interned masks naming the freed slots are garbage now (no block points at them any more).
        self._masks = {m: m for m in self._masks.values() if not m & retired}
        # Only now may the slots be reused: no block carries their bits any more.
        self._retired &= ~retired
        self._free_slots.extend(s for s in range(retired.bit_length()) if retired >> s & 1)

    # ---- lookup ----------------------------------------------------------------------------------------

    def longest_prefixes(self, chain: Sequence[int], live_mask: int) -> dict[str, int]:
        """engine_id -> how many leading blocks of ``chain`` it holds, for the engines in ``live_mask``;
        engines holding none are left out. What vLLM's ``find_longest_cache_hit`` finds there, as far as
        the index knows, probing O(log chain) blocks per distinct prefix length instead of every block.

        Why a search is exact: an engine's cached blocks are *prefix-closed* — holding block k of a chain
        means holding blocks 0..k-1 — because a block can only be reached through its parents (hashes chain
        them, and a prefix hit walks from the first block) and vLLM frees a request's blocks tail first into
        an LRU queue, so a block is evicted before its parents, never after. Along a chain the set of holders
        therefore only shrinks, and each place where it shrinks can be found by galloping then bisecting.
        Where the index's view is not prefix-closed (a block of the middle forgotten by the cap, an event
        applied out of the engine's order) an engine's answer lies between the plain walk's, which stops at
        the first hole, and its deepest held block past the hole, and the block before the answer is held:
        a wrong answer costs a cache miss, never correctness (tests/unit/routing/test_local_index.py)."""
        alive = live_mask & ~self._retired if self._retired else live_mask
        num = len(chain)
        if not num or not alive:
            return {}
        if self._native_lookup is not None:
            return self._native_lookup(self._holders, chain, alive, self._slot_engine)
        get = self._holders.get
        first = get(chain[0])
        holders = first & alive if first is not None else 0
        out: dict[str, int] = {}
        # Invariant: every engine in ``holders`` holds blocks 0..held_to. A miss probes one block; a 62-block
        # hit held to its end seven (0, 1, 3, 7, 15, 31, 61); one ending inside the chain about twice that.
        held_to = 0
        while holders:
            # Gallop: double the stride while every holder still holds the probed block.
            stride = 1
            while True:
                probe = held_to + stride
                if probe >= num:
                    probe = num - 1
                    if probe == held_to:  # held to the chain's end
                        self._record(out, holders, num)
                        return out
                mask = get(chain[probe])
                if mask is not None and (mask & holders) == holders:
                    held_to = probe
                    stride <<= 1
                else:
                    break
            # Bisect (held_to, probe): the first block not every holder holds.
            while probe - held_to > 1:
                middle = (held_to + probe) >> 1
                middle_mask = get(chain[middle])
                if middle_mask is not None and (middle_mask & holders) == holders:
                    held_to = middle
                else:
                    probe, mask = middle, middle_mask
            staying = mask & holders if mask is not None else 0
            self._record(out, holders & ~staying, probe)
            holders, held_to = staying, probe
        return out

    def _record(self, out: dict[str, int], mask: int, depth: int) -> None:
        names = self._slot_engine
        while mask:
            low = mask & -mask
            name = names[low.bit_length() - 1]
            assert name is not None, "a live mask names a slot no engine holds"
            out[name] = depth
            mask ^= low

    def blocks_of(self, engine_id: str) -> set[int]:
        """Every hash the index says the engine holds (tests and debugging: a full scan)."""
        slot = self._slots.get(engine_id)
        if slot is None:
            return set()
        return {h for h, mask in self._holders.items() if mask >> slot & 1}
