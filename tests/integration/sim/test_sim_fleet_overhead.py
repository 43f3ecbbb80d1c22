"""What a fleet of simulated replicas costs its one event loop beyond serving: each replica's server ticks once
a second (uvicorn's ten a second were a tenth of the loop at 1,000 replicas) and still stops at once, and the
replicas' heartbeats go to Redis in batches, one round trip each, every replica registered."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tessera.engine.sim import fleet as fleet_module
from tessera.engine.sim import fleet_redis
from tessera.engine.sim.config import SimEngineConfig
from tessera.engine.sim.fleet import SimFleet
from tessera.redis_conn import EmbeddedRedis, connect
from tessera.registry import EngineRegistry


def config(**overrides: Any) -> SimEngineConfig:
    return SimEngineConfig(**{"num_gpu_blocks": 64, "block_size": 16, "max_model_len": 1024, **overrides})


def test_a_replicas_server_ticks_once_a_second_and_stops_at_once(monkeypatch: Any) -> None:
    ticks: list[int] = []
    original = fleet_module._QuietServer.on_tick

    async def counted(self: Any, counter: int) -> bool:
        ticks.append(counter)
        return await original(self, counter)

    monkeypatch.setattr(fleet_module._QuietServer, "on_tick", counted)

    async def run() -> float:
        fleet = await SimFleet(config(), 1, redis_url=None).start()
        await asyncio.sleep(2.5)
        started = time.monotonic()
        await fleet.stop()
        return time.monotonic() - started

    stop_s = asyncio.run(run())
    assert 2 <= len(ticks) <= 4  # uvicorn's own loop ticks ~25 times in 2.5 s
    assert all(counter % 10 == 0 for counter in ticks)  # each tick refreshes the Date header
    assert stop_s < 0.9  # woken by stop, not by the next tick


def test_a_fleets_heartbeats_register_every_replica_in_batched_round_trips(monkeypatch: Any) -> None:
    # A Redis of its own: the fleet registers its model (the sim's default, with no tokenizer a gateway could load),
    # which the session's shared Redis must not keep for the gateways of later tests.
    monkeypatch.setattr(fleet_redis, "HEARTBEAT_BATCH", 4)
    calls: list[int] = []
    original = EngineRegistry.heartbeat_many

    async def counted(self: EngineRegistry, records: Any) -> None:
        calls.append(len(records))
        await original(self, records)

    monkeypatch.setattr(EngineRegistry, "heartbeat_many", counted)

    async def run(redis_url: str) -> list[str]:
        fleet = await SimFleet(config(feed_index=False), 10, redis_url=redis_url,
                               engine_id_prefix="batched").start()
        redis = connect(redis_url, timeout_s=5.0)
        try:
            for _ in range(100):
                live = [e.engine_id for e in await EngineRegistry(redis).live_engines()]
                mine = sorted(e for e in live if e.startswith("batched-"))
                if len(mine) == 10:
                    return mine
                await asyncio.sleep(0.05)
            return mine
        finally:
            await fleet.stop()
            await redis.aclose()

    server = EmbeddedRedis().start()
    try:
        registered = asyncio.run(run(server.url))
    finally:
        server.stop()
    assert len(registered) == 10
    assert calls[:3] == [4, 4, 2]  # a round of 10 replicas: three round trips
