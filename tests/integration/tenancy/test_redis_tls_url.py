"""A ``rediss://`` URL's TLS options hold for the gateway's lean Redis connection as for redis-py: with a
private CA named in ``ssl_ca_certs`` both reach the server; without it both refuse the certificate (it is
verified, not trusted blindly). A real TLS handshake in front of a real Redis (tests/support/tls_proxy.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from tessera.redis_conn import EmbeddedRedis, connect
from tessera.redis_wire import RedisWire
from tests.support.tls_proxy import make_private_ca, tls_front

pytestmark = pytest.mark.adversarial


async def test_the_lean_connection_honours_the_urls_private_ca(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    ca = make_private_ca(tmp_path)
    async with tls_front(ca, redis_server.port) as port:
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca.ca_file}"
        wire = RedisWire(url, timeout_s=5.0)
        redis = connect(url, timeout_s=5.0)
        try:
            assert await wire.execute([("PING",)]) == [b"PONG"]
            assert await redis.ping()
        finally:
            await wire.close()
            await redis.aclose()


async def test_without_the_ca_the_certificate_is_refused(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    ca = make_private_ca(tmp_path)
    async with tls_front(ca, redis_server.port) as port:
        wire = RedisWire(f"rediss://127.0.0.1:{port}/0", timeout_s=5.0)
        with pytest.raises(RedisConnectionError, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            await wire.execute([("PING",)])
        await wire.close()
