"""One control loop's effects on real Redis and the spans it emits (no engine needed: the loop is fed decoded
KV event batches and engine states directly; the engine-facing paths run in test_controller_actions.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tessera.redis_conn import EmbeddedRedis, connect
from tessera.registry import EngineRecord, pressure_key
from tessera.routing.kv_events import DecodedBatch
from tessera.tenancy.demotion import demoted_key
from tessera.tenancy.policy import TenantPolicy
from tessera.tenancy.store import TenantStore
from tessera_operators.kvcontrol.directory import DemotionBook, TenantDirectory
from tessera_operators.kvcontrol.loop import EngineControlLoop, EngineState, LoopContext
from tessera_operators.kvcontrol.metrics import ControllerMetrics
from tessera_operators.kvcontrol.policy import (
    ClearPressure,
    Demote,
    InFlightRequest,
    PolicyConfig,
    Restore,
    SetPressure,
)

TP_BOB = "00-000000000000000000000000000000b1-00000000000000b1-01"


def record(engine_id: str) -> EngineRecord:
    return EngineRecord(engine_id=engine_id, url="http://127.0.0.1:9", model="m", block_size=32, num_gpu_blocks=64,
                        max_model_len=2048)


@pytest.fixture
async def loops(redis_server: EmbeddedRedis) -> AsyncIterator[tuple[list[EngineControlLoop], InMemorySpanExporter]]:
    redis = connect(redis_server.url, timeout_s=5)
    store = TenantStore(redis)
    for name in ("effects-alice", "effects-bob"):
        if await store.get_tenant(name) is None:
            await store.create_tenant(name, TenantPolicy(kv_quota=0.25))
    http = aiohttp.ClientSession()
    ctx = LoopContext(redis=redis, http=http, tenants=TenantDirectory(store), demotions=DemotionBook(),
                      metrics=ControllerMetrics(), policy=PolicyConfig(), flag_ttl_s=3)
    await ctx.tenants.refresh(force=True)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    made = []
    for engine_id in ("effects-e1", "effects-e2"):
        loop = EngineControlLoop(record(engine_id), ctx)
        loop.tracer = provider.get_tracer("test")
        made.append(loop)
    yield made, exporter
    for loop in made:
        await loop._release()
    await http.close()
    await redis.aclose()


def salt_of(loop: EngineControlLoop, tenant: str) -> str:
    return next(s for s, t in loop.ctx.tenants.salt_to_tenant.items() if t == tenant)


async def test_evictions_become_spans_with_owner_evictor_prefix_and_links(loops) -> None:  # type: ignore[no-untyped-def]
    (loop, _), exporter = loops
    alice, bob = salt_of(loop, "effects-alice"), salt_of(loop, "effects-bob")
    loop.requests = {"r-bob": InFlightRequest("r-bob", "effects-bob", 20, 1.0, TP_BOB)}
    loop.state = EngineState(63, 40, 1, 0)
    stored = DecodedBatch(seq=0, ts=1000.0, ops=[("store", 1), ("store", 2), ("store", 3)],
                          stored_blocks=[(1, None, [], alice), (2, 1, [], None), (3, 2, [], None)])
    loop.on_batch(stored)
    evicting = DecodedBatch(seq=1, ts=1001.5, ops=[("remove", 3), ("remove", 2), ("store", 9)],
                            stored_blocks=[(9, None, [], bob)])
    loop.on_batch(evicting)
    assert not exporter.get_finished_spans()  # waits for the next poll to learn "free blocks after"
    loop.observe(EngineState(63, 7, 1, 0))
    (span,) = exporter.get_finished_spans()
    attrs = dict(span.attributes or {})
    assert span.name == "kvcontrol.eviction" and span.start_time == int(1001.5e9)
    assert attrs["tessera.tenant"] == "effects-alice" and attrs["tessera.kv.evicted_by"] == "effects-bob"
    assert attrs["tessera.cause"] == "cross_tenant" and attrs["tessera.kv.blocks"] == 2
    assert (attrs["tessera.kv.free_blocks_before"], attrs["tessera.kv.free_blocks_after"]) == (40, 7)
    (event,) = span.events
    assert dict(event.attributes or {}) == {"tessera.kv.prefix_root": f"{1:016x}", "tessera.kv.depth_min": 1,
                                            "tessera.kv.depth_max": 2, "tessera.kv.blocks": 2}
    assert [f"{link.context.trace_id:032x}" for link in span.links] == ["000000000000000000000000000000b1"]
    metrics = loop.ctx.metrics.render()[0].decode()
    assert 'tessera_kv_evictions_total{cause="cross_tenant",engine="effects-e1",tenant="effects-alice"} 2.0' in metrics
    assert 'tessera_kv_tenant_blocks{engine="effects-e1",tenant="effects-bob"} 1.0' in metrics


async def test_demotion_flag_is_per_tenant_and_cleared_by_the_last_engine(loops) -> None:  # type: ignore[no-untyped-def]
    (e1, e2), exporter = loops
    redis = e1.ctx.redis
    snap = await e1.snapshot(EngineState(63, 10, 1, 0))
    await e1.apply(Demote("effects-alice", 30, 15, "over_kv_quota"), snap)
    await e2.apply(Demote("effects-alice", 20, 15, "over_kv_quota"), snap)
    assert 0 < await redis.ttl(demoted_key("effects-alice")) <= 3
    await e1.apply(Restore("effects-alice", 5, 15, "under_kv_quota"), snap)
    assert await redis.exists(demoted_key("effects-alice"))  # e2 still demotes the tenant
    await e2.apply(Restore("effects-alice", 5, 15, "under_kv_quota"), snap)
    assert not await redis.exists(demoted_key("effects-alice"))
    e1.observe(EngineState(63, 12, 1, 0))
    e2.observe(EngineState(63, 12, 1, 0))
    names = sorted(s.name for s in exporter.get_finished_spans())
    assert names == ["kvcontrol.demote", "kvcontrol.demote", "kvcontrol.restore", "kvcontrol.restore"]
    demote = next(s for s in exporter.get_finished_spans() if s.name == "kvcontrol.demote")
    attrs = dict(demote.attributes or {})
    assert attrs["tessera.kv.free_blocks_before"] == 10 and attrs["tessera.kv.free_blocks_after"] == 12
    assert attrs["tessera.kv.quota_blocks"] == 15 and attrs["tessera.tenant"] == "effects-alice"


async def test_pressure_flag_is_set_with_a_ttl_cleared_and_released(loops) -> None:  # type: ignore[no-untyped-def]
    (e1, _), _ = loops
    redis = e1.ctx.redis
    snap = await e1.snapshot(EngineState(63, 2, 3, 1))
    await e1.apply(SetPressure(0.97, "kv_usage 0.97 >= high_watermark 0.9"), snap)
    assert 0 < await redis.ttl(pressure_key("effects-e1")) <= 3
    await e1.apply(ClearPressure(0.5, "kv_usage 0.50 <= low_watermark 0.7"), snap)
    assert not await redis.exists(pressure_key("effects-e1"))
    await e1.apply(SetPressure(0.97, "again"), snap)
    await e1._release()  # a loop that stops gives its flags back
    assert not await redis.exists(pressure_key("effects-e1"))
