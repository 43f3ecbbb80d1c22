"""How long the host lets vLLM's engine-core process exit before vLLM kills it (engine/vllm_engine.py)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from tessera.engine.config import EngineConfig
from tessera.engine.vllm_engine import CPU_ENGINE_CORE_EXIT_GRACE_S, engine_core_exit_grace_s, shutdown_engine


def test_a_cpu_engine_core_gets_a_short_grace() -> None:
    # Its graceful exit only frees what the OS frees when the process ends, and took 5-6 s on a 2-vCPU VM:
    # vLLM's default grace (5 s) held every stop that long and then killed it anyway.
    assert engine_core_exit_grace_s(EngineConfig(model="/m", accelerator="cpu")) == CPU_ENGINE_CORE_EXIT_GRACE_S
    assert CPU_ENGINE_CORE_EXIT_GRACE_S < 5.0


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_a_gpu_engine_core_keeps_vllms_own_grace(tensor_parallel_size: int) -> None:
    # A GPU engine core releases device memory on its way out (ROCm's can stay resident when it is killed).
    config = EngineConfig(model="/m", accelerator="gpu", tensor_parallel_size=tensor_parallel_size)
    assert engine_core_exit_grace_s(config) is None


class RecordingEngine:
    """Stands where vLLM's AsyncLLM would: records how it was asked to shut down."""

    def __init__(self) -> None:
        self.timeouts: list[float | None] = []

    def shutdown(self, timeout: float | None = None) -> None:
        self.timeouts.append(timeout)


@pytest.mark.parametrize("grace_s", [CPU_ENGINE_CORE_EXIT_GRACE_S, None])
def test_the_grace_reaches_vllms_shutdown(grace_s: float | None) -> None:
    engine = RecordingEngine()
    asyncio.run(shutdown_engine(cast(Any, engine), grace_s))
    assert engine.timeouts == [grace_s]
