"""A ``/generate`` response's head sent with its first line, not ahead of the prefill.

The replica answers a generation at once with 200 and its headers, but the first line (a delta, or the error
or closing line) comes only after the prefill, tens to hundreds of milliseconds later. Sent apart, the two wake
the gateway's worker twice, and on this project's VMs a wake-up costs a process 90-220 µs of CPU
(docs/performance.md section 9, "Wake-ups"), as much as the rest of a streamed chunk's relay. Held until the
first line, the head leaves right before it, and the gateway reads both in one wake-up.

The hold is bounded (``HEAD_HOLD_S``): a request that waits in vLLM's queue longer gets its head then, as
before, so the gateway's head timeout (gateway/http_wire.py ``HEAD_TIMEOUT_S``, 30 s) still tells a replica that
answers nothing from one whose queue is long.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tessera.asgi import Send

# The longest the head waits for the first line, seconds: a hit's or a short prompt's first token comes well
# within it; beyond it, the gateway's extra wake-up is small beside the wait.
HEAD_HOLD_S = 1.0


class HeldHead:
    """An ASGI ``send`` for one response whose start message goes out with the first body message, or when
    ``hold_s`` passes first; ``close`` (always call it) stops the hold."""

    def __init__(self, send: Send, start: dict[str, Any], hold_s: float | None = None) -> None:
        """``hold_s``: None for ``HEAD_HOLD_S``."""
        self._send = send
        self._start = start
        self._head: asyncio.Future[None] | None = None
        self._head_out = False  # the head's send has completed: every later message goes straight through
        self._timer = asyncio.get_running_loop().call_later(HEAD_HOLD_S if hold_s is None else hold_s,
                                                            self._send_head)

    async def __call__(self, message: dict[str, Any]) -> None:
        if not self._head_out:  # the first line (the per-token messages after it pay one flag read)
            self._timer.cancel()
            if self._head is None:
                await self._send(self._start)  # the usual case: in this step, right before the line, no task
            else:
                await self._head  # the hold ran out and its send is under way: done before the first line
            self._head_out = True
        await self._send(message)

    def close(self) -> None:
        self._timer.cancel()

    def _send_head(self) -> None:
        """The hold ran out: the head goes now, in a task of its own (a timer callback cannot await)."""
        self._head = asyncio.ensure_future(self._send(self._start))
        # Sent by the timer for a stream whose caller then left, nobody awaits it: its error is no news.
        self._head.add_done_callback(lambda head: head.cancelled() or head.exception())
