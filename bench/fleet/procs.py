"""The processes a fleet run needs: a simulated fleet (``tessera engine sim``, one process, all replicas)
and vLLM's Rust router in front of it; and what is read from the fleet after a run (each replica's /stats,
its registry record).

Each (size, policy) run gets a fresh fleet: every policy starts from cold caches, and nothing one policy
left queued or cached reaches the next.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from fleet.summary import EngineStat

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / ".venv" / "bin"
STACK_VENV = REPO / ".venv-bench-stack"
VLLM_ROUTER = STACK_VENV / "bin" / "vllm-router"
FLEET_START_TIMEOUT_S = 180.0
ROUTER_START_TIMEOUT_S = 180.0
STATS_CONCURRENCY = 32


class RouterUnavailable(RuntimeError):
    """vllm-router is not installed here, or did not start: its rows are skipped, and the reason recorded."""


def _stop_group(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@dataclass
class Fleet:
    proc: subprocess.Popen[bytes]
    urls: list[str]
    log: Path

    def stop(self) -> None:
        _stop_group(self.proc)


def start_fleet(num_engines: int, sim_config: dict[str, Any], redis_url: str, work: Path, tag: str) -> Fleet:
    """``tessera engine sim`` with ``num_engines`` replicas, registered in ``redis_url``; returns once serving."""
    ready = work / f"fleet-{tag}.json"
    log = work / f"fleet-{tag}.log"
    ready.unlink(missing_ok=True)
    cmd = [str(BIN / "tessera"), "engine", "sim", "--num-engines", str(num_engines), "--config",
           json.dumps(sim_config), "--ready-file", str(ready), "--engine-id-prefix", f"fleet-{tag}"]
    env = {**os.environ, "TESSERA_REDIS_URL": redis_url, "TESSERA_TRACE_EXPORTER": "none"}
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, process_group=0)
    deadline = time.monotonic() + FLEET_START_TIMEOUT_S
    while not ready.exists() or not ready.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop_group(proc)
            raise RuntimeError(f"the simulated fleet did not start; see {log}")
        time.sleep(0.2)
    time.sleep(0.1)  # the ready file is written in one call; a read racing it sees it whole the next time
    return Fleet(proc, json.loads(ready.read_text()), log)


async def wait_registered(redis_url: str, urls: list[str], timeout_s: float = 60.0) -> dict[str, Any]:
    """Waits until the registry's live engines are exactly ``urls`` (the previous fleet gone); returns the
    records by URL."""
    from tessera.redis_conn import connect
    from tessera.registry import EngineRegistry

    redis = connect(redis_url, timeout_s=5.0)
    try:
        registry = EngineRegistry(redis)
        wanted = set(urls)
        deadline = time.monotonic() + timeout_s
        while True:
            records = await registry.live_engines()
            by_url = {r.url: r for r in records}
            if set(by_url) == wanted:
                return by_url
            if time.monotonic() > deadline:
                raise RuntimeError(f"registry holds {len(wanted & set(by_url))} of {len(wanted)} fleet engines "
                                   f"and {len(set(by_url) - wanted)} others after {timeout_s:.0f} s")
            await asyncio.sleep(0.3)
    finally:
        await redis.aclose()


async def fleet_stats(urls: list[str]) -> list[EngineStat]:
    """Every replica's signed /stats."""
    from _support import signed_headers

    limit = asyncio.Semaphore(STATS_CONCURRENCY)
    async with httpx.AsyncClient(timeout=30.0, limits=httpx.Limits(max_connections=STATS_CONCURRENCY)) as client:
        async def one(url: str) -> EngineStat:
            async with limit:
                resp = await client.get(f"{url}/stats", headers=signed_headers("GET", "/stats"))
            resp.raise_for_status()
            s = resp.json()
            return EngineStat(s["engine_id"], float(s["busy_s"]), int(s["prefix_queries"]), int(s["prefix_hits"]),
                              int(s["num_preemptions"]))

        return list(await asyncio.gather(*(one(u) for u in urls)))


# Its Prometheus series kept with a run's row: how its policy decided (KV lookups and their inputs, tree
# hits and misses, load-balancing overrides), which its HTTP answers do not say.
ROUTER_METRICS = ("vllm_router_kv_", "vllm_router_cache_", "vllm_router_tree_size", "vllm_router_policy_decisions",
                  "vllm_router_load_balancing_events", "vllm_router_prefix_routing_decisions")


@dataclass
class VllmRouter:
    proc: subprocess.Popen[bytes]
    url: str
    command: list[str]
    log: Path
    metrics_url: str

    def metrics(self) -> list[str]:
        """Its policy's Prometheus series (ROUTER_METRICS), as exposition lines; [] if unreadable."""
        try:
            text = httpx.get(self.metrics_url, timeout=10).text
        except httpx.HTTPError:
            return []
        return [ln for ln in text.splitlines() if ln.startswith(ROUTER_METRICS)]

    def stop(self) -> None:
        _stop_group(self.proc, timeout_s=20.0)

    def rss_bytes(self) -> int | None:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None


def router_version() -> str | None:
    try:
        out = subprocess.run([str(STACK_VENV / "bin" / "pip"), "show", "vllm-router"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return next((ln.split(":", 1)[1].strip() for ln in out.stdout.splitlines() if ln.startswith("Version:")), None)


def start_vllm_router(policy: str, urls: list[str], kv_endpoints: dict[str, str], model: str, block_size: int,
                      work: Path, tag: str, log_level: str = "warning") -> VllmRouter:
    """vllm-router with ``policy`` (``cache_aware`` or ``kv_aware``) in front of the fleet's OpenAI routes;
    kv_aware subscribes to each replica's KV-event publisher (``--kv-event-source URL=ENDPOINT``)."""
    if not VLLM_ROUTER.exists():
        raise RouterUnavailable(f"{VLLM_ROUTER} is missing (make bench-fleet installs vllm-router==0.1.17 there)")
    from tests.support.machine import free_port

    port, metrics_port = free_port(), free_port()
    log = work / f"vllm-router-{tag}.log"
    cmd = [str(VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--worker-urls", *urls, "--log-level", log_level, "--worker-startup-check-interval", "1",
           "--prometheus-port", str(metrics_port), "--disable-retries", "--disable-circuit-breaker",
           "--health-check-interval-secs", "600"]
    if policy == "kv_aware":
        for url in urls:
            cmd += ["--kv-event-source", f"{url}={kv_endpoints[url]}"]
        cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, process_group=0)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-5:])
            raise RouterUnavailable(f"vllm-router exited with code {proc.returncode}: {tail[-800:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return VllmRouter(proc, url, cmd, log, f"http://127.0.0.1:{metrics_port}/metrics")
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    _stop_group(proc)
    raise RouterUnavailable(f"vllm-router did not answer {url}/v1/models within {ROUTER_START_TIMEOUT_S:.0f} s; "
                            f"see {log}")
