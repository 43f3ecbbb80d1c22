"""Lost KV events on a real control loop and real Redis (ledger.py ``_reset``, resync.py): no tenant is
demoted on phantom blocks, a demotion in force is not lifted by the reset, and once the engine's cache is
cleared the ledger acts again. The loop is fed decoded batches and its engine polls directly, and one batch
is dropped on the way, as a slow subscriber loses it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from tessera.redis_conn import EmbeddedRedis, connect
from tessera.registry import EngineRecord
from tessera.routing.kv_events import DecodedBatch
from tessera.tenancy.demotion import demoted_key
from tessera.tenancy.policy import TenantPolicy
from tessera.tenancy.store import TenantStore
from tessera_operators.kvcontrol.directory import DemotionBook, TenantDirectory
from tessera_operators.kvcontrol.loop import EngineControlLoop, EngineState, LoopContext
from tessera_operators.kvcontrol.metrics import ControllerMetrics
from tessera_operators.kvcontrol.policy import Demote, InFlightRequest, PolicyConfig, Restore

ALICE, BOB = "resync-alice", "resync-bob"
# 64 blocks, 63 usable: a kv_quota of 0.25 is 15 blocks.
STATE = EngineState(num_gpu_blocks=63, num_free_blocks=30, num_running=2, num_waiting=0)


@pytest.fixture
async def loop(redis_server: EmbeddedRedis) -> AsyncIterator[EngineControlLoop]:
    redis = connect(redis_server.url, timeout_s=5)
    store = TenantStore(redis)
    for name in (ALICE, BOB):
        if await store.get_tenant(name) is None:
            await store.create_tenant(name, TenantPolicy(kv_quota=0.25))
        await redis.delete(demoted_key(name))
    http = aiohttp.ClientSession()
    ctx = LoopContext(redis=redis, http=http, tenants=TenantDirectory(store), demotions=DemotionBook(),
                      metrics=ControllerMetrics(), policy=PolicyConfig(enable_abort=False), flag_ttl_s=30)
    await ctx.tenants.refresh(force=True)
    record = EngineRecord(engine_id="resync-e1", url="http://127.0.0.1:9", model="m", block_size=32,
                          num_gpu_blocks=64, max_model_len=2048)
    made = EngineControlLoop(record, ctx)

    async def poll() -> EngineState:  # the engine's /stats and /requests: both tenants have a request running
        made.requests = {f"r-{t}": InFlightRequest(f"r-{t}", t, 0, 1.0) for t in (ALICE, BOB)}
        made.state = STATE
        return STATE

    made.poll = poll  # type: ignore[method-assign]
    yield made
    await made._release()
    await http.close()
    await redis.aclose()


def salt(loop: EngineControlLoop, tenant: str) -> str:
    return next(s for s, t in loop.ctx.tenants.salt_to_tenant.items() if t == tenant)


def chain_batch(seq: int, *chains: tuple[int, int, str | None, int | None]) -> DecodedBatch:
    """Chains of (first hash, length, root salt, parent of the first)."""
    out = DecodedBatch(seq=seq, ts=time.time())
    for start, n, root_salt, parent in chains:
        for i in range(n):
            out.ops.append(("store", start + i))
            out.stored_blocks.append((start + i, parent if i == 0 else start + i - 1, [],
                                      root_salt if i == 0 else None))
    return out


def removals(seq: int, hashes: list[int]) -> DecodedBatch:
    return DecodedBatch(seq=seq, ts=time.time(), ops=[("remove", h) for h in hashes])


async def demoted(loop: EngineControlLoop, tenant: str) -> bool:
    return bool(await loop.ctx.redis.exists(demoted_key(tenant)))


def stale_gauge(loop: EngineControlLoop) -> float | None:
    value = loop.ctx.metrics.registry.get_sample_value("tessera_kvcontrol_ledger_stale", {"engine": loop.engine_id})
    return value


async def lose_batch_1(loop: EngineControlLoop) -> None:
    """Alice stores 12 blocks (under her 15), Bob 20 (over: he is demoted). Batch 1, lost on the way, evicts
    10 of Alice's blocks and all of Bob's; batch 2 stores 10 more of Alice's. She then holds 12 blocks: a
    ledger that kept the lost ones would count 22 and demote her."""
    alice, bob = salt(loop, ALICE), salt(loop, BOB)
    loop.on_batch(chain_batch(0, (1000, 12, alice, None), (2000, 20, bob, None)))
    assert [type(a) for a in await loop.tick()] == [Demote]
    assert not await demoted(loop, ALICE) and await demoted(loop, BOB)
    lost = removals(1, [*range(1002, 1012), *range(2000, 2020)])
    for sent in (lost, chain_batch(2, (3000, 10, None, 1001))):
        if sent is not lost:
            loop.on_batch(sent)
    # Stale: no demotion of Alice, and Bob, forgotten to 0 blocks by the reset, is not restored yet either.
    assert await loop.tick() == []
    assert stale_gauge(loop) == 1.0
    assert not await demoted(loop, ALICE) and await demoted(loop, BOB)


async def test_no_tenant_is_demoted_on_phantom_blocks_once_the_ledger_acts_again(loop: EngineControlLoop) -> None:
    await lose_batch_1(loop)
    # Requests without a salt fill the whole cache: it has turned over, the ledger is whole again. Alice, at 12
    # blocks, stays; Bob, who has none left, is restored.
    loop.on_batch(chain_batch(3, (5000, STATE.num_gpu_blocks, None, None)))
    assert [(type(a), a.tenant) for a in await loop.tick() if isinstance(a, Demote | Restore)] == [(Restore, BOB)]
    assert not await demoted(loop, ALICE) and not await demoted(loop, BOB)
    assert loop.ledger.owner_blocks(loop.ctx.tenants.salt_to_tenant)[ALICE] == 10  # a lower bound of her 12


async def test_once_the_engine_clears_its_cache_the_ledger_acts_again(loop: EngineControlLoop) -> None:
    await lose_batch_1(loop)
    # Alice stores 20 blocks after a clear, truly over her quota: demoted; Bob restored.
    cleared = chain_batch(3, (4000, 20, salt(loop, ALICE), None))
    cleared.ops.insert(0, ("clear", 0))
    loop.on_batch(cleared)
    actions = await loop.tick()
    assert sorted((type(a).__name__, a.tenant) for a in actions if isinstance(a, Demote | Restore)) == [
        ("Demote", ALICE), ("Restore", BOB)]
    assert await demoted(loop, ALICE) and not await demoted(loop, BOB)
    assert stale_gauge(loop) == 0.0
