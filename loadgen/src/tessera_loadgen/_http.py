"""A lean HTTP/1.1 client transport: keep-alive connection pool on asyncio protocols and httptools.

Why not aiohttp or httpx: at thousands of streamed requests per second on one core, their per-request
and per-chunk overhead (tasks, stream readers, header objects) is what limits vLLM's and GuideLLM's
clients. Here a request is a pre-built ``bytes`` written to a pooled connection, and the response is
delivered straight from ``data_received`` to a handler's callbacks; no task or future exists per request.

The seam is the ``Handler`` protocol: the pool calls ``on_sent`` when the request bytes were written, then
``on_headers``, ``on_body`` (decoded of chunked framing), and exactly one of ``on_complete`` or
``on_error``. Invariant: a connection serves one exchange at a time, and returns to the pool only after
``on_message_complete`` on a keep-alive response.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from typing import Protocol, cast

import httptools

from tessera_loadgen.records import ERROR_BROKEN_STREAM, ERROR_CONNECT

_perf_counter = time.perf_counter


class Handler(Protocol):
    """Receives one HTTP exchange's events (see the module docstring for the order)."""

    def on_sent(self, t_send: float, connection: Connection) -> None: ...
    def on_headers(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...
    def on_body(self, data: bytes) -> None: ...
    def on_complete(self) -> None: ...
    def on_error(self, kind: str, detail: str) -> None: ...


class Connection(asyncio.Protocol):
    """One keep-alive TCP connection; also the httptools parser's callback target."""

    __slots__ = (
        "_data",
        "_got_bytes",
        "_handler",
        "_headers",
        "_parser",
        "_pool",
        "_retried",
        "closed",
        "num_exchanges",
        "transport",
    )

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._handler: Handler | None = None
        self._data = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._got_bytes = False
        self._retried = False
        self.num_exchanges = 0
        self.closed = False

    # asyncio.Protocol ---------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # NOTE: uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self._pool._all.add(self)

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ERROR_BROKEN_STREAM, f"malformed HTTP response: {exc}")
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        handler = self._handler
        self._handler = None
        self._pool._discard(self)
        if handler is None:
            return
        if self.num_exchanges > 0 and not self._got_bytes and not self._retried:
            # NOTE: the server closed an idle keep-alive connection just as we reused it; nothing was
            # processed, so sending the request again on another connection is safe (as browsers do).
            self._pool._submit(self._data, handler, retried=True)
            return
        handler.on_error(ERROR_BROKEN_STREAM, f"connection closed: {exc or 'by peer'}")

    # httptools callbacks ------------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._handler is not None:
            self._handler.on_headers(self._parser.get_status_code(), self._headers)

    def on_body(self, body: bytes) -> None:
        if self._handler is not None:
            self._handler.on_body(body)

    def on_message_complete(self) -> None:
        handler = self._handler
        self._handler = None
        self._data = b""
        self.num_exchanges += 1
        keep_alive = self._parser.should_keep_alive()
        if handler is not None:
            handler.on_complete()
        if keep_alive and not self.closed:
            self._pool._release(self)
        else:
            self.close()

    # used by the pool and handlers ----------------------------------------------------------------------
    def send(self, data: bytes, handler: Handler, retried: bool) -> None:
        assert self._handler is None, "a connection serves one exchange at a time"
        assert self.transport is not None
        self._handler = handler
        self._data = data
        self._headers = []
        self._got_bytes = False
        self._retried = retried
        self.transport.write(data)
        handler.on_sent(_perf_counter(), self)

    def detach(self, handler: Handler) -> None:
        """Stop delivering events to ``handler`` and drop the connection (timeouts, cancellation)."""
        if self._handler is handler:
            self._handler = None
            self.abort()

    def _fail(self, kind: str, detail: str) -> None:
        handler = self._handler
        self._handler = None
        if handler is not None:
            handler.on_error(kind, detail)

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


MAX_CONNECTING = 32
"""Connection attempts in progress at once, per pool."""


class ConnectionPool:
    """Keep-alive connections to one origin, at most ``max_connections`` open (``None``: unbounded).

    Requests beyond the cap wait in FIFO order inside the client; their time waiting is schedule lag, not
    server time, which is exactly how a connection-limited client hides queueing unless latency is also
    measured from the intended send time.

    NOTE: at most ``MAX_CONNECTING`` connection attempts run at once; further requests wait for the next
    connection that opens or frees up. Without this, a 50 ms server hiccup at thousands of requests per
    second starts thousands of handshakes, the server's accept queue overflows, dropped SYNs are retried
    only after a second, and the hiccup becomes a multi-second collapse of client and server alike.
    """

    def __init__(
        self,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self._ssl = ssl_context
        self.max_connections = max_connections
        self._idle: list[Connection] = []
        self._waiting: deque[tuple[bytes, Handler]] = deque()
        self._all: set[Connection] = set()
        self.num_open = 0
        self.num_connecting = 0
        self.num_connects = 0
        self._closing = False

    def request(self, data: bytes, handler: Handler) -> None:
        """Send ``data`` on an idle connection, a new one, or queue it until one is free."""
        self._submit(data, handler, retried=False)

    def cancel(self, handler: Handler) -> bool:
        """Drop a request still waiting for a connection; ``True`` if it was waiting."""
        for i, (_, waiting) in enumerate(self._waiting):
            if waiting is handler:
                del self._waiting[i]
                return True
        return False

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    async def close(self) -> None:
        self._closing = True
        for connection in list(self._all):
            connection.close()
        self._idle.clear()
        for _, handler in self._waiting:
            handler.on_error(ERROR_CONNECT, "client closed")
        self._waiting.clear()
        await asyncio.sleep(0)

    # internals ------------------------------------------------------------------------------------------
    def _submit(self, data: bytes, handler: Handler, retried: bool) -> None:
        idle = self._idle
        while idle:
            connection = idle.pop()
            if not connection.closed:
                connection.send(data, handler, retried)
                return
        if self._may_connect():
            self.num_open += 1
            self.num_connecting += 1
            asyncio.get_running_loop().create_task(self._connect(data, handler, retried))
        else:
            self._waiting.append((data, handler))

    def _may_connect(self) -> bool:
        return self.num_connecting < MAX_CONNECTING and (
            self.max_connections is None or self.num_open < self.max_connections
        )

    async def _connect(self, data: bytes, handler: Handler, retried: bool) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, connection = await loop.create_connection(lambda: Connection(self), self.host, self.port, ssl=self._ssl)
        except (TimeoutError, OSError) as exc:
            self.num_open -= 1
            self.num_connecting -= 1
            handler.on_error(ERROR_CONNECT, f"{type(exc).__name__}: {exc}")
            self._pump()
            return
        self.num_connecting -= 1
        self.num_connects += 1
        if self._closing or connection.closed:
            connection.close()
            handler.on_error(ERROR_CONNECT, "client closed" if self._closing else "closed on connect")
            return
        connection.send(data, handler, retried)
        self._pump()

    def _release(self, connection: Connection) -> None:
        if self._waiting:
            data, handler = self._waiting.popleft()
            connection.send(data, handler, False)
        elif not self._closing:
            self._idle.append(connection)

    def _discard(self, connection: Connection) -> None:
        if connection in self._all:
            self._all.discard(connection)
            self.num_open -= 1
        self._pump()

    def _pump(self) -> None:
        """Open connections for waiting requests while the caps allow (after a connect or a close)."""
        while self._waiting and not self._closing and self._may_connect():
            data, handler = self._waiting.popleft()
            self._submit(data, handler, retried=False)
