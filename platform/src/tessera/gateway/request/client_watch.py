"""A client that leaves ends its request: ``ClientWatch`` cancels the request's task when the client's
connection closes, and says so, so the phase that awaited the engine can tell that cancellation (end quietly:
nothing more to send) from any other (raise). Cancelling closes the engine connection on the way out, and the
replica aborts the vLLM request; settling (billing, the lease) runs as for any other end.

Used by both answers: a stream whose client left must not keep the engine generating, and neither must a
non-streamed request, which sends nothing until the end and would otherwise run to ``max_tokens``."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from tessera.asgi import wait_disconnect

if TYPE_CHECKING:
    from tessera.asgi import Receive


class ClientWatch:
    __slots__ = ("_gone", "_handler", "active", "client_left")

    def __init__(self, receive: Receive) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handler = handler
        self.active = True
        self.client_left = False
        self._gone = asyncio.ensure_future(wait_disconnect(receive))
        self._gone.add_done_callback(self._left)

    def _left(self, gone: asyncio.Future[None]) -> None:
        # Runs an iteration after the watcher ended: only cancel what is still this request's wait.
        if self.active and not gone.cancelled() and gone.exception() is None:
            self.client_left = True
            self._handler.cancel()

    def absorb(self) -> bool:
        """Called on a ``CancelledError``: True when it was the client leaving, and the task is un-cancelled
        (the request then ends normally, with nothing more to send); False: the caller re-raises it."""
        if self.client_left:
            self._handler.uncancel()
        return self.client_left

    def close(self) -> None:
        self.active = False
        self._gone.cancel()
