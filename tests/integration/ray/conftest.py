"""One multi-node Ray cluster with GPU-declaring nodes, shared by this directory's tests (see
tests/support/ray_cluster.py for why its driver is a child process). One for the package, not per module:
starting a cluster costs seconds of both cores, and each test deletes the applications it deployed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tessera.redis_conn import EmbeddedRedis
from tests.support.ray_cluster import GPU_NODES, GPUS_PER_NODE, ClusterDriver, ClusterSpec


@pytest.fixture(scope="package")
def cluster(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterDriver]:
    """A head without GPUs (as the chart's) and GPU_NODES nodes declaring GPUS_PER_NODE GPUs each."""
    env = {
        # Serve says a replica waits for resources after this long (default 30 s).
        "RAY_SERVE_SLOW_STARTUP_WARNING_S": "1",
        "RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        # The real engine replica: its registry, and the CPU build's settings as the local platform's.
        "TESSERA_REDIS_URL": redis_server.url,
        "TESSERA_TRACE_DIR": str(tmp_path_factory.mktemp("ray-traces")),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    driver = ClusterDriver(ClusterSpec(gpu_nodes=GPU_NODES, gpus_per_node=GPUS_PER_NODE, cpus_per_gpu_node=2,
                                       env=tuple(env.items())))
    try:
        yield driver
    finally:
        driver.close()
