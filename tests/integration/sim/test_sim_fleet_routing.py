"""A real gateway routing over a fleet large enough for prefix_affinity's decision in C (routing/_affinity_rank.c
takes decisions whose walk meets 16 open engines: 17 engines or more): 24 simulated replicas in one `tessera engine
sim` process, registered and publishing KV events as real replicas do. A prompt's first request is placed as a
new prefix, the next ones follow it to the engine its blocks went to, and once the gateway's local index holds
them the reason names the cached tokens; a prompt that shares nothing goes by its own homes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tessera.native_steps import AFFINITY_STEP
from tessera.redis_conn import EmbeddedRedis, connect
from tessera.registry import EngineRegistry
from tests.support.gateways import running_gateways
from tests.support.native_build import skip_where_nothing_can_be_built
from tests.support.routing_stack import issue_tenant_key
from tests.support.sim_process import START_TIMEOUT_S, SimProcess, running_sim

MODEL = "sim-fleet-routing"
NUM_ENGINES = 24
SHARED = "a long system prompt that every turn of this conversation begins with, " * 12


@pytest.fixture(scope="module")
def sim_fleet(small_model_dir: Path, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[SimProcess]:
    config = {"served_model_name": MODEL, "tokenizer": str(small_model_dir), "block_size": 16,
              "num_gpu_blocks": 256, "max_model_len": 1024, "heartbeat_interval_s": 0.5,
              "step_time": {"kind": "measured", "step_s": 0.002, "per_seq_s": 0.0, "per_prefill_token_s": 1e-5}}
    with running_sim(config, NUM_ENGINES, redis_server.url, tmp_path_factory.mktemp("sim-fleet")) as sim:
        yield sim


async def all_registered(redis_url: str) -> None:
    redis = connect(redis_url, timeout_s=5.0)
    try:
        async with asyncio.timeout(START_TIMEOUT_S):
            while sum(e.model == MODEL for e in await EngineRegistry(redis).live_engines()) < NUM_ENGINES:
                await asyncio.sleep(0.2)
    finally:
        await redis.aclose()


def test_a_gateway_follows_a_prefix_to_its_engine_over_a_24_engine_fleet(
        sim_fleet: SimProcess, redis_server: EmbeddedRedis,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    skip_where_nothing_can_be_built()
    assert AFFINITY_STEP.built() and not AFFINITY_STEP.forced_off()  # the gateway below decides in C
    asyncio.run(all_registered(redis_server.url))
    key, _salt = issue_tenant_key(redis_server.url, f"fleet-{time.monotonic_ns()}")
    env = {"TESSERA_REDIS_TIMEOUT_S": "2.0", "TESSERA_REGISTRY_REFRESH_S": "0.25", "TESSERA_REGISTRY_MAX_AGE_S": "0.5"}

    async def chat(client: httpx.AsyncClient, url: str, question: str) -> tuple[str, str]:
        body = {"model": MODEL, "max_tokens": 2,
                "messages": [{"role": "system", "content": SHARED}, {"role": "user", "content": question}]}
        response = await client.post(f"{url}/v1/chat/completions", json=body,
                                     headers={"authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
        return response.headers["x-tessera-engine"], response.headers["x-tessera-route-reason"]

    async def scenario(url: str) -> None:
        async with httpx.AsyncClient(timeout=30.0) as client:
            first_engine, first_reason = await chat(client, url, "hello")
            assert first_reason.startswith("prefix_affinity miss: new prefix"), first_reason
            reasons: list[str] = []
            async with asyncio.timeout(20):
                while True:
                    engine, reason = await chat(client, url, f"question {len(reasons)}")
                    assert engine == first_engine, (reasons, reason)
                    reasons.append(reason)
                    if reason.startswith("prefix_affinity cached_tokens="):
                        break
                    assert reason.startswith("prefix_affinity miss: pending where it was sent"), reasons
                    await asyncio.sleep(0.2)
            assert int(reason.split("cached_tokens=")[1].split()[0]) >= 16 * 8  # the shared prompt's blocks
            _, other = await chat(client, url, "x")  # the same system prompt: a hit again
            assert other.startswith("prefix_affinity cached_tokens=")
            body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "unrelated " * 40}]}
            response = await client.post(f"{url}/v1/chat/completions", json=body,
                                          headers={"authorization": f"Bearer {key}"})
            assert response.status_code == 200
            assert response.headers["x-tessera-route-reason"].startswith("prefix_affinity miss: new prefix")

    with running_gateways(1, redis_server.url, tmp_path_factory.mktemp("fleet-gw"), env) as gateways:
        asyncio.run(scenario(gateways[0].url))
