"""The answer to ``stream: false``: the engine's deltas collected, then one OpenAI response body."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera.asgi import JSON_CONTENT, send_response
from tessera.gateway.openai_format import usage

if TYPE_CHECKING:
    from tessera.engine.protocol import Delta
    from tessera.gateway.request.context import Relay, RequestContext, ResponseHead

async def respond_full(ctx: RequestContext, relay: Relay, head: ResponseHead) -> None:
    body = ctx.body
    texts: dict[int, list[str]] = {i: [] for i in range(body.n)}

    def take(deltas: list[Delta], last: bool) -> None:
        for delta in deltas:
            texts.setdefault(delta.index, []).append(delta.text)

    await relay(take)
    result = ctx.result
    cached = int(result.stats.get("num_cached_tokens", 0))
    payload = ctx.endpoint.full_response(head.response_id, body.model, head.created,
                                         {i: "".join(t) for i, t in texts.items()}, result.finish,
                                         usage(ctx.num_prompt_tokens, result.completion_tokens, cached))
    await send_response(ctx.send, 200, payload, [JSON_CONTENT, *head.headers])
