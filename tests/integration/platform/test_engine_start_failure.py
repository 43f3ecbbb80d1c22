"""An engine that cannot start says why in one line: the cause from vLLM's engine process, and the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.engine.config import EngineConfig
from tessera.engine.deployment import EngineReplica
from tessera.engine.host import EngineHost, EngineStartError

pytestmark = pytest.mark.engine


def test_a_failure_inside_vllms_engine_process_is_named_with_its_setting(small_model_dir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # More KV space than any machine here has: vLLM's worker process refuses it while its frontend only
    # says "Engine core initialization failed. See root cause above."
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "100000")
    host = EngineHost(EngineConfig(model=str(small_model_dir), kv_events={"enabled": False}), None)
    with pytest.raises(EngineStartError) as failure:
        host.start(timeout_s=300)
    message = str(failure.value)
    assert "\n" not in message and "See root cause above" not in message
    assert "ValueError: Available memory on node" in message and "100000.0 GiB" in message
    assert "[Tessera setting: cpuKvCacheSpaceGib" in message


def test_a_replica_whose_host_never_started_shuts_down_quietly() -> None:
    # Ray calls __del__ on a replica whose constructor raised: it has no host to stop.
    replica_class = EngineReplica.func_or_class
    replica = replica_class.__new__(replica_class)
    replica.__del__()
