"""What the platform was doing when an end-to-end test failed, for the test's report: the engine replica's
in-flight requests and load (its own ``/requests`` and ``/stats``) and the tail of the Serve replicas' logs.
A request that timed out in CI says nothing of why; this does (an engine still busy with an earlier test's
stream, a wedged engine, a replica that restarted)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from tessera.local.platform import LocalPlatform
from tessera.redis_conn import connect
from tessera.registry import EngineRegistry
from tests.support.data_plane import ENGINE_AUTH

LOG_TAIL_LINES = 40


def describe_platform(platform: LocalPlatform) -> str:
    parts = []
    try:
        urls = asyncio.run(_engine_urls(platform.redis_url))
    except Exception as exc:  # a diagnostic never fails the report
        urls, parts = [], [f"registry unreadable: {exc!r}"]
    if not urls:
        parts.append("no engine replica registered")
    for url in urls:
        for path in ("/stats", "/requests"):
            try:
                response = httpx.get(f"{url}{path}", auth=ENGINE_AUTH, timeout=5)
                parts.append(f"GET {url}{path} -> {response.status_code}: {response.text[:4000]}")
            except httpx.HTTPError as exc:
                parts.append(f"GET {url}{path} failed: {exc!r}")
    parts.extend(_serve_log_tails())
    return "\n".join(parts)


async def _engine_urls(redis_url: str) -> list[str]:
    redis = connect(redis_url, timeout_s=5)
    try:
        return [record.url for record in await EngineRegistry(redis).live_engines()]
    finally:
        await redis.aclose()


def _serve_log_tails() -> list[str]:
    try:
        import ray

        node = ray._private.worker._global_node
        if node is None:
            return ["(no Ray session in this process)"]
        logs_dir = Path(node.get_logs_dir_path())
    except Exception as exc:
        return [f"(Ray's log directory unknown: {exc!r})"]
    tails = []
    for log in sorted((logs_dir / "serve").glob("replica_*.log")):
        lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        tails.append(f"--- {log.name} (last {len(lines)} lines)\n" + "\n".join(lines))
    return tails
