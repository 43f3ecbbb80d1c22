"""A multi-node Ray cluster on this machine, driven from a child process.

Nodes *declare* GPUs (``num_gpus``): Ray hands them out by id and sets ``CUDA_VISIBLE_DEVICES`` from the
declared ids without hardware, so GPU placement can be tested on a CPU-only machine.

NOTE: one process holds one Ray connection, and the end-to-end tests' platform (a local Ray) stays up for
the whole pytest session. The cluster's driver therefore lives in a spawned child process that the tests
command over a pipe (``ClusterDriver.call``); its Ray calls run in that process's main thread.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tessera.redis_conn import connect
from tessera.registry import EngineRecord, EngineRegistry

REPO = Path(__file__).resolve().parents[2]
PROBE_DEPLOYMENT = "probe"
GPU_NODES = 2
GPUS_PER_NODE = 2


@dataclass(frozen=True)
class ClusterSpec:
    gpu_nodes: int = 2
    gpus_per_node: int = 2
    cpus_per_gpu_node: int = 2
    env: tuple[tuple[str, str], ...] = ()


class _Driver:
    """Runs in the child: owns the cluster, the Ray connection and Serve."""

    def __init__(self, spec: ClusterSpec) -> None:
        # Before the first node starts: every Ray process (raylets, Serve controller, replicas) inherits it.
        os.environ.update(dict(spec.env))
        # The probe deployment's module (tests.support.ray_probe) must import in Ray's workers.
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        import ray
        from ray import serve
        from ray.cluster_utils import Cluster

        self.spec = spec
        # The head runs the Serve controller and no replica: no GPUs, as the chart's head.
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0,
                                                                     "include_dashboard": False})
        self.nodes: dict[str, Any] = {}
        for _ in range(spec.gpu_nodes):
            self.add_gpu_node()
        ray.init(address=self.cluster.address, log_to_driver=False, configure_logging=False)
        serve.start(proxy_location="Disabled")
        self.holders: dict[str, list[Any]] = {}

    # ---- nodes -----------------------------------------------------------------------------------

    def add_gpu_node(self) -> str:
        node = self.cluster.add_node(num_cpus=self.spec.cpus_per_gpu_node, num_gpus=self.spec.gpus_per_node)
        self.nodes[node.node_id] = node
        return str(node.node_id)

    def gpu_node_ids(self) -> list[str]:
        return list(self.nodes)

    def remove_node(self, node_id: str) -> None:
        """As a pod deleted by Kubernetes: the raylet is told to stop, its workers die with it."""
        self.cluster.remove_node(self.nodes.pop(node_id), allow_graceful=True)

    def hold_gpu(self, node_id: str) -> None:
        """Takes one GPU of ``node_id`` away from Serve (a plain actor pinned to the node)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from tests.support.ray_probe import GpuWorker

        holder = GpuWorker.options(  # type: ignore[attr-defined]
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        ray.get(holder.devices.remote(), timeout=60)
        self.holders.setdefault(node_id, []).append(holder)

    def release_gpus(self, node_id: str | None = None) -> None:
        """Gives back what ``hold_gpu`` took on ``node_id`` (None: on every node)."""
        import ray

        for node in [node_id] if node_id is not None else list(self.holders):
            for holder in self.holders.pop(node, []):
                ray.kill(holder)

    # ---- Serve -----------------------------------------------------------------------------------

    def run_probes(self, app: str, engine: dict[str, Any], replicas: int, redis_url: str, wait: bool) -> None:
        """The light replica, deployed with the engine's own options builder."""
        from ray import serve

        from tessera.engine.config import EngineConfig
        from tessera.engine.placement import deployment_options
        from tests.support.ray_probe import PlacementProbe

        config = EngineConfig.model_validate(engine)
        bound = PlacementProbe.options(name=PROBE_DEPLOYMENT, num_replicas=replicas,  # type: ignore[attr-defined]
                                       **deployment_options(config)).bind(engine, redis_url, app)
        self._run(serve, bound, app, wait)

    def run_engine(self, app: str, engine: dict[str, Any], replicas: int) -> None:
        """The real engine application, exactly as the chart's serveConfigV2 builds it."""
        from ray import serve

        from tessera.engine.deployment import build_app

        self._run(serve, build_app({"engine": engine, "replicas": replicas}), app, wait=True)

    @staticmethod
    def _run(serve: Any, bound: Any, app: str, wait: bool) -> None:
        if wait:
            serve.run(bound, name=app, route_prefix=None)
        else:
            # NOTE: serve.run waits until the application runs; an application that cannot place all its
            # replicas never does. Serve's own non-waiting variant (private).
            serve._run(bound, name=app, route_prefix=None, _blocking=False)

    def status(self, app: str) -> dict[str, Any]:
        from ray import serve

        application = serve.status().applications.get(app)
        if application is None:
            return {}
        return {"status": _name(application.status), "message": application.message,
                "deployments": {name: {"status": _name(d.status), "message": d.message,
                                       "replica_states": {_name(k): v for k, v in d.replica_states.items()}}
                                for name, d in application.deployments.items()}}

    def ask(self, app: str) -> dict[str, Any]:
        """One replica's discovery answer (the application's only replica, in these tests)."""
        from ray import serve

        answer: dict[str, Any] = serve.get_app_handle(app).remote(None).result(timeout_s=60)
        return answer

    def serve_controller_log(self, last_lines: int = 40) -> str:
        """The last lines of the Serve controller's log: why a replica is not RUNNING (a failed start or
        health check, a restart), for a test's failure message."""
        logs = Path(self.cluster.head_node.get_session_dir_path()) / "logs" / "serve"
        tails = []
        for path in sorted(logs.glob("controller_*.log")):
            # Serve repeats its slow-start warning every second: a message once per run of repeats.
            lines: list[str] = []
            for line in path.read_text(errors="replace").splitlines():
                if not lines or line.partition(" -- ")[2] != lines[-1].partition(" -- ")[2]:
                    lines.append(line)
            tails.append(f"{path.name}:\n" + "\n".join(lines[-last_lines:]))
        return "\n".join(tails) or f"no controller log under {logs}"

    def delete(self, app: str) -> None:
        from ray import serve

        serve.delete(app)

    def shutdown(self) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            self.cluster.shutdown()


def _name(state: Any) -> str:
    """A Serve status enum member (or, where Serve already made it one, its string) as its value."""
    return str(getattr(state, "value", state))


def _serve_commands(conn: Connection, spec: ClusterSpec) -> None:
    """The child's main loop: one command at a time, answered with ('ok', value) or ('error', traceback)."""
    try:
        driver = _Driver(spec)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    while True:
        method, args = conn.recv()
        try:
            conn.send(("ok", getattr(driver, method)(*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        if method == "shutdown":
            return


class ClusterDriver:
    """The tests' side: ``call("method", *args)`` runs ``_Driver.method`` in the child."""

    def __init__(self, spec: ClusterSpec, start_timeout_s: float = 180.0) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve_commands, args=(child, spec), name="ray-cluster-driver")
        self._process.start()
        self._receive(start_timeout_s)

    def call(self, method: str, *args: Any, timeout_s: float = 300.0) -> Any:
        self._conn.send((method, args))
        return self._receive(timeout_s)

    def _receive(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(1.0):
            if not self._process.is_alive():
                raise RuntimeError(f"the cluster driver exited with code {self._process.exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster driver did not answer within {timeout_s} s")
        kind, value = self._conn.recv()
        if kind == "error":
            raise RuntimeError(f"in the cluster driver:\n{value}")
        return value

    def replica_states(self, app: str, deployment: str) -> dict[str, int]:
        """Serve's replica count per state of ``deployment`` in ``app`` ({} while Serve has none)."""
        states: dict[str, int] = self.call("status", app).get("deployments", {}).get(deployment, {}).get(
            "replica_states", {})
        return states

    def wait_for_replica_states(self, app: str, deployment: str, accept: Callable[[dict[str, int]], bool],
                                timeout_s: float, what: str) -> None:
        """Polls Serve until ``accept(replica_states)``; a timeout names Serve's status and its controller's last
        lines (why a replica is not RUNNING: a failed start or health check, a restart)."""
        try:
            wait_for(lambda: accept(self.replica_states(app, deployment)), timeout_s, what)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\nServe's status: {self.call('status', app)}\n"
                                 f"{self.call('serve_controller_log')}") from None

    def close(self) -> None:
        try:
            if self._process.is_alive():
                self.call("shutdown", timeout_s=120)
        finally:
            self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(timeout=10)


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str, period_s: float = 0.5) -> Any:
    """Polls until ``condition()`` is truthy and returns it; a timeout names what was awaited."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(period_s)


def live_engines(redis_url: str) -> list[EngineRecord]:
    async def read() -> list[EngineRecord]:
        redis = connect(redis_url, timeout_s=5)
        try:
            return await EngineRegistry(redis).live_engines()
        finally:
            await redis.aclose()

    return asyncio.run(read())


def engine_settings(model_dir: Path) -> dict[str, object]:
    """The real engine, small and quick on the CPU build, asking for a GPU as on a GPU node."""
    return {"model": str(model_dir), "accelerator": "gpu", "kvEvents": {"enabled": False}, "speculative": None,
            "maxModelLen": 512, "maxNumSeqs": 4, "cpuKvCacheSpaceGib": 1, "heartbeatIntervalS": 0.5}
