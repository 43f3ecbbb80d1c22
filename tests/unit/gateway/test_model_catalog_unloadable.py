"""A model record the gateway cannot load (gateway/models.py ``ModelCatalog``), on real Redis: the others are
served, the same broken record is not loaded again on every refresh (a tokenizer that exists but will not load can
cost a second of CPU a try), a changed record is tried at once, and a model loaded from an earlier record keeps
serving when its new record is broken. (The gateway's 503 for it: tests/integration/tenancy/test_input_limits.py.)"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from tessera.gateway import models
from tessera.gateway.models import ModelCatalog
from tessera.redis_conn import EmbeddedRedis, connect
from tessera.registry import MODELS_HASH, ModelInfo, register_model


async def test_a_broken_record_is_tried_again_only_when_it_changes_or_after_a_while(
        redis_server: EmbeddedRedis, small_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    redis = connect(redis_server.url, timeout_s=5.0)
    good, broken = f"good-{uuid.uuid4().hex[:6]}", f"broken-{uuid.uuid4().hex[:6]}"
    tries: list[str] = []
    load = models.load_served_model

    def counted(info: ModelInfo) -> Any:
        tries.append(info.name)
        return load(info)

    monkeypatch.setattr(models, "load_served_model", counted)
    catalog = ModelCatalog(redis)
    try:
        await register_model(redis, ModelInfo(good, str(small_model_dir), 1024, 32))
        await register_model(redis, ModelInfo(broken, "/no/such/tokenizer", 1024, 32))
        for _ in range(3):
            await catalog.refresh()
        assert await catalog.get(good) is not None and await catalog.get(broken) is None
        assert tries.count(broken) == 1 and tries.count(good) == 1
        assert "/no/such/tokenizer" in (catalog.unavailable(broken) or "") and catalog.unavailable(good) is None
        await register_model(redis, ModelInfo(broken, "/another/missing/path", 1024, 32))
        await catalog.refresh()  # a changed record: tried at once
        assert tries.count(broken) == 2 and "/another/missing/path" in (catalog.unavailable(broken) or "")
        monkeypatch.setattr(models, "RETRY_UNLOADABLE_S", 0.0)
        await catalog.refresh()  # the same record, after the wait
        assert tries.count(broken) == 3
        # A model served from a good record keeps serving when its record turns bad.
        await register_model(redis, ModelInfo(good, "/no/such/tokenizer", 1024, 32))
        await catalog.refresh()
        assert await catalog.get(good) is not None and catalog.unavailable(good) is None
    finally:
        await redis.hdel(MODELS_HASH, good, broken)
        await catalog.close()
        await redis.aclose()
