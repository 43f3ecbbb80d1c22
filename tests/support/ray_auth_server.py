"""A stand-in for a Ray 2.60 node's dashboard agent (52365) and head dashboard (8265) behind Ray's own token
middleware, with the public paths each of Ray's servers declares. Run as a script, with RAY_AUTH_MODE=token
and RAY_AUTH_TOKEN set (Ray reads them once per process): prints "<agent port> <head port>" and serves until
killed. tests/unit/helm/test_helm_ray_auth_probes.py points the chart's probes at it."""

from __future__ import annotations

import ast
import asyncio
import inspect
import json

import aiohttp
from aiohttp import web
from ray._private.authentication.http_token_authentication import get_token_auth_middleware
from ray.dashboard import http_server_agent, http_server_head


def head_public_paths() -> set[str]:
    """The exact paths Ray's head dashboard serves without a token (a literal inside HttpServerDashboardHead.run)."""
    for node in ast.walk(ast.parse(inspect.getsource(http_server_head))):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "public_exact_paths" for t in node.targets):
            paths: set[str] = ast.literal_eval(node.value)
            return paths
    raise AssertionError("Ray's head dashboard no longer lists public_exact_paths")


async def _success(_: web.Request) -> web.Response:
    return web.Response(text="success")


async def _applications(_: web.Request) -> web.Response:
    return web.Response(text=json.dumps({"applications": {}}), content_type="application/json")


async def main() -> None:
    agent = web.Application(middlewares=[get_token_auth_middleware(aiohttp, http_server_agent.PUBLIC_EXACT_PATHS)])
    agent.router.add_get("/api/local_raylet_healthz", _success)
    head = web.Application(middlewares=[get_token_auth_middleware(aiohttp, head_public_paths(), ("/static/",))])
    head.router.add_get("/api/gcs_healthz", _success)
    head.router.add_get("/api/serve/applications/", _applications)
    ports = []
    for app in (agent, head):
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ports.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    print(*ports, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
