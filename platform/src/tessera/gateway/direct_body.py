"""A streamed response's body chunk written straight to the client's transport, past ASGI's ``send``.

The gateway writes one SSE chunk per engine delta, one every inter-token latency, so each chunk's steps run
from cold caches, and every Python frame and C routine on the way costs a refill (``bench/relay_cold.py``:
~3.5 us a chunk back to back, ~40 us after a pause, in process). For a body chunk of a response that is
already streaming in chunked encoding to a client that keeps up, uvicorn's ``send`` (a coroutine made, run
and closed, a message dict, its checks) ends in one write of ``<size>\\r\\n<body>\\r\\n``; the writer here
makes that write (the caller frames the chunk: gateway/delta_chunk.py) when uvicorn's own state says those
conditions hold, and says False otherwise, so the caller sends through ASGI, which waits for a paused
transport and ends the response.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

if TYPE_CHECKING:
    from tessera.asgi import Send


def direct_body_writer(send: Send) -> Callable[[bytes], bool] | None:
    """A writer of body chunks for the response ``send`` belongs to; None when ``send`` is not uvicorn's
    httptools cycle's own (another server, or a send some middleware wrapped): ASGI only, then."""
    cycle = getattr(send, "__self__", None)
    if type(cycle) is not RequestResponseCycle:
        return None
    flow, transport = cycle.flow, cycle.transport

    def write(framed: bytes) -> bool:
        """Writes ``framed`` (``<size>\\r\\n<body>\\r\\n``) as the next chunk, True; False, writing nothing,
        when the response has not started in chunked encoding or is over, the client is gone, or its transport
        is paused (ASGI's ``send`` waits for it to drain)."""
        if flow.write_paused or cycle.disconnected or cycle.response_complete or cycle.chunked_encoding is not True:
            return False
        transport.write(framed)
        return True

    return write


__all__ = ["direct_body_writer"]
