"""Phase ``call``: the engine request (``engine.protocol.GenerateBody``, under an id of the gateway's own) to
the route's replicas, best first (``EngineClient.relay`` retries on the next one), answered to the client as a
stream (respond_stream.py) or as one body (respond_full.py). The first engine counts the request in flight
while it runs."""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

from tessera.gateway.request.context import ResponseHead
from tessera.gateway.request.respond_full import respond_full
from tessera.gateway.request.respond_stream import respond_stream
from tessera.tenancy.policy import DEMOTION_STEP
from tessera.unique_ids import UniqueIds

if TYPE_CHECKING:
    from tessera.engine.protocol import GenerateBody
    from tessera.gateway.engine_client import EngineClient
    from tessera.gateway.request.context import RequestContext
    from tessera.routing.router import Router

# The ids this gateway process makes: response ids, and request ids where the client sent none.
_ids = UniqueIds()


def process_unique_id(prefix: str) -> str:
    """``prefix``, this process's random part and the next count: unique across processes, never a secret."""
    return _ids.next(prefix)


def engine_request_id(tenant: str, response_id: str) -> str:
    """The id the replica and vLLM know the request by: made here, never the client's ``X-Request-Id``
    (vLLM aborts every request sharing an id and the replica keys its in-flight table by it, so a tenant
    reusing another's id could cut that tenant's stream short). The client's id stays a label: echoed in the
    response, on the spans and in the ``x-request-id`` header to the replica. The tenant in front scopes it
    and names the owner in the replica's ``/requests`` and in vLLM's logs."""
    return f"{tenant}/{response_id}"


def new_response_id(id_prefix: str) -> str:
    """A response id, made at admission: the request's ticket names the engine request id built from it, so
    the settler finds the engine's usage record if this gateway dies (tenancy/settlement.py)."""
    return process_unique_id(id_prefix)


async def call_engine(ctx: RequestContext, engines: EngineClient, router: Router) -> None:
    body, decision, records = ctx.body, ctx.decision, ctx.records
    priority = ctx.tenant.policy.priority + (DEMOTION_STEP if ctx.demoted else 0)
    response_id = ctx.response_id
    # The prompt tokens the engine must prefill (those its cache does not hold, as the index saw it): declared
    # to the replica, which reports their sum over its requests awaiting a first token in its heartbeat, and
    # counted here against the engine until the first delta (routing/router.py ``InFlight``): the prefill
    # backlog prefix_affinity places a new prefix by.
    prefill_tokens = decision.tokens_to_prefill(len(ctx.prompt_ids))
    engine_body: GenerateBody = {
        "request_id": engine_request_id(ctx.tenant.name, response_id), "prompt_token_ids": ctx.prompt_ids,
        "max_tokens": ctx.max_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed, "stop": body.stop_list,
        "n": body.n, "cache_salt": ctx.cache_salt, "priority": priority, "ignore_eos": body.ignore_eos,
        "prefill_tokens": prefill_tokens}
    ctx.engine_body = engine_body
    engine_headers = {"x-tessera-tenant": ctx.tenant.name, "x-request-id": ctx.request_id}
    ctx.notes.engine_headers(engine_headers)
    first = decision.ranked[0]
    head = ResponseHead(response_id, int(time.time()),
                        [(b"x-request-id", ctx.request_id.encode()), (b"x-tessera-engine", first.encode()),
                         (b"x-tessera-route-reason", decision.reason.encode())])
    ctx.notes.attributes.update({"tessera.engine": first, "tessera.route.reason": decision.reason,
                                 "tessera.priority": priority})
    relay = functools.partial(engines.relay, [(eid, records[eid].url) for eid in decision.ranked], engine_body,
                              engine_headers, ctx.result)
    respond = respond_stream if body.stream else respond_full
    result, notes = ctx.result, ctx.notes
    with router.in_flight(first, prefill_tokens) as flight:
        result.on_first_delta = flight.prefilled
        ctx.called = True
        notes.call_started()
        call_error: Exception | None = None
        try:
            await respond(ctx, relay, head)
        except Exception as exc:
            call_error = exc
            raise
        finally:
            if result.first_delta_ns is not None:
                notes.event("first_token", result.first_delta_ns)  # the analyzer's TTFT as the gateway saw it
            notes.call_ended({"tessera.engines_tried": ",".join(result.engines_tried)}, call_error)
