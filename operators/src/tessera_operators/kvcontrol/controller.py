"""The controller process: discovers engines in the Redis registry and runs one control loop per engine."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from tessera.data_plane_auth import signer_from_settings
from tessera.redis_conn import connect
from tessera.registry import EngineRecord, EngineRegistry
from tessera.swallowed_cancel import raise_if_cancelled
from tessera.tenancy.store import TenantStore

from .directory import DemotionBook, TenantDirectory
from .loop import EngineControlLoop, LoopContext
from .metrics import ControllerMetrics
from .settings import KVControlSettings
from .sharding import shard_of

logger = logging.getLogger(__name__)

# How long an engine may be missing from the registry before its loop stops (and its flags are released).
ENGINE_GONE_GRACE_S = 15.0


class KVController:
    """``start()`` in a running event loop, ``stop()`` to end every loop and release every flag."""

    def __init__(self, settings: KVControlSettings, metrics: ControllerMetrics | None = None) -> None:
        if not settings.redis_url:
            raise ValueError("TESSERA_REDIS_URL is not set: the controller reads engines and tenants from Redis")
        self.settings = settings
        # Polls and aborts are signed: replicas refuse unsigned calls, so no key means no controller.
        self.signer = signer_from_settings(settings, "the KV controller")
        self.metrics = metrics or ControllerMetrics()
        self.loops: dict[str, EngineControlLoop] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._supervisor: asyncio.Task[None] | None = None
        self._missing_since: dict[str, float] = {}
        self.ctx: LoopContext | None = None

    async def start(self) -> KVController:
        settings = self.settings
        assert settings.redis_url is not None
        redis = connect(settings.redis_url, timeout_s=5.0)
        self.ctx = LoopContext(
            redis=redis, http=aiohttp.ClientSession(), tenants=TenantDirectory(TenantStore(redis),
                                                                               settings.kvcontrol_tenant_refresh_s),
            demotions=DemotionBook(), metrics=self.metrics, policy=settings.kvcontrol_policy,
            poll_interval_s=settings.kvcontrol_poll_interval_s, flag_ttl_s=settings.kvcontrol_flag_ttl_s,
            observe_only=settings.kvcontrol_observe_only, shard=settings.kvcontrol_shard,
            signer=self.signer,
        )
        await self.ctx.tenants.refresh(force=True)
        await self.discover()
        self._supervisor = asyncio.create_task(self._supervise())
        return self

    async def stop(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        for engine_id in list(self._tasks):
            await self._stop_loop(engine_id)
        if self.ctx is not None:
            await self.ctx.http.close()
            await self.ctx.redis.aclose()

    async def _supervise(self) -> None:
        """Everything the loops need from Redis, read here on its own cadence so that a slow Redis never
        delays a loop's decision: the live engines (and their pressure flags) and the tenants."""
        assert self.ctx is not None
        while True:
            raise_if_cancelled()  # one lost on the way (swallowed_cancel.py): stop() would wait for good
            await asyncio.sleep(self.settings.kvcontrol_discovery_interval_s)
            try:
                await self.discover()
                await self.ctx.tenants.refresh()
            except Exception as exc:  # Redis blips must not stop the controller
                self.metrics.errors.labels("", "discovery").inc()
                logger.warning("engine discovery failed: %s", exc)

    def _wanted(self, record: EngineRecord) -> bool:
        settings = self.settings
        model = settings.kvcontrol_model
        return (bool(record.kv_events_endpoint) and (model is None or record.model == model)
                and shard_of(record.engine_id, settings.kvcontrol_shards) == settings.kvcontrol_shard)

    async def discover(self) -> None:
        """Starts loops for new engines, stops loops of engines that left (or moved their endpoint)."""
        assert self.ctx is not None
        records = await EngineRegistry(self.ctx.redis).live_engines()
        self.ctx.live_engines = {r.engine_id: r for r in records}
        live = {r.engine_id: r for r in records if self._wanted(r)}
        now = time.monotonic()
        for engine_id, loop in list(self.loops.items()):
            record = live.get(engine_id)
            if record is None:
                # NOTE: a late heartbeat is not a dead engine: restarting the loop would throw its ledger away.
                missing_since = self._missing_since.setdefault(engine_id, now)
                if now - missing_since < ENGINE_GONE_GRACE_S and not self._tasks[engine_id].done():
                    continue
            else:
                self._missing_since.pop(engine_id, None)
            if record is None or record.kv_events_endpoint != loop.record.kv_events_endpoint \
                    or record.url != loop.record.url or self._tasks[engine_id].done():
                await self._stop_loop(engine_id)
        for engine_id, record in live.items():
            if engine_id not in self.loops:
                loop = EngineControlLoop(record, self.ctx)
                self.loops[engine_id] = loop
                self._tasks[engine_id] = asyncio.create_task(loop.run(), name=f"kvcontrol-{engine_id}")
                logger.info("controlling %s (%s, events %s)", engine_id, record.url, record.kv_events_endpoint)
        self.metrics.engines.set(len(self.loops))

    async def _stop_loop(self, engine_id: str) -> None:
        self._missing_since.pop(engine_id, None)
        task = self._tasks.pop(engine_id)
        self.loops.pop(engine_id)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            # The loop's own cancellation ends it here; the caller's (stop() cancelling the supervisor while it
            # stops a loop of an engine that left) must go on up. NOTE: swallowing both kept the supervisor
            # running and stop() waiting on it for ever (bench_kvcontrol.py --engines 64, at the fleet's end).
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
        except Exception as exc:  # a loop that died is replaced at the next discovery
            logger.warning("control loop of %s ended with an error: %s", engine_id, exc)


async def run_forever(settings: KVControlSettings) -> None:
    from tessera.telemetry.tracing import configure_tracing

    configure_tracing("tessera-kvcontrol", settings.trace_exporter, settings.trace_dir, settings.otlp_endpoint,
                      settings.trace_sample_ratio)
    # NOTE: the loops decode KV events with the ledger's own types (events.py), not vLLM's: the controller
    # never imports vLLM (seconds of CPU holding the GIL and hundreds of MB, for a process that follows tens
    # of engines).
    metrics = ControllerMetrics()
    if settings.kvcontrol_metrics_port:
        metrics.serve(settings.kvcontrol_metrics_port)
    controller = await KVController(settings, metrics).start()
    # Started: what the process holds now is its startup heap (tessera.telemetry.gc_heap: frozen, no full
    # collection walks it again); its collections' pauses go to /metrics.
    from tessera.telemetry.gc_heap import freeze_startup_heap, process_gc_pauses

    freeze_startup_heap()
    metrics.registry.register(process_gc_pauses())
    try:
        await asyncio.Event().wait()
    finally:
        await controller.stop()
