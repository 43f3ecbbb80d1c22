from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera.engine.host import EngineHost
from tessera.redis_conn import EmbeddedRedis
from tests.support.engines import start_host


@pytest.fixture(scope="session")
def fp8_engine(small_model_dir: Path, redis_server: EmbeddedRedis) -> Iterator[EngineHost]:
    """One real vLLM engine (CPU build) with the platform defaults: FP8 KV, n-gram speculation."""
    host = start_host(small_model_dir, redis_server)
    yield host
    host.stop()


@pytest.fixture
def cpu_without_fp8_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's torch reports no AVX-512 and no AMX: what vLLM's own ISA check sees on an AVX2-only
    CPU. Spawned vLLM workers still see the real CPU."""
    import torch

    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
