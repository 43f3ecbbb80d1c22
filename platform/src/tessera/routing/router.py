"""The gateway-side adapter around the pure policies: reads the registry and prefix index from Redis,
keeps this process's in-flight counts, and asks the configured policy for a ranking."""

from __future__ import annotations

import time
from collections import defaultdict

import redis.asyncio as aioredis

from tessera.engine.registry import EngineRecord, EngineRegistry
from tessera.routing.policies import make_policy
from tessera.routing.snapshot import EngineView, RouteDecision, RouteRequest, RouteSnapshot

# Engine load changes fast, but heartbeats are once a second: re-reading the registry more often than
# this only costs Redis round trips on the request path.
REGISTRY_CACHE_S = 0.25


class Router:
    def __init__(self, redis: aioredis.Redis, policy_name: str, prefix_index: object | None = None) -> None:
        self._registry = EngineRegistry(redis)
        self.policy_name = policy_name
        self._policy = make_policy(policy_name)
        self._prefix_index = prefix_index
        self._engines: list[EngineRecord] = []
        self._read_at = 0.0
        self.in_flight: dict[str, int] = defaultdict(int)

    async def engines(self, model: str) -> list[EngineRecord]:
        if time.monotonic() - self._read_at > REGISTRY_CACHE_S:
            self._engines = await self._registry.live_engines()
            self._read_at = time.monotonic()
        return [e for e in self._engines if e.model == model]

    async def route(self, request: RouteRequest) -> tuple[RouteDecision, dict[str, EngineRecord]]:
        records = await self.engines(request.model)
        views = tuple(
            EngineView(r.engine_id, r.url, r.num_running, r.num_waiting, r.kv_cache_usage, r.num_gpu_blocks,
                       r.block_size, r.under_pressure)
            for r in records
        )
        cached: dict[str, int] = {}
        if self._prefix_index is not None and request.block_hashes and views:
            cached = await self._prefix_index.longest_prefixes(  # type: ignore[attr-defined]
                request.block_hashes, [v.engine_id for v in views]
            )
        snapshot = RouteSnapshot(views, cached, dict(self.in_flight))
        return self._policy(snapshot, request), {r.engine_id: r for r in records}

    def started(self, engine_id: str) -> None:
        self.in_flight[engine_id] += 1

    def finished(self, engine_id: str) -> None:
        self.in_flight[engine_id] -= 1
        if self.in_flight[engine_id] <= 0:
            del self.in_flight[engine_id]
