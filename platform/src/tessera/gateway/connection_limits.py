"""What one client may hold of a gateway worker: bytes of a request head, time to send it, connections, and
requests in flight; beyond each, an OpenAI-style error, never an unbounded buffer or a wait.

uvicorn's httptools protocol has none of these (issue #15): httptools gathers a header's value in a buffer
of its own until the value ends, so an 8 MiB header was read whole (and copied at every piece); a connection
that never finishes its head was held forever; connections and tasks had no cap. ``LimitedHttpToolsProtocol``
is that protocol with:

- the request target over ``max_url_bytes``: 414 ``url_too_long``;
- the header lines over ``max_header_bytes``: 431 ``headers_too_large`` (measured exactly when the head is
  complete, and after each read while it is not, so a header still arriving is never read whole);
- a head not complete ``header_timeout_s`` after the connection opened (or after the head's first bytes on a
  kept-alive connection): 408 ``header_timeout``;
- each of those closes the connection;
- a connection beyond ``max_connections`` (counted at connect): each of its requests gets 503
  ``too_many_connections`` with ``Retry-After``, and the connection closes;
- a request beyond ``max_in_flight`` running in the worker: 503 ``too_many_requests_in_flight`` with
  ``Retry-After``.

``/health`` is answered beyond the two caps (a liveness probe must not fail because the worker is busy:
Kubernetes would restart it). A connection refused before its head was complete (408, or a head over a limit
still arriving) gets its answer and the write side shut at once, then reads nothing more and closes
``REFUSED_LINGER_S`` later, time for the answer to reach the client before the close resets the connection
(it does, with unread data). Reading and dropping the rest instead cost the worker a core under a flood of
8 MiB headers (``make bench-flood``); unread, the rest waits in the kernel and the sender's window closes.

Cost per request on the hot path: a few comparisons per read and per head, no callback per header and no
timer unless a head arrives in more than one read (``make bench-flood`` prints the protocol's CPU per request
beside uvicorn's).

The same protocol serves the metrics listener (``metrics_port``): a connection to that port reaches only
``metrics.metrics_app``, one to the API port never does.
"""

from __future__ import annotations

import asyncio
import functools
import http
from dataclasses import dataclass
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from tessera.asgi import Receive, Scope, Send
from tessera.gateway.errors import error_body
from tessera.gateway.metrics import metrics_app
from tessera.gateway.response_date import RESPONSE_DATE

