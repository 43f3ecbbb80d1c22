"""What the engine host puts in the environment before vLLM starts (engine/vllm_engine.py)."""

from __future__ import annotations

import os

import pytest

from tessera.engine import shm_wait
from tessera.engine.config import EngineConfig
from tessera.engine.vllm_engine import prepare_environment

MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare_environment writes os.environ: every variable it may set is restored after the test."""
    for name in (MULTIPROCESSING, shm_wait.ENV, "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(shm_wait, "install", lambda: None)  # patches vLLM's class: not this test's concern


def test_a_cpu_engine_with_one_worker_keeps_vllms_in_process_executor() -> None:
    # vLLM's CPU platform replaces the "uni" executor with "mp" unless this variable is "0".
    prepare_environment(EngineConfig(model="/m", accelerator="cpu"))
    assert os.environ[MULTIPROCESSING] == "0"


@pytest.mark.parametrize("overrides", [{"cpuModelInEngineCore": False}, {"accelerator": "gpu"},
                                       {"tensorParallelSize": 2}])
def test_vllms_own_layout_is_left_alone_elsewhere(overrides: dict[str, object]) -> None:
    prepare_environment(EngineConfig.model_validate({"model": "/m", "accelerator": "cpu", **overrides}))
    assert MULTIPROCESSING not in os.environ
