"""Process start-up: kopf settings for least privilege, the Redis and Kubernetes clients, then kopf."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tessera.redis_conn import check_eviction_policy, connect
from tessera.registry import EngineRegistry
from tessera.tenancy.store import TenantStore

from .discovery import start_discovery
from .handlers import OperatorContext
from .kube import KubernetesApi
from .settings import OperatorSettings

_log = logging.getLogger(__name__)


@kopf.on.startup()
async def operator_startup(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    operator_settings: OperatorSettings = memo.operator_settings
    # NOTE: the Role grants nothing cluster-wide, so kopf must not scan namespaces or CRDs, nor keep its
    # progress in objects it cannot create (peering is off: one replica runs standalone).
    settings.scanning.disabled = True
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="tessera.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="tessera.dev")
    settings.persistence.finalizer = "tessera.dev/operator"
    settings.posting.level = logging.WARNING
    if not operator_settings.redis_url:
        raise kopf.PermanentError("TESSERA_REDIS_URL is not set: the operator keeps tenants in Redis")
    # Longer timeouts than the request path's: the operator is not latency-bound.
    redis = connect(operator_settings.redis_url, timeout_s=5.0)
    memo.redis = redis
    registry = EngineRegistry(redis)
    memo.tessera = OperatorContext(
        store=TenantStore(redis),
        kube=KubernetesApi(),
        ray_service=operator_settings.operator_ray_service,
        registry=registry,
    )
    if operator_settings.operator_discovery_port:
        memo.discovery = await start_discovery(registry, operator_settings.operator_discovery_port)
    await _warn_if_redis_evicts(redis)


async def _warn_if_redis_evicts(redis: aioredis.Redis) -> None:
    """An evicting Redis would silently drop what the operator writes (and budgets): say so at start. Not
    fatal: the tenants are still served, and an unreachable Redis is the handlers' TemporaryError to report."""
    try:
        problem = await check_eviction_policy(redis)
    except RedisError as exc:
        _log.warning("could not read Redis's maxmemory-policy: %s", exc)
        return
    if problem is not None:
        _log.error("%s", problem)


@kopf.on.cleanup()
async def operator_cleanup(memo: Any, **_: Any) -> None:
    discovery = getattr(memo, "discovery", None)
    if discovery is not None:
        await discovery.cleanup()
    redis = getattr(memo, "redis", None)
    if redis is not None:
        await redis.aclose()


def run() -> None:
    settings = OperatorSettings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(
        kopf.operator(
            standalone=True,
            namespaces=[settings.operator_namespace],
            liveness_endpoint=f"http://0.0.0.0:{settings.operator_health_port}/healthz",
            memo=kopf.Memo(operator_settings=settings),
        )
    )
