from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera.engine.config import EngineConfig
from tessera.engine.host import EngineHost
from tessera.redis_conn import EmbeddedRedis


def start_host(model_dir: Path, redis: EmbeddedRedis | None, **overrides: object) -> EngineHost:
    config = EngineConfig.model_validate({"model": str(model_dir), "heartbeat_interval_s": 0.5, **overrides})
    return EngineHost(config, redis.url if redis else None).start()


@pytest.fixture(scope="session")
def fp8_engine(small_model_dir: Path, redis_server: EmbeddedRedis) -> Iterator[EngineHost]:
    """One real vLLM engine (CPU build) with the platform defaults: FP8 KV, n-gram speculation."""
    host = start_host(small_model_dir, redis_server)
    yield host
    host.stop()
