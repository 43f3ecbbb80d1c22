"""Benchmark: simulated engines as Ray Serve replicas at fleet size (issue #17), on a local multi-node Ray
cluster (``ray.cluster_utils.Cluster``) whose nodes declare GPUs.

The replicas are the real deployment (``tessera.engine.deployment:build_app`` with ``backend: sim``), placed
by the engine's own placement code (TP > 1: a STRICT_PACK placement group of one-GPU bundles per replica),
registered by the real heartbeat and feeding the real prefix index from their own KV events. Measured:

- how long the cluster takes to start, and the deployment to have every replica RUNNING in Serve and live
  in the registry (from the deploy call);
- memory: RSS and USS of the replica processes (each Ray actor is a Python process), the Ray processes in
  all, and the machine's available memory before and after;
- the registry while the fleet holds for ``--hold`` seconds: the share of samples (every 0.5 s) with every
  replica live;
- with ``--kill``: one replica's process killed with SIGKILL, and how long until Serve's replacement is live
  in the registry and the dead one is out.

Results: bench/results/ray_fleet.json and a table. Watch ``free -g`` first: each replica is a process.

Usage: ``.venv/bin/python bench/bench_ray_fleet.py [--replicas 64] [--nodes 4] [--gpus-per-node 128] [--tp 8]
[--hold 10] [--kill]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from typing import Any

import psutil
from _support import bench_model, print_table, stop_on_sigterm, write_results

APP, MODEL = "sim-fleet", "sim-llama-3-70b"


def sim_engine(model_dir: str, tp: int) -> dict[str, Any]:
    """The issue's preset (H100 SXM, Llama-3-70B, FP8 KV) at ``tp`` GPUs per replica, simulated in real time."""
    return {"model": model_dir, "servedModelName": MODEL, "backend": "sim", "accelerator": "gpu",
            "tensorParallelSize": tp, "kvCacheDtype": "fp8", "blockSize": 16, "maxModelLen": 8192,
            "maxNumSeqs": 256, "maxNumBatchedTokens": 8192, "speculative": None, "heartbeatIntervalS": 1.0,
            "drainTimeoutS": 5, "sim": {"gpu": "h100-sxm", "modelPreset": "llama-3-70b"}}


def live_ids(redis_url: str) -> set[str]:
    from tessera.redis_conn import connect
    from tessera.registry import EngineRegistry

    async def read() -> set[str]:
        redis = connect(redis_url, timeout_s=5)
        try:
            return {r.engine_id for r in await EngineRegistry(redis).live_engines() if r.model == MODEL}
        finally:
            await redis.aclose()

    return asyncio.run(read())


def running_replicas() -> int:
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None:
        return 0
    deployment = app.deployments.get(f"engine-{MODEL}")
    states = {str(getattr(k, "value", k)): v for k, v in (deployment.replica_states if deployment else {}).items()}
    return int(states.get("RUNNING", 0))


def ray_processes(root_pids: list[int]) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """(replica actor processes, every process under the cluster's node processes)."""
    everything: dict[int, psutil.Process] = {}
    for pid in root_pids:
        try:
            root = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
        for proc in [root, *root.children(recursive=True)]:
            everything[proc.pid] = proc
    replicas = []
    for proc in everything.values():
        try:
            if "ServeReplica" in " ".join(proc.cmdline()) or "ServeReplica" in proc.name():
                replicas.append(proc)
        except psutil.Error:
            continue
    return replicas, list(everything.values())


def memory_mib(procs: list[psutil.Process], uss: bool) -> float:
    total = 0
    for proc in procs:
        try:
            info = proc.memory_full_info() if uss else proc.memory_info()
            total += info.uss if uss else info.rss
        except psutil.Error:
            continue
    return total / 2**20


