"""The ``date`` header on every response of a gateway worker, right to the second without a tick each second.

uvicorn writes ``server_state.default_headers`` (the date, then the configured headers) at the head of every
response, from a copy its request cycle takes when the request's head is complete, and refreshes them on its
tick. The gateway's server ticks every ``lean_server.SERVER_TICK_S`` (2 s: each tick is a wake-up of an idle
worker), so the first request head of each new second refreshes them too (``LimitedHttpToolsProtocol``, before
the cycle takes its copy): a clock read a request, and a formatted date at most once a second.
"""

from __future__ import annotations

import time
from email.utils import formatdate
from typing import Protocol


class _HeaderConfig(Protocol):
    date_header: bool
    encoded_headers: list[tuple[bytes, bytes]]


class _HeaderState(Protocol):
    default_headers: list[tuple[bytes, bytes]]


class ResponseDate:
    """Keeps a server state's default headers dated to the current second."""

    __slots__ = ("_headers", "_second")

    def __init__(self) -> None:
        self._second = -1
        self._headers: list[tuple[bytes, bytes]] | None = None  # the list it last dated (uvicorn's tick makes others)

    def refresh(self, state: _HeaderState, config: _HeaderConfig, now_s: float | None = None) -> None:
        """Dates ``state``'s default headers to ``now_s`` (default: now) unless they are the ones it dated in that
        second; the headers are uvicorn's own: the date where ``config.date_header``, then the configured ones."""
        second = int(time.time() if now_s is None else now_s)
        if second == self._second and state.default_headers is self._headers:
            return
        self._second = second
        date = [(b"date", formatdate(second, usegmt=True).encode())] if config.date_header else []
        self._headers = state.default_headers = date + config.encoded_headers


# This process's: a worker's connections share one server state (another state, in tests, is dated afresh).
RESPONSE_DATE = ResponseDate()
