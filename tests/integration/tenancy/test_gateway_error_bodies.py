"""What a failed engine call tells the client: the kind of failure, never an internal address, errno text or
what a replica said (those go to the logs and the request's span). A real gateway process and Redis; the
"replica" is a registry record whose port nobody listens on."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from tessera.redis_conn import EmbeddedRedis, connect
from tessera.registry import EngineRecord, EngineRegistry, ModelInfo, register_model
from tests.support.gateways import spawn_gateway
from tests.support.machine import free_port
from tests.support.tenancy import GATEWAY_ENV, create_tenant


async def _heartbeat_dead_replica(redis_url: str, model: str, tokenizer_dir: Path, port: int) -> None:
    """A registry record (and catalog entry) for a replica on ``port``, where nothing listens."""
    redis = connect(redis_url, timeout_s=5.0)
    try:
        await register_model(redis, ModelInfo(model, str(tokenizer_dir), 4096, 16))
        await EngineRegistry(redis).heartbeat(
            EngineRecord(f"dead-{port}", f"http://127.0.0.1:{port}", model, 16, 4096, 4096))
    finally:
        await redis.aclose()


@pytest.mark.adversarial
def test_an_unreachable_replica_is_named_by_kind_not_address(redis_server: EmbeddedRedis, small_model_dir: Path,
                                                             tmp_path: Path) -> None:
    model, port = f"dead-{time.monotonic_ns()}", free_port()
    gateway = spawn_gateway(redis_server.url, tmp_path, GATEWAY_ENV)
    try:
        gateway.wait_healthy()
        tenant = create_tenant(gateway, prefix="errors")
        deadline = time.monotonic() + 20
        while True:  # until the gateway's registry view holds the record (it refreshes every second)
            asyncio.run(_heartbeat_dead_replica(redis_server.url, model, small_model_dir, port))
            response = httpx.post(f"{gateway.url}/v1/completions", headers=tenant.headers, timeout=30,
                                  json={"model": model, "prompt": "hi", "max_tokens": 2})
            if "No engine is serving" not in response.text or time.monotonic() > deadline:
                break
    finally:
        gateway.stop()
    assert response.status_code == 503, response.text
    message = response.json()["error"]["message"]
    assert "could not be reached" in message
    assert "127.0.0.1" not in response.text and str(port) not in response.text and "dead-" not in response.text
