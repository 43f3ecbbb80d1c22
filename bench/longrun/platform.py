"""The local platform for the long-running benches, and what they read of it.

``start_platform`` is ``LocalPlatform`` as ``tessera up`` and the end-to-end tests start it (embedded Redis
with its append-only file, Ray Serve with the engine replicas, the gateway, the KV-eviction controller), in
this process's session. The readers walk only this process's own descendants: other engineers' Ray clusters
on the same machine have processes with the same titles.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

from tessera.local.platform import LocalPlatform, LocalPlatformOptions
from tessera.tenancy.policy import TenantPolicy

REPLICA_TITLE = "ServeReplica:tessera-engines"


def start_platform(work: Path, model_dir: Path, *, num_engines: int = 1, gateway_port: int,
                   extra_env: dict[str, str] | None = None, max_model_len: int = 1024,
                   kv_blocks: int | None = None) -> LocalPlatform:
    """``kv_blocks``: each engine's KV cache in blocks (``num_gpu_blocks_override``); None sizes it from
    ``VLLM_CPU_KVCACHE_SPACE`` as ``tessera up`` does."""
    overrides: dict[str, Any] = {"served_model_name": "tessera-small", "max_model_len": max_model_len}
    if kv_blocks is not None:
        overrides["num_gpu_blocks_override"] = kv_blocks
    platform = LocalPlatform(LocalPlatformOptions(
        state_dir=work / "state", model_dir=model_dir, num_engines=num_engines, gateway_port=gateway_port,
        gateway_workers=2, trace_dir=work / "traces", extra_env=extra_env or {}, engine_overrides=overrides))
    try:
        platform.start()
    except BaseException:
        platform.stop()
        raise
    return platform


def create_tenants(platform: LocalPlatform, names: Iterable[str],
                   policy: TenantPolicy | None = None) -> dict[str, str]:
    """name -> a new API key, each tenant created with ``policy`` (None: the defaults)."""
    import asyncio

    return {name: asyncio.run(platform.create_tenant(name, policy)) for name in names}


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def replica_pids() -> list[int]:
    """The engine replica actors among this process's descendants (``ray::ServeReplica:tessera-engines:...``)."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            if REPLICA_TITLE in " ".join([proc.name(), *proc.cmdline()]):
                found.append(proc.pid)
    return found


def rss_bytes(pids: Iterable[int]) -> int:
    """Resident memory of these processes and all their descendants (each counted once)."""
    seen: dict[int, int] = {}
    for pid in pids:
        for proc in _tree(pid):
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                seen[proc.pid] = proc.memory_info().rss
    return sum(seen.values())


def inet_sockets(pid: int) -> int:
    """Open TCP/UDP sockets of a process tree (the gateway's: client, engine and Redis connections)."""
    total = 0
    for proc in _tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            total += len(proc.net_connections(kind="inet"))
    return total


