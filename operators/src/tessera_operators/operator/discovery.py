"""The operator's HTTP endpoint for Prometheus' engine discovery (scrape_targets.py): GET
``SCRAPE_TARGETS_PATH`` answers the live replicas as HTTP-SD target groups, read from the registry per
request (Prometheus asks every refreshInterval, 30 s by default)."""

from __future__ import annotations

import json
import logging

from aiohttp import web
from redis.exceptions import RedisError

from tessera.registry import EngineRegistry

from .scrape_targets import SCRAPE_TARGETS_PATH, build_scrape_targets

_log = logging.getLogger(__name__)


def discovery_app(registry: EngineRegistry) -> web.Application:
    async def engine_targets(_: web.Request) -> web.Response:
        try:
            engines = await registry.live_engines()
        except RedisError as exc:
            # A failed refresh makes Prometheus keep the targets it had, which is the right fallback.
            _log.warning("engine targets: registry unreadable: %s", exc)
            return web.json_response({"error": f"engine registry unreadable: {exc}"}, status=503)
        return web.Response(text=json.dumps(build_scrape_targets(engines)), content_type="application/json")

    app = web.Application()
    app.router.add_get(SCRAPE_TARGETS_PATH, engine_targets)
    return app


async def start_discovery(registry: EngineRegistry, port: int, host: str = "0.0.0.0") -> web.AppRunner:
    """Serves ``discovery_app`` on ``host:port`` until the returned runner is cleaned up."""
    runner = web.AppRunner(discovery_app(registry), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
