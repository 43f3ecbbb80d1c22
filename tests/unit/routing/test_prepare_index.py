"""prepare_index: before a replica's feed starts, its own old claims go and dead engines' leftovers are swept,
and a failing start-up read is retried rather than ending the feed."""

from __future__ import annotations

import pytest

from tessera.routing.indexer import prepare_index
from tessera.routing.prefix_index import PrefixIndex


async def test_it_clears_its_own_claims_sweeps_the_dead_and_retries_a_failed_read(
        index: PrefixIndex, engine_ids: list[str], hashes: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    me, alive, dead = engine_ids
    for engine_id in engine_ids:
        await index.apply(engine_id, [("store", h) for h in hashes[:4]])
    import tessera.routing.prefix_index as prefix_index

    monkeypatch.setattr(prefix_index, "SWEEP_GRACE_S", 0.0)
    calls = 0

    async def live_engine_ids() -> list[str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("Redis restarting")
        return [alive]

    await prepare_index(index, me, live_engine_ids, retry_s=0.01)
    assert calls == 2
    assert await index.blocks_of(me) == {} and await index.blocks_of(dead) == {}
    assert await index.blocks_of(alive) == {h: 1 for h in hashes[:4]}
