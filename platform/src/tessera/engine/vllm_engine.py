"""vLLM's ``AsyncLLM`` for one replica: made from the resolved config, warmed up, shut down.

Everything here runs on the host's event-loop thread.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm import AsyncEngineArgs, SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM

from tessera.engine import shm_wait
from tessera.engine.capabilities import Resolution, kv_fallback_note
from tessera.engine.config import EngineConfig
from tessera.engine.stats import LoadTracker, make_stat_logger_factory
from tessera.engine.vllm_metrics import VllmMetrics

logger = logging.getLogger(__name__)

# One forward pass before the endpoint opens. Found on this project's CI machine kind (Xeon with AMX, in a
# VM, vLLM 0.32 CPU build): when the engine's first pass has fewer than 5 tokens, its worker dies with
# SIGILL (exit code -4) and the engine is dead; after any first pass of 5 or more tokens, prompts of one
# token run. Fewer tokens than a KV block (32 on CPU), so nothing lands in the prefix cache, and a salt no
# tenant has.
WARMUP_PROMPT_TOKENS = 16
WARMUP_SALT = "tessera-engine-warmup"


def shm_busy_loop_s(config: EngineConfig) -> float:
    """``config.shm_busy_loop_s``, or its platform default (see its description)."""
    if config.shm_busy_loop_s is not None:
        return config.shm_busy_loop_s
    return 0.0 if config.placed_on == "cpu" else 1.0


def prepare_environment(config: EngineConfig) -> None:
    """What vLLM reads from the environment, set before it starts (its processes inherit it)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.cpu_kv_cache_space_gib))
    os.environ[shm_wait.ENV] = str(shm_busy_loop_s(config))
    if config.runs_model_in_engine_core:
        # NOTE: vLLM's CPU platform turns the "uni" executor into "mp" unless this is "0" (platforms/cpu.py,
        # check_and_update_config); elsewhere vLLM 0.32 reads it only in the synchronous LLMEngine, which no
        # replica uses. The engine-core process is still its own: AsyncLLM always starts one.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    shm_wait.install()  # this process's own queues (vLLM's spawned processes: its plugin, see shm_wait.py)


def build_engine(resolution: Resolution, kv_events_bind: str | None, tracker: LoadTracker,
                 vllm_metrics: VllmMetrics) -> AsyncLLM:
    """The engine for what this platform runs of the config; its load and KV geometry go to ``tracker``,
    vLLM's own Prometheus metrics to ``vllm_metrics`` (see vllm_metrics.py)."""
    args = AsyncEngineArgs(**resolution.config.to_vllm_kwargs(kv_events_endpoint=kv_events_bind))
    engine = AsyncLLM.from_engine_args(args, stat_loggers=[make_stat_logger_factory(tracker),
                                                           vllm_metrics.stat_logger])
    cache = engine.vllm_config.cache_config
    tracker.load.num_gpu_blocks = int(cache.num_gpu_blocks or 0)
    tracker.load.block_size = int(cache.block_size)
    tracker.load.kv_cache_dtype = str(cache.cache_dtype)
    return engine


def log_fallbacks(engine: AsyncLLM, engine_id: str, requested: EngineConfig, resolution: Resolution,
                  tracker: LoadTracker) -> None:
    """One line per setting that runs differently from the config; the KV line says what it costs."""
    load = tracker.snapshot()
    for fallback in resolution.fallbacks:
        if fallback.setting == "kvCacheDtype":
            element: Any = engine.vllm_config.model_config.dtype  # a torch.dtype once resolved
            logger.warning("engine %s: %s", engine_id, kv_fallback_note(
                fallback, str(element).removeprefix("torch."), element.itemsize, load.num_gpu_blocks,
                load.block_size, blocks_fixed=requested.num_gpu_blocks_override is not None))
        else:
            logger.warning("engine %s: %s", engine_id, fallback.describe())


async def warm_up(engine: AsyncLLM, engine_id: str) -> None:
    """See WARMUP_PROMPT_TOKENS; also takes the first pass's one-time costs off the first request."""
    prompt: Any = {"prompt_token_ids": list(range(1, WARMUP_PROMPT_TOKENS + 1)), "cache_salt": WARMUP_SALT}
    async for _ in engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0),
                                   request_id=f"{engine_id}-warmup"):
        pass


# How long vLLM's engine-core process may take to exit after its SIGTERM before vLLM kills it, on the CPU
# build. Its graceful exit there only does what the OS does anyway when the process ends (three full garbage
# collections of its heap, then the interpreter's teardown): 5-6 s on a 2-vCPU VM, so vLLM's default grace
# (5 s) ended in the kill on every stop, after holding the replica's stop (and the pod's, and Serve's
# scale-down) for those 5 s. The requests are aborted as the SIGTERM lands, whatever the grace.
CPU_ENGINE_CORE_EXIT_GRACE_S = 0.5


def engine_core_exit_grace_s(config: EngineConfig) -> float | None:
    """The engine-core process's exit grace for ``config``; None: vLLM's own (5 s; longer on ROCm, whose
    device memory can stay resident when a process is killed in its teardown)."""
    return CPU_ENGINE_CORE_EXIT_GRACE_S if config.placed_on == "cpu" else None


async def shutdown_engine(engine: AsyncLLM, exit_grace_s: float | None) -> None:
    # A coroutine, run on the host's loop: vLLM closes its asyncio ZMQ sockets only from a running loop.
    engine.shutdown(timeout=exit_grace_s)