def component_cpu_s(platform: LocalPlatform) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each part of the platform among this process's descendants:
    the gateway's tree, the engine replicas' trees (vLLM's engine core and worker included), the KV controller,
    Redis, everything else (Ray's processes), and this process (the load generator's client). Differences
    between two samples say which part's cost per request grew."""
    def cpu(proc: psutil.Process) -> float:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            times = proc.cpu_times()
            return float(times.user + times.system)
        return 0.0

    owner: dict[int, str] = {}
    for part, roots in (("gateway", [gateway_pid(platform)]), ("engine", replica_pids())):
        for root in roots:
            owner.update({proc.pid: part for proc in _tree(root)})
    totals = {"gateway": 0.0, "engine": 0.0, "kvcontrol": 0.0, "redis": 0.0, "ray_other": 0.0,
              "client": cpu(psutil.Process())}
    for proc in psutil.Process().children(recursive=True):
        name = owner.get(proc.pid)
        if name is None:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                line = " ".join(proc.cmdline())
                name = ("kvcontrol" if "tessera-kvcontrol" in line
                        else "redis" if "valkey-server" in line else "ray_other")
        totals[name or "ray_other"] += cpu(proc)
    # The whole machine's: what ran beside the platform (busy CPU not ours; "outside" is read against the
    # parts' sum per window) and what the hypervisor took (steal: a VM whose host is busy stalls every
    # process at once, which looks like a slow window of ours).
    machine = psutil.cpu_times()
    totals["machine_busy"] = machine.user + machine.nice + machine.system + machine.irq + machine.softirq
    totals["machine_steal"] = getattr(machine, "steal", 0.0)
    return {k: round(v, 2) for k, v in totals.items()}


@dataclass(frozen=True, slots=True)
class RedisStats:
    keys: int
    used_memory_bytes: int
    connected_clients: int


def redis_stats(url: str) -> RedisStats:
    with redis.Redis.from_url(url, socket_timeout=5) as client:
        memory: dict[str, Any] = client.info("memory")
        clients: dict[str, Any] = client.info("clients")
        return RedisStats(int(client.dbsize()), int(memory["used_memory"]), int(clients["connected_clients"]))


def redis_persistence(url: str) -> dict[str, int]:
    """Redis's forks so far (an AOF rewrite forks: on 2 cores the copy competes with everything else), the
    last fork's microseconds and the AOF's size: whether a slow window had a rewrite in it."""
    with redis.Redis.from_url(url, socket_timeout=5) as client:
        stats: dict[str, Any] = client.info("stats")
        persistence: dict[str, Any] = client.info("persistence")
        return {"total_forks": int(stats.get("total_forks", 0)),
                "latest_fork_usec": int(stats.get("latest_fork_usec", 0)),
                "aof_current_size": int(persistence.get("aof_current_size", 0))}


def key_families(url: str, depth: int = 2) -> dict[str, int]:
    """Keys by their first ``depth`` colon-separated parts (``tessera:pfx``...), most numerous first:
    which family a growing key count comes from."""
    from collections import Counter

    families: Counter[str] = Counter()
    with redis.Redis.from_url(url, socket_timeout=5) as client:
        for key in client.scan_iter(count=1000):
            text = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
            families[":".join(text.split(":")[:depth])] += 1
    return dict(families.most_common(15))


def gateway_pid(platform: LocalPlatform) -> int:
    assert platform.gateway is not None, "start() first"
    return platform.gateway.pid


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


GC_PARTS = ("gateway", "engine", "kvcontrol")
LONG_PAUSE_S = 0.05  # a bucket bound of tessera.telemetry.gc_heap.PAUSE_BUCKETS_S


class GcScraper:
    """Per part, from its /metrics (tessera.telemetry.gc_heap): full collections so far, their total seconds,
    collections of any generation longer than 50 ms, and objects frozen at start. A part that does not answer is
    left out. One HTTP client for the whole run, and only the ``tessera_gc_`` lines parsed: a fresh
    ``httpx.get`` built a TLS context each time (~22 ms of this process's CPU a scrape) and the engine's 55 kB
    of vLLM series took 12 ms to parse, at every window's end, on the two cores the platform serves from."""

    def __init__(self, platform: LocalPlatform) -> None:
        self._platform = platform
        self._client = httpx.Client(timeout=5)

    def close(self) -> None:
        self._client.close()

    def __call__(self) -> dict[str, dict[str, float]]:
        from _support import signed_headers
        from prometheus_client.parser import text_string_to_metric_families

        targets: dict[str, list[tuple[str, dict[str, str]]]] = {
            "gateway": [(self._platform.gateway_metrics_url, {})],
            "kvcontrol": [(self._platform.kvcontrol_metrics_url, {})],
            "engine": [(f"{url}/metrics", signed_headers("GET", "/metrics")) for url in self._engine_urls()]}
        out: dict[str, dict[str, float]] = {}
        for part, urls in targets.items():
            totals = {"full_collections": 0.0, "full_collection_s": 0.0, "long_pauses": 0.0, "frozen_objects": 0.0}
            for url, headers in urls:
                try:
                    text = self._client.get(url, headers=headers).text
                except httpx.HTTPError:
                    continue
                ours = "\n".join(line for line in text.splitlines() if "tessera_gc_" in line)
                for family in text_string_to_metric_families(ours):
                    for s in family.samples:
                        if s.name == "tessera_gc_frozen_objects":
                            totals["frozen_objects"] += s.value
                        elif s.name == "tessera_gc_pause_seconds_count" and s.labels.get("generation") == "2":
                            totals["full_collections"] += s.value
                        elif s.name == "tessera_gc_pause_seconds_sum" and s.labels.get("generation") == "2":
                            totals["full_collection_s"] += s.value
                        elif s.name == "tessera_gc_pause_seconds_bucket":
                            le = s.labels.get("le")
                            totals["long_pauses"] += (s.value if le == "+Inf"
                                                      else -s.value if le == str(LONG_PAUSE_S) else 0)
                out[part] = totals
        return out

    def _engine_urls(self) -> list[str]:
        import asyncio

        from tessera.redis_conn import connect
        from tessera.registry import EngineRegistry

        async def read() -> list[str]:
            redis = connect(self._platform.redis_url, timeout_s=5)
            try:
                return [record.url for record in await EngineRegistry(redis).live_engines()]
            finally:
                await redis.aclose()

        return asyncio.run(read())
