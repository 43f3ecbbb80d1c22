"""The gateway's engine HTTP client (http_wire) against a real uvicorn server with httptools, as the engine
host runs it: chunked NDJSON streams line by line, keep-alive reuse, error bodies, an early close reaching
the server as a disconnect, a stale pooled connection replaced, refused and broken connections, and the
timeouts: a hung head, a stalled stream (but not a relay paused for its consumer)."""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import orjson
import pytest
import uvicorn

from tessera.gateway.http_wire import EngineHTTP, EngineTimeout, EngineUnreachable
from tests.support.poll import async_wait_until

T = TypeVar("T")


class StreamingApp:
    """POST /stream {"n": k, "gap_s": g} answers k NDJSON lines; /fail answers 503; /die drops the
    connection mid-stream. Records the client ports it served and the disconnects it saw."""

    def __init__(self) -> None:
        self.client_ports: list[int] = []
        self.disconnects = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.client_ports.append(scope["client"][1])
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/hang":  # a replica that took the request and never answers
            while (await receive())["type"] != "http.disconnect":
                pass
            self.disconnects += 1
            return
        if scope["path"] == "/fail":
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": b"engine is dead"})
            return
        args = orjson.loads(body)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/x-ndjson")]})
        for i in range(args["n"]):
            if scope["path"] == "/die" and i == 2:
                raise RuntimeError("engine crashed mid-stream")  # uvicorn drops the connection
            await send({"type": "http.response.body", "body": orjson.dumps({"i": i}) + b"\n", "more_body": True})
            if args.get("gap_s"):
                waiter = asyncio.ensure_future(receive())
                done, _ = await asyncio.wait({waiter}, timeout=args["gap_s"])
                if waiter in done and waiter.result()["type"] == "http.disconnect":
                    self.disconnects += 1
                    return
                waiter.cancel()
        # "tail": a last line without its newline, after a blank line (the relay skips blank lines).
        end = b"\n" + orjson.dumps({"tail": True}) if args.get("tail") else b""
        await send({"type": "http.response.body", "body": end, "more_body": False})


@pytest.fixture
async def server() -> AsyncIterator[tuple[StreamingApp, str]]:
    app = StreamingApp()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http="httptools", loop="none", lifespan="off", log_level="critical",
                            timeout_keep_alive=1)
    srv = uvicorn.Server(config)
    task = asyncio.ensure_future(srv.serve(sockets=[sock]))
    while not srv.started:
        await asyncio.sleep(0.01)
    yield app, f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    await task


async def _lines(http: EngineHTTP, url: str, body: dict[str, Any]) -> list[Any]:
    async with http.post(url, orjson.dumps(body), {"x-request-id": "r1"}) as resp:
        assert resp.status == 200
        return [orjson.loads(line) async for line in resp.lines()]


async def test_streams_every_line_and_reuses_the_connection(server: tuple[StreamingApp, str]) -> None:
    app, base = server
    http = EngineHTTP()
    assert await _lines(http, f"{base}/stream", {"n": 50}) == [{"i": i} for i in range(50)]
    assert await _lines(http, f"{base}/stream", {"n": 3, "gap_s": 0.01}) == [{"i": i} for i in range(3)]
    assert len(app.client_ports) == 2 and app.client_ports[0] == app.client_ports[1]  # one keep-alive connection
    await http.close()


async def test_an_error_status_comes_with_its_body(server: tuple[StreamingApp, str]) -> None:
    _, base = server
    http = EngineHTTP()
    async with http.post(f"{base}/fail", b"{}", {}) as resp:
        assert resp.status == 503 and await resp.text() == "engine is dead"
    await http.close()


async def test_closing_early_reaches_the_server_as_a_disconnect(server: tuple[StreamingApp, str]) -> None:
    app, base = server
    http = EngineHTTP()
    async with http.post(f"{base}/stream", orjson.dumps({"n": 1000, "gap_s": 0.05}), {}) as resp:
        async for line in resp.lines():
            if orjson.loads(line)["i"] == 2:
                break
    await async_wait_until(lambda: app.disconnects, 2.0, "the server seeing the disconnect")
    assert app.disconnects == 1
    await http.close()