# A connection refused before its head was complete closes this long after its answer, seconds (see the
# module docstring).
REFUSED_LINGER_S = 2.0
# What a 503 for a full worker asks the client to wait, seconds.
BUSY_RETRY_AFTER_S = 1
# Request-line bytes beside the URL (method, version, separators): the head may exceed the URL and header
# limits by this much before the per-read check refuses it.
_REQUEST_LINE_SLACK = 64
# Paths answered whatever the caps say (liveness).
_EXEMPT_PATHS = frozenset({"/health"})


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The limits of one worker (``TESSERA_*`` settings, see ``settings.py``)."""

    max_url_bytes: int
    max_header_bytes: int
    header_timeout_s: float
    max_connections: int
    max_in_flight: int

    def __post_init__(self) -> None:
        for name in ("max_url_bytes", "max_header_bytes", "max_connections", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.header_timeout_s <= 0:
            raise ValueError(f"header_timeout_s must be above 0, not {self.header_timeout_s}")


def raw_error_response(status: int, code: str, message: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A whole HTTP/1.1 error response with an OpenAI-style body, closing the connection."""
    body = error_body(message, "invalid_request_error", code)
    lines = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n".encode()]
    lines += [name + b": " + value + b"\r\n" for name, value in default_headers]
    lines.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
    return b"".join(lines) + body


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol within ``ConnectionLimits``; uvicorn builds one per connection
    (``launch.py`` passes it as ``http=`` with the limits bound).

    NOTE: it overrides two methods only, ``data_received`` and ``on_headers_complete`` (which also dates the
    response: response_date.py): each parser callback
    overridden in Python costs a call per request or per header (``make bench-flood`` prints the protocol's
    CPU per request beside uvicorn's). Whether a head is incomplete is read from uvicorn's own state: a
    message began (``on_message_begin`` made a new ``scope``) that no request cycle holds yet."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, limits: ConnectionLimits,
                 metrics_port: int | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._limits = limits
        self._metrics_port = metrics_port
        self._max_head_bytes = limits.max_url_bytes + limits.max_header_bytes + _REQUEST_LINE_SLACK
        self._connection_app: Any = self.app
        # Bytes read so far of a head that spans reads: at least (reads that may hold the message before it not
        # counted) and at most (such reads counted whole).
        self._num_head_bytes_low = 0
        self._num_head_bytes_high = 0
        self._num_read_bytes = 0  # the high count with the current read: a bound on the head completing in it
        self._over_cap = False
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None

    # Connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self._metrics_port is not None and self.server is not None and self.server[1] == self._metrics_port:
            self._connection_app = metrics_app
        # ``connections`` holds this one already.
        self._over_cap = len(self.connections) > self._limits.max_connections
        self._head_timer = self.loop.call_later(self._limits.header_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # refused: what was in flight when reading paused
        scope_before = self.scope
        self._num_read_bytes = self._num_head_bytes_high + len(data)
        super().data_received(data)
        if not self._head_incomplete() or self.transport.is_closing():
            return
        # A head still incomplete. Bytes of this read before the head began belong to the message before (if
        # there was one): the refusal counts a read where the head began only on a fresh connection, so a
        # pipelined request is never refused for its predecessor's bytes (the bound is one read looser).
        if self.scope is scope_before:
            self._num_head_bytes_low += len(data)
            self._num_head_bytes_high += len(data)
        else:
            self._num_head_bytes_low = len(data) if scope_before is None else 0
            self._num_head_bytes_high = len(data)
        if len(self.url) > self._limits.max_url_bytes:
            self._refuse(*self._url_too_long())
        elif self._num_head_bytes_low > self._max_head_bytes:
            self._refuse(*self._headers_too_large())
        elif self._head_timer is None:
            self._head_timer = self.loop.call_later(self._limits.header_timeout_s, self._head_timed_out)

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        app = self._connection_app
        if self._num_read_bytes > self._limits.max_header_bytes or len(self.url) > self._limits.max_url_bytes:
            app = self._checked_size(app)  # rare: a head (or a read) this large is measured exactly
        if app is self._connection_app and (self._over_cap or len(self.tasks) >= self._limits.max_in_flight):
            app = self._answer_busy
        self._num_head_bytes_low = self._num_head_bytes_high = 0
        # The response's date to the second: the server ticks every two seconds (response_date.py). Before uvicorn's
        # request cycle copies the default headers.
        RESPONSE_DATE.refresh(self.server_state, self.config)
        # uvicorn's on_headers_complete starts ``self.app`` for the request.
        self.app = app
        super().on_headers_complete()

    # Refusals
    def _checked_size(self, app: Any) -> Any:
        if len(self.url) > self._limits.max_url_bytes:
            return functools.partial(_answer_error, *self._url_too_long())
        if sum(len(name) + len(value) + 4 for name, value in self.headers) > self._limits.max_header_bytes:
            return functools.partial(_answer_error, *self._headers_too_large())
        return app

    def _url_too_long(self) -> tuple[int, str, str]:
        return (414, "url_too_long",
                f"The request URL exceeds the gateway's limit of {self._limits.max_url_bytes} bytes.")

    def _headers_too_large(self) -> tuple[int, str, str]:
        return (431, "headers_too_large",
                f"The request's headers exceed the gateway's limit of {self._limits.max_header_bytes} bytes.")

    async def _answer_busy(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app of a request beyond a cap: 503 naming the limit (``/health`` is served all the same)."""
        if scope["path"] in _EXEMPT_PATHS:
            await self._connection_app(scope, receive, send)
        elif self._over_cap:
            await _answer_error(503, "too_many_connections", f"This gateway worker holds its limit of "
                                f"{self._limits.max_connections} connections (TESSERA_MAX_CONNECTIONS_PER_WORKER); "
                                "retry shortly.", scope, receive, send)
        else:
            await _answer_error(503, "too_many_requests_in_flight", f"This gateway worker has its limit of "
                                f"{self._limits.max_in_flight} requests in flight (TESSERA_MAX_IN_FLIGHT_PER_WORKER); "
                                "retry shortly.", scope, receive, send, keep_alive=True)

    def _head_incomplete(self) -> bool:
        """A message began (``on_message_begin`` made a scope) that no request cycle holds yet."""
        return self.scope is not None and (self.cycle is None or self.cycle.scope is not self.scope)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._refused or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            if self._head_incomplete():  # a pipelined head may wait for the response under way
                self._head_timer = self.loop.call_later(self._limits.header_timeout_s, self._head_timed_out)
            return
        if self.cycle is not None and not self._head_incomplete():
            return  # between requests: the keep-alive timeout's to close
        self._refuse(408, "header_timeout", f"The request's headers did not arrive within "
                     f"{self._limits.header_timeout_s:g} s.")

    def _refuse(self, status: int, code: str, message: str) -> None:
        """Answers ``status`` outside any request cycle, stops reading and closes soon after (module
        docstring); a response under way on this connection is cut instead (a pipelined head the client itself
        sent too large)."""
        self._refused = True
        self._cancel_head_timer()
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()
            return
        self.transport.pause_reading()
        RESPONSE_DATE.refresh(self.server_state, self.config)
        self.transport.write(raw_error_response(status, code, message, self.server_state.default_headers))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger_timer = self.loop.call_later(REFUSED_LINGER_S, self.transport.close)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


async def _answer_error(status: int, code: str, message: str, scope: Scope, receive: Receive, send: Send,
                        keep_alive: bool = False) -> None:
    """An error as a request's ASGI app: OpenAI-style body, ``Retry-After`` on a 503, and unless
    ``keep_alive`` the connection closed after it (uvicorn reads the ``connection`` header)."""
    body = error_body(message, "service_unavailable" if status == 503 else "invalid_request_error", code)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if status == 503:
        headers.append((b"retry-after", b"%d" % BUSY_RETRY_AFTER_S))
    if not keep_alive:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


__all__ = ["BUSY_RETRY_AFTER_S", "REFUSED_LINGER_S", "ConnectionLimits", "LimitedHttpToolsProtocol",
           "raw_error_response"]
