"""The one object a generation request carries from phase to phase (see ``pipeline.py`` for the order).

Fields without a default are filled in by the phase named beside them; a phase reads only what the phases
before it wrote (reading a field before its phase ran is an ``AttributeError``, a bug in the order).
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tessera.gateway.engine_client import StreamResult

if TYPE_CHECKING:
    from tessera.asgi import Headers, Receive, Send
    from tessera.engine.protocol import GenerateBody
    from tessera.gateway.engine_client import ChunkSink, DeltaSink
    from tessera.gateway.models import ServedModel
    from tessera.gateway.request.endpoint import Endpoint, OpenAIRequest
    from tessera.registry import EngineRecord
    from tessera.routing.router import RoutePlan
    from tessera.routing.snapshot import RouteDecision, RouteRequest
    from tessera.telemetry.late_spans import LateTrace
    from tessera.tenancy.admission import Lease
    from tessera.tenancy.store import Tenant


@dataclass(slots=True, eq=False)
class RequestContext:
    # Given by the server.
    endpoint: Endpoint
    headers: dict[str, str]
    request_id: str
    notes: LateTrace  # the request's span attributes and events (telemetry/late_spans.py)
    receive: Receive
    send: Send
    t_start: float  # time.monotonic() at arrival

    # parse
    raw: bytes = field(init=False)
    body: OpenAIRequest = field(init=False)
    # authenticate
    tenant: Tenant = field(init=False)
    # prompt
    model: ServedModel = field(init=False)
    prompt_ids: list[int] = field(init=False)
    max_tokens: int = field(init=False)
    cache_salt: str | None = field(init=False)
    # admit: the route's inputs, the response id (the engine request id on the ticket is made of it), the
    # lease, the prefix lookup's answer (None: it did not ride along) and the tenant's demotion flag.
    route_request: RouteRequest = field(init=False)
    response_id: str = field(init=False)
    plan: RoutePlan | None = field(init=False)
    lease: Lease | None = None
    cached: dict[str, int] | None = None
    demoted: bool = False
    # route
    decision: RouteDecision = field(init=False)
    records: dict[str, EngineRecord] = field(init=False)
    # call
    engine_body: GenerateBody = field(init=False)
    called: bool = False  # the engine call started (settle then counts the request in the metrics)
    result: StreamResult = field(default_factory=StreamResult)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """What every response to the request starts with: its OpenAI id, creation time and HTTP headers."""

    response_id: str
    created: int
    headers: Headers


# The engine call as the respond phases see it: runs it, handing its deltas to the sink (a bound
# ``EngineClient.relay``).


class Relay(Protocol):
    """The engine call with everything but where the deltas go (``EngineClient.relay``, partly applied)."""

    def __call__(self, on_deltas: DeltaSink, on_chunk: ChunkSink | None = None, /) -> Awaitable[None]: ...
