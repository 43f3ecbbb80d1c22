"""Engine-wide load and counters, captured from vLLM's stat-logger hook in the frontend process."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase


@dataclass(slots=True)
class EngineLoad:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_gpu_blocks: int = 0
    block_size: int = 0
    kv_cache_dtype: str = ""
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0


class LoadTracker:
    """Thread-safe holder: vLLM writes from its output loop, the heartbeat and /stats read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.load = EngineLoad()

    def snapshot(self) -> EngineLoad:
        with self._lock:
            return EngineLoad(**{f: getattr(self.load, f) for f in EngineLoad.__slots__})  # type: ignore[attr-defined]

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        with self._lock:
            if scheduler_stats is not None:
                self.load.num_running = scheduler_stats.num_running_reqs
                self.load.num_waiting = scheduler_stats.num_waiting_reqs
                self.load.kv_cache_usage = scheduler_stats.kv_cache_usage
                spec = scheduler_stats.spec_decoding_stats
                if spec is not None:
                    self.load.spec_num_drafts += spec.num_drafts
                    self.load.spec_draft_tokens += spec.num_draft_tokens
                    self.load.spec_accepted_tokens += spec.num_accepted_tokens
                prefix = scheduler_stats.prefix_cache_stats
                if prefix is not None:
                    self.load.prefix_queries += prefix.queries
                    self.load.prefix_hits += prefix.hits
            if iteration_stats is not None:
                self.load.num_preemptions += getattr(iteration_stats, "num_preempted_reqs", 0)


def make_stat_logger_factory(tracker: LoadTracker) -> type[StatLoggerBase]:
    """vLLM builds stat loggers from a factory taking (vllm_config, engine_index); bind our tracker."""

    class _TrackerLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            cache = vllm_config.cache_config
            with tracker._lock:
                tracker.load.num_gpu_blocks = int(cache.num_gpu_blocks or 0)
                tracker.load.block_size = int(cache.block_size)
                tracker.load.kv_cache_dtype = str(cache.cache_dtype)
            self._cache = cache

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
        ) -> None:
            tracker.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            # The block count is known only after the engine profiled memory.
            with tracker._lock:
                tracker.load.num_gpu_blocks = int(self._cache.num_gpu_blocks or 0)

    return _TrackerLogger
