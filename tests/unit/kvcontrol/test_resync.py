"""The ledger after lost KV events (ledger.py ``_reset``, resync.py): it starts over with no phantom block,
is stale until the engine's cache was cleared or turned over or ``resync_max_s`` passed, and while stale
holds exactly the ledger-driven actions and aborts."""

from __future__ import annotations

import pytest

from tessera_operators.kvcontrol.ledger import KVLedger
from tessera_operators.kvcontrol.policy import (
    Abort,
    ClearPressure,
    Demote,
    InFlightRequest,
    Restore,
    SetPressure,
)
from tessera_operators.kvcontrol.resync import ResyncView, actions_while_stale, is_stale
from tests.unit.kvcontrol.test_ledger import SALTS, batch, chain


def test_a_gap_resets_the_ledger_so_a_lost_removal_leaves_no_phantom() -> None:
    ledger = KVLedger()
    ledger.apply(batch(0, *chain(1, 12, "salt-a")))
    # Batch 1 (lost) removed blocks 3..12; batch 2 continues alice's chain from block 2.
    update = ledger.apply(batch(2, *chain(50, 10, None, parent=2)))
    assert update.missed_batches == 1 and ledger.num_resets == 1
    # Only what the ledger saw since the gap, and still alice's: the owners of the forgotten blocks stay known.
    assert ledger.owner_blocks(SALTS) == {"alice": 10} and ledger.num_blocks == 10
    assert (ledger.stores_since_reset, ledger.cleared_since_reset) == (10, False)
    ledger.apply(batch(3, ("clear",), *chain(70, 2, "salt-b")))
    assert (ledger.stores_since_reset, ledger.cleared_since_reset) == (12, True)
    assert ledger.owner_blocks(SALTS) == {"bob": 2}


def test_no_reset_without_a_gap() -> None:
    ledger = KVLedger()
    ledger.apply(batch(0, *chain(1, 3, "salt-a")))
    ledger.apply(batch(1, ("remove", 3)))
    assert ledger.num_resets == 0 and ledger.owner_blocks(SALTS) == {"alice": 2}


@pytest.mark.parametrize(("view", "stale"), [
    (None, False),  # never reset
    (ResyncView(1.0, 10, False), True),
    (ResyncView(1.0, 62, False), True),  # one store short of a turnover
    (ResyncView(1.0, 63, False), False),  # the cache turned over
    (ResyncView(1.0, 0, True), False),  # the engine cleared its cache
    (ResyncView(59.9, 0, False), True),
    (ResyncView(60.0, 0, False), False),  # resync_max_s
])
def test_stale_until_cleared_turned_over_or_the_bound(view: ResyncView | None, stale: bool) -> None:
    assert is_stale(view, num_usable_blocks=63, resync_max_s=60.0) is stale


def test_a_stale_ledger_holds_demote_restore_and_abort_but_not_the_pressure_flag() -> None:
    request = InFlightRequest("r", "bob", 20, 1.0)
    actions = [Demote("a", 20, 16, "x"), Restore("b", 1, 16, "x"), SetPressure(0.95, "x"), ClearPressure(0.5, "x"),
               Abort(request, "x")]
    assert actions_while_stale(actions) == [SetPressure(0.95, "x"), ClearPressure(0.5, "x")]
