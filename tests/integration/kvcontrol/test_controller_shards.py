"""Two controller processes' worth of KVControllers (shards 0 and 1 of 2) over one registry in a real
Redis: each engine is controlled by exactly one of them, and an engine registered later goes to its shard
only. The loops poll engines that do not answer (nothing listens at their addresses): what is checked is who
controls whom."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tessera.redis_conn import EmbeddedRedis, connect
from tessera.registry import EngineRecord, EngineRegistry
from tessera_operators.kvcontrol.controller import KVController
from tessera_operators.kvcontrol.settings import KVControlSettings
from tessera_operators.kvcontrol.sharding import shard_of

NUM_ENGINES = 12
MODEL = "shard-test-model"  # the session's Redis holds other tests' engines: the controllers watch this model


def _record(i: int) -> EngineRecord:
    # Port 9 (discard) on loopback: nothing answers, so the loops' polls fail fast and harmlessly.
    return EngineRecord(f"shard-test-engine-{i}", "http://127.0.0.1:9", MODEL, 16, 1024, 4096,
                        kv_events_endpoint="tcp://127.0.0.1:9")


@pytest.fixture
async def registry(redis_server: EmbeddedRedis) -> AsyncIterator[EngineRegistry]:
    redis = connect(redis_server.url, timeout_s=5.0)
    registry = EngineRegistry(redis, heartbeat_interval_s=30)  # records outlive the test
    for i in range(NUM_ENGINES):
        await registry.heartbeat(_record(i))
    yield registry
    await redis.aclose()


async def test_every_engine_has_exactly_one_controller(redis_server: EmbeddedRedis,
                                                       registry: EngineRegistry) -> None:
    controllers = [KVController(KVControlSettings(redis_url=redis_server.url, kvcontrol_shard=shard,
                                                  kvcontrol_shards=2, kvcontrol_metrics_port=0,
                                                  kvcontrol_model=MODEL))
                   for shard in (0, 1)]
    try:
        for controller in controllers:
            await controller.start()
        first, second = (set(c.loops) for c in controllers)
        everyone = {_record(i).engine_id for i in range(NUM_ENGINES)}
        assert first | second == everyone and not first & second
        assert first and second, "12 engines all on one shard: the hash does not spread them"
        assert all(shard_of(e, 2) == 0 for e in first) and all(shard_of(e, 2) == 1 for e in second)

        late = _record(NUM_ENGINES)
        await registry.heartbeat(late)
        for controller in controllers:
            await controller.discover()
        owners = [late.engine_id in c.loops for c in controllers]
        assert owners.count(True) == 1 and owners.index(True) == shard_of(late.engine_id, 2)
    finally:
        for controller in controllers:
            await controller.stop()
