"""A Redis restart under idle pooled connections (issue #16): a real Valkey SIGKILLed and started again on the
same port with its AOF. Every command after it is served: the pool replaces each connection the server
closed before it writes a command on it (redis_conn.py's docstring), and the gateway's lean connection
reconnects; an admission sent after the restart counts once. Behind Sentinels, the same with the primary and
the Sentinel both restarted: the client's idle connection to the Sentinel is replaced as well.

The kill and the start run in a thread, so this process's event loop keeps running meanwhile, as a
gateway's does while its Redis restarts.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera.redis_conn import EmbeddedRedis, connect
from tessera.redis_wire import RedisWire, run_script
from tessera.tenancy.admission import Admission, Lease
from tessera.tenancy.policy import TenantPolicy
from tests.support.sentinel_cluster import SentinelCluster

NUM_POOLED = 6
# Long enough that NUM_POOLED concurrent BLPOPs overlap (each then holds its own pooled connection).
HOLD_S = 0.3


@pytest.fixture
def data_dir() -> Iterator[Path]:
    shm = Path("/dev/shm")  # the AOF on a tmpfs where there is one: no waiting on a busy disk
    path = Path(tempfile.mkdtemp(prefix="tessera-pool-restart-", dir=shm if shm.is_dir() else None))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def restart(server: EmbeddedRedis, data_dir: Path) -> EmbeddedRedis:
    """SIGKILL, then a new server on the same port and AOF, as a StatefulSet restarts its container."""
    port = server.port
    await asyncio.to_thread(server.kill)
    restarted = await asyncio.to_thread(EmbeddedRedis(port=port, data_dir=data_dir).start)
    assert restarted.port == port
    return restarted


async def test_every_pooled_connection_serves_its_first_command_after_a_restart(data_dir: Path) -> None:
    server = EmbeddedRedis(data_dir=data_dir).start()
    redis = connect(server.url, timeout_s=1.0)
    wire = RedisWire(server.url, timeout_s=1.0)
    try:
        await redis.set("kept", "v")
        await asyncio.gather(*(redis.blpop([f"empty-{i}"], timeout=HOLD_S) for i in range(NUM_POOLED)))
        assert len(redis.connection_pool._available_connections) == NUM_POOLED, "that many idle connections"
        assert await wire.execute([("GET", "kept")]) == [b"v"]

        server = await restart(server, data_dir)

        # At once: each takes a different idle connection the server closed.
        assert await asyncio.gather(*(redis.get("kept") for _ in range(NUM_POOLED))) == [b"v"] * NUM_POOLED
        for _ in range(NUM_POOLED):
            assert await redis.incrby("counter", 1) > 0
        assert int(await redis.get("counter") or 0) == NUM_POOLED, "each INCRBY ran once"

        # The gateway's admission: EVALSHA over the lean connection, NOSCRIPT (the restart lost the scripts)
        # loads it through the pool; each admitted once.
        admission = Admission(redis)
        tenant, policy = "restarted", TenantPolicy(requests_per_minute=100)
        for _ in range(3):
            call = admission.prepare(tenant, policy, reserve_tokens=10)
            reply = await run_script(wire, admission._admit, call.keys, call.args)
            assert isinstance(call.outcome(reply), Lease)
        assert await redis.zcard(f"tessera:rl:{tenant}:rpm") == 3
        assert await admission.in_flight(tenant) == 3
    finally:
        await wire.close()
        await redis.aclose()
        server.stop()


async def test_a_restarted_sentinel_and_primary_serve_every_command(data_dir: Path) -> None:
    # No replica: nothing to fail over to, so the restarted primary stays the primary.
    cluster = SentinelCluster(data_dir, num_replicas=0, num_sentinels=1, quorum=1).start()
    redis = connect(cluster.url(), timeout_s=1.0)
    try:
        await redis.set("kept", "v")
        await asyncio.gather(*(redis.blpop([f"empty-{i}"], timeout=HOLD_S) for i in range(NUM_POOLED)))
        assert len(redis.connection_pool._available_connections) == NUM_POOLED

        for node in (cluster.primary(), cluster.sentinels[0]):
            await asyncio.to_thread(node.kill)
            await asyncio.to_thread(node.start)
            await asyncio.to_thread(node.wait_ready)

        # Twice the pooled connections at once: the idle ones, and new ones that each ask the Sentinel first.
        replies = await asyncio.gather(*(redis.get("kept") for _ in range(2 * NUM_POOLED)))
        assert replies == [b"v"] * 2 * NUM_POOLED
    finally:
        await redis.aclose()
        cluster.stop()
