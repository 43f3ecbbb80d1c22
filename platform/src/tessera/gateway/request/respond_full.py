"""The answer to ``stream: false``: the engine's deltas collected, then one OpenAI response body. A client that
leaves meanwhile ends the request (``ClientWatch``): the replica aborts it rather than generating for nobody."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from tessera.asgi import JSON_CONTENT, send_response
from tessera.gateway.openai_format import usage
from tessera.gateway.request.client_watch import ClientWatch

if TYPE_CHECKING:
    from tessera.engine.protocol import Delta
    from tessera.gateway.request.context import Relay, RequestContext, ResponseHead

async def respond_full(ctx: RequestContext, relay: Relay, head: ResponseHead) -> None:
    body = ctx.body
    texts: dict[int, list[str]] = {i: [] for i in range(body.n)}

    def take(deltas: list[Delta], last: bool) -> None:
        for delta in deltas:
            texts.setdefault(delta.index, []).append(delta.text)

    watch = ClientWatch(ctx.receive)
    try:
        await relay(take)
    except asyncio.CancelledError:
        if not watch.absorb():
            raise
        return  # the client left: nobody to answer
    finally:
        watch.close()
    result = ctx.result
    cached = int(result.stats.get("num_cached_tokens", 0))
    payload = ctx.endpoint.full_response(head.response_id, body.model, head.created,
                                         {i: "".join(t) for i, t in texts.items()}, result.finish,
                                         usage(ctx.num_prompt_tokens, result.completion_tokens, cached))
    await send_response(ctx.send, 200, payload, [JSON_CONTENT, *head.headers])
