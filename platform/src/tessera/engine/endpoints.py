"""The engine replica's HTTP routes (raw ASGI, the gateway's hot path):

  POST /generate   NDJSON stream (see protocol.py); the vLLM request is aborted if the caller leaves
  POST /abort      {"request_id", "reason"}: the controller's last-resort abort (gateway retries)
  GET  /requests   in-flight requests with tenant and priority (the controller picks victims)
  GET  /health     200 while the engine is alive, 503 once it is dead
  GET  /stats      engine load, KV geometry, speculative-decoding counters, and what runs
  GET  /metrics    the same in Prometheus text (tessera_engine_*), then vLLM's own vllm:* series

Every route but /health takes only calls signed with the release's data-plane key (data_plane_auth.py):
anything else is a 401 before the body is parsed or any work is done; /metrics also takes the read-only
scrape token. /health stays open for Ray's and the kubelet's probes (it names the engine id and nothing else).
A body that is not a valid request is a 400 whose ``error`` names each wrong field; a body over
``EngineConfig.max_body_bytes`` is a 413.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tessera.asgi import (
    Receive,
    Scope,
    Send,
    header_map,
    respond_json,
    wait_disconnect,
)
from tessera.data_plane_auth import ReplicaGuard, authenticated_body
from tessera.engine.generation import traced_generation
from tessera.engine.held_head import HeldHead
from tessera.engine.in_flight import InFlightRequests
from tessera.engine.metrics import render_engine_metrics
from tessera.engine.protocol import GenerateRequest
from tessera.engine.stats import EngineLoad

if TYPE_CHECKING:
    from tessera.engine.speculation_control import SpeculationControl
    from tessera.engine.vllm_metrics import VllmMetrics

NDJSON_HEADERS = [(b"content-type", b"application/x-ndjson"), (b"cache-control", b"no-store")]


class ServedEngine(Protocol):
    """What the routes need of the replica that serves them (``EngineHost``)."""

    @property
    def engine_id(self) -> str: ...

    @property
    def served_model_name(self) -> str: ...

    @property
    def engine(self) -> Any: ...  # vLLM's AsyncLLM once started

    def is_healthy(self) -> bool: ...

    def load(self) -> EngineLoad: ...

    def facts(self, load: EngineLoad | None = None) -> dict[str, Any]: ...

    @property
    def speculation(self) -> SpeculationControl | None: ...  # adaptive speculation, when it runs

    @property
    def vllm_metrics(self) -> VllmMetrics: ...  # vLLM's own Prometheus metrics of this replica


class AbortRequest(BaseModel):
    """``POST /abort``: what the KV-eviction controller sends."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1)
    reason: str = "aborted"


class BadBody(ValueError):
    """A request body the route cannot use; the message names what is wrong."""


def describe_validation_error(exc: ValidationError) -> str:
    """One line naming each wrong field and why: "prompt_token_ids: Field required; max_tokens: ..."."""
    parts = []
    for error in exc.errors(include_url=False, include_context=False):
        where = ".".join(str(part) for part in error["loc"])
        parts.append(f"{where}: {error['msg']}" if where else str(error["msg"]))
    return "; ".join(parts)


class EngineEndpoints:
    """The routes of one replica; ``asgi`` is the application uvicorn serves."""

    def __init__(self, replica: ServedEngine, in_flight: InFlightRequests, max_body_bytes: int,
                 guard: ReplicaGuard) -> None:
        self.replica = replica
        self.in_flight = in_flight
        self.max_body_bytes = max_body_bytes
        self.guard = guard

    async def asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/health":
            healthy = self.replica.is_healthy()
            await respond_json(send, 200 if healthy else 503, {"healthy": healthy, "engine_id": self.replica.engine_id})
            return
        headers = header_map(scope)
        scraper = path == "/metrics" and self.guard.is_metrics_scraper(headers)
        body = b"" if scraper else await authenticated_body(self.guard, scope, receive, send, headers,
                                                            self.max_body_bytes)
        if body is None:
            return
        if path == "/generate" and method == "POST":
            await self.generate(body, headers, receive, send)
        elif path == "/stats":
            load = self.replica.load()
            await respond_json(send, 200, {"engine_id": self.replica.engine_id, **asdict(load),
                                           **self.replica.facts(load)})
        elif path == "/metrics":
            load = self.replica.load()
            body, content_type = render_engine_metrics(self.replica.engine_id, self.replica.served_model_name, load,
                                                       self.replica.facts(load))
            speculation = self.replica.speculation
            if speculation is not None:
                body += speculation.prometheus_text(self.replica.engine_id, self.replica.served_model_name)
            body += self.replica.vllm_metrics.render()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", content_type.encode())]})
            await send({"type": "http.response.body", "body": body})
        elif path == "/requests":
            await respond_json(send, 200, self.in_flight.listing())
        elif path == "/abort" and method == "POST":
            await self.abort(body, send)
        else:
            await respond_json(send, 404, {"error": f"no route {method} {path}"})

    @staticmethod
    async def _parse(body: bytes, send: Send, model: type[BaseModel]) -> Any:
        """The body validated as ``model``, or None once a 400 naming the wrong fields is sent."""
        try:
            return model.model_validate_json(body)
        except ValidationError as exc:
            await respond_json(send, 400, {"error": f"invalid {model.__name__}: {describe_validation_error(exc)}"})
        return None

    async def abort(self, raw: bytes, send: Send) -> None:
        body = await self._parse(raw, send, AbortRequest)
        if body is None:
            return
        entry = self.in_flight.get(body.request_id)
        if entry is None:
            await respond_json(send, 404, {"error": f"request {body.request_id!r} is not running here"})
            return
        entry.abort_reason = body.reason
        await self.replica.engine.abort(body.request_id)
        await respond_json(send, 200, {"aborted": body.request_id})

    async def generate(self, raw: bytes, headers: dict[str, str], receive: Receive, send: Send) -> None:
        request: GenerateRequest | None = await self._parse(raw, send, GenerateRequest)
        if request is None:
            return
        if not self.replica.is_healthy():
            await respond_json(send, 503, {"error": "engine is not healthy"})
            return
        if self.in_flight.get(request.request_id) is not None:
            # vLLM aborts every request sharing an id and the table below holds one entry per id: a second
            # request under a running one's id would cut the first short.
            await respond_json(send, 409, {"error": f"request {request.request_id!r} is already running here; "
                                                    "every request needs an id of its own"})
            return
        entry = self.in_flight.start(request.request_id, headers.get("x-tessera-tenant", ""), request.priority,
                                     min(request.prefill_tokens, len(request.prompt_token_ids)))
        engine = self.replica.engine
        # The 200 leaves with the first line (held_head.py): one wake-up of the gateway for both.
        held = HeldHead(send, {"type": "http.response.start", "status": 200, "headers": NDJSON_HEADERS})
        stream = asyncio.create_task(traced_generation(engine, self.replica.engine_id, request, entry, held, headers))
        disconnect = asyncio.create_task(wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({stream, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if stream not in done:
                # The caller left: cancelling the generator makes vLLM abort; abort explicitly as well.
                stream.cancel()
                await asyncio.gather(stream, return_exceptions=True)
                await engine.abort(request.request_id)
            else:
                stats = stream.result()
                speculation = self.replica.speculation
                if speculation is not None and entry.abort_reason is None:
                    # Aborted requests carry no draft counts: they would pull the measured acceptance down.
                    speculation.observe(stats, entry.tenant)
        finally:
            held.close()
            disconnect.cancel()
            self.in_flight.finish(request.request_id)