async def test_a_pooled_connection_the_server_closed_is_replaced(server: tuple[StreamingApp, str]) -> None:
    app, base = server
    http = EngineHTTP()
    assert len(await _lines(http, f"{base}/stream", {"n": 2})) == 2
    await asyncio.sleep(1.5)  # past the server's 1 s keep-alive: it closes the idle connection
    assert len(await _lines(http, f"{base}/stream", {"n": 2})) == 2
    assert len(set(app.client_ports)) == 2
    await http.close()


async def test_a_stale_connection_whose_close_was_not_yet_seen_is_retried_once(
        server: tuple[StreamingApp, str]) -> None:
    app, base = server
    http = EngineHTTP()
    assert len(await _lines(http, f"{base}/stream", {"n": 2})) == 2
    [(conn, _)] = next(iter(http._idle.values()))
    conn.transport.abort()  # type: ignore[union-attr]  # as if the engine had reset it just now
    conn.closed = False  # ...and the pool had not noticed yet
    assert len(await _lines(http, f"{base}/stream", {"n": 2})) == 2
    assert len(app.client_ports) == 2 and app.client_ports[0] != app.client_ports[1]  # sent once more, fresh
    await http.close()


async def test_a_refused_connection_names_the_address() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    http = EngineHTTP()
    with pytest.raises(EngineUnreachable, match=f"127.0.0.1:{port}"):
        async with http.post(f"http://127.0.0.1:{port}/generate", b"{}", {}):
            pass


async def test_a_stream_cut_mid_way_raises(server: tuple[StreamingApp, str]) -> None:
    _, base = server
    http = EngineHTTP()
    got: list[Any] = []
    with pytest.raises(EngineUnreachable, match="closed the connection"):
        async with http.post(f"{base}/die", orjson.dumps({"n": 10}), {}) as resp:
            async for line in resp.lines():
                got.append(orjson.loads(line))
    assert got == [{"i": 0}, {"i": 1}]
    await http.close()


async def test_a_header_with_a_line_break_is_refused() -> None:
    http = EngineHTTP()
    with pytest.raises(ValueError, match="line break"):
        async with http.post("http://127.0.0.1:1/generate", b"{}", {"x-request-id": "a\r\nx-evil: 1"}):
            pass


class Recorder:
    """A LineSink that keeps what it gets; optionally pauses the response after its first batch."""

    def __init__(self, pause_first: bool = False) -> None:
        self.lines: list[Any] = []
        self.batches = 0
        self.pause_first = pause_first
        self.response: Any = None
        self.ended: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    def lines_received(self, lines: list[bytes]) -> None:
        assert not self.ended.done(), "a line after the end"
        self.lines.extend(orjson.loads(line) for line in lines)
        self.batches += 1
        if self.pause_first and self.batches == 1:
            self.response.pause()

    def body_ended(self, failure: BaseException | None) -> None:
        assert not self.ended.done(), "ended twice"
        self.ended.set_result(failure)


async def _relayed(http: EngineHTTP, url: str, body: dict[str, Any], late: bool = False) -> Recorder:
    sink = Recorder()
    async with http.post(url, orjson.dumps(body), {}) as resp:
        assert resp.status == 200
        while late and not resp._conn.complete:  # the whole body is here before the relay starts
            await asyncio.sleep(0.01)
        resp.relay(sink)
        assert await sink.ended is None
    return sink


async def test_relay_hands_every_line_in_order_then_the_end(server: tuple[StreamingApp, str]) -> None:
    app, base = server
    http = EngineHTTP()
    assert (await _relayed(http, f"{base}/stream", {"n": 50})).lines == [{"i": i} for i in range(50)]
    paced = await _relayed(http, f"{base}/stream", {"n": 5, "gap_s": 0.02})
    assert paced.lines == [{"i": i} for i in range(5)]
    buffered = await _relayed(http, f"{base}/stream", {"n": 20}, late=True)
    assert buffered.lines == [{"i": i} for i in range(20)] and buffered.batches == 1  # all at relay()
    unterminated = await _relayed(http, f"{base}/stream", {"n": 2, "tail": True})
    assert unterminated.lines == [{"i": 0}, {"i": 1}, {"tail": True}]
    assert len(set(app.client_ports)) == 1  # the relayed responses left the connection reusable
    await http.close()


