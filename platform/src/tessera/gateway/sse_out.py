"""The client side of a streamed completion: engine deltas out as OpenAI SSE chunks, written from the engine
connection's callbacks (see ``engine_client``) with eager sends (see ``eager_send``).

Order is kept when the client reads slowly: a send that has to wait for the client's socket holds every
later message in a backlog, and the engine relay stops reading until that wait is over.

Once the response streams, a lone delta of choice 0 takes ``write_now``: its client chunk, made by
gateway/delta_chunk.py, written straight to the client's transport (``direct_body``) when nothing waits before
it and the client keeps up; otherwise ``deltas``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from tessera.gateway.direct_body import direct_body_writer
from tessera.gateway.eager_send import send_now

if TYPE_CHECKING:
    from tessera.asgi import Send
    from tessera.engine.protocol import Delta
    from tessera.gateway.engine_client import ChunkSink
    from tessera.gateway.openai_format import ChunkWriter

SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class SSEOut:
    """One streamed response. ``deltas`` is the engine relay's ``DeltaSink``; ``end`` sends the tail."""

    def __init__(self, send: Send, writer: ChunkWriter, role_choices: int,
                 headers: list[tuple[bytes, bytes]]) -> None:
        """``role_choices``: how many chat choices open with the assistant's role chunk (0: a completion)."""
        self._send = send
        self._direct = direct_body_writer(send)
        self._writer = writer
        self._role_choices = role_choices
        self._headers = headers
        self.started = False
        self._behind: asyncio.Future[None] | None = None  # a send waiting for the client, then the backlog
        self._backlog: list[dict[str, Any]] = []
        self._held = b""  # the last deltas' chunks, kept for the tail's write
        self.text_frame = writer.text_frame(0)  # (ChunkSink) what a choice-0 delta's client chunk holds its text in

    def deltas(self, deltas: list[Delta], last: bool = False) -> asyncio.Future[None] | None:
        """``last``: the engine's closing line came with these deltas; their chunks then leave with the tail
        (``end``), one socket write fewer per request."""
        writer = self._writer
        body = b"".join([writer.text(d.index, d.text) for d in deltas if d.text])
        if not self.started:
            # The response starts with the engine's first delta, and the role chunks leave with its text.
            self._start()
            body = b"".join([writer.role(i) for i in range(self._role_choices)]) + body
        if last:
            self._held += body
        elif body:
            self._emit({"type": "http.response.body", "body": body, "more_body": True})
        return self._behind

    @property
    def chunk_sink(self) -> ChunkSink | None:
        """This response where ``write_now`` can ever write (uvicorn's own send), else None: the relay then
        makes no per-token attempt that could only decline after building the chunk."""
        return self if self._direct is not None else None

    def write_now(self, framed: bytes) -> bool:
        """One delta's client chunk, HTTP framing included (``split_delta_chunk``), written at once (the engine
        relay's ``ChunkSink``; b"": an empty text, nothing to write). False, having written nothing, when it
        cannot be: the response not started, messages waiting before it, the client's transport paused, or a
        server other than uvicorn's (the delta then goes to ``deltas``)."""
        if self._behind is not None or not self.started or self._direct is None:
            return False
        return not framed or self._direct(framed)

    async def end(self, tail: bytes) -> None:
        """The last bytes of the body (after the held deltas), after everything sent before them."""
        if not self.started:
            self._start()
        if self._behind is not None:
            await self._behind
        await self._send({"type": "http.response.body", "body": self._held + tail, "more_body": False})

    def close(self) -> None:
        """Drops what still waits for a client that went away."""
        if self._behind is not None:
            self._behind.cancel()

    def _start(self) -> None:
        self.started = True
        self._emit({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + self._headers})

    def _emit(self, message: dict[str, Any]) -> None:
        if self._behind is not None:
            self._backlog.append(message)
            return
        rest = send_now(self._send(message))
        if rest is not None:
            self._behind = asyncio.ensure_future(self._catch_up(rest))

    async def _catch_up(self, rest: asyncio.Future[None]) -> None:
        await rest
        while self._backlog:
            await self._send(self._backlog.pop(0))
        self._behind = None
