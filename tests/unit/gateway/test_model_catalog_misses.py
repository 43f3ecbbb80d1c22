"""Requests naming models nobody serves (gateway/models.py ``ModelCatalog.get``, on real Redis): the name is checked
before admission, so no tenant limit counts them; they re-read the catalog at most once in ``MISS_REREAD_S``, and a
model registered since the last read is still served on its first request once that has passed."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from tessera.gateway import models
from tessera.gateway.models import ModelCatalog
from tessera.redis_conn import EmbeddedRedis, connect
from tessera.registry import MODELS_HASH, ModelInfo, register_model


async def test_made_up_model_names_re_read_the_catalog_at_most_once_a_period(
        redis_server: EmbeddedRedis, small_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    redis = connect(redis_server.url, timeout_s=5.0)
    catalog = ModelCatalog(redis)
    reads: list[float] = []
    read = catalog._read

    async def counted() -> list[ModelInfo]:
        reads.append(asyncio.get_running_loop().time())
        return await read()

    monkeypatch.setattr(catalog, "_read", counted)
    late = f"late-{uuid.uuid4().hex[:6]}"
    try:
        await catalog.names()  # the first read (the copy's age), not a miss's
        assert len(reads) == 1
        for _ in range(200):  # a tenant's made-up names, as fast as it can send them
            assert await catalog.get(f"made-up-{uuid.uuid4().hex}") is None
        assert len(reads) == 2  # one re-read for all 200 (fails with one a request: 201)
        # A model registered now is served on the first request after the period.
        await register_model(redis, ModelInfo(late, str(small_model_dir), 1024, 32))
        monkeypatch.setattr(models, "MISS_REREAD_S", 0.05)
        await asyncio.sleep(0.06)
        assert await catalog.get(late) is not None
        assert len(reads) == 3
    finally:
        await redis.hdel(MODELS_HASH, late)
        await catalog.close()
        await redis.aclose()
