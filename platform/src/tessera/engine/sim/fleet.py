"""Many simulated replicas in one process: one asyncio loop, one HTTP port and one KV-event publisher
each, one shared clock.

The fleet does for each replica what a real one's host does (``engine/host.py``): the replica serves its
routes; with Redis, its ``EngineRecord`` is heartbeaten into the registry, its own KV events (read from
its publisher by a subscriber, as the real feed reads vLLM's) feed the prefix index, and on stop it leaves
the registry and the index — over connections the fleet shares (``fleet_redis.py`` says why).
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

from tessera.data_plane_auth import ReplicaGuard, guard_from_settings
from tessera.engine.ports import reserve_port
from tessera.engine.sim.config import SimEngineConfig
from tessera.engine.sim.engine import SimClock, SimEngine
from tessera.engine.sim.fleet_redis import FedEngine, FleetRedis
from tessera.engine.sim.kv_wire import KVEventPublisher
from tessera.engine.sim.server import SimEndpoints
from tessera.registry import EngineRecord, ModelInfo
from tessera.routing.indexer import FeedStats
from tessera.settings import load_settings
from tessera.wake_grid import WakeableSleep

logger = logging.getLogger(__name__)


# How often a replica's server ticks (refreshes its Date header, looks at should_exit): uvicorn ticks ten times a
# second, and 1,000 replicas' ticks were a tenth of the fleet's one event loop.
SERVER_TICK_S = 1.0


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signals alone (a fleet has hundreds in one thread, its owner handles
    SIGTERM once for all of them) and ticks once a second, woken at once by ``exit``."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._tick_sleep = WakeableSleep()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def main_loop(self) -> None:
        counter = 0  # on_tick refreshes the Date header where counter % 10 == 0: every tick here
        while not await self.on_tick(counter):
            await self._tick_sleep.sleep(SERVER_TICK_S)
            counter += 10

    def exit(self) -> None:
        self.should_exit = True
        self._tick_sleep.wake()


class SimReplica:
    def __init__(self, config: SimEngineConfig, clock: SimClock, zmq_context: zmq.Context[Any],
                 engine_id: str | None = None, guard: ReplicaGuard | None = None) -> None:
        self.config = config
        self.engine_id = engine_id or f"sim-{uuid.uuid4().hex[:10]}"
        self.publisher = KVEventPublisher(zmq_context, f"tcp://{config.http_host}:*")
        port = self.publisher.endpoint.rsplit(":", 1)[1]
        self.kv_events_endpoint = f"tcp://{config.advertise_host}:{port}"
        self.engine = SimEngine(config, self.engine_id, clock, publish=self.publisher.publish)
        self.endpoints = SimEndpoints(self.engine, config.served_model_name, config.max_body_bytes,
                                      guard or guard_from_settings(load_settings(), "a simulated replica"))
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
            pending_prefill_tokens=engine.pending_prefill_tokens,
            kv_cache_dtype=str(getattr(self.config.step_time, "kv_cache_dtype", "")),
            kv_capacity_tokens=(engine.num_gpu_blocks - 1) * self.config.block_size,
        )

    def model_info(self) -> ModelInfo:
        return ModelInfo(name=self.config.served_model_name, tokenizer=self.config.tokenizer,
                         max_model_len=self.config.max_model_len, block_size=self.config.block_size)

    def fed(self) -> FedEngine:
        return FedEngine(self.engine_id, self.kv_events_endpoint, self.record, self.feed_stats)

    async def start(self) -> None:
        """Serves and steps; returns once listening."""
        self._tasks.append(asyncio.create_task(self.engine.run()))
        self._tasks.append(asyncio.create_task(self._server.serve(sockets=[self._socket])))
        while not self._server.started:
            if self._tasks[1].done():
                self._tasks[1].result()  # raises why the server did not start
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.exit()
        for task in self._tasks:
            if task is not self._tasks[1]:
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.publisher.close()


class SimFleet:
    """``num_engines`` replicas sharing one clock and one ZMQ context."""

    def __init__(self, config: SimEngineConfig, num_engines: int, redis_url: str | None,
                 engine_id_prefix: str = "sim") -> None:
        if num_engines < 1:
            raise ValueError("a fleet needs num_engines >= 1")
        self.config = config
        self.clock = SimClock(config.time_scale)
        self._zmq = zmq.Context()
        run_id = uuid.uuid4().hex[:6]
        guard = guard_from_settings(load_settings(), "a simulated replica")  # one for the fleet: one key
        self.replicas = [SimReplica(config, self.clock, self._zmq, f"{engine_id_prefix}-{run_id}-{i}", guard)
                         for i in range(num_engines)]
        self._redis = (FleetRedis(redis_url, [r.fed() for r in self.replicas], [self.replicas[0].model_info()],
                                  config.heartbeat_interval_s) if redis_url else None)
        self._redis_tasks: list[asyncio.Task[None]] = []

    async def start(self) -> SimFleet:
        """Serving once this returns; with Redis, registered within a heartbeat."""
        await asyncio.gather(*(replica.start() for replica in self.replicas))
        if self._redis is not None:
            if self.config.feed_index:
                # As the real host: subscribed and the old entries cleared before a heartbeat makes the
                # replicas routable.
                await self._redis.prepare_index()
                self._redis_tasks.append(asyncio.create_task(self._redis.feed_index()))
            self._redis_tasks.append(asyncio.create_task(self._redis.heartbeat()))
        return self

    async def stop(self) -> None:
        for task in self._redis_tasks:
            task.cancel()
        await asyncio.gather(*self._redis_tasks, return_exceptions=True)
        if self._redis is not None:
            await self._redis.deregister()  # out of the registry first, as a draining replica
        await asyncio.gather(*(replica.stop() for replica in self.replicas), return_exceptions=True)
        if self._redis is not None:
            await self._redis.close()
        self._zmq.term()