class ChunkRecorder(Recorder):
    """A Recorder also offered reads between chunks (``chunk_received``): it takes those that are one whole
    chunk of one line with an odd ``i``, declines the rest."""

    def __init__(self, pause_first: bool = False) -> None:
        super().__init__(pause_first)
        self.offered: list[bytes] = []
        self.taken = 0

    def chunk_received(self, data: bytes) -> bool:
        assert not self.ended.done(), "a read after the end"
        self.offered.append(data)
        size, crlf, rest = data.partition(b"\r\n")
        if not crlf or len(rest) != int(size, 16) + 2 or not rest.endswith(b"\n\r\n") or rest.count(b"\n") != 2:
            return False
        message = orjson.loads(rest)
        if message.get("i", 0) % 2 == 0:
            return False
        self.lines.append(message)
        self.taken += 1
        return True


async def test_a_sink_offered_reads_between_chunks_gets_every_line_once_in_order(
        server: tuple[StreamingApp, str]) -> None:
    """Reads it declines are parsed and reach lines_received in their place; a read offered starts where the
    parser stands between two chunks (a chunk's size line) with nothing buffered before it (so taking it keeps
    the order), and none is offered while the relay is paused."""
    _, base = server
    http = EngineHTTP()
    paced = ChunkRecorder()
    async with http.post(f"{base}/stream", orjson.dumps({"n": 20, "gap_s": 0.01}), {}) as resp:
        resp.relay(paced)
        assert await paced.ended is None
    assert paced.lines == [{"i": i} for i in range(20)]
    assert paced.taken == 10 and all(re.match(rb"[0-9a-fA-F]+\r\n", data) for data in paced.offered)
    paused = ChunkRecorder(pause_first=True)
    held = await _paused_then_resumed(http, base, paused, lambda: len(paused.offered))
    assert paused.lines == [{"i": i} for i in range(40)]
    assert held <= 2 and paused.taken < 20  # the lines that waited were delivered together, not offered
    await http.close()


async def test_reads_that_split_chunks_anywhere_are_offered_only_between_chunks() -> None:
    """The parser is skipped only for a read that starts between two chunks: a read that ended after a chunk
    and the first digits of the next one's size line, or inside a chunk's data, leaves the next read to the
    parser (without the size-line check, the read after "...\\r\\n1b" is offered and a sink that takes it
    breaks the stream)."""
    lines = [orjson.dumps({"i": i, "pad": "x" * 10}) + b"\n" for i in range(8)]  # each chunk's size: 2 digits
    chunks = [b"%x\r\n%b\r\n" % (len(line), line) for line in lines]
    reads = [chunks[0], chunks[1],  # the second is offered (whole, between chunks)
             chunks[2] + chunks[3][:2], chunks[3][2:],  # a size line split after its digits
             chunks[4][:10], chunks[4][10:],  # a chunk's data split
             chunks[5], chunks[6] + chunks[7] + b"0\r\n\r\n"]

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for read in reads:
            await asyncio.sleep(0.05)  # apart: each its own read at the client
            writer.write(read)
            await writer.drain()
        writer.close()

    engine = await asyncio.start_server(answer, "127.0.0.1", 0)
    http = EngineHTTP()
    sink = ChunkRecorder()
    try:
        async with http.post(f"http://127.0.0.1:{engine.sockets[0].getsockname()[1]}/generate", b"{}", {}) as resp:
            resp.relay(sink)
            assert await sink.ended is None
    finally:
        await http.close()
        engine.close()
    assert sink.lines == [orjson.loads(line) for line in lines]
    assert all(re.match(rb"[0-9a-fA-F]+\r\n", data) for data in sink.offered), sink.offered
    assert sink.taken >= 1  # the first odd chunk, at least, came alone and whole


