"""Many simulated replicas in one process: one asyncio loop, one HTTP port and one KV-event publisher
each, one shared clock.

Each replica does what a real one's host does (``engine/host.py``): it serves its routes, heartbeats its
``EngineRecord`` into the registry (``engine/heartbeat.py``, the real loop), feeds the prefix index from
its own KV events (``engine/index_feed.py``, the real loop, subscribing to the sim's publisher) and, when
stopped, leaves the registry and clears its index entries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Generator
from typing import Any

import uvicorn
import zmq

from tessera.engine.heartbeat import deregister, heartbeat_loop
from tessera.engine.index_feed import index_feed_loop
from tessera.engine.ports import reserve_port
from tessera.engine.sim.config import SimEngineConfig
from tessera.engine.sim.engine import SimClock, SimEngine
from tessera.engine.sim.kv_wire import KVEventPublisher
from tessera.engine.sim.server import SimEndpoints
from tessera.registry import EngineRecord, ModelInfo
from tessera.routing.indexer import FeedStats

logger = logging.getLogger(__name__)


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signals alone: a fleet has hundreds in one thread, its owner handles
    SIGTERM once for all of them."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class SimReplica:
    def __init__(self, config: SimEngineConfig, clock: SimClock, zmq_context: zmq.Context[Any],
                 redis_url: str | None, engine_id: str | None = None) -> None:
        self.config = config
        self.engine_id = engine_id or f"sim-{uuid.uuid4().hex[:10]}"
        self.redis_url = redis_url
        self.publisher = KVEventPublisher(zmq_context, f"tcp://{config.http_host}:*")
        port = self.publisher.endpoint.rsplit(":", 1)[1]
        self.kv_events_endpoint = f"tcp://{config.advertise_host}:{port}"
        self.engine = SimEngine(config, self.engine_id, clock, publish=self.publisher.publish)
        self.endpoints = SimEndpoints(self.engine, config.served_model_name, config.max_body_bytes)
        self._socket = reserve_port(config.http_host)
        self.port = int(self._socket.getsockname()[1])
        self.url = f"http://{config.advertise_host}:{self.port}"
        self.feed_stats = FeedStats()
        self._server = _QuietServer(uvicorn.Config(
            self.endpoints.asgi, host=config.http_host, port=self.port, loop="none", http="httptools",
            log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=300, interface="asgi3"))
        self._tasks: list[asyncio.Task[None]] = []

    def record(self) -> EngineRecord:
        engine = self.engine
        return EngineRecord(
            engine_id=self.engine_id, url=self.url, model=self.config.served_model_name,
            block_size=self.config.block_size, num_gpu_blocks=engine.num_gpu_blocks,
            max_model_len=self.config.max_model_len, kv_events_endpoint=self.kv_events_endpoint,
            num_running=engine.num_running, num_waiting=engine.num_waiting, kv_cache_usage=engine.kv_cache_usage,
            kv_cache_dtype=str(getattr(self.config.step_time, "kv_cache_dtype", "")),
            kv_capacity_tokens=(engine.num_gpu_blocks - 1) * self.config.block_size,
        )

    def model_info(self) -> ModelInfo:
        return ModelInfo(name=self.config.served_model_name, tokenizer=self.config.tokenizer,
                         max_model_len=self.config.max_model_len, block_size=self.config.block_size)

    async def start(self) -> None:
        """Serves, steps and (with Redis) heartbeats and feeds the index; returns once listening."""
        self._tasks.append(asyncio.create_task(self.engine.run()))
        self._tasks.append(asyncio.create_task(self._server.serve(sockets=[self._socket])))
        if self.redis_url:
            if self.config.feed_index:
                # As the real host: the feed subscribes (and clears this id's old entries) before the first
                # heartbeat makes the replica routable.
                self._tasks.append(asyncio.create_task(index_feed_loop(
                    self.redis_url, self.engine_id, self.kv_events_endpoint, "", self.feed_stats)))
            self._tasks.append(asyncio.create_task(heartbeat_loop(
                self.redis_url, self.config.heartbeat_interval_s, self.model_info(), lambda: True, self.record)))
        while not self._server.started:
            if self._tasks[1].done():
                self._tasks[1].result()  # raises why the server did not start
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        for task in self._tasks:
            if task is not self._tasks[1]:
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.publisher.close()
        if self.redis_url:
            await deregister(self.redis_url, self.engine_id)


class SimFleet:
    """``num_engines`` replicas sharing one clock and one ZMQ context."""

    def __init__(self, config: SimEngineConfig, num_engines: int, redis_url: str | None,
                 engine_id_prefix: str = "sim") -> None:
        if num_engines < 1:
            raise ValueError("a fleet needs num_engines >= 1")
        self.clock = SimClock(config.time_scale)
        self._zmq = zmq.Context()
        run_id = uuid.uuid4().hex[:6]
        self.replicas = [SimReplica(config, self.clock, self._zmq, redis_url, f"{engine_id_prefix}-{run_id}-{i}")
                         for i in range(num_engines)]

    async def start(self) -> SimFleet:
        await asyncio.gather(*(replica.start() for replica in self.replicas))
        return self

    async def stop(self) -> None:
        await asyncio.gather(*(replica.stop() for replica in self.replicas), return_exceptions=True)
        self._zmq.term()
