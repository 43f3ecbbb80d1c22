"""The answer to ``stream: true``: OpenAI SSE chunks, written from the engine connection's callbacks as the
deltas arrive (``sse_out.SSEOut``), then the finish chunks, the usage chunk if asked for, and ``[DONE]``.

This task runs the relay itself, so the request is on the engine's socket in this very step (a relay task
would wait for the next event-loop iteration), and a watcher cancels it when the client leaves: the engine
connection then closes on the way out, and the replica aborts the vLLM request. An error after the stream
started becomes one SSE event with the error body every other error has (``errors.error_body``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from tessera.asgi import wait_disconnect
from tessera.gateway.errors import APIError
from tessera.gateway.openai_format import finish_reason, usage
from tessera.gateway.sse_out import SSEOut

if TYPE_CHECKING:
    from tessera.gateway.request.context import Relay, RequestContext, ResponseHead


def error_event(err: APIError) -> bytes:
    return b"data: " + err.body() + b"\n\n"


async def respond_stream(ctx: RequestContext, relay: Relay, head: ResponseHead) -> None:
    body, result = ctx.body, ctx.result
    writer = ctx.endpoint.chunk_writer(head.response_id, body.model, head.created)
    out = SSEOut(ctx.send, writer, ctx.endpoint.role_choices(body.n), head.headers)
    handler = asyncio.current_task()
    assert handler is not None
    watch = _Watch()

    def client_left(gone: asyncio.Task[None]) -> None:
        # Runs an iteration after the watcher ended: only cancel what is still this stream.
        if watch.streaming and not gone.cancelled() and gone.exception() is None:
            watch.client_left = True
            handler.cancel()

    gone = asyncio.ensure_future(wait_disconnect(ctx.receive))
    gone.add_done_callback(client_left)
    try:
        await relay(out.deltas)
        tail = [writer.finish(i, finish_reason(result.finish.get(i))) for i in range(body.n)]
        if body.include_usage:
            cached = int(result.stats.get("num_cached_tokens", 0))
            tail.append(writer.usage(usage(ctx.num_prompt_tokens, result.completion_tokens, cached)))
        tail.append(writer.done())
        await out.end(b"".join(tail))
    except asyncio.CancelledError:
        if not watch.client_left:
            raise
        handler.uncancel()  # the client left: nothing more to send, the request ends normally
    except APIError as err:
        if not out.started:
            raise
        await out.end(error_event(err))
    finally:
        watch.streaming = False
        gone.cancel()
        out.close()


class _Watch:
    __slots__ = ("client_left", "streaming")

    def __init__(self) -> None:
        self.streaming = True
        self.client_left = False
