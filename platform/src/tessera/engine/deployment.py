"""The engine as a Ray Serve deployment: Ray places replicas, restarts them when their health check fails
and rolls them on upgrade; tokens do not travel through Ray (each replica serves HTTP on its own port and
the gateway streams from it directly — see design §1 for the measurements behind this).

Serve config (what the operator writes into ``serveConfigV2`` for a Model, or the Helm chart without the operator)::

    import_path: tessera.engine.deployment:build_app
    args: {engine: {<EngineConfig, camelCase>}, replicas: 1}

What a replica asks Ray for (its GPUs, or a placement group for tensor parallelism) is decided by
engine/placement.py from the config alone. What each replica runs is ``engine.backend``: vLLM (engine/host.py)
or a simulated engine (engine/sim/serve_replica.py), with the same placement, registry, heartbeat, KV events,
index feed, drain and Ray replacement; a simulated replica never imports vLLM. How many replicas run is
``replicas`` (fixed) or, exclusively, ``engine.autoscaling`` (engine/autoscaling.py: each replica reports its
load, a Tessera policy in Serve's controller sizes the deployment, and a removed replica drains before it
stops, engine/drain.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

from ray import serve

from tessera.engine.autoscaling import ReplicaLoad, replica_count_options, replica_signals, serve_shutdown_options
from tessera.engine.config import EngineBackend, EngineConfig
from tessera.engine.devices import ReplicaDevices, current_devices
from tessera.engine.placement import deployment_options
from tessera.settings import load_settings
from tessera.telemetry.gc_heap import frozen_objects, note_frozen_heap, process_gc_pauses

logger = logging.getLogger(__name__)


class LoadView(Protocol):
    """What the deployment reads of a replica's load."""

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_cache_usage(self) -> float: ...


class ReplicaHost(Protocol):
    """What ``EngineReplica`` needs of the engine it hosts (``EngineHost``, ``SimReplicaHost``)."""

    engine_id: str

    @property
    def url(self) -> str: ...

    @property
    def in_flight(self) -> Any: ...

    def is_healthy(self) -> bool: ...

    def load(self) -> LoadView: ...

    def drain(self, timeout_s: float | None = None) -> Any: ...


def _vllm_host(config: EngineConfig, redis_url: str | None, engine_id: str, advertise_host: str) -> ReplicaHost:
    # Imported here: engine/host.py imports vLLM, which a simulated replica never loads.
    from tessera.engine.host import EngineHost

    return EngineHost(config, redis_url, engine_id=engine_id, advertise_host=advertise_host).start()


def _sim_host(config: EngineConfig, redis_url: str | None, engine_id: str, advertise_host: str) -> ReplicaHost:
    from tessera.engine.sim.serve_replica import SimReplicaHost

    return SimReplicaHost(config, redis_url, engine_id=engine_id, advertise_host=advertise_host).start()


# The engine each backend runs in a replica (EngineConfig.backend), started and serving once returned.
REPLICA_HOSTS: dict[EngineBackend, Callable[[EngineConfig, str | None, str, str], ReplicaHost]] = {
    "vllm": _vllm_host,
    "sim": _sim_host,
}


def start_host(config: EngineConfig, redis_url: str | None, engine_id: str, advertise_host: str) -> ReplicaHost:
    """The started host of ``config.backend`` (ValueError naming the valid ones for any other)."""
    try:
        make = REPLICA_HOSTS[config.backend]
    except KeyError:
        raise ValueError(f"unknown engine backend {config.backend!r}; valid: {', '.join(sorted(REPLICA_HOSTS))}") \
            from None
    return make(config, redis_url, engine_id, advertise_host)


