"""The simulated replica's host (engine/sim/serve_replica.py) in this process, with real Redis: what a Ray Serve
replica of ``backend: sim`` runs. It serves the replica protocol, registers through the real heartbeat, feeds
the prefix index from its own vLLM-format KV events, reports its load, and a drain takes it out of the
registry and the index. (tests/integration/ray/test_sim_replicas.py runs the same host on Ray.)"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import orjson

from tessera.engine.config import EngineConfig
from tessera.engine.sim.serve_replica import SimReplicaHost
from tessera.redis_conn import EmbeddedRedis, connect
from tessera.registry import EngineRecord, EngineRegistry
from tessera.routing.hashing import block_hash_chain
from tessera.routing.prefix_index import PrefixIndex
from tests.support.data_plane import ENGINE_AUTH

BLOCK_SIZE = 16


def sim_config(model_dir: Path, name: str) -> EngineConfig:
    return EngineConfig.model_validate({
        "model": str(model_dir), "backend": "sim", "servedModelName": name, "blockSize": BLOCK_SIZE,
        "maxModelLen": 512, "numGpuBlocksOverride": 64, "heartbeatIntervalS": 0.25, "drainTimeoutS": 5,
        "sim": {"stepTime": "measured", "stepS": 0.002, "perSeqS": 0.0, "perPrefillTokenS": 1e-5}})


async def until(check, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


def test_the_sim_host_serves_registers_feeds_the_index_and_drains(redis_server: EmbeddedRedis,
                                                                   small_model_dir: Path) -> None:
    name = f"sim-host-{time.monotonic_ns()}"
    host = SimReplicaHost(sim_config(small_model_dir, name), redis_server.url, engine_id=f"{name}-0").start()
    prompt = list(range(100, 140))  # two full blocks
    chain = block_hash_chain(prompt, BLOCK_SIZE, "salt-a")[:2]

    async def scenario() -> None:
        redis = connect(redis_server.url, timeout_s=5.0)
        try:
            async def mine() -> list[EngineRecord]:
                return [r for r in await EngineRegistry(redis).live_engines() if r.model == name]

            (record,) = await until(mine, 10, "the sim replica in the registry")
            assert (record.engine_id, record.url, record.block_size, record.num_gpu_blocks) == (
                host.engine_id, host.url, BLOCK_SIZE, 64)
            assert record.kv_events_endpoint == host.kv_events_endpoint != ""
            async with httpx.AsyncClient(timeout=10) as client:
                assert (await client.get(f"{host.url}/health")).status_code == 200
                assert (await client.post(f"{host.url}/generate", json={"request_id": "r", "prompt_token_ids": prompt,
                                                                        "max_tokens": 2})).status_code == 401
                response = await client.post(f"{host.url}/generate", auth=ENGINE_AUTH, json={
                    "request_id": "r1", "prompt_token_ids": prompt, "max_tokens": 3, "cache_salt": "salt-a"})
                lines = [orjson.loads(line) for line in response.content.splitlines()]
                assert lines[-1]["done"] and lines[-1]["stats"]["num_output_tokens"] == 3
            index = PrefixIndex(redis)

            async def indexed() -> dict[int, int]:
                blocks = await index.blocks_of(host.engine_id)
                return blocks if all(h in blocks for h in chain) else {}

            await until(indexed, 10, "the prompt's blocks in the prefix index")

            async def counted() -> bool:
                # The feed counts a batch once Redis has answered its write, in the host's own thread: the
                # count may follow the index by that thread's next turn (seen on a VM under heavy steal).
                return host.index_stats.num_batches >= 1

            await until(counted, 10, "the feed's count of the batch it applied")
            load = host.load()
            assert (load.num_running, load.num_waiting, load.kv_cache_usage) == (0, 0, 0.0)  # idle: nothing held
            assert host.is_healthy()

            outcome = await asyncio.to_thread(host.drain)
            assert outcome is not None and outcome.drained
            assert not host.is_healthy()
            assert await mine() == [] and await index.blocks_of(host.engine_id) == {}
        finally:
            await redis.aclose()

    try:
        asyncio.run(scenario())
    finally:
        host.stop(force=True)
