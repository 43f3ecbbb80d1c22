"""One engine replica: a vLLM ``AsyncLLM`` and the lean streaming HTTP endpoint the gateway calls.

The host runs in a thread of its own with its own event loop, so it works the same inside a Ray Serve
replica (which only has to construct it and forward health checks) and in a plain process (benchmarks).
This module is the replica's lifecycle; the rest is one concern per module:

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

import asyncio
import logging
import os
import threading
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import uvicorn
import uvloop

from tessera.asgi import Receive, Scope, Send
from tessera.data_plane_auth import guard_from_settings
from tessera.engine.capabilities import PlatformAnswers, Resolution, ask_vllm, resolve
from tessera.engine.config import EngineConfig
from tessera.engine.drain import DrainOutcome, drain
from tessera.engine.endpoints import EngineEndpoints
from tessera.engine.heartbeat import deregister, heartbeat_loop
from tessera.engine.in_flight import InFlight, InFlightRequests
from tessera.engine.index_feed import index_feed_loop
from tessera.engine.ports import below_ephemeral_range, free_port, kv_events_bind_endpoint, reserve_port
from tessera.engine.root_cause import EngineErrorLog, start_failure_line
from tessera.engine.speculation_control import SpeculationControl, speculation_control_for, speculation_loop
from tessera.engine.stats import EngineLoad, LoadTracker
from tessera.engine.tokenizer_source import published_tokenizer_dir
from tessera.engine.usage_record import RecorderConfig, UsageRecord, UsageRecorder
from tessera.engine.vllm_engine import build_engine, log_fallbacks, prepare_environment, shutdown_engine, warm_up
from tessera.engine.vllm_metrics import VllmMetrics
from tessera.registry import EngineRecord, ModelInfo
from tessera.routing.indexer import FeedStats
from tessera.settings import load_settings
from tessera.telemetry.tracing import configure_tracing

logger = logging.getLogger(__name__)

__all__ = ["EngineHost", "EngineStartError"]


class EngineStartError(RuntimeError):
    """An engine replica could not start; the message names the root cause and, where known, the fix."""


class EngineHost:
    """Owns the engine, the HTTP server and the registry heartbeat of one replica."""

    def __init__(self, config: EngineConfig, redis_url: str | None, engine_id: str | None = None,
                 advertise_host: str = "127.0.0.1",
                 ask_platform: Callable[[EngineConfig], PlatformAnswers] = ask_vllm) -> None:
        self.config = config  # as requested; ``resolution.config`` is what runs
        self._ask_platform = ask_platform
        self.resolution = Resolution(config)
        self.redis_url = redis_url
        self.engine_id = engine_id or f"engine-{uuid.uuid4().hex[:8]}"
        self.advertise_host = advertise_host
        # Before any port is taken: a replica without the data-plane key does not start (it would serve anyone).
        guard = guard_from_settings(load_settings())
        # The replica's HTTP endpoint and its KV-event publisher listen on the address it is called at (the pod
        # IP in the chart, loopback locally), never on every interface, unless the config says so.
        self.bind_host = config.http_host or advertise_host
        # Held from here until the server listens on it (see reserve_port).
        self._http_socket = (reserve_port(self.bind_host, f"{config.http_port}-{config.http_port}")
                             if config.http_port else
                             reserve_port(self.bind_host, os.environ.get("TESSERA_ENGINE_PORT_RANGE")))
        self.port = int(self._http_socket.getsockname()[1])
        self.kv_events_port = (free_port(self.bind_host, os.environ.get("TESSERA_KV_EVENTS_PORT_RANGE")
                                         or below_ephemeral_range())
                               if config.kv_events.enabled else 0)
        self.tracker = LoadTracker()
        self.vllm_metrics = VllmMetrics()  # vLLM's own vllm:* series of this replica, on /metrics
        self.in_flight = InFlightRequests()
        self.index_stats = FeedStats()  # the prefix-index feed's counters (tests, debugging)
        self.endpoints = EngineEndpoints(self, self.in_flight, config.max_body_bytes, guard)
        self.engine: Any = None  # vLLM's AsyncLLM once started
        self.speculation: SpeculationControl | None = None  # adaptive speculation, once the engine runs
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._error_log: EngineErrorLog | None = None
        self._server: uvicorn.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the host thread's loop, once it runs
        self._background_tasks: list[asyncio.Task[None]] = []  # heartbeat, index feed, speculation
        # What each ended request used, written to Redis for the gateways' settler (usage_record.py).
        settings = load_settings()
        self.usage_records = UsageRecorder(RecorderConfig(settings.engine_usage_flush_s,
                                                          settings.engine_usage_record_ttl_s))
        self.in_flight.on_end = self._request_ended

    # ---- what the replica is ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.advertise_host}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://{self.advertise_host}:{self.kv_events_port}" if self.kv_events_port else ""

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

    def start(self, timeout_s: float = 600.0) -> EngineHost:
        """Starts the engine thread and waits until the engine is up and the endpoint listens."""
        settings = load_settings()
        configure_tracing("tessera-engine", settings.trace_exporter, settings.trace_dir, settings.otlp_endpoint,
                          settings.trace_sample_ratio)
        self._thread = threading.Thread(target=self._thread_main, name=f"tessera-{self.engine_id}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"engine {self.engine_id} did not start within {timeout_s} s")
        if self._startup_error is not None:
            cause = self._startup_error
            child_cause = self._error_log.cause() if self._error_log is not None else None
            raise EngineStartError(f"engine {self.engine_id} could not start: "
                                   f"{start_failure_line(cause, child_cause)}") from cause
        return self

    def stop(self, force: bool = False) -> None:
        """Stops the server: it closes its socket and finishes the responses under way (``force``: cuts them)."""
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = force
        if self._thread is not None:
            self._thread.join(timeout=30)

    def drain(self, timeout_s: float | None = None) -> DrainOutcome | None:
        """Leaves the registry, finishes the open requests (at most ``timeout_s``, default the config's
        drainTimeoutS) and stops (drain.py). Blocks the caller; None where the host was not running."""
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive() or self._server is None:
            self.stop()
            return None
        max_age_s = load_settings().registry_max_age_s
        running = asyncio.run_coroutine_threadsafe(
            drain(lambda: len(self.in_flight), self._leave_registry, max_age_s, timeout_s), loop)
        outcome = running.result(timeout=timeout_s + 30)
        if outcome.drained:
            logger.info("engine %s drained in %.1f s", self.engine_id, outcome.waited_s)
        else:
            logger.warning("engine %s: drain timed out after %.1f s (drainTimeoutS) with %d requests open; "
                           "they are cut", self.engine_id, outcome.waited_s, outcome.num_cut)
        self.stop(force=not outcome.drained)
        return outcome

    async def _leave_registry(self) -> None:
        """The background loops end (no heartbeat, index feed or speculation control after this; a beat after
        the deregistration would register the replica again), then it leaves the registry and prefix index."""
        for task in self._background_tasks:
            task.cancel()
        await asyncio.gather(*self._background_tasks, return_exceptions=True)
        if self.redis_url:
            await deregister(self.redis_url, self.engine_id)

    def _thread_main(self) -> None:
        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:
            self._startup_error = self._startup_error or exc
            logger.exception("engine host %s stopped with an error", self.engine_id)
        finally:
            self._ready.set()
            self._http_socket.close()  # no-op once the server owns and closed it
            if self.engine is not None:
                # Inside the loop: vLLM closes its asyncio ZMQ sockets only from a running loop (from outside
                # it schedules the close on this loop, which never runs again), and a ZMQ context with open
                # sockets hangs the process when it is garbage-collected.
                loop.run_until_complete(shutdown_engine(self.engine))
            loop.close()

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

        config = uvicorn.Config(
            self.asgi, host=self.bind_host, port=self.port, loop="none", http="httptools",
            log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=300,
            interface="asgi3", proxy_headers=False,
        )
        # NOTE: uvicorn installs no signal handlers off the main thread: the host's owner handles signals.
        self._server = uvicorn.Server(config)
        self._background_tasks = [asyncio.create_task(coro) for coro in self._background()]
        tasks = [asyncio.create_task(self._ready_when_listening()), *self._background_tasks]
        try:
            await self._server.serve(sockets=[self._http_socket])
        finally:
            for task in tasks:
                task.cancel()
            if self.redis_url:
                await deregister(self.redis_url, self.engine_id)

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
                                self.record)]
        if self.kv_events_port:
            local = "127.0.0.1" if self.bind_host == "0.0.0.0" else self.bind_host
            loops.append(index_feed_loop(self.redis_url, self.engine_id, f"tcp://{local}:{self.kv_events_port}",
                                         self.config.kv_events.topic, self.index_stats))
        return loops

    def _request_ended(self, entry: InFlight) -> None:
        if entry.stats is not None and self.redis_url:
            self.usage_records.add(UsageRecord(entry.request_id, entry.stats.num_prompt_tokens,
                                               entry.stats.num_output_tokens))

    async def _ready_when_listening(self) -> None:
        assert self._server is not None
        while not self._server.started:
            await asyncio.sleep(0.02)
        self._ready.set()