async def _paused_then_resumed(http: EngineHTTP, base: str, sink: Recorder, at_hold: Callable[[], T]) -> T:
    """Relays 40 paced lines to ``sink`` (which pauses after its first batch), holds 0.3 s while the server
    sends the rest, resumes and waits for the end; returns ``at_hold()`` as it was during the hold."""
    async with http.post(f"{base}/stream", orjson.dumps({"n": 40, "gap_s": 0.002}), {}) as resp:
        sink.response = resp
        resp.relay(sink)
        while not sink.batches:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.3)  # the server sends everything meanwhile; it waits in the socket
        held = at_hold()
        assert not sink.ended.done()
        resp.resume()
        assert await sink.ended is None
    return held


async def test_a_paused_relay_reads_nothing_until_resumed(server: tuple[StreamingApp, str]) -> None:
    _, base = server
    http = EngineHTTP()
    sink = Recorder(pause_first=True)
    held = await _paused_then_resumed(http, base, sink, lambda: len(sink.lines))
    assert held < 40
    assert sink.lines == [{"i": i} for i in range(40)]
    await http.close()


async def test_a_relay_cut_mid_way_ends_with_the_failure(server: tuple[StreamingApp, str]) -> None:
    _, base = server
    http = EngineHTTP()
    sink = Recorder()
    async with http.post(f"{base}/die", orjson.dumps({"n": 10}), {}) as resp:
        resp.relay(sink)
        failure = await sink.ended
    assert isinstance(failure, EngineUnreachable) and "closed the connection" in str(failure)
    assert sink.lines == [{"i": 0}, {"i": 1}]
    await http.close()


async def test_leaving_a_relay_early_reaches_the_server_as_a_disconnect(server: tuple[StreamingApp, str]) -> None:
    app, base = server
    http = EngineHTTP()
    sink = Recorder()
    async with http.post(f"{base}/stream", orjson.dumps({"n": 1000, "gap_s": 0.05}), {}) as resp:
        resp.relay(sink)
        while len(sink.lines) < 2:
            await asyncio.sleep(0.01)
    await async_wait_until(lambda: app.disconnects, 2.0, "the server seeing the disconnect")
    assert app.disconnects == 1 and not sink.ended.done()  # nothing reaches a relay after it was left
    await http.close()


async def test_a_replica_that_sends_no_head_times_out_and_sees_the_caller_go(
        server: tuple[StreamingApp, str]) -> None:
    app, base = server
    http = EngineHTTP(head_timeout_s=0.3)
    with pytest.raises(EngineTimeout, match=r"no response head within 0\.3 s"):
        async with http.post(f"{base}/hang", b"{}", {}):
            pass
    await async_wait_until(lambda: app.disconnects, 2.0, "the server seeing the disconnect")
    assert app.disconnects == 1  # the connection closed: a real replica aborts the request
    await http.close()


async def test_a_stream_that_stalls_fails_the_relay_and_closes_the_connection(
        server: tuple[StreamingApp, str]) -> None:
    app, base = server
    http = EngineHTTP(idle_timeout_s=0.2)
    sink = Recorder()
    async with http.post(f"{base}/stream", orjson.dumps({"n": 3, "gap_s": 5.0}), {}) as resp:
        resp.relay(sink)
        failure = await asyncio.wait_for(sink.ended, 3)
    assert isinstance(failure, EngineTimeout) and "sent nothing for 0.2 s" in str(failure)
    assert sink.lines == [{"i": 0}]
    await async_wait_until(lambda: app.disconnects, 2.0, "the server seeing the disconnect")
    assert app.disconnects == 1
    await http.close()


async def test_a_relay_paused_for_its_consumer_is_not_idle(server: tuple[StreamingApp, str]) -> None:
    _, base = server
    http = EngineHTTP(idle_timeout_s=0.1)
    sink = Recorder(pause_first=True)
    async with http.post(f"{base}/stream", orjson.dumps({"n": 20, "gap_s": 0.002}), {}) as resp:
        sink.response = resp
        resp.relay(sink)
        while not sink.lines:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.5)  # five idle periods with nothing read: the consumer, not the engine, is slow
        assert not sink.ended.done()
        resp.resume()
        assert await sink.ended is None
    assert sink.lines == [{"i": i} for i in range(20)]
    await http.close()
