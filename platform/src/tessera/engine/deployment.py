"""The engine as a Ray Serve deployment: Ray places replicas, restarts them when their health check fails
and rolls them on upgrade; tokens do not travel through Ray (each replica serves HTTP on its own port and
the gateway streams from it directly — see design §1 for the measurements behind this).

Serve config (what the Helm chart renders into ``serveConfigV2``)::

    import_path: tessera.engine.deployment:build_app
    args: {engine: {<EngineConfig, camelCase>}, replicas: 1}

What a replica asks Ray for (its GPUs, or a placement group for tensor parallelism) is decided by
engine/placement.py from the config alone.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ray import serve

from tessera.engine.config import EngineConfig
from tessera.engine.devices import ReplicaDevices, current_devices
from tessera.engine.host import EngineHost
from tessera.engine.placement import deployment_options, installed_vllm_build, resolve_accelerator
from tessera.settings import load_settings

logger = logging.getLogger(__name__)


@serve.deployment(
    name="tessera-engine",
    health_check_period_s=5,
    health_check_timeout_s=10,
    graceful_shutdown_timeout_s=20,
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
        self.host = EngineHost(config, settings.redis_url, engine_id=f"{config.served_model_name}-{replica_id}",
                               advertise_host=settings.advertise_host).start()

    def check_health(self) -> None:
        """Ray calls this periodically; raising marks the replica unhealthy and Ray replaces it."""
        if not self.host.is_healthy():
            raise RuntimeError(f"engine {self.host.engine_id} is dead")

    async def __call__(self, request: Any) -> dict[str, Any]:
        # Not the data path: a discovery endpoint answering where this replica streams from, and on which
        # node and devices it runs.
        return {"engine_id": self.host.engine_id, "url": self.host.url, "devices": self.devices.to_dict()}

    def __del__(self) -> None:
        # A replica whose host never started (its constructor raised) has no host to stop.
        host: EngineHost | None = getattr(self, "host", None)
        if host is not None:
            host.stop()


def build_app(args: dict[str, Any]) -> Any:
    """Serve application builder (``import_path`` target)."""
    unknown = set(args) - {"engine", "replicas"}
    if unknown:
        raise ValueError(f"unknown args {sorted(unknown)}; valid: engine, replicas")
    engine = EngineConfig.model_validate(args["engine"])
    # NOTE: 'auto' is resolved here, where the application is built (the same image as the replicas), and
    # the replicas get the resolved config: what they ask Ray for and what vLLM is told agree.
    engine = engine.model_copy(update={"accelerator": resolve_accelerator(engine.accelerator, installed_vllm_build())})
    replicas = int(args.get("replicas", 1))
    return EngineReplica.options(  # type: ignore[attr-defined]
        num_replicas=replicas, name=f"engine-{engine.served_model_name}", **deployment_options(engine),
    ).bind(engine.model_dump(by_alias=True))
