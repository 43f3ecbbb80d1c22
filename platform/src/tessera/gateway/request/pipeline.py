"""One generation request, start to end: the order of the phases is ``GenerationPipeline.handle``.

    read  →  authenticate  →  parse  →  prompt  →  admit  →  route  →  call (stream | full)  →  settle

Each phase is a module of this package that reads what the earlier ones left on the ``RequestContext`` and
adds its own; an error is an ``APIError`` (the server answers it, or the stream's error event does).
The body is read before authentication (an oversized body is refused before any other work) and parsed
after it (a client without a valid key learns nothing about its body). Settling runs whenever admission
granted a lease, however the request ends.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tessera.gateway.request.admit import Admitter
from tessera.gateway.request.authenticate import authenticate
from tessera.gateway.request.call import call_engine
from tessera.gateway.request.context import RequestContext
from tessera.gateway.request.parse import parse, read
from tessera.gateway.request.prompt import prepare_prompt
from tessera.gateway.request.route import route
from tessera.gateway.request.settle import settle
from tessera.tenancy.billing import FinishQueue

if TYPE_CHECKING:
    from tessera.asgi import Receive, Send
    from tessera.gateway.auth import Authenticator
    from tessera.gateway.engine_client import EngineClient
    from tessera.gateway.failopen import FailOpen
    from tessera.gateway.metrics import GatewayMetrics
    from tessera.gateway.models import ModelCatalog
    from tessera.gateway.request.endpoint import Endpoint
    from tessera.redis_wire import RedisWire
    from tessera.routing.router import Router
    from tessera.telemetry.late_spans import LateTrace
    from tessera.tenancy.admission import Admission


class GenerationPipeline:
    """The phases and the services they use (nothing else: a phase gets what it needs by argument)."""

    def __init__(self, *, auth: Authenticator, catalog: ModelCatalog, admission: Admission, wire: RedisWire,
                 router: Router, engines: EngineClient, metrics: GatewayMetrics, fail_open: FailOpen,
                 finishes: FinishQueue, max_body_bytes: int) -> None:
        self.auth = auth
        self.catalog = catalog
        self.router = router
        self.engines = engines
        self.metrics = metrics
        self.fail_open = fail_open
        self.finishes = finishes
        self.admitter = Admitter(admission, wire, router, metrics, fail_open, finishes)
        self.max_body_bytes = max_body_bytes

    async def handle(self, endpoint: Endpoint, headers: dict[str, str], request_id: str, notes: LateTrace,
                     receive: Receive, send: Send) -> None:
        ctx = RequestContext(endpoint, headers, request_id, notes, receive, send, time.monotonic())
        await read(ctx, self.max_body_bytes)
        await authenticate(ctx, self.auth)
        parse(ctx)
        await prepare_prompt(ctx, self.catalog, self.fail_open)
        await self.admitter.run(ctx)
        keeper = self.admitter.keep_lease(ctx.lease) if ctx.lease is not None else None
        try:
            await route(ctx, self.router, self.fail_open)
            await call_engine(ctx, self.engines, self.router)
        finally:
            if keeper is not None:
                keeper.cancel()
            await settle(ctx, self.metrics, self.finishes)
