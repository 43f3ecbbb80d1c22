"""A light stand-in for the engine replica: it asks Ray for exactly what the engine asks for (the same
options builder), starts no vLLM, and reports where it runs and which devices it got.

A tensor-parallel probe starts one worker actor per bundle of its placement group, one GPU each, as vLLM's
Ray executor does (vllm/v1/executor/ray_executor_v2.py: ``num_cpus=0``, ``num_gpus=1``, the bundle's
index), and reports the workers' devices too.

Reports live in Redis with a short TTL, heartbeated: a probe that dies (its node removed) drops out, as the
engine registry's records do.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import ray
import redis
from ray import serve
from ray.util import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tessera.engine.config import EngineConfig
from tessera.engine.devices import current_devices

REPORT_PREFIX = "tessera-test:probe"
REPORT_TTL_S = 2
HEARTBEAT_S = 0.5


def report_key(app: str, replica_id: str) -> str:
    return f"{REPORT_PREFIX}:{app}:{replica_id}"


@ray.remote(num_cpus=0, num_gpus=1)
class GpuWorker:
    """A vLLM worker's resource shape; also used to hold a GPU away from Serve."""

    def devices(self) -> dict[str, Any]:
        return current_devices().to_dict()


@serve.deployment(health_check_period_s=1, health_check_timeout_s=5, graceful_shutdown_timeout_s=1)
class PlacementProbe:
    def __init__(self, engine: dict[str, Any], redis_url: str, app: str) -> None:
        config = EngineConfig.model_validate(engine)
        replica_id = serve.get_replica_context().replica_id.unique_id
        workers: list[dict[str, Any]] = []
        group = get_current_placement_group()
        if group is not None:
            self._workers = [
                GpuWorker.options(scheduling_strategy=PlacementGroupSchedulingStrategy(  # type: ignore[attr-defined]
                    placement_group=group, placement_group_bundle_index=rank)).remote()
                for rank in range(config.tensor_parallel_size)
            ]
            workers = ray.get([w.devices.remote() for w in self._workers], timeout=60)
        self.report = {"replica_id": replica_id, "devices": current_devices().to_dict(), "workers": workers}
        self._key = report_key(app, replica_id)
        self._redis = redis.Redis.from_url(redis_url)
        self._stop = threading.Event()
        self._beat()
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def _beat(self) -> None:
        self._redis.set(self._key, json.dumps(self.report), ex=REPORT_TTL_S)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except redis.RedisError:
                pass  # the next beat retries; the TTL decides

    def __call__(self, request: Any) -> dict[str, Any]:
        return self.report

    def __del__(self) -> None:
        stop: threading.Event | None = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            self._redis.delete(self._key)


def live_reports(redis_url: str, app: str) -> list[dict[str, Any]]:
    """The reports of the probes of ``app`` that are alive now."""
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{REPORT_PREFIX}:{app}:*"))
        values = client.mget(keys) if keys else []
        return [json.loads(v) for v in values if v is not None]
    finally:
        client.close()
