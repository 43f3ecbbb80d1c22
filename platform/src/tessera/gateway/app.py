"""The gateway: a stateless ASGI app (uvicorn + uvloop, several workers); all shared state is in Redis.

This module wires the services and dispatches by path; a generation request goes through the phases of
``request/pipeline.py`` (read → authenticate → parse → prompt → admit → route → call → settle). Raw ASGI
(``tessera.asgi``) rather than a framework: this is the hot path of every token.
"""

from __future__ import annotations

import asyncio
import logging

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagate import extract, get_global_textmap

from tessera.asgi import Receive, Scope, Send, header_map
from tessera.data_plane_auth import signer_from_settings
from tessera.gateway.admin import AdminAPI, usage_report
from tessera.gateway.auth import Authenticator
from tessera.gateway.drain import DRAIN_STATE_KEY, SETTLE_GRACE_S, GatewayDrain, answer_cut, draining_error
from tessera.gateway.engine_client import EngineClient
from tessera.gateway.errors import STORE_ERRORS, APIError, store_unavailable
from tessera.gateway.failopen import FailOpen
from tessera.gateway.finish_journal import FinishJournal, JournalConfig
from tessera.gateway.metrics import FLUSH_STATE_KEY, GatewayMetrics
from tessera.gateway.models import ModelCatalog, replicas_extension, tokenizer_document
from tessera.gateway.openapi import openapi_document
from tessera.gateway.request.authenticate import require_tenant
from tessera.gateway.request.call import process_unique_id
from tessera.gateway.request.endpoint import ENDPOINTS
from tessera.gateway.request.pipeline import GenerationPipeline
from tessera.gateway.responses import respond, respond_error
from tessera.gateway.settler import Settler
from tessera.redis_conn import connect
from tessera.redis_wire import RedisWire
from tessera.routing import pod_in_flight
from tessera.routing.prefix_index import PrefixIndex
from tessera.routing.router import Router
from tessera.settings import TesseraSettings, load_settings
from tessera.telemetry.late_spans import LateTrace
from tessera.telemetry.tracing import configure_tracing, span_lines
from tessera.tenancy.admission import Admission
from tessera.tenancy.billing import FinishQueue
from tessera.tenancy.store import TenantStore

logger = logging.getLogger(__name__)


def _is_store_error(exc: BaseException) -> bool:
    return isinstance(exc, STORE_ERRORS)


def new_request_id() -> str:
    """The id of a request without its own X-Request-Id: a label for logs and spans, made as the response ids
    are (no uuid4's getrandom system call per request); the engine request id is made apart (request/call.py)."""
    return process_unique_id("req-")


