"""A model's load in the gateway (gateway/models.py ``ModelCatalog``, on real Redis and the small model's real
tokenizer): it runs off the worker's event loop, which keeps relaying other streams meanwhile (a tokenizer file
read, its template compiled and up to ``FAST_PATH_WAIT_S`` of the tiktoken check held the loop for as long);
two refreshes at once load a newly registered model once; and requests that find the copy stale together wait
for one read, not for one each behind the refreshes' lock."""

from __future__ import annotations

import asyncio
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from tessera.gateway import models
from tessera.gateway.models import ModelCatalog
from tessera.redis_conn import EmbeddedRedis, connect
from tessera.registry import MODELS_HASH, ModelInfo, register_model


async def test_a_model_loads_while_the_event_loop_keeps_turning(
        redis_server: EmbeddedRedis, small_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    redis = connect(redis_server.url, timeout_s=5.0)
    name = f"loads-{uuid.uuid4().hex[:6]}"
    loop_turned = threading.Event()
    seen: dict[str, Any] = {}
    load = models.load_served_model

    def slow_load(info: ModelInfo) -> Any:
        # A large tokenizer's load, as the loop sees it: the load finishes only once the loop has run something
        # else meanwhile (a loop held by the load never does: the wait runs out).
        seen["thread"] = threading.get_ident()
        seen["loop_turned"] = loop_turned.wait(timeout=5.0)
        return load(info)

    async def another_stream() -> None:
        await asyncio.sleep(0.01)
        loop_turned.set()

    monkeypatch.setattr(models, "load_served_model", slow_load)
    catalog = ModelCatalog(redis)
    try:
        await register_model(redis, ModelInfo(name, str(small_model_dir), 1024, 32))
        other = asyncio.create_task(another_stream())
        await catalog.refresh()
        await other
        assert seen["thread"] != threading.get_ident()
        assert seen["loop_turned"]  # fails with the load on the loop's thread: nothing else ran for 5 s
        served = await catalog.get(name)
        assert served is not None and served.encode("hello there") == load(served.info).encode("hello there")
    finally:
        await redis.hdel(MODELS_HASH, name)
        await catalog.close()
        await redis.aclose()


async def test_two_refreshes_at_once_load_a_new_model_once(
        redis_server: EmbeddedRedis, small_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    redis = connect(redis_server.url, timeout_s=5.0)
    name = f"once-{uuid.uuid4().hex[:6]}"
    tries: list[str] = []
    load = models.load_served_model
    second_read = threading.Event()

    def counted(info: ModelInfo) -> Any:
        tries.append(info.name)
        # A load long enough for the other refresh to read the catalog meanwhile, where nothing holds it back (with
        # the refreshes' lock it reads only after this load: the wait runs out, a second of the test's time).
        second_read.wait(timeout=1.0)
        return load(info)

    monkeypatch.setattr(models, "load_served_model", counted)
    catalog = ModelCatalog(redis)
    read, reads = catalog._read, []

    async def counted_read() -> list[ModelInfo]:
        reads.append(1)
        if len(reads) == 2:
            second_read.set()
        return await read()

    monkeypatch.setattr(catalog, "_read", counted_read)
    try:
        await register_model(redis, ModelInfo(name, str(small_model_dir), 1024, 32))
        # The refresher's pass and a request's miss re-read, together.
        await asyncio.gather(catalog.refresh(), catalog.refresh())
        assert tries.count(name) == 1  # fails without the refreshes' lock: each loads it (2)
        assert await catalog.get(name) is not None
    finally:
        await redis.hdel(MODELS_HASH, name)
        await catalog.close()
        await redis.aclose()


async def test_requests_that_find_the_copy_stale_together_wait_for_one_read(redis_server: EmbeddedRedis,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    redis = connect(redis_server.url, timeout_s=5.0)
    catalog = ModelCatalog(redis)
    read, reads = catalog._read, []

    async def counted_read() -> list[ModelInfo]:
        reads.append(1)
        return await read()

    monkeypatch.setattr(catalog, "_read", counted_read)
    try:
        # Five at once: the first reads, the second waits for it and reads again (its call came after that read
        # began), the other three find that second read begun after their calls.
        await asyncio.gather(*(catalog.refresh() for _ in range(5)))
        assert len(reads) == 2  # fails with each refresh reading in turn behind the lock (5)
        await catalog.refresh()  # a call after every read began reads again
        assert len(reads) == 3
    finally:
        await catalog.close()
        await redis.aclose()
