"""Phase ``route``: which engine replicas serve the request, best first (503 when none does).

The route's inputs (``route_request``) are made before admission. With the local prefix index the plan needs
no lookup and ``Router.decide`` walks the chain in process; with the Redis index admission's round trip
carries the lookup (see admit.py). Either way this phase then decides without Redis (``Router.decide``, the
pure policy), and otherwise (no plan, or the lookup did not come) routes with its own round trip. Redis
unreachable: the last known route of the model when failing open, else 503 (``FailOpen``). """

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tessera.gateway.errors import STORE_ERRORS, APIError
from tessera.routing.hashing import block_hash_chain
from tessera.routing.snapshot import RouteRequest

if TYPE_CHECKING:
    from tessera.gateway.failopen import FailOpen
    from tessera.gateway.request.context import RequestContext
    from tessera.routing.router import Routed, RoutePlan, Router

# The approx_prefix baseline routes on the prompt's leading characters: about this many.
APPROX_PREFIX_CHARS = 4096


def route_request(ctx: RequestContext, policy_name: str) -> RouteRequest:
    ids, model = ctx.prompt_ids, ctx.model
    prompt_text = model.tokenizer.decode(ids[:APPROX_PREFIX_CHARS // 2]) if policy_name == "approx_prefix" else ""
    return RouteRequest(tenant=ctx.tenant.name, model=ctx.body.model, num_prompt_tokens=len(ids),
                        block_hashes=block_hash_chain(ids, model.info.block_size, ctx.cache_salt),
                        prompt_prefix=prompt_text, session_id=ctx.body.user, cache_salt=ctx.cache_salt)


async def route(ctx: RequestContext, router: Router, fail_open: FailOpen) -> None:
    started_ns = time.time_ns()
    request = ctx.route_request
    decision, records = await decide(router, fail_open, request, ctx.plan, ctx.cached)
    hashes = request.block_hashes
    ctx.notes.child("route", started_ns, {
        "tessera.route.reason": decision.reason,
        "tessera.route.expected_cached_tokens": decision.expected_cached_tokens,
        # The chain's first block names the prefix in the controller's eviction spans (``tessera traces
        # analyze`` joins on it).
        "tessera.prefix_root": f"{hashes[0]:016x}" if hashes else "",
        "tessera.prompt_blocks": len(hashes)})
    if not decision.ranked:
        raise APIError(503, f"No engine is serving {request.model!r} right now; retry shortly.",
                       "engine_unavailable", headers={"Retry-After": "2"})
    ctx.decision, ctx.records = decision, records


async def decide(router: Router, fail_open: FailOpen, request: RouteRequest, plan: RoutePlan | None,
                 cached: dict[str, int] | None) -> Routed:
    """The route from admission's lookup when it came (no Redis), else from a round trip of its own."""
    try:
        if plan is not None and cached is not None:
            routed = router.decide(plan, cached)
        else:
            routed = await router.route(request)
    except STORE_ERRORS as exc:
        return fail_open.recall("route", request.model, exc)  # type: ignore[no-any-return]
    return fail_open.remember("route", request.model, routed)
