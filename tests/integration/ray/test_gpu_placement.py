"""Engine replicas own their GPUs, on a real multi-node Ray cluster whose nodes declare GPUs.

The probe replicas are deployed with the engine's own options builder (engine/placement.py); the last test
deploys the real engine application (build_app) and removes the node it runs on.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tessera.redis_conn import EmbeddedRedis
from tests.support.ray_cluster import (
    GPU_NODES,
    GPUS_PER_NODE,
    PROBE_DEPLOYMENT,
    ClusterDriver,
    engine_settings,
    live_engines,
    wait_for,
)
from tests.support.ray_probe import live_reports

pytestmark = pytest.mark.engine

GPUS = GPU_NODES * GPUS_PER_NODE


def probe_engine(tensor_parallel_size: int) -> dict[str, object]:
    return {"model": "/not-loaded", "accelerator": "gpu", "tensorParallelSize": tensor_parallel_size}


def waiting_message(cluster: ClusterDriver, app: str, waiting: int) -> str:
    """Serve's deployment message once it says ``waiting`` replicas wait to be scheduled; '' before.

    NOTE: Serve rewrites the message every RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S, so it may still count
    replicas that have started since, or say that replicas are slow to initialize (on a busy machine)."""
    status = cluster.call("status", app)
    message: str = status.get("deployments", {}).get(PROBE_DEPLOYMENT, {}).get("message", "")
    waits = re.search(rf"has {waiting} replicas that have taken more than \d+s to be scheduled", message)
    return message if waits else ""


class TestOneGpuReplicas:
    """GPUS + 1 single-GPU replicas on GPUS GPUs."""

    APP = "tp1"

    @pytest.fixture(scope="class")
    def overcommitted(self, cluster: ClusterDriver, redis_server: EmbeddedRedis) -> Iterator[str]:
        cluster.call("run_probes", self.APP, probe_engine(1), GPUS + 1, redis_server.url, False)
        try:
            wait_for(lambda: len(live_reports(redis_server.url, self.APP)) >= GPUS, 120, f"{GPUS} running probes")
            yield self.APP
        finally:
            cluster.call("delete", self.APP)

    def test_each_replica_sees_only_its_own_gpu(self, overcommitted: str, cluster: ClusterDriver,
                                                redis_server: EmbeddedRedis) -> None:
        reports = live_reports(redis_server.url, overcommitted)
        assert len(reports) == GPUS
        owned = set()
        for report in reports:
            devices = report["devices"]
            (gpu,) = devices["gpu_ids"]
            assert devices["cuda_visible_devices"] == gpu, devices  # what CUDA (and vLLM) will use
            assert devices["placement_group_id"] is None
            owned.add((devices["node_id"], gpu))
        assert len(owned) == GPUS, f"two replicas share a GPU: {reports}"
        assert {node for node, _ in owned} == set(cluster.call("gpu_node_ids"))

    def test_a_replica_beyond_the_gpus_waits_and_serve_says_for_what(self, overcommitted: str,
                                                                     cluster: ClusterDriver,
                                                                     redis_server: EmbeddedRedis) -> None:
        message = wait_for(lambda: waiting_message(cluster, overcommitted, 1), 30, "Serve's waiting message")
        assert 'Resources required for each replica: {"CPU": 0.5, "GPU": 1}' in message
        status = cluster.call("status", overcommitted)
        assert status["status"] == "DEPLOYING"
        assert status["deployments"][PROBE_DEPLOYMENT]["replica_states"] == {"RUNNING": GPUS, "STARTING": 1}
        assert len(live_reports(redis_server.url, overcommitted)) == GPUS


def test_a_tensor_parallel_replica_never_spans_two_nodes(cluster: ClusterDriver, redis_server: EmbeddedRedis) -> None:
    app = "tp2"
    first, *others = cluster.call("gpu_node_ids")
    try:
        # One free GPU on every node: enough GPUs in all for TP=2, but on no single node.
        for node in [first, *others]:
            cluster.call("hold_gpu", node)
        cluster.call("run_probes", app, probe_engine(2), 1, redis_server.url, False)
        message = wait_for(lambda: waiting_message(cluster, app, 1), 30, "Serve's waiting message")
        assert '[{"CPU": 0.5, "GPU": 1.0}, {"GPU": 1.0}]' in message
        assert live_reports(redis_server.url, app) == []

        cluster.call("release_gpus", first)  # now one node has two free GPUs
        (report,) = wait_for(lambda: live_reports(redis_server.url, app), 60, "the TP=2 probe")
        replica, workers = report["devices"], report["workers"]
        assert replica["gpu_ids"] == [] and replica["placement_group_id"]  # its GPUs are its workers'
        assert replica["node_id"] == first
        assert [w["node_id"] for w in workers] == [first, first]
        assert [w["placement_group_id"] for w in workers] == [replica["placement_group_id"]] * 2
        gpus = [w["gpu_ids"] for w in workers]
        assert sorted(gpus) == [["0"], ["1"]], gpus  # disjoint: each worker owns one of the node's GPUs
        assert [w["cuda_visible_devices"] for w in workers] == [g[0] for g in gpus]
    finally:
        cluster.call("delete", app)
        cluster.call("release_gpus", None)


def test_engine_replica_owns_its_gpu_serves_and_moves_off_a_removed_node(
        cluster: ClusterDriver, redis_server: EmbeddedRedis, small_model_dir: Path) -> None:
    """The real EngineReplica (vLLM CPU build) on a node that declares GPUs: Ray gives it one, vLLM is not
    confused by CUDA_VISIBLE_DEVICES, it registers and serves; its node removed, Serve starts it on another
    node and the registry the gateway routes from follows."""
    app, model = "engine", "placement-small"
    engine = {**engine_settings(small_model_dir), "servedModelName": model}

    def registered() -> list[str]:
        return [r.engine_id for r in live_engines(redis_server.url) if r.model == model]

    try:
        cluster.call("run_engine", app, engine, 1, timeout_s=420)
        first = cluster.call("ask", app)
        devices = first["devices"]
        (gpu,) = devices["gpu_ids"]
        assert devices["cuda_visible_devices"] == gpu
        assert httpx.get(f"{first['url']}/health", timeout=10).status_code == 200
        assert wait_for(registered, 10, "the engine in the registry") == [first["engine_id"]]

        cluster.call("remove_node", devices["node_id"])
        moved = wait_for(lambda: (ids := registered()) and first["engine_id"] not in ids and ids, 420,
                         "the replacement engine in the registry, the removed one gone")
        second = cluster.call("ask", app)
        assert moved == [second["engine_id"]]
        assert second["devices"]["node_id"] in cluster.call("gpu_node_ids")
        assert second["devices"]["node_id"] != devices["node_id"]
        assert len(second["devices"]["gpu_ids"]) == 1
        assert httpx.get(f"{second['url']}/health", timeout=10).status_code == 200
    finally:
        cluster.call("delete", app)
        while len(cluster.call("gpu_node_ids")) < GPU_NODES:
            cluster.call("add_gpu_node")