@serve.deployment(
    name="tessera-engine",
    health_check_period_s=5,
    health_check_timeout_s=10,
    max_ongoing_requests=10_000,
)
class EngineReplica:
    def __init__(self, engine: dict[str, Any]) -> None:
        config = EngineConfig.model_validate(engine)
        settings = load_settings()
        try:
            replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:
            replica_id = f"local-{os.getpid()}"
        self.devices: ReplicaDevices = current_devices()
        logger.info("engine replica %s on node %s: GPUs %s (CUDA_VISIBLE_DEVICES=%s), placement group %s",
                    replica_id, self.devices.node_id, self.devices.gpu_ids, self.devices.cuda_visible_devices,
                    self.devices.placement_group_id)
        self.host: ReplicaHost = start_host(config, settings.redis_url, f"{config.served_model_name}-{replica_id}",
                                            settings.advertise_host)
        # NOTE: no freeze here: Ray Serve freezes a replica's heap once __init__ returns
        # (RAY_SERVE_FREEZE_GC_ON_STARTUP, on by default) — this process (Ray's worker, vLLM's front end, the
        # host) holds ~650,000 tracked objects, ~420 ms per full collection unfrozen (telemetry/gc_heap.py).
        # Its collections' pauses are counted from here on, for /metrics.
        process_gc_pauses()
        self._frozen_noted = False

    def check_health(self) -> None:
        """Ray calls this periodically; raising marks the replica unhealthy and Ray replaces it. Its first
        call comes right after Serve froze the heap, before the replica counts as started: where the frozen
        objects are counted, the one time (a count walks them all: gc_heap.note_frozen_heap)."""
        if not self._frozen_noted:
            note_frozen_heap()
            self._frozen_noted = True
        if not self.host.is_healthy():
            raise RuntimeError(f"engine {self.host.engine_id} is dead")

    async def __call__(self, request: Any) -> dict[str, Any]:
        # Not the data path: a discovery endpoint answering where this replica streams from, and on which
        # node and devices it runs (and its process, which a test kills to see Ray replace it).
        return {"engine_id": self.host.engine_id, "url": self.host.url, "devices": self.devices.to_dict(),
                "pid": os.getpid(), "gc_frozen_objects": frozen_objects()}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaler reads the replica's load here (every metrics interval while the deployment
        autoscales): the streams go past Serve, so Serve cannot count them itself."""
        load = self.host.load()
        return replica_signals(ReplicaLoad(ongoing_requests=len(self.host.in_flight), queue_depth=load.num_waiting,
                                           kv_cache_usage=load.kv_cache_usage))

    def __del__(self) -> None:
        # Serve calls this when it removes the replica (scale-down, redeploy), then kills the actor after
        # graceful_shutdown_timeout_s: leave the registry and finish the open streams first (drain.py).
        # A replica whose host never started (its constructor raised) has no host to stop.
        host: ReplicaHost | None = getattr(self, "host", None)
        if host is not None:
            host.drain()


def build_app(args: dict[str, Any]) -> Any:
    """Serve application builder (``import_path`` target)."""
    engine = resolved_engine(args)
    replicas = args.get("replicas")
    options = engine_deployment_options(engine, None if replicas is None else int(replicas))
    return EngineReplica.options(**options).bind(engine.model_dump(by_alias=True))  # type: ignore[attr-defined]


def resolved_engine(args: dict[str, Any]) -> EngineConfig:
    """The application's engine config with its accelerator resolved."""
    unknown = set(args) - {"engine", "replicas"}
    if unknown:
        raise ValueError(f"unknown args {sorted(unknown)}; valid: engine, replicas")
    engine = EngineConfig.model_validate(args["engine"])
    if engine.backend == "sim":
        # Where the application is built, not in every replica: a sim config that cannot run fails the deploy.
        from tessera.engine.sim.serve_replica import sim_engine_config

        sim_engine_config(engine)
    # NOTE: 'auto' is resolved here, where the application is built (the same image as the replicas), and
    # the replicas get the resolved config: what they ask Ray for and what vLLM is told agree.
    return engine.model_copy(update={"accelerator": engine.placed_on})


def engine_deployment_options(engine: EngineConfig, replicas: int | None) -> dict[str, Any]:
    """``EngineReplica.options(...)`` of a resolved engine: name, replica count or autoscaling, drain deadline
    and placement. ``replicas`` None (absent or null in the args): one replica, or what autoscaling decides."""
    return {"name": f"engine-{engine.served_model_name}", **replica_count_options(engine.autoscaling, replicas),
            **serve_shutdown_options(engine.drain_timeout_s), **deployment_options(engine)}