def main() -> None:
    stop_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=64)
    # NOTE: each node is a raylet plus its agents (a few hundred MB on one machine): few big nodes.
    parser.add_argument("--nodes", type=int, default=4, help="worker nodes (the head holds no replica)")
    parser.add_argument("--gpus-per-node", type=int, default=128, help="GPUs each node declares")
    parser.add_argument("--cpus-per-node", type=int, default=8, help="CPUs each node declares (0.5 per replica)")
    parser.add_argument("--tp", type=int, default=8, help="GPUs per replica (tensor parallel)")
    parser.add_argument("--hold", type=float, default=10.0, help="seconds the registry is watched once ready")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--kill", action="store_true", help="kill one replica and time its replacement")
    args = parser.parse_args()

    from tessera.redis_conn import EmbeddedRedis

    model_dir = str(bench_model("tessera-small"))  # its tokenizer is what the replicas register for gateways
    redis = EmbeddedRedis().start()
    # Before the first node starts: every Ray process (raylets, Serve controller, replicas) inherits them.
    os.environ.update({"TESSERA_REDIS_URL": redis.url, "RAY_USAGE_STATS_ENABLED": "0",
                       "RAY_SERVE_SLOW_STARTUP_WARNING_S": "5"})
    available_before = psutil.virtual_memory().available / 2**30
    load_before = os.getloadavg()
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from tessera.engine.deployment import build_app

    t0 = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False})
    result: dict[str, Any] = {}
    try:
        for _ in range(args.nodes):
            cluster.add_node(num_cpus=args.cpus_per_node, num_gpus=args.gpus_per_node)
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        serve.start(proxy_location="Disabled")
        cluster_s = time.monotonic() - t0
        print(f"[bench] cluster of {args.nodes} nodes x {args.gpus_per_node} GPUs up in {cluster_s:.1f} s; deploying "
              f"{args.replicas} simulated replicas (TP {args.tp}); load average {os.getloadavg()[0]:.1f}", flush=True)
        deployed_at = time.monotonic()
        serve._run(build_app({"engine": sim_engine(model_dir, args.tp), "replicas": args.replicas}),
                   name=APP, route_prefix=None, _blocking=False)
        timeline: list[tuple[float, int, int]] = []
        all_running_s = all_live_s = None
        while all_running_s is None or all_live_s is None:
            now = time.monotonic() - deployed_at
            if now > args.ready_timeout:
                raise TimeoutError(f"not ready after {args.ready_timeout} s: {timeline[-1:]}")
            running, live = running_replicas(), len(live_ids(redis.url))
            timeline.append((round(now, 2), running, live))
            if all_running_s is None and running >= args.replicas:
                all_running_s = now
            if all_live_s is None and live >= args.replicas:
                all_live_s = now
            if len(timeline) % 10 == 0:
                print(f"[bench] {now:.0f} s: {running} running, {live} live (load {os.getloadavg()[0]:.1f})",
                      flush=True)
            time.sleep(0.5)
        load_ready = os.getloadavg()
        # Every node's processes (the raylets start the workers; the head also runs the GCS and Serve's controller).
        roots = [p.process.pid for n in cluster.list_all_nodes() for ps in n.all_processes.values() for p in ps]
        replicas, everything = ray_processes(roots)
        memory = {"replica_processes": len(replicas), "replica_rss_mib": memory_mib(replicas, False),
                  "replica_uss_mib": memory_mib(replicas, True), "ray_processes": len(everything),
                  "ray_rss_mib": memory_mib(everything, False), "ray_uss_mib": memory_mib(everything, True),
                  "available_gib_before": available_before,
                  "available_gib_ready": psutil.virtual_memory().available / 2**30}
        print(f"[bench] all running in {all_running_s:.1f} s, all live in {all_live_s:.1f} s; {memory}", flush=True)

        samples = []
        hold_until = time.monotonic() + args.hold
        while time.monotonic() < hold_until:
            samples.append(len(live_ids(redis.url)))
            time.sleep(0.5)
        kill: dict[str, Any] = {}
        if args.kill:
            answer = serve.get_app_handle(APP).remote(None).result(timeout_s=60)
            before = live_ids(redis.url)
            os.kill(int(answer["pid"]), signal.SIGKILL)
            killed_at = time.monotonic()
            while True:
                ids = live_ids(redis.url)
                if answer["engine_id"] not in ids and len(ids) >= args.replicas:
                    break
                if time.monotonic() - killed_at > 120:
                    raise TimeoutError("no replacement within 120 s")
                time.sleep(0.25)
            kill = {"replaced_in_registry_s": time.monotonic() - killed_at, "new": sorted(ids - before)}
            print(f"[bench] killed {answer['engine_id']}: replacement live in {kill['replaced_in_registry_s']:.1f} s",
                  flush=True)
        result = {
            "benchmark": "ray_fleet", "replicas": args.replicas, "nodes": args.nodes,
            "gpus_per_node": args.gpus_per_node, "cpus_per_node": args.cpus_per_node, "tp": args.tp,
            "cluster_start_s": cluster_s, "all_running_s": all_running_s, "all_live_in_registry_s": all_live_s,
            "memory": memory, "registry_hold_samples": samples,
            "registry_all_live_share": sum(1 for s in samples if s >= args.replicas) / max(1, len(samples)),
            "kill": kill, "timeline": timeline, "loadavg_before": load_before, "loadavg_ready": load_ready,
            "loadavg_end": os.getloadavg(), "cpus": os.cpu_count(),
        }
    finally:
        t_stop = time.monotonic()
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
            redis.stop()
        print(f"[bench] cluster stopped in {time.monotonic() - t_stop:.1f} s", flush=True)
    path = write_results("ray_fleet", result)
    m = result["memory"]
    print_table(["replicas", "TP", "cluster s", "all RUNNING s", "all live s", "replica RSS MiB (sum)",
                 "replica USS MiB (sum)", "USS/replica MiB", "Ray RSS MiB", "all-live share", "replaced s",
                 "load 1m"],
                [[args.replicas, args.tp, result["cluster_start_s"], result["all_running_s"],
                  result["all_live_in_registry_s"], m["replica_rss_mib"], m["replica_uss_mib"],
                  m["replica_uss_mib"] / max(1, m["replica_processes"]), m["ray_rss_mib"],
                  result["registry_all_live_share"], kill.get("replaced_in_registry_s", "-"),
                  result["loadavg_ready"][0]]])
    print(f"results: {path}")


if __name__ == "__main__":
    main()
