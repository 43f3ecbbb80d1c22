"""The engine host's start-up paths that do not need vLLM: its HTTP port is held from the moment it is
chosen, the KV-event port avoids the ephemeral range, and registration survives a Redis that answers late."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from tessera.engine.config import EngineConfig
from tessera.engine.heartbeat import heartbeat_loop
from tessera.engine.host import EngineHost
from tessera.engine.ports import below_ephemeral_range, free_port, reserve_port
from tessera.redis_conn import EmbeddedRedis, connect
from tessera.registry import EngineRegistry, list_models


def _bind_fails(port: int) -> bool:
    with socket.socket() as other:
        try:
            other.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


def test_a_reserved_port_cannot_be_taken_until_released() -> None:
    sock = reserve_port("127.0.0.1")
    port = int(sock.getsockname()[1])
    assert _bind_fails(port)
    sock.close()
    assert not _bind_fails(port)


def test_a_fixed_port_in_use_is_named_in_the_error() -> None:
    with reserve_port("0.0.0.0") as held:
        port = int(held.getsockname()[1])
        with pytest.raises(OSError, match=f"port {port} is in use"):
            reserve_port("0.0.0.0", f"{port}-{port}")


def test_the_engine_host_holds_its_http_port_before_the_engine_starts() -> None:
    host = EngineHost(EngineConfig(model="/m"), redis_url=None)
    try:
        assert _bind_fails(host.port)
        assert host.url.endswith(f":{host.port}")
    finally:
        host._http_socket.close()


def test_kv_event_ports_come_from_below_the_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    port_range = below_ephemeral_range()
    assert port_range == f"{low - 10000}-{low - 1}"
    assert low - 10000 <= free_port(port_range=port_range) < low
    host = EngineHost(EngineConfig(model="/m"), redis_url=None)
    try:
        assert low - 10000 <= host.kv_events_port < low
    finally:
        host._http_socket.close()


async def test_registration_is_retried_until_redis_answers() -> None:
    # Redis is not there when the heartbeat starts; it comes up later on the same port.
    port = free_port()
    host = EngineHost(EngineConfig(model="/m", served_model_name="late-redis", heartbeat_interval_s=0.1),
                      redis_url=f"redis://127.0.0.1:{port}/0", engine_id="late-redis-engine")
    # No vLLM here: only the registry path, with the replica healthy.
    assert host.redis_url is not None
    beat = asyncio.create_task(heartbeat_loop(host.redis_url, host.config.heartbeat_interval_s, host.model_info(),
                                              lambda: True, host.record))
    server = None
    try:
        await asyncio.sleep(0.5)
        assert not beat.done(), "a Redis error must not end the heartbeat"
        server = EmbeddedRedis(port=port).start()
        redis = connect(server.url)
        for _ in range(100):
            live = await EngineRegistry(redis).live_engines()
            if live and [m.name for m in await list_models(redis)] == ["late-redis"]:
                break
            await asyncio.sleep(0.1)
        assert [e.engine_id for e in live] == ["late-redis-engine"]
        assert [m.name for m in await list_models(redis)] == ["late-redis"]
        await redis.aclose()
    finally:
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
        host._http_socket.close()
        if server is not None:
            server.stop()
