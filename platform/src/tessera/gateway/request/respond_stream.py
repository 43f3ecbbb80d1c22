"""The answer to ``stream: true``: OpenAI SSE chunks, written from the engine connection's callbacks as the
deltas arrive (``sse_out.SSEOut``), then the finish chunks, the usage chunk if asked for, and ``[DONE]``.

This task runs the relay itself, so the request is on the engine's socket in this very step (a relay task
would wait for the next event-loop iteration), and a ``ClientWatch`` cancels it when the client leaves: the
engine connection then closes on the way out, and the replica aborts the vLLM request. An error after the stream
started becomes one SSE event with the error body every other error has (``errors.error_body``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from tessera.gateway.errors import APIError
from tessera.gateway.openai_format import finish_reason, usage
from tessera.gateway.request.client_watch import ClientWatch
from tessera.gateway.sse_out import SSEOut

if TYPE_CHECKING:
    from tessera.gateway.request.context import Relay, RequestContext, ResponseHead


def error_event(err: APIError) -> bytes:
    return b"data: " + err.body() + b"\n\n"


async def respond_stream(ctx: RequestContext, relay: Relay, head: ResponseHead) -> None:
    body, result = ctx.body, ctx.result
    writer = ctx.endpoint.chunk_writer(head.response_id, body.model, head.created)
    out = SSEOut(ctx.send, writer, ctx.endpoint.role_choices(body.n), head.headers)
    watch = ClientWatch(ctx.receive)
    try:
        await relay(out.deltas, out.chunk_sink)
        tail = [writer.finish(i, finish_reason(result.finish.get(i))) for i in range(body.n)]
        if body.include_usage:
            cached = int(result.stats.get("num_cached_tokens", 0))
            tail.append(writer.usage(usage(ctx.num_prompt_tokens, result.completion_tokens, cached)))
        tail.append(writer.done())
        await out.end(b"".join(tail))
    except asyncio.CancelledError:
        if not watch.absorb():
            raise  # not the client leaving (the client left: nothing more to send, the request ends normally)
    except APIError as err:
        if not out.started:
            raise
        await out.end(error_event(err))
    finally:
        watch.close()
        out.close()
