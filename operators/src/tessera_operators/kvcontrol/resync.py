"""When a ledger that started over after lost KV events (ledger.py) may be acted on again.

After the reset the ledger is a lower bound of the engine's block pool: blocks cached before the gap are
missing. Acting on it at once would restore a demoted tenant whose count only fell because it was forgotten
(and demote it again a moment later). The engine does not list its cached blocks (``/stats`` gives usage,
not hashes), so the ledger is *stale* until its own events vouch for it again, whichever comes first:

* an AllBlocksCleared: the engine's cache is empty, every block since is one the ledger saw stored;
* as many blocks stored since the reset as the engine has: the cache has turned over, and what the ledger
  still misses is only pre-gap prefixes re-used since (too few, never too many: no phantom demotes anyone);
* ``resync_max_s`` since the reset: the ledger is then as good as a controller that has just started, and
  holding every decision longer would keep a demotion (or its absence) that nothing supports any more.

While stale the loop holds the decisions the ledger drives (demote, restore) and its aborts (an eviction of
a request, the controller's heaviest hand); the pressure flag, read from the engine's own ``/stats``,
still follows the engine. A demotion in force is held too (its flag is still refreshed).

Invariant (tests/unit/kvcontrol/test_resync.py): a ledger reset on a gap is stale until one of the three.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .policy import Abort, Action, Demote, Restore

# The actions a stale ledger does not take.
HELD_WHILE_STALE: tuple[type, ...] = (Demote, Restore, Abort)


@dataclass(frozen=True, slots=True)
class ResyncView:
    """What a ledger has seen since it last started over on a gap."""

    seconds_since_reset: float
    num_stores_since: int
    cleared_since: bool


def is_stale(view: ResyncView | None, num_usable_blocks: int, resync_max_s: float) -> bool:
    """``view``: None when the ledger never started over (or has been trusted again since)."""
    if view is None:
        return False
    return not (view.cleared_since or view.num_stores_since >= num_usable_blocks
                or view.seconds_since_reset >= resync_max_s)


def actions_while_stale(actions: Sequence[Action]) -> list[Action]:
    return [a for a in actions if not isinstance(a, HELD_WHILE_STALE)]


__all__ = ["HELD_WHILE_STALE", "ResyncView", "actions_while_stale", "is_stale"]
