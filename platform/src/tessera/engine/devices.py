"""Where a replica runs and which devices Ray gave it, as the replica itself sees them (its discovery
answer, its start-up log line, and the placement tests on a multi-node Ray cluster)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ReplicaDevices:
    node_id: str
    # Ray's GPU ids for this process (empty where it asked for none, e.g. a TP>1 replica: its vLLM workers
    # own the GPUs, one bundle each).
    gpu_ids: list[str]
    # As the process sees it; None where nothing set it (Ray sets it only for a process that asked for GPUs).
    cuda_visible_devices: str | None
    placement_group_id: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def current_devices() -> ReplicaDevices:
    """Inside a Ray worker (a Serve replica, or one of its actors); outside Ray, no node and no Ray GPUs."""
    import ray
    from ray.util import get_current_placement_group

    if not ray.is_initialized():  # NOTE: the runtime context would start a Ray instance
        return ReplicaDevices("", [], os.environ.get("CUDA_VISIBLE_DEVICES"), None)
    context = ray.get_runtime_context()
    group = get_current_placement_group()
    return ReplicaDevices(
        node_id=context.get_node_id(),
        gpu_ids=[str(i) for i in context.get_accelerator_ids().get("GPU", [])],
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        placement_group_id=group.id.hex() if group is not None else None,
    )
