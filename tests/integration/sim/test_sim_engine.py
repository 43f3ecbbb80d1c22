"""A simulated engine (``tessera engine sim``, a real process) registers in real Redis, a real gateway routes
a streamed chat to it, Tessera's KV-event decoder reads its events, its own index feed puts the prompt's
blocks in the prefix index under the gateway's hashes, and on SIGTERM it leaves the registry and the index."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tessera.redis_conn import EmbeddedRedis, connect
from tessera.registry import EngineRecord, EngineRegistry
from tessera.routing.hashing import block_hash_chain
from tessera.routing.kv_events import KVEventSubscriber
from tessera.routing.prefix_index import PrefixIndex
from tests.support.data_plane import ENGINE_AUTH
from tests.support.gateways import running_gateways
from tests.support.routing_stack import issue_tenant_key
from tests.support.sim_process import START_TIMEOUT_S, SimProcess, running_sim

MODEL = "sim-small"
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def sim_process(small_model_dir: Path, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[SimProcess]:
    # Measured step costs and a small cache: a test-sized engine (the roofline preset's H100 cache would do
    # as well, it is only bigger).
    config = {"served_model_name": MODEL, "tokenizer": str(small_model_dir), "block_size": BLOCK_SIZE,
              "num_gpu_blocks": 64, "max_model_len": 512, "heartbeat_interval_s": 0.5,
              "step_time": {"kind": "measured", "step_s": 0.002, "per_seq_s": 0.0, "per_prefill_token_s": 1e-5}}
    with running_sim(config, 1, redis_server.url, tmp_path_factory.mktemp("sim")) as sim:
        yield sim


async def registered(redis_url: str, url: str) -> EngineRecord:
    redis = connect(redis_url, timeout_s=5.0)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for record in await EngineRegistry(redis).live_engines():
                if record.url == url:
                    return record
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{url} never registered")
    finally:
        await redis.aclose()


def sse_contents(body: str) -> list[str]:
    out = []
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in orjson.loads(line[6:]).get("choices", []):
                out.append(choice.get("delta", {}).get("content") or "")
    return out


def test_a_gateway_routes_to_a_sim_engine_and_its_kv_events_reach_the_decoder_and_the_index(
        sim_process: SimProcess, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> None:
    record = asyncio.run(registered(redis_server.url, sim_process.urls[0]))
    assert (record.model, record.block_size, record.num_gpu_blocks) == (MODEL, BLOCK_SIZE, 64)
    key, _salt = issue_tenant_key(redis_server.url, f"sim-{time.monotonic_ns()}")
    env = {"TESSERA_REDIS_TIMEOUT_S": "2.0", "TESSERA_REGISTRY_REFRESH_S": "0.25", "TESSERA_REGISTRY_MAX_AGE_S": "0.5"}
    prompt_ids = list(range(1000, 1040))  # two full blocks and a partial one
    expected_chain = block_hash_chain(prompt_ids, BLOCK_SIZE, "tenant-salt")[:2]

    async def scenario(gateway_url: str) -> None:
        # Subscribed before any request: the first batches are not missed.
        events = KVEventSubscriber(record.kv_events_endpoint)
        try:
            async with httpx.AsyncClient(timeout=30.0) as client:
                chat = {"model": MODEL, "stream": True, "max_tokens": 4,
                        "messages": [{"role": "user", "content": "tell me about simulated engines " * 6}]}
                response = await client.post(f"{gateway_url}/v1/chat/completions", json=chat,
                                             headers={"authorization": f"Bearer {key}"})
                assert response.status_code == 200, response.text
                assert response.headers["x-tessera-engine"] == record.engine_id
                assert "".join(sse_contents(response.text)).count(" t") == 4
                # The replica protocol straight to the engine, with known ids: its events carry their hashes.
                direct = await client.post(f"{record.url}/generate", json={
                    "request_id": "direct-1", "prompt_token_ids": prompt_ids, "max_tokens": 2,
                    "cache_salt": "tenant-salt"}, auth=ENGINE_AUTH)
                lines = [orjson.loads(line) for line in direct.content.splitlines()]
                assert lines[-1]["done"] and lines[-1]["stats"]["num_output_tokens"] == 2
            stored: dict[int, tuple[int | None, str | None]] = {}
            async with asyncio.timeout(15):
                async for batch in events:
                    stored.update({h: (parent, salt) for h, parent, _, salt in batch.stored_blocks})
                    if all(h in stored for h in expected_chain):
                        break
            assert stored[expected_chain[0]] == (None, "tenant-salt")
            assert stored[expected_chain[1]] == (expected_chain[0], None)
        finally:
            events.close()
        # The sim's own index feed (the real engine host's loop) put the blocks in the shared prefix index.
        redis = connect(redis_server.url, timeout_s=5.0)
        try:
            async with asyncio.timeout(15):
                while (await PrefixIndex(redis).longest_prefixes(expected_chain, [record.engine_id])
                       ).get(record.engine_id, 0) < 2:
                    await asyncio.sleep(0.1)
        finally:
            await redis.aclose()

    with running_gateways(1, redis_server.url, tmp_path_factory.mktemp("sim-gw"), env) as gateways:
        asyncio.run(scenario(gateways[0].url))

    # Stopped as a real replica stops: out of the registry, its blocks out of the index, exit status 0.
    os.killpg(sim_process.process.pid, signal.SIGTERM)
    assert sim_process.process.wait(timeout=30) == 0

    async def gone() -> None:
        redis = connect(redis_server.url, timeout_s=5.0)
        try:
            assert record.engine_id not in [e.engine_id for e in await EngineRegistry(redis).live_engines()]
            assert (await PrefixIndex(redis).longest_prefixes(expected_chain, [record.engine_id])
                    ).get(record.engine_id, 0) == 0
        finally:
            await redis.aclose()

    asyncio.run(gone())
