"""A simulated engine hosted by a Ray Serve replica: what ``engine/host.py`` is to vLLM, for ``backend: sim``.

The replica is the same ``EngineReplica`` deployment (engine/deployment.py), placed by the same code
(engine/placement.py: its GPUs, or a placement group for tensor parallelism, asked of Ray though nothing
uses them), registered by the same heartbeat (engine/heartbeat.py), leaving the registry and the prefix index
the same way on a drain (engine/drain.py) or a stop (the lifecycle it shares with ``EngineHost``,
engine/replica_lifecycle.py), and replaced by Ray when it dies. Only the engine differs: one ``SimEngine``
(engine/sim/engine.py) stepped in simulated time, publishing vLLM-format KV events on its own ZMQ PUB socket,
behind the simulated replica's routes (engine/sim/server.py).

NOTE: nothing this module imports loads vLLM (engine/host.py and engine/stats.py do, at import): a
simulated replica starts in about a second and a few tens of MB beyond Ray's own worker, so a local Ray
cluster holds 64+ of them. Its prefix-index feed is the real one (engine/index_feed.py's ``index_feed_loop``)
over the hashes-only ``KVEventSubscriber`` (``with_blocks=False``), which does not import vLLM.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from tessera.data_plane_auth import guard_from_settings
from tessera.engine.config import EngineConfig, KVCacheDtype
from tessera.engine.heartbeat import heartbeat_loop
from tessera.engine.index_feed import index_feed_loop
from tessera.engine.replica_lifecycle import ThreadedReplicaHost
from tessera.engine.sim.config import SimEngineConfig
from tessera.engine.sim.engine import SimClock, SimEngine
from tessera.engine.sim.kv_wire import KVEvent, KVEventPublisher
from tessera.engine.sim.server import SimEndpoints
from tessera.engine.sim.step_time import MeasuredStepTime, RooflineStepTime
from tessera.engine.tokenizer_source import published_tokenizer_dir
from tessera.registry import EngineRecord, ModelInfo
from tessera.routing.indexer import FeedStats
from tessera.routing.kv_events import KVEventSubscriber
from tessera.settings import load_settings

logger = logging.getLogger(__name__)

__all__ = ["SimLoad", "SimReplicaHost", "sim_engine_config"]


def _roofline_kv_dtype(kv_cache_dtype: KVCacheDtype) -> str:
    # 'auto' is the model's own dtype, bf16 for the planner's presets.
    return "bf16" if kv_cache_dtype == "auto" else "fp8"


def sim_engine_config(config: EngineConfig, http_host: str = "127.0.0.1",
                      advertise_host: str = "127.0.0.1") -> SimEngineConfig:
    """The simulated engine of a ``backend: sim`` replica: the settings a vLLM replica shares with it taken
    from ``config`` itself, the rest from ``config.sim`` (ValueError, pydantic's, where they do not fit)."""
    sim = config.sim_settings
    step_time: RooflineStepTime | MeasuredStepTime
    if sim.step_time == "roofline":
        defaults = {"compute_efficiency": sim.compute_efficiency, "memory_efficiency": sim.memory_efficiency,
                    "step_overhead_s": sim.step_overhead_s}
        step_time = RooflineStepTime.model_validate({
            "gpu": sim.gpu, "model": sim.model_preset, "tensor_parallel_size": config.tensor_parallel_size,
            "weight_dtype": sim.weight_dtype, "kv_cache_dtype": _roofline_kv_dtype(config.kv_cache_dtype),
            **{name: value for name, value in defaults.items() if value is not None}})
    else:
        step_time = MeasuredStepTime(step_s=sim.step_s or 0.0, per_seq_s=sim.per_seq_s or 0.0,
                                     per_prefill_token_s=sim.per_prefill_token_s or 0.0)
    fields: dict[str, Any] = {
        "served_model_name": config.served_model_name, "tokenizer": config.tokenizer_path,
        "max_model_len": config.max_model_len, "block_size": config.block_size,
        "num_gpu_blocks": config.num_gpu_blocks_override, "max_num_seqs": config.max_num_seqs,
        "enable_chunked_prefill": sim.enable_chunked_prefill, "enable_prefix_caching": config.enable_prefix_caching,
        "scheduling_policy": config.scheduling_policy, "step_time": step_time, "time_scale": sim.time_scale,
        "http_host": http_host, "advertise_host": advertise_host, "heartbeat_interval_s": config.heartbeat_interval_s,
        "feed_index": config.kv_events.enabled, "max_body_bytes": config.max_body_bytes,
    }
    if config.max_num_batched_tokens is not None:
        fields["max_num_batched_tokens"] = config.max_num_batched_tokens
    return SimEngineConfig(**fields)


@dataclass(frozen=True, slots=True)
class SimLoad:
    """The replica's load as the deployment reads it (engine/stats.py's ``EngineLoad`` imports vLLM)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float


class SimReplicaHost(ThreadedReplicaHost):
    """Owns one simulated engine, its HTTP server, KV-event publisher, registry heartbeat and index feed, in a
    thread of its own with its own event loop (as ``EngineHost``: the Serve replica only constructs it and
    forwards health checks)."""

    kind = "simulated engine"

    def __init__(self, config: EngineConfig, redis_url: str | None, engine_id: str | None = None,
                 advertise_host: str = "127.0.0.1") -> None:
        if config.backend != "sim":
            raise ValueError(f"a simulated replica needs backend 'sim', not {config.backend!r}")
        # As a real replica: no data-plane key, no replica; it binds the address it registers. Both are checked
        # before the port is taken.
        guard = guard_from_settings(load_settings(), "a simulated replica")
        self.sim_config = sim_engine_config(config, config.http_host or advertise_host, advertise_host)
        super().__init__(config, redis_url, engine_id or f"sim-{uuid.uuid4().hex[:10]}", advertise_host)
        self.clock = SimClock(self.sim_config.time_scale)
        self.engine = SimEngine(self.sim_config, self.engine_id, self.clock, publish=self._publish)
        self.endpoints = SimEndpoints(self.engine, config.served_model_name, config.max_body_bytes, guard)
        self.in_flight = self.endpoints.in_flight
        self.index_stats = FeedStats()
        self._zmq: zmq.Context[Any] | None = None  # the host thread's, while it serves
        self._publisher: KVEventPublisher | None = None
        self._engine_task: asyncio.Task[None] | None = None

    # ---- what the replica is ---------------------------------------------------------------------

    def is_healthy(self) -> bool:
        """Alive while its thread runs and its engine steps (a step loop that raised is a dead engine)."""
        task = self._engine_task
        alive = self._thread is not None and self._thread.is_alive()
        return bool(alive and task is not None and not task.done())

    def load(self) -> SimLoad:
        return SimLoad(self.engine.num_running, self.engine.num_waiting, self.engine.kv_cache_usage)

    def record(self) -> EngineRecord:
        """The replica's registry entry (what the heartbeat writes), as ``SimReplica.record`` in a fleet."""
        engine = self.engine
        kv_dtype = getattr(self.sim_config.step_time, "kv_cache_dtype", "")
        return EngineRecord(
            engine_id=self.engine_id, url=self.url, model=self.config.served_model_name,
            block_size=self.config.block_size, num_gpu_blocks=engine.num_gpu_blocks,
            max_model_len=self.config.max_model_len, kv_events_endpoint=self.kv_events_endpoint,
            num_running=engine.num_running, num_waiting=engine.num_waiting, kv_cache_usage=engine.kv_cache_usage,
            kv_cache_dtype=str(kv_dtype), kv_capacity_tokens=(engine.num_gpu_blocks - 1) * self.config.block_size,
        )

    def model_info(self) -> ModelInfo:
        tokenizer = published_tokenizer_dir(self.config.tokenizer_path) or self.config.tokenizer_path
        return ModelInfo(name=self.config.served_model_name, tokenizer=tokenizer,
                         max_model_len=self.config.max_model_len, block_size=self.config.block_size)

    def _publish(self, ts: float, events: list[KVEvent]) -> None:
        if self._publisher is not None:
            self._publisher.publish(ts, events)

    # ---- lifecycle (the rest is ThreadedReplicaHost's) ------------------------------------------------

    async def _serve(self) -> None:
        context: zmq.Context[Any] = zmq.Context()
        self._zmq = context
        if self.config.kv_events.enabled:
            # Bound here, in the thread that publishes (a ZMQ socket belongs to one thread).
            self._publisher = KVEventPublisher(context, f"tcp://{self.bind_host}:*", self.config.kv_events.topic)
            self.kv_events_port = int(self._publisher.endpoint.rsplit(":", 1)[1])
        self._engine_task = asyncio.create_task(self.engine.run())
        try:
            await self._serve_http(self.endpoints.asgi, [self._engine_task])
        finally:
            publisher, self._publisher = self._publisher, None
            if publisher is not None:
                publisher.close()
            # Every socket on it is closed by now: the index feed's closes its own as its task ends.
            context.term()

    def _background(self) -> list[Coroutine[Any, Any, None]]:
        """The registry heartbeat and the prefix-index feed, as a vLLM replica's host runs them."""
        if not self.redis_url:
            return []
        loops = [heartbeat_loop(self.redis_url, self.config.heartbeat_interval_s, self.model_info(),
                                self.is_healthy, self.record, lambda: self.leaving)]
        if self.kv_events_port and self.sim_config.feed_index:
            assert self._zmq is not None  # made by _serve, which calls this
            local = "127.0.0.1" if self.bind_host == "0.0.0.0" else self.bind_host
            endpoint, events_context = f"tcp://{local}:{self.kv_events_port}", zmq.asyncio.Context.shadow(self._zmq)
            loops.append(index_feed_loop(
                self.redis_url, self.engine_id,
                lambda: KVEventSubscriber(endpoint, with_blocks=False, context=events_context), self.index_stats))
        return loops