class Gateway:
    def __init__(self, settings: TesseraSettings) -> None:
        if not settings.redis_url:
            raise ValueError("TESSERA_REDIS_URL is not set: the gateway keeps all shared state in Redis")
        self.settings = settings
        configure_tracing("tessera-gateway", settings.trace_exporter, settings.trace_dir,
                          settings.otlp_endpoint, settings.trace_sample_ratio)
        self.redis = connect(settings.redis_url, settings.redis_timeout_s)
        # The request path's one round trip before the engine call (admission), its finish and the caches'
        # background refreshes (keys, registry, catalog) go over this lean connection; everything else uses
        # the redis-py client above (see redis_wire.py for why).
        self.wire = RedisWire(settings.redis_url, settings.redis_timeout_s)
        # The local prefix index's feed blocks on its stream reads: a lean connection of its own.
        self.feed_wire = RedisWire(settings.redis_url, settings.redis_timeout_s)
        self.store = TenantStore(self.redis, self.wire)
        self.auth = Authenticator(self.store, settings.key_cache_ttl_s, settings.redis_fail_open, _is_store_error)
        self.catalog = ModelCatalog(self.redis, refresh_s=settings.catalog_refresh_s,
                                    max_age_s=settings.catalog_max_age_s, wire=self.wire)
        self.admission = Admission(self.redis, settings.lease_ttl_s, self.wire, settings.kvcontrol_shards)
        self.router = Router(self.redis, settings.routing_policy, PrefixIndex(self.redis),
                             refresh_s=settings.registry_refresh_s, max_age_s=settings.registry_max_age_s,
                             wire=self.wire, index_source=settings.prefix_index,
                             local_index_max_blocks=settings.local_index_max_blocks, feed_wire=self.feed_wire,
                             pod=pod_in_flight.attach_from_env())
        self.engines = EngineClient(settings.engine_head_timeout_s, settings.engine_idle_timeout_s,
                                    settings.engine_total_timeout_s, signer_from_settings(settings, "a gateway"))
        self.metrics = GatewayMetrics()
        self.tracer = trace.get_tracer("tessera.gateway")
        # The headers the configured propagators read (traceparent, tracestate, baggage by default).
        self._trace_fields = frozenset(get_global_textmap().fields)
        # Finishes Redis did not take wait in a journal on disk (finish_journal.py); requests whose gateway
        # died are billed by the settler (settler.py), which every worker runs.
        journal_dir = settings.finish_journal_dir or settings.state_dir / "finish-journal"
        self.journal = FinishJournal(JournalConfig(journal_dir, settings.finish_journal_max_entries,
                                                   settings.finish_journal_fsync_s)).open()
        self.finishes = FinishQueue(self.admission, _is_store_error, self.journal)
        self.settler = Settler(self.redis, self.admission, settings.settle_interval_s, settings.settle_grace_s)
        self._settler_task: asyncio.Task[None] | None = None
        self.pipeline = GenerationPipeline(
            auth=self.auth, catalog=self.catalog, admission=self.admission, wire=self.wire, router=self.router,
            engines=self.engines, metrics=self.metrics, fail_open=FailOpen(settings.redis_fail_open),
            finishes=self.finishes, max_body_bytes=settings.max_body_bytes)
        self.admin = AdminAPI(self.store, self.admission, settings.admin_token)
        self.drain = GatewayDrain(settings.drain_timeout_s)  # begun by the server on SIGTERM (drain.py)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        headers = header_map(scope)
        request_id = headers.get("x-request-id") or new_request_id()
        if len(request_id) > 128:
            request_id = new_request_id()
        path, method = scope["path"], scope["method"]
        try:
            endpoint = ENDPOINTS.get(path)
            if endpoint is not None:
                if method != "POST":
                    raise APIError(405, f"{path} only accepts POST", "method_not_allowed")
                if self.drain.draining:
                    raise draining_error()
                # The request's spans are noted as it runs and made after it (see telemetry/late_spans.py).
                # Most requests carry no trace context: then there is nothing to extract.
                context = extract(headers) if not self._trace_fields.isdisjoint(headers) else Context()
                late = LateTrace(self.tracer, context, {"tessera.request_id": request_id, "http.route": path})
                error: Exception | None = None
                task = asyncio.current_task()
                assert task is not None
                self.drain.track(task, send)
                try:
                    await self.pipeline.handle(endpoint, headers, request_id, late, receive, send)
                except asyncio.CancelledError:
                    # Cut at the drain deadline: the pipeline settled the request on the way out (billing);
                    # only its answer is left. Any other cancellation is not ours to swallow.
                    answer = self.drain.take_cut(task)
                    if answer is None:
                        raise
                    task.uncancel()
                    error = await answer_cut(send, answer, self.drain.timeout_s, request_id)
                except Exception as exc:
                    error = exc
                    raise
                finally:
                    self.drain.untrack(task)
                    late.emit(error)
            elif path == "/v1/models" and method == "GET":
                await self._models(send, headers, request_id)
            elif path.startswith("/v1/models/") and path.endswith("/tokenizer") and method == "GET":
                await self._tokenizer(path.removeprefix("/v1/models/").removesuffix("/tokenizer"), send,
                                      headers, request_id)
            elif path == "/v1/usage" and method == "GET":
                await self._usage(scope, send, headers, request_id)
            elif path == "/health":  # liveness: the process serves requests
                await respond(send, 200, {"status": "ok"}, request_id)
            elif path == "/ready":
                await self._ready(send, request_id)
            elif path == "/openapi.json":
                await respond(send, 200, openapi_document(), request_id)
            elif path.startswith("/admin/"):
                await self.admin.handle(scope, receive, send, headers, request_id)
            else:
                raise APIError(404, f"No route {method} {path}.", "not_found")
        except APIError as err:
            await respond_error(send, err, request_id)
        except STORE_ERRORS as exc:
            logger.warning("redis unavailable: %s", exc)
            await respond_error(send, store_unavailable(), request_id)
        except Exception:
            logger.exception("unhandled error in %s %s", method, path)
            await respond_error(send, APIError(500, "Internal error; the request id identifies it in the logs.",
                                               "internal_error"), request_id)

    async def _models(self, send: Send, headers: dict[str, str], request_id: str) -> None:
        tenant = await require_tenant(self.auth, headers)
        names = [n for n in await self.catalog.names() if tenant.policy.allows_model(n)]
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "tessera",
                 "tessera": replicas_extension(await self.router.engines(n))} for n in names]
        await respond(send, 200, {"object": "list", "data": data}, request_id)

    async def _tokenizer(self, name: str, send: Send, headers: dict[str, str], request_id: str) -> None:
        """The served model's tokenizer and chat template, so a load generator can build prompts of exact
        token lengths (tessera-loadgen); only for a model this key may use."""
        tenant = await require_tenant(self.auth, headers)
        served = await self.catalog.get(name) if tenant.policy.allows_model(name) else None
        if served is None:
            raise APIError(404, f"The model {name!r} does not exist; GET /v1/models lists yours.",
                           "model_not_found")
        await respond(send, 200, tokenizer_document(served), request_id)

    async def _ready(self, send: Send, request_id: str) -> None:
        """Readiness: not draining, Redis answers (unless the gateway runs fail-open) and at least one engine
        is registered; 503 naming what is missing otherwise, so Kubernetes sends no traffic a gateway cannot
        serve."""
        if self.drain.draining:
            await respond(send, 503, {"status": "draining", "problems": ["the gateway is shutting down"]},
                          request_id)
            return
        problems: list[str] = []
        try:
            await self.redis.ping()
            if not await self.router.num_live_engines():
                problems.append("no engine replica is registered")
        except STORE_ERRORS as exc:
            if not self.settings.redis_fail_open:
                problems.append(f"Redis is unreachable ({type(exc).__name__})")
        await respond(send, 503 if problems else 200,
                      {"status": "not_ready" if problems else "ready", "problems": problems}, request_id)

    async def _usage(self, scope: Scope, send: Send, headers: dict[str, str], request_id: str) -> None:
        tenant = await require_tenant(self.auth, headers)
        report = await usage_report(self.admission, tenant, scope.get("query_string", b""))
        await respond(send, 200, report, request_id)

    def _each_tick(self) -> None:
        """The server's tick (every two seconds, lean_server.py): the metrics' flush, and the request spans' lines,
        which the tick writes from its first call on instead of a thread of their own (span_lines.py)."""
        self.metrics.flush()
        if (lines := span_lines()) is not None:
            lines.flush_from_caller()

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                # The server's side of the drain finds it here (lean_server.LeanServer).
                # ... and what its tick flushes (the metrics, metrics.py; the spans' lines).
                if isinstance(scope.get("state"), dict):
                    scope["state"][DRAIN_STATE_KEY] = self.drain
                    scope["state"][FLUSH_STATE_KEY] = self._each_tick
                # What earlier processes could not record is replayed; then the settler's timer starts.
                self.finishes.restore(self.journal.adopt())
                self._settler_task = asyncio.create_task(self.settler.run())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                # A request cut at the deadline settles on its way out: Redis stays open until it has.
                left = await self.drain.wait_closed(SETTLE_GRACE_S)
                if left:
                    logger.error("%d requests still open at shutdown; their usage may be unrecorded", left)
                if self._settler_task is not None:
                    self._settler_task.cancel()
                self.metrics.flush()
                await self.finishes.close()
                await self.router.close()
                await self.auth.close()
                await self.catalog.close()
                await self.engines.close()
                await self.wire.close()
                await self.feed_wire.close()
                await self.redis.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


def create_app() -> Gateway:
    """uvicorn factory; start it with ``tessera gateway`` (gateway/launch.py), which serves the workers' summed
    metrics on a port of their own (gateway/metrics.py): ``/metrics`` is not a route of the API."""
    return Gateway(load_settings())


__all__ = ["Gateway", "create_app"]
