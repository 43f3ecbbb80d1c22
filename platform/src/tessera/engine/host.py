"""One engine replica: a vLLM ``AsyncLLM`` and the lean streaming HTTP endpoint the gateway calls.

The host runs in a thread of its own with its own event loop, so it works the same inside a Ray Serve
replica (which only has to construct it and forward health checks) and in a plain process (benchmarks).
This module is what a vLLM replica is and how it starts and stops its engine; the rest is one concern per
module:

  replica_lifecycle.py  the host thread, start/stop/drain and the HTTP server (shared with the simulated
                   replica, engine/sim/serve_replica.py)
  vllm_engine.py   the ``AsyncLLM``: made from the resolved config, warmed up, shut down
  endpoints.py     the HTTP routes (/generate /abort /requests /health /stats /metrics)
  generation.py    one request: vLLM's stream -> protocol lines, ``RequestStats`` and its span
  in_flight.py     the requests running here, as the KV-eviction controller sees them
  heartbeat.py     the registry heartbeat and deregistration
  drain.py         leaving without failing a request (scale-down, redeploy)
  index_feed.py    the prefix-index feed from this engine's own KV events
  shm_wait.py      how long vLLM's processes busy-wait on their shared-memory queues
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, Self

from tessera.asgi import Receive, Scope, Send
from tessera.data_plane_auth import guard_from_settings
from tessera.engine.capabilities import CapabilityError, PlatformAnswers, Resolution, ask_vllm, resolve
from tessera.engine.config import EngineConfig
from tessera.engine.endpoints import EngineEndpoints
from tessera.engine.heartbeat import heartbeat_loop
from tessera.engine.in_flight import InFlight, InFlightRequests
from tessera.engine.index_feed import index_feed_loop
from tessera.engine.ports import free_port, kv_events_bind_endpoint
from tessera.engine.replica_lifecycle import ThreadedReplicaHost
from tessera.engine.root_cause import EngineErrorLog, start_failure_line
from tessera.engine.speculation_control import SpeculationControl, speculation_control_for, speculation_loop
from tessera.engine.stats import EngineLoad, LoadTracker
from tessera.engine.tokenizer_source import published_tokenizer_dir
from tessera.engine.usage_record import RecorderConfig, UsageRecord, UsageRecorder
from tessera.engine.vllm_engine import (
    build_engine,
    engine_core_exit_grace_s,
    log_fallbacks,
    prepare_environment,
    shutdown_engine,
    warm_up,
)
from tessera.engine.vllm_metrics import VllmMetrics
from tessera.registry import EngineRecord, ModelInfo
from tessera.routing.indexer import FeedStats
from tessera.routing.kv_events import KVEventSubscriber
from tessera.settings import load_settings
from tessera.telemetry.tracing import configure_tracing

logger = logging.getLogger(__name__)

__all__ = ["EngineHost", "EngineStartError"]


class EngineStartError(RuntimeError):
    """An engine replica could not start; the message names the root cause and, where known, the fix."""


class EngineConfigRefused(EngineStartError):
    """This platform refuses the config as written (a strict setting it cannot run: capabilities.py): the same
    config fails the same way here however often it is tried, so a caller that can tell stops at the first
    failure (``tessera up``, local/engine_failure.py), where Ray Serve would construct the replica again."""


def start_error(engine_id: str, cause: BaseException, child_cause: str | None) -> EngineStartError:
    """What a replica that could not start raises: the cause in a line (the engine process's own, ``child_cause``,
    where vLLM only wraps it), refused where the platform refused the config."""
    kind = EngineConfigRefused if isinstance(cause, CapabilityError) else EngineStartError
    return kind(f"engine {engine_id} could not start: {start_failure_line(cause, child_cause)}")


class EngineHost(ThreadedReplicaHost):
    """Owns the engine, the HTTP server and the registry heartbeat of one replica."""

    def __init__(self, config: EngineConfig, redis_url: str | None, engine_id: str | None = None,
                 advertise_host: str = "127.0.0.1",
                 ask_platform: Callable[[EngineConfig], PlatformAnswers] = ask_vllm) -> None:
        # Before any port is taken: a replica without the data-plane key does not start (it would serve anyone).
        guard = guard_from_settings(load_settings())
        super().__init__(config, redis_url, engine_id or f"engine-{uuid.uuid4().hex[:8]}", advertise_host)
        # ``self.config`` is the config as requested; ``resolution.config`` is what runs.
        self._ask_platform = ask_platform
        self.resolution = Resolution(config)
        self.kv_events_port = (free_port(self.bind_host, os.environ.get("TESSERA_KV_EVENTS_PORT_RANGE"))
                               if config.kv_events.enabled else 0)
        self.tracker = LoadTracker()
        self.vllm_metrics = VllmMetrics()  # vLLM's own vllm:* series of this replica, on /metrics
        self.in_flight = InFlightRequests()
        self.index_stats = FeedStats()  # the prefix-index feed's counters (tests, debugging)
        self.endpoints = EngineEndpoints(self, self.in_flight, config.max_body_bytes, guard)
        self.engine: Any = None  # vLLM's AsyncLLM once started
        self.speculation: SpeculationControl | None = None  # adaptive speculation, once the engine runs
        self._error_log: EngineErrorLog | None = None
        # What each ended request used, written to Redis for the gateways' settler (usage_record.py).
        settings = load_settings()
        self.usage_records = UsageRecorder(RecorderConfig(settings.engine_usage_flush_s,
                                                          settings.engine_usage_record_ttl_s))
        self.in_flight.on_end = self._request_ended

    # ---- what the replica is ---------------------------------------------------------------------

    @property
    def served_model_name(self) -> str:
        return self.config.served_model_name

    def is_healthy(self) -> bool:
        engine = self.engine
        alive = self._thread is not None and self._thread.is_alive()
        return bool(alive and engine is not None and not engine.errored)

    def load(self) -> EngineLoad:
        return self.tracker.snapshot()

    def facts(self, load: EngineLoad | None = None) -> dict[str, Any]:
        """What this replica runs, for /stats, /metrics and the registry: the effective KV dtype and
        capacity, the speculative method, and why any of them differ from the config."""
        load = load or self.tracker.snapshot()
        return {
            "kv_cache_dtype": self.resolution.config.kv_cache_dtype,
            "kv_cache_dtype_requested": self.config.kv_cache_dtype,
            "kv_capacity_tokens": load.num_gpu_blocks * load.block_size,
            "speculative_method": self.resolution.speculative_method,
            "fallbacks": [f.describe() for f in self.resolution.fallbacks],
            "speculation": self.speculation.facts() if self.speculation is not None else None,
        }

    def record(self) -> EngineRecord:
        """The replica's registry entry (what the heartbeat writes)."""
        load = self.tracker.snapshot()
        facts = self.facts(load)
        return EngineRecord(
            engine_id=self.engine_id,
            url=self.url,
            model=self.config.served_model_name,
            block_size=load.block_size,
            num_gpu_blocks=load.num_gpu_blocks,
            max_model_len=self.config.max_model_len,
            kv_events_endpoint=self.kv_events_endpoint,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            kv_cache_usage=load.kv_cache_usage,
            pending_prefill_tokens=self.in_flight.pending_prefill_tokens,
            kv_cache_dtype=facts["kv_cache_dtype"],
            kv_capacity_tokens=facts["kv_capacity_tokens"],
            speculative_method=facts["speculative_method"],
            fallbacks="\n".join(facts["fallbacks"]),
        )

    def model_info(self) -> ModelInfo:
        """The served model's registry entry; its tokenizer is a directory the gateways read (a hub id's
        snapshot in the Hugging Face cache, once vLLM has loaded it: see tokenizer_source.py)."""
        tokenizer = published_tokenizer_dir(self.config.tokenizer_path)
        if tokenizer is None:
            logger.warning("engine %s: no tokenizer.json for %r on this pod; gateways cannot tokenize for %s",
                           self.engine_id, self.config.tokenizer_path, self.config.served_model_name)
        return ModelInfo(name=self.config.served_model_name, tokenizer=tokenizer or self.config.tokenizer_path,
                         max_model_len=self.config.max_model_len, block_size=self.tracker.snapshot().block_size)

    async def asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The replica's HTTP application (see endpoints.py)."""
        await self.endpoints.asgi(scope, receive, send)

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self, timeout_s: float = 600.0) -> Self:
        """Starts the engine thread and waits until the engine is up and the endpoint listens."""
        settings = load_settings()
        configure_tracing("tessera-engine", settings.trace_exporter, settings.trace_dir, settings.otlp_endpoint,
                          settings.trace_sample_ratio)
        return super().start(timeout_s)

    def _start_error(self, cause: BaseException) -> Exception:
        return start_error(self.engine_id, cause, self._error_log.cause() if self._error_log is not None else None)

    async def _close_in_loop(self) -> None:
        if self.engine is not None:
            # Inside the loop: vLLM closes its asyncio ZMQ sockets only from a running loop (from outside
            # it schedules the close on this loop, which never runs again), and a ZMQ context with open
            # sockets hangs the process when it is garbage-collected.
            await shutdown_engine(self.engine, engine_core_exit_grace_s(self.resolution.config))

    async def _serve(self) -> None:
        prepare_environment(self.config)
        # Before the model loads: what this platform can run of the config (a strict config stops here).
        self.resolution = resolve(self.config, self._ask_platform(self.config))
        self._error_log = EngineErrorLog()  # where vLLM's engine process logs why it failed, if it does
        kv_bind = kv_events_bind_endpoint(self.bind_host, self.kv_events_port) if self.kv_events_port else None
        self.engine = build_engine(self.resolution, kv_bind, self.tracker, self.vllm_metrics)
        self.speculation = speculation_control_for(self.resolution.config.speculative)
        log_fallbacks(self.engine, self.engine_id, self.config, self.resolution, self.tracker)
        await warm_up(self.engine, self.engine_id)
        await self._serve_http(self.asgi, [])

    def _background(self) -> list[Coroutine[Any, Any, None]]:
        """The loops that run beside the server: speculation control, the registry heartbeat and the
        prefix-index feed."""
        loops: list[Coroutine[Any, Any, None]] = []
        spec = self.resolution.config.speculative
        if self.speculation is not None and spec is not None:
            loops.append(speculation_loop(self.speculation, self.engine, spec.adaptive.interval_s,
                                          lambda: self.tracker.snapshot().num_running))
        if not self.redis_url:
            return loops
        loops.append(self.usage_records.run(self.redis_url))
        loops += [heartbeat_loop(self.redis_url, self.config.heartbeat_interval_s, self.model_info(), self.is_healthy,
                                 self.record, lambda: self.leaving)]
        if self.kv_events_port:
            local = "127.0.0.1" if self.bind_host == "0.0.0.0" else self.bind_host
            endpoint, topic = f"tcp://{local}:{self.kv_events_port}", self.config.kv_events.topic
            # The feed needs the block hashes only, not their token ids (those are for the KV-eviction
            # controller's ledger).
            loops.append(index_feed_loop(self.redis_url, self.engine_id,
                                         lambda: KVEventSubscriber(endpoint, topic, with_blocks=False),
                                         self.index_stats))
        return loops

    def _request_ended(self, entry: InFlight) -> None:
        if entry.stats is not None and self.redis_url:
            self.usage_records.add(UsageRecord(entry.request_id, entry.stats.num_prompt_tokens,
                                               entry.stats.num_output_tokens))
