"""The tenancy tests' stack: a restartable Redis that persists (AOF), one real vLLM engine, and two real
gateway processes; shared by every test of this package. Each test makes its own tenants."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tessera.engine.host import EngineHost
from tessera.redis_conn import connect
from tests.support.engines import start_host
from tests.support.gateways import GatewayProcess, start_gateways
from tests.support.tenancy import (
    GATEWAY_ENV,
    MODEL,
)
from tests.support.valkey import RestartableRedis


@pytest.fixture(scope="package")
def tenancy_redis() -> Iterator[RestartableRedis]:
    # In memory where the machine has a tmpfs: the append-only file must not wait on a busy disk.
    shm = Path("/dev/shm")
    data_dir = Path(tempfile.mkdtemp(prefix="tessera-tenancy-redis-", dir=shm if shm.is_dir() else None))
    server = RestartableRedis(data_dir).start()
    yield server
    server.stop()
    shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture(scope="package")
def tenancy_engine(small_model_dir: Path, tenancy_redis: RestartableRedis) -> Iterator[EngineHost]:
    """One real engine. 1024 KV blocks of 32 tokens: room for a few long streams at once."""
    host = start_host(small_model_dir, tenancy_redis, served_model_name=MODEL,  # type: ignore[arg-type]
                      num_gpu_blocks_override=1024, max_model_len=8192,
                      # Registry TTL 5 s: this test process also runs the clients, and a busy machine
                      # can delay a heartbeat past the 2 s of a 0.5 s interval.
                      heartbeat_interval_s=1.0)
    yield host
    host.stop()


@pytest.fixture(scope="package")
def gateway_trace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the shared gateways write their spans (JSONL): the server side of latency bounds."""
    return tmp_path_factory.mktemp("gateway-traces")


@pytest.fixture(scope="package")
def gateways(tenancy_redis: RestartableRedis, tenancy_engine: EngineHost, gateway_trace_dir: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[GatewayProcess]]:
    """Two gateway processes on the same Redis: every limit must hold across both."""
    env = {**GATEWAY_ENV, "TESSERA_TRACE_EXPORTER": "jsonl", "TESSERA_TRACE_DIR": str(gateway_trace_dir)}
    processes = start_gateways(2, tenancy_redis.url, tmp_path_factory.mktemp("gateway-logs"), env)
    yield processes
    for process in processes:
        process.stop()


@pytest.fixture
async def redis_client(tenancy_redis: RestartableRedis) -> AsyncIterator[aioredis.Redis]:
    client = connect(tenancy_redis.url, timeout_s=5.0)
    yield client
    await client.aclose()
