"""Simulated engines as Ray Serve replicas on a real multi-node Ray cluster (nodes declaring GPUs): the fleet
path real engines use, with ``backend: sim`` instead of vLLM (engine/sim/serve_replica.py).

REPLICAS replicas are deployed through the real application builder (``build_app``, as the chart's
serveConfigV2), each asking Ray for one GPU by the engine's own placement code; they all register through
the real heartbeat and are discovered by a real gateway, which routes to them (its default policy,
prefix_affinity, from the index their own KV events feed); one replica's actor process is killed with
SIGKILL, Ray Serve replaces it, and the registry follows: the dead replica drops out, a new one registers.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tessera.redis_conn import EmbeddedRedis
from tests.support.gateways import GatewayProcess, running_gateways
from tests.support.ray_cluster import ClusterDriver, live_engines, wait_for
from tests.support.routing_stack import issue_tenant_key

APP, MODEL = "sim-fleet", "sim-on-ray"
# More replicas than the package cluster's 4 declared GPUs: one more node (2 GPUs) for the test's duration.
REPLICAS = 6
PROMPT = "a simulated engine on a Ray Serve replica keeps the prefix it cached " * 4


def sim_engine(model_dir: Path) -> dict[str, Any]:
    """A small simulated engine asking for one GPU, as a TP=1 GPU replica; the model directory is read for
    its tokenizer only (the gateways tokenize with it)."""
    return {"model": str(model_dir), "servedModelName": MODEL, "backend": "sim", "accelerator": "gpu",
            "blockSize": 16, "maxModelLen": 512, "numGpuBlocksOverride": 256, "heartbeatIntervalS": 0.5,
            "drainTimeoutS": 2, "speculative": None,
            "sim": {"stepTime": "measured", "stepS": 0.002, "perSeqS": 0.0005, "perPrefillTokenS": 1e-5}}


def registered(redis_url: str) -> dict[str, str]:
    """engine id -> URL of MODEL's replicas in the registry."""
    return {r.engine_id: r.url for r in live_engines(redis_url) if r.model == MODEL}


@pytest.fixture
def sim_app(cluster: ClusterDriver, small_model_dir: Path) -> Iterator[str]:
    extra_node = cluster.call("add_gpu_node")
    try:
        cluster.call("run_engine", APP, sim_engine(small_model_dir), REPLICAS, timeout_s=180)
        yield APP
    finally:
        cluster.call("delete", APP)
        cluster.call("remove_node", extra_node)


@pytest.fixture
def gateway(redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[GatewayProcess]:
    env = {"TESSERA_REDIS_TIMEOUT_S": "2.0", "TESSERA_REGISTRY_REFRESH_S": "0.25"}
    with running_gateways(1, redis_server.url, tmp_path, env) as (process,):
        yield process


def complete(gateway: GatewayProcess, key: str) -> tuple[str, int]:
    """(engine, cached prompt tokens) of one completion through the gateway."""
    response = httpx.post(f"{gateway.url}/v1/completions", timeout=30, headers={"authorization": f"Bearer {key}"},
                          json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return response.headers["x-tessera-engine"], int((usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                                                     or 0)


def test_sim_replicas_register_serve_through_a_gateway_and_ray_replaces_a_killed_one(
        sim_app: str, cluster: ClusterDriver, gateway: GatewayProcess, redis_server: EmbeddedRedis) -> None:
    redis_url = redis_server.url
    before = wait_for(lambda: len(ids := registered(redis_url)) == REPLICAS and ids, 60,
                      f"{REPLICAS} simulated replicas in the registry")
    status = cluster.call("status", sim_app)
    assert status["deployments"][f"engine-{MODEL}"]["replica_states"] == {"RUNNING": REPLICAS}

    # Placed as a GPU replica by the same placement code: each owns one declared GPU, its own.
    answers = [cluster.call("ask", sim_app) for _ in range(8)]
    for answer in answers:
        (gpu,) = answer["devices"]["gpu_ids"]
        assert answer["devices"]["cuda_visible_devices"] == gpu
        assert answer["engine_id"] in before and answer["url"] == before[answer["engine_id"]]
        # Its startup heap frozen (tessera.telemetry.gc_heap), as vLLM's own server does: no full collection walks it.
        assert answer["gc_frozen_objects"] > 10_000
    assert len({(a["devices"]["node_id"], a["devices"]["gpu_ids"][0]) for a in answers}) == len(
        {a["engine_id"] for a in answers})

    # A real gateway discovers them and routes to them; the repeated prompt goes where its blocks are cached
    # (the index their KV events feed).
    key, _ = issue_tenant_key(redis_url, f"sim-ray-{time.monotonic_ns()}")
    first_engine, _ = complete(gateway, key)
    assert first_engine in before
    time.sleep(0.5)  # the first request's blocks reach the index
    again, cached = complete(gateway, key)
    assert (again, cached > 0) == (first_engine, True)

    # Kill one replica's actor process: Serve replaces it, and the registry follows.
    victim = answers[0]
    os.kill(int(victim["pid"]), signal.SIGKILL)
    after = wait_for(lambda: (ids := registered(redis_url)) and victim["engine_id"] not in ids
                     and len(ids) == REPLICAS and ids, 60,
                     "the killed replica out of the registry and its replacement in")
    (replacement,) = set(after) - set(before)
    assert set(before) - set(after) == {victim["engine_id"]}
    cluster.wait_for_replica_states(sim_app, f"engine-{MODEL}", lambda states: states == {"RUNNING": REPLICAS}, 30,
                                    "Serve back at all replicas running")
    assert httpx.get(f"{after[replacement]}/health", timeout=10).status_code == 200
    engine, _ = complete(gateway, key)
    assert engine in after
