"""The replica in the registry: a heartbeat while its engine is alive, and a clean exit on stop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tessera.redis_conn import connect
from tessera.registry import EngineRecord, EngineRegistry, ModelInfo, register_model
from tessera.routing.prefix_index import PrefixIndex
from tessera.swallowed_cancel import raise_if_cancelled

logger = logging.getLogger(__name__)


async def heartbeat_loop(redis_url: str, interval_s: float, model: ModelInfo, is_healthy: Callable[[], bool],
                         record: Callable[[], EngineRecord], leaving: Callable[[], bool] = lambda: False) -> None:
    """Registers ``model`` once and the replica's ``record()`` every ``interval_s`` while ``is_healthy()``,
    until cancelled or ``leaving()``. NOTE: ``leaving``, not the cancellation alone: Python 3.11's
    ``asyncio.wait_for`` (inside redis-py) can swallow a cancellation that lands as a beat's write completes,
    and a loop that went on beating registered a draining replica again after it left (test_gateway_drain
    under a loaded `make test`: 21 s in the registry after its drain began). A cancellation swallowed that way
    is still counted on the task (``Task.cancelling``): ``connect``'s connections now raise it at the write
    (swallowed_cancel.py), and the loop honours one lost anywhere else at its next beat, so a caller that cancels
    without ``leaving`` (a test, an engine host torn down) never waits on a loop that never ends."""
    redis = connect(redis_url)
    registry = EngineRegistry(redis, interval_s)
    model_registered = False
    try:
        while not leaving():
            raise_if_cancelled()  # one lost on the way (see the NOTE)
            # A dead engine stops heartbeating, so the gateway stops routing to it within the TTL. A Redis
            # error is retried on the next beat: one slow answer at start-up must not leave the replica
            # serving but unregistered for good.
            if is_healthy():
                try:
                    if not model_registered:
                        await register_model(redis, model)
                        model_registered = True
                    await registry.heartbeat(record())
                except Exception as exc:
                    logger.warning("heartbeat to Redis failed: %s", exc)
            await asyncio.sleep(interval_s)
    finally:
        await redis.aclose()


async def deregister(redis_url: str, engine_id: str) -> None:
    """Takes the replica out of the registry and its blocks out of the prefix index."""
    # Not on a request path: a busy Redis gets time, so the index does not keep a stopped engine's blocks.
    redis = connect(redis_url, timeout_s=5.0)
    try:
        await EngineRegistry(redis).deregister(engine_id)
        await PrefixIndex(redis).clear_engine(engine_id)
    except Exception as exc:
        logger.warning("deregister failed: %s", exc)
    finally:
        await redis.aclose()
