"""A lean HTTP/1.1 client for the one call the gateway makes per request: POST to an engine replica and
read its streamed, chunked NDJSON answer over a pooled keep-alive connection.

Why not aiohttp: the request is on every request's time to first token, once each way, and a plain asyncio
protocol sends it and reads the stream in less time than aiohttp, back to back and more so as the first call
after an idle spell; ``make bench-wires`` measures both side by side (bench/bench_wires.py).
Parsing is httptools' (llhttp, the parser uvicorn uses), so chunked framing and keep-alive follow the spec.

A response's body is read in one of two ways: ``lines()``, an async iterator, or ``relay(sink)``, which hands
every batch of complete lines to the sink from inside the protocol's ``data_received`` callback. The relay
is the gateway's per-token path: a line reaches the client in the same event-loop callback that read it
from the engine, with no task wakeup, future or async-generator step between (measured in ``make
bench-gateway``: the CPU per streamed chunk). A sink that cannot take more (its client reads slowly) pauses
the response, which stops reading from the engine socket until it resumes. A sink with a ``chunk_received``
is offered each socket read that comes where the response parser stands between two chunks, with nothing
buffered, before the parser sees it: the per-token path with the fewest steps (gateway/delta_chunk.py). A read
it takes must be exactly one whole chunk, so the parser, which never saw it, still stands between two.

Closing a response before its end closes its connection: that is how the engine learns the caller went
away and aborts the vLLM request. A finished response returns its connection to the pool. A request sent
on a reused connection that the engine had meanwhile closed (no byte of a response came back) is sent once
more on a new connection, as HTTP clients do for idempotent-by-construction failures: the engine never
saw it.

Nothing waits on an engine forever: the connect, the response head (``head_timeout_s``: the replica sends its
head before any generation work, so a slow head means a hung replica) and, while a response is relayed, any
``idle_timeout_s`` in which no byte came (checked once per period: a stall is noticed within two periods; a
relay paused for a slow client is not idle) each fail with ``EngineTimeout``, and the connection closes, so
the replica aborts the request.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Protocol
from urllib.parse import urlsplit

import httptools

from tessera.data_plane_auth import SIGNATURE_HEADER, Signer

# Idle pooled connections older than this are closed instead of reused (the engine keeps them 300 s).
IDLE_KEEP_S = 60.0
CONNECT_TIMEOUT_S = 2.0
HEAD_TIMEOUT_S = 30.0
IDLE_TIMEOUT_S = 120.0
# Reading pauses while this much body waits for the consumer (engine streams are small; this is a guard).
MAX_BUFFER_BYTES = 1 << 20


class EngineUnreachable(ConnectionError):
    """The engine refused the connection, or closed it before the response ended."""


class EngineRefused(EngineUnreachable):
    """No connection could be made (refused, or not accepted in time): the engine never saw the request."""


class EngineTimeout(EngineUnreachable):
    """The engine did not answer, or went quiet mid-stream, within its time."""


class LineSink(Protocol):
    """Receives a relayed response body (see ``StreamResponse.relay``), on the event loop's callbacks.

    It may also have ``chunk_received(data: bytes) -> bool``: offered a socket read of a chunked body when the
    parser stands between two chunks, nothing is buffered and the relay is not paused; True when it took the
    read, which it does only when the read is exactly one whole chunk, False (having done nothing) to have it
    parsed and its lines delivered to ``lines_received`` as usual."""

    def lines_received(self, lines: list[bytes]) -> None:
        """The complete lines that arrived, in order, without their newlines (never empty)."""

    def body_ended(self, failure: BaseException | None) -> None:
        """Called once, after the last line: None when the response completed, else why it did not."""


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reset()

    def reset(self) -> None:
        """Fresh per-response state, for the next request on the same connection."""
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.got_bytes = False
        self.complete = False
        self.keep_alive = False
        self.failure: BaseException | None = None
        self.buffer = bytearray()
        self.headers_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._wakeup: asyncio.Future[None] | None = None
        self._paused = False
        self.sink: LineSink | None = None
        self._sink_chunk_received: Callable[[bytes], bool] | None = None  # the sink's chunk_received, if any
        self._offer_chunk: Callable[[bytes], bool] | None = None  # the same while it may take a read now
        self._between_chunks = False  # the parser has just completed a chunk and seen nothing after it
        self._sink_ended = False
        self._sink_paused = False
        self._heard = False  # a byte came since the idle watch last looked
        self._idle_watch: asyncio.TimerHandle | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = self._heard = True
        offer = self._offer_chunk
        if offer is not None and self._between_chunks and not self.buffer and offer(data):
            return
        self._between_chunks = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(EngineUnreachable(f"the engine sent a malformed response: {exc}"))
            self.transport.abort()  # type: ignore[union-attr]
            return
        if self._between_chunks and not data.endswith(b"\r\n"):
            self._between_chunks = False  # the start of the next chunk's size line came after the last one
        if self.sink is not None:
            if self.buffer or self.complete or self.failure is not None:  # (a read of framing only brings none)
                self.deliver()
        elif len(self.buffer) > MAX_BUFFER_BYTES and not self._paused and self.transport is not None:
            self.transport.pause_reading()
            self._paused = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            self._fail(EngineUnreachable(f"the engine closed the connection: {exc or 'end of stream'}"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_chunk_header(self) -> None:
        self._between_chunks = False

    def on_chunk_complete(self) -> None:
        self._between_chunks = True

    def on_body(self, body: bytes) -> None:
        self.buffer += body
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # read now: the parser resets after the message
        self._wake()

    # for the response
    def _fail(self, exc: BaseException) -> None:
        self.failure = exc
        self._offer_chunk = None
        if not self.headers_done.done():
            self.headers_done.set_exception(exc)
        self._wake()

    def _wake(self) -> None:
        if self.sink is not None:
            if self.failure is not None:
                self.deliver()  # data_received will not come again: end the relay now
            return
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    # relay mode (StreamResponse.relay)
    def deliver(self) -> None:
        """Hands the buffer's complete lines to the sink, then the end once the response is over."""
        sink = self.sink
        if sink is None or self._sink_ended or self._sink_paused:
            return
        buffer = self.buffer
        end = buffer.rfind(b"\n")
        if self.complete and buffer:
            end = len(buffer) - 1  # a last line without its newline
        if end >= 0:
            if end == len(buffer) - 1:  # the usual case: the read ended on a line's end
                lines = bytes(buffer).split(b"\n")
                buffer.clear()
            else:
                lines = bytes(buffer[:end + 1]).split(b"\n")
                del buffer[:end + 1]
            if not lines[-1]:
                lines.pop()  # what followed the last newline: nothing
            if b"" in lines:
                lines = [line for line in lines if line]
            if lines:
                sink.lines_received(lines)
        elif len(buffer) > MAX_BUFFER_BYTES:
            self._fail(EngineUnreachable(f"the engine sent a line longer than {MAX_BUFFER_BYTES} bytes"))
            if self.transport is not None:
                self.transport.abort()
        if self._sink_paused:
            return  # the end, if it came, waits for resume: it must follow the sink's last lines
        if self.complete or self.failure is not None:
            self._sink_ended = True
            self._offer_chunk = None
            sink.body_ended(None if self.complete else self.failure)

    def set_sink(self, sink: LineSink | None) -> None:
        self.sink = sink
        self._sink_chunk_received = self._offer_chunk = getattr(sink, "chunk_received", None)

    def pause_sink(self) -> None:
        self._sink_paused = True
        self._offer_chunk = None
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_sink(self) -> None:
        if not self._sink_paused:
            return
        self._sink_paused = False
        if not self._sink_ended and self.failure is None:
            self._offer_chunk = self._sink_chunk_received
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()
        self.deliver()

    async def wait_for_body(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self._wakeup = asyncio.get_running_loop().create_future()
        await self._wakeup

    def watch_idle(self, idle_timeout_s: float) -> None:
        """Fails the relay when a whole ``idle_timeout_s`` passes with no byte from the engine while the
        sink takes more (one timer per period, not per chunk)."""
        self._heard = False
        self._idle_watch = asyncio.get_running_loop().call_later(idle_timeout_s, self._check_idle, idle_timeout_s)

    def _check_idle(self, idle_timeout_s: float) -> None:
        if self._sink_ended or self.sink is None:
            return
        if self._heard or self._sink_paused:
            self.watch_idle(idle_timeout_s)  # looks again a period later, for bytes from now on
            return
        self._fail(EngineTimeout(f"the engine sent nothing for {idle_timeout_s:g} s"))
        if self.transport is not None:
            self.transport.abort()

    def stop_watch(self) -> None:
        if self._idle_watch is not None:
            self._idle_watch.cancel()
            self._idle_watch = None

    @property
    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed


class StreamResponse:
    def __init__(self, connection: _Connection, idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        self._conn = connection
        self.status = connection.status
        self._idle_timeout_s = idle_timeout_s

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's newline-terminated lines (the last one also when it has no newline)."""
        conn = self._conn
        while True:
            end = conn.buffer.find(b"\n")
            if end >= 0:
                line = bytes(conn.buffer[:end + 1])
                del conn.buffer[:end + 1]
                yield line
                continue
            if conn.complete:
                if conn.buffer:
                    yield bytes(conn.buffer)
                    conn.buffer.clear()
                return
            if conn.failure is not None:
                raise conn.failure
            await conn.wait_for_body()

    def relay(self, sink: LineSink) -> None:
        """From now on the body's lines go to ``sink`` as they arrive (those already here go now), and
        ``sink.body_ended`` says when the response is over; ``lines()`` must not be used alongside."""
        self._conn.set_sink(sink)
        self._conn.watch_idle(self._idle_timeout_s)
        self._conn.deliver()

    def pause(self) -> None:
        """Stops relaying (and reading from the engine) until ``resume``: the sink's consumer is behind."""
        self._conn.pause_sink()

    def resume(self) -> None:
        self._conn.resume_sink()

    async def read(self) -> bytes:
        return b"".join([line async for line in self.lines()])

    async def text(self) -> str:
        return (await self.read()).decode(errors="replace")


class EngineHTTP:
    """Keep-alive connections per engine address, most recently used first (the warmest one)."""

    def __init__(self, connect_timeout_s: float = CONNECT_TIMEOUT_S, idle_keep_s: float = IDLE_KEEP_S,
                 head_timeout_s: float = HEAD_TIMEOUT_S, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 signer: Signer | None = None) -> None:
        self._signer = signer  # signs every call with the data-plane key (None: unsigned, for test servers)
        self._connect_timeout_s = connect_timeout_s
        self._head_timeout_s = head_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._idle_keep_s = idle_keep_s
        self._idle: dict[tuple[str, int], list[tuple[_Connection, float]]] = {}

    @asynccontextmanager
    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> AsyncIterator[StreamResponse]:
        netloc, path, address = _target(url)
        if self._signer is not None:
            headers = {**headers, SIGNATURE_HEADER: self._signer.sign("POST", path, body)}
        request = _request_bytes(netloc, path, body, headers)
        conn = await self._send(address, request)
        try:
            yield StreamResponse(conn, self._idle_timeout_s)
        finally:
            conn.stop_watch()
            conn.set_sink(None)  # a relay ends with its response: nothing reaches it from a late close
            if conn.reusable:
                self._idle.setdefault(address, []).append((conn, time.monotonic()))
            elif conn.transport is not None:
                conn.transport.close()  # mid-stream: the engine sees the disconnect and aborts

    async def _send(self, address: tuple[str, int], request: bytes) -> _Connection:
        """Writes the request and waits for the response's headers. Any failure or cancellation on the way
        closes the connection, so an engine that got the request sees its caller go."""
        reused = self._pooled(address)
        if reused is not None:
            try:
                return await _exchange(reused, request, self._head_timeout_s)
            except EngineUnreachable as exc:
                if reused.got_bytes or isinstance(exc, EngineTimeout):
                    raise
                # Stale: the engine had closed it while idle and never saw this request. Once more, fresh.
        return await _exchange(await self._connect(address), request, self._head_timeout_s)

    def _pooled(self, address: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(address)
        now = time.monotonic()
        while idle:
            conn, since = idle.pop()
            if not conn.closed and now - since < self._idle_keep_s:
                conn.reset()
                return conn
            if conn.transport is not None:
                conn.transport.close()
        return None

    async def _connect(self, address: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(_Connection, *address)
        except TimeoutError:
            raise EngineRefused(f"no connection to {address[0]}:{address[1]} within "
                                    f"{self._connect_timeout_s} s") from None
        except OSError as exc:
            raise EngineRefused(f"cannot connect to {address[0]}:{address[1]}: {exc}") from exc
        return conn

    async def close(self) -> None:
        for idle in self._idle.values():
            for conn, _ in idle:
                if conn.transport is not None:
                    conn.transport.close()
        self._idle.clear()


@functools.lru_cache(maxsize=1024)
def _target(url: str) -> tuple[str, str, tuple[str, int]]:
    """(host header, path, address) of an engine URL; a handful of URLs, parsed once each."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"engine URL must be http://host:port/..., got {url!r}")
    return parts.netloc, parts.path or "/", (parts.hostname, parts.port or 80)


async def _exchange(conn: _Connection, request: bytes, head_timeout_s: float) -> _Connection:
    assert conn.transport is not None
    try:
        conn.transport.write(request)
        async with asyncio.timeout(head_timeout_s):
            await conn.headers_done
    except TimeoutError:
        conn.transport.abort()
        raise EngineTimeout(f"the engine sent no response head within {head_timeout_s:g} s") from None
    except BaseException:
        conn.transport.abort()
        raise
    return conn


def _request_bytes(host: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} has a line break in its name or value")
    head = [f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n"]
    head.extend(f"{name}: {value}\r\n" for name, value in headers.items())
    head.append("\r\n")
    return "".join(head).encode("latin-1") + body
