"""Real engine hosts (vLLM in this process) for the integration tests."""

from __future__ import annotations

from pathlib import Path

from tessera.engine.config import EngineConfig
from tessera.engine.host import EngineHost
from tessera.redis_conn import EmbeddedRedis


def start_host(model_dir: Path, redis: EmbeddedRedis | None, **overrides: object) -> EngineHost:
    """A started engine host for ``model_dir`` (registered in ``redis`` when given), heartbeating every
    0.5 s unless ``overrides`` say otherwise; the caller stops it."""
    config = EngineConfig.model_validate({"model": str(model_dir), "heartbeat_interval_s": 0.5, **overrides})
    return EngineHost(config, redis.url if redis else None).start()
