"""The per-tenant ledger of one engine's KV cache, built only from that engine's own KV events.

What a block belongs to: vLLM salts the first block of a request's chain with the request's ``cache_salt``
(the gateway sends each tenant's own salt), and every later block names its parent. So the owner of a
chain is the salt on its root block and every block inherits its parent's owner. The ledger keys owners by
salt (``UNSALTED`` for requests without one, ``UNKNOWN`` for chains whose root it never saw, e.g. stored
before it subscribed); ``owner_blocks`` maps salts to tenant names at read time, so a tenant created after
the fact is attributed correctly without replaying anything.

Copies, not a set: vLLM does not de-duplicate identical blocks (``BlockHashToBlockMap`` NOTE #1), so two
requests that prefill the same prefix in one step each cache a copy, each announced by a BlockStored, and
evicting one copy announces one BlockRemoved while the other copy stays. (With the default "incremental"
report mode a prefix-cache *hit* announces nothing, so every BlockStored is a new physical copy.)

Invariant (tests/unit/kvcontrol/test_ledger.py checks it exactly, and the integration test checks it
against the engine's own block pool): after the events of one engine are applied in order,

* ``copies(h)`` = stores of h − removes of h since the last AllBlocksCleared (never below 0; a remove of
  a hash with no copy is counted in ``num_unknown_removals`` and changes nothing),
* ``num_blocks`` = Σ_h copies(h) = the number of cached physical blocks the engine holds,
* ``blocks_by_owner[o]`` = Σ copies(h) over the hashes h whose owner is o, so Σ_o blocks_by_owner[o] =
  ``num_blocks``, and
* a hash's owner, root and depth are fixed when its first copy is stored and forgotten when its last copy
  goes; they never change in between.

A gap in the batches' ``seq`` (events lost: a slow subscriber, a dropped message) breaks the invariant: a
lost BlockRemoved leaves a phantom block that can push its owner over quota. So on a gap the ledger starts
over, as the prefix-index feeder does (routing/indexer.py): it forgets every block (keeping their owners for
children stored later) and counts what it sees since (``stores_since_reset``, ``cleared_since_reset``).
From then on it is a lower bound of the engine's pool (a block stored before the gap and still cached is
missing, never one too many), and resync.py says when it may be acted on again.

Each BlockRemoved is reported as an ``Eviction`` with the owner, the chain root and the depth of the block
(depth 0 = the chain's first block), so a prefix-cache miss of a later request can be traced to the
eviction of exactly the blocks it had to recompute. ``evicted_by`` names the owner of the next block stored
in the same batch: vLLM evicts while allocating for a request and announces that request's newly full
blocks right after (NOTE: a heuristic; an allocation for a block that is not full yet stores nothing, and
then the next store in the batch may belong to another request).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from tessera.routing.kv_events import DecodedBatch

UNSALTED = "(unsalted)"
UNKNOWN = "(unknown)"
# Owners of recently evicted hashes, so that a child stored after its parent left (an event lost, or the
# controller started between them) still finds its owner. Per engine, the last _FORGOTTEN_MAX / 2 to
# _FORGOTTEN_MAX evicted hashes (two generations: see ``_forget``): at a busy engine's ~600 evictions a
# second, the last 14 s or more. NOTE: 65,536 an engine (a FIFO) was ~600 MB at 64 engines.
_FORGOTTEN_MAX = 16_384


@dataclass(slots=True)
class _Block:
    owner: str
    root: int
    depth: int
    copies: int = 1


class Eviction(NamedTuple):
    """One cached block copy the engine dropped (a tuple: made for every evicted block, so made cheaply)."""

    block_hash: int
    owner: str
    root: int
    depth: int
    evicted_by: str | None
    ts: float


@dataclass(slots=True)
class LedgerUpdate:
    """What one batch changed: blocks stored and evicted per owner, in event order."""

    seq: int
    ts: float
    stored: Counter[str] = field(default_factory=Counter)
    evictions: list[Eviction] = field(default_factory=list)
    cleared: bool = False
    missed_batches: int = 0


class KVLedger:
    """Applies decoded KV event batches of one engine; see the module docstring for the invariant."""

    def __init__(self) -> None:
        self._blocks: dict[int, _Block] = {}
        # Evicted hashes' (owner, root, depth), the newer generation first (see ``_forget``).
        self._forgotten: dict[int, tuple[str, int, int]] = {}
        self._forgotten_old: dict[int, tuple[str, int, int]] = {}
        self.blocks_by_owner: Counter[str] = Counter()
        # When each owner last stored a block (the batch's engine wall-clock time): who is active here.
        self.last_store_ts: dict[str, float] = {}
        self.num_blocks = 0
        self.num_unknown_removals = 0
        self.num_missed_batches = 0
        self.last_seq: int | None = None
        # Since the last reset on a gap (resync.py): blocks stored, and whether an AllBlocksCleared came.
        self.num_resets = 0
        self.stores_since_reset = 0
        self.cleared_since_reset = False

    # ---- reading ---------------------------------------------------------------------------------

    def copies(self, block_hash: int) -> int:
        block = self._blocks.get(block_hash)
        return block.copies if block else 0

    def owner_of(self, block_hash: int) -> str | None:
        block = self._blocks.get(block_hash)
        return block.owner if block else None

    def resident_hashes(self, owner: str | None = None) -> set[int]:
        return {h for h, b in self._blocks.items() if owner is None or b.owner == owner}

    def last_store_by_tenant(self, salt_to_tenant: Mapping[str, str]) -> dict[str, float]:
        out: dict[str, float] = {}
        for owner, ts in self.last_store_ts.items():
            tenant = tenant_of(owner, salt_to_tenant)
            out[tenant] = max(ts, out.get(tenant, ts))
        return out

    def owner_blocks(self, salt_to_tenant: Mapping[str, str]) -> dict[str, int]:
        """Blocks per tenant name (salts without a tenant keep a ``salt:<prefix>`` label)."""
        out: Counter[str] = Counter()
        for owner, num in self.blocks_by_owner.items():
            if num:
                out[tenant_of(owner, salt_to_tenant)] += num
        return dict(out)

    # ---- writing ---------------------------------------------------------------------------------

    def apply(self, batch: DecodedBatch) -> LedgerUpdate:
        update = LedgerUpdate(seq=batch.seq, ts=batch.ts)
        if self.last_seq is not None and batch.seq > self.last_seq + 1:
            update.missed_batches = batch.seq - self.last_seq - 1
            self.num_missed_batches += update.missed_batches
            self._reset()
        self.last_seq = batch.seq
        stored = iter(batch.stored_blocks)
        pending: list[tuple[int, _Block]] = []  # evictions waiting for the next store to name the evictor
        # NOTE: the hot path of a controller that follows many engines (tens of thousands of ops a second,
        # bench_kvcontrol.py --engines 64): per-batch counts are kept in locals and written once.
        num_stored = 0
        stored_by: Counter[str] = update.stored
        last_owner: str | None = None
        for op, block_hash in batch.ops:
            if op == "store":
                h, parent, _tokens, salt = next(stored)
                assert h == block_hash, "stored_blocks must follow the store ops one to one"
                owner = self._store(h, parent, salt)
                num_stored += 1
                stored_by[owner] += 1
                if owner is not last_owner:
                    self.last_store_ts[owner] = batch.ts
                    last_owner = owner
                if pending:
                    self._flush(pending, owner, update, batch.ts)
            elif op == "remove":
                removed = self._remove(block_hash)
                if removed is not None:
                    pending.append((block_hash, removed))
            elif op == "clear":
                self._flush(pending, None, update, batch.ts)
                self._clear()
                self.cleared_since_reset = True
                update.cleared = True
        if pending:
            self._flush(pending, None, update, batch.ts)
        self.stores_since_reset += num_stored
        return update

    def apply_all(self, batches: Iterable[DecodedBatch]) -> list[LedgerUpdate]:
        return [self.apply(b) for b in batches]

    def _store(self, block_hash: int, parent: int | None, salt: str | None) -> str:
        existing = self._blocks.get(block_hash)
        if existing is not None:
            existing.copies += 1
            self.blocks_by_owner[existing.owner] += 1
            self.num_blocks += 1
            return existing.owner
        if salt is not None:
            owner, root, depth = salt, block_hash, 0
        elif parent is None:
            owner, root, depth = UNSALTED, block_hash, 0
        else:
            known = self._blocks.get(parent)
            if known is not None:
                owner, root, depth = known.owner, known.root, known.depth + 1
            else:
                forgotten = self._forgotten.get(parent) or self._forgotten_old.get(parent)
                if forgotten is not None:
                    owner, root, parent_depth = forgotten
                    depth = parent_depth + 1
                else:
                    owner, root, depth = UNKNOWN, parent, 1
        # NOTE: a hash stored again may stay in the forgotten generations: every look-up asks _blocks first,
        # and its next eviction writes it anew.
        self._blocks[block_hash] = _Block(owner, root, depth)
        self.blocks_by_owner[owner] += 1
        self.num_blocks += 1
        return owner

    def _remove(self, block_hash: int) -> _Block | None:
        block = self._blocks.get(block_hash)
        if block is None:
            self.num_unknown_removals += 1
            return None
        block.copies -= 1
        self.blocks_by_owner[block.owner] -= 1
        self.num_blocks -= 1
        if block.copies == 0:
            del self._blocks[block_hash]
            self._forget(block_hash, block)
        return block

    def _forget(self, block_hash: int, block: _Block) -> None:
        """Remembers an evicted hash's owner in the newer of two generations; a full generation becomes the
        older one and the older is dropped whole, so the last _FORGOTTEN_MAX / 2 evictions (at least) are
        kept in O(1) per eviction (a FIFO of single entries, an OrderedDict, cost more than the rest of an
        eviction)."""
        forgotten = self._forgotten
        forgotten[block_hash] = (block.owner, block.root, block.depth)
        if len(forgotten) >= _FORGOTTEN_MAX // 2:
            self._forgotten_old = forgotten
            self._forgotten = {}

    def _reset(self) -> None:
        """Starts over after lost events: no block it cannot vouch for (see the module docstring)."""
        self._clear()
        self.num_resets += 1
        self.stores_since_reset = 0
        self.cleared_since_reset = False

    def _clear(self) -> None:
        for block_hash, block in self._blocks.items():
            self._forget(block_hash, block)
        self._blocks.clear()
        self.blocks_by_owner.clear()
        self.num_blocks = 0

    @staticmethod
    def _flush(pending: list[tuple[int, _Block]], evicted_by: str | None, update: LedgerUpdate,
               ts: float) -> None:
        for block_hash, block in pending:
            update.evictions.append(Eviction(block_hash, block.owner, block.root, block.depth, evicted_by, ts))
        pending.clear()


def tenant_of(owner: str, salt_to_tenant: Mapping[str, str]) -> str:
    """The tenant name of a ledger owner key (a salt, ``UNSALTED`` or ``UNKNOWN``)."""
    if owner in (UNSALTED, UNKNOWN):
        return owner
    return salt_to_tenant.get(owner, f"salt:{owner[:8]}")
