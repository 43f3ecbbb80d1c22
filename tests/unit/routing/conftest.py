"""A prefix index on the session's real Redis; every test gets its own engine ids and block hashes."""

from __future__ import annotations

import random
import uuid
from collections.abc import AsyncIterator

import pytest

from tessera.redis_conn import EmbeddedRedis, connect
from tessera.routing.prefix_index import PrefixIndex


@pytest.fixture
async def index(redis_server: EmbeddedRedis) -> AsyncIterator[PrefixIndex]:
    redis = connect(redis_server.url, timeout_s=5.0)
    yield PrefixIndex(redis)
    await redis.aclose()


@pytest.fixture
def engine_ids() -> list[str]:
    tag = uuid.uuid4().hex[:8]
    return [f"t-{tag}-{name}" for name in ("a", "b", "c")]


@pytest.fixture
def hashes() -> list[int]:
    """Random 64-bit block hashes, fresh per test (the index is shared by the whole session)."""
    rng = random.Random(uuid.uuid4().int)
    return [rng.getrandbits(64) for _ in range(16)]
