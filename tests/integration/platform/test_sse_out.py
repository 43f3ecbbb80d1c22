"""SSEOut, the client side of the gateway's streamed responses, behind a real uvicorn server (httptools, as
the gateway runs): deltas written from synchronous code in order, the role chunk first, the last deltas in
the tail's write when the engine's closing line came with them, and a client that reads slowly holding later
chunks back (the relay is told to wait) without losing or reordering any. The per-token path (``write_now``
of the chunk ``split_delta_chunk`` made, straight to uvicorn's transport) the same, and it declines while the
client's transport is paused."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import uvicorn

from tessera.engine.protocol import Delta, delta_line
from tessera.gateway.delta_chunk import split_delta_chunk
from tessera.gateway.direct_body import direct_body_writer
from tessera.gateway.openai_format import ChunkWriter
from tessera.gateway.sse_out import SSEOut

BIG_TEXT = "x" * 2000


class DeltaApp:
    """Streams the deltas a test asks for through SSEOut, as the engine relay would: each batch handed over
    synchronously, and the next one only after the future SSEOut returned (if any) is done."""

    def __init__(self) -> None:
        self.batches: list[list[Delta]] = []
        self.role_choices = 1
        self.times_behind = 0
        self.last_batch_ends = False  # the last batch came with the engine's closing line
        self.body_writes = 0
        self.per_token = False  # after the first batch, each delta is offered to write_now first (uvicorn's send)
        self.written_now = 0  # deltas write_now wrote
        self.declined = 0  # deltas write_now declined while the response streamed

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        async def counting_send(message: dict[str, Any]) -> None:
            self.body_writes += message["type"] == "http.response.body"
            await send(message)

        writer = ChunkWriter(True, "chatcmpl-test", "m", 0)
        out = SSEOut(send if self.per_token else counting_send, writer, self.role_choices, [(b"x-request-id", b"r1")])
        for i, batch in enumerate(self.batches):
            if self.per_token and i > 0 and len(batch) == 1:
                # The engine's chunk of this delta, made into the client's as the relay makes it.
                line = delta_line(batch[0].index, batch[0].text, batch[0].token_ids) + b"\n"
                split = split_delta_chunk(b"%x\r\n%b\r\n" % (len(line), line), *out.text_frame)
                assert split is not None
                if out.write_now(split[0]):
                    self.written_now += 1
                    continue
                self.declined += 1
            behind = out.deltas(batch, self.last_batch_ends and i == len(self.batches) - 1)
            if behind is not None:
                self.times_behind += 1
                await behind
        await out.end(writer.finish(0, "stop") + writer.done())


@pytest.fixture
async def server() -> AsyncIterator[tuple[DeltaApp, int]]:
    app = DeltaApp()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, http="httptools", loop="none", lifespan="off", log_level="critical"))
    task = asyncio.ensure_future(srv.serve(sockets=[sock]))
    while not srv.started:
        await asyncio.sleep(0.01)
    yield app, sock.getsockname()[1]
    srv.should_exit = True
    await task


async def _get(port: int, read_after_s: float = 0.0) -> tuple[bytes, list[Any]]:
    """The raw response head and the SSE events' JSON (``[DONE]`` as the string), read by a client with a
    small receive buffer that starts reading only after ``read_after_s``."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, b"GET / HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
    await asyncio.sleep(read_after_s)
    raw = bytearray()
    while chunk := await loop.sock_recv(sock, 65536):
        raw += chunk
    sock.close()
    head, _, body = bytes(raw).partition(b"\r\n\r\n")
    events = []
    for line in _dechunk(body).split(b"\n"):
        if line.startswith(b"data: "):
            data = line[len(b"data: "):]
            events.append(data.decode() if data == b"[DONE]" else orjson.loads(data))
    return head, events


def _dechunk(body: bytes) -> bytes:
    out, rest = bytearray(), body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out += rest[:size]
        rest = rest[size + 2:]
    return bytes(out)


async def test_role_chunk_first_then_the_texts_in_order(server: tuple[DeltaApp, int]) -> None:
    app, port = server
    app.batches = [[Delta(0, "", [7])], [Delta(0, "Hel", [8]), Delta(0, "lo", [9])], [Delta(0, "!", [10])]]
    head, events = await _get(port)
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head and b"x-request-id: r1" in head
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"},
                      {"content": "!"}, {}]
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-1] == "[DONE]"


async def test_the_last_deltas_leave_with_the_tail_in_one_write(server: tuple[DeltaApp, int]) -> None:
    app, port = server
    app.last_batch_ends = True
    app.batches = [[Delta(0, "", [7])], [Delta(0, "Hel", [8])], [Delta(0, "lo", [9])]]
    _, events = await _get(port)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}, {}]
    assert events[-1] == "[DONE]"
    assert app.body_writes == 3, "role, 'Hel', then 'lo' with the tail: the last batch had a write of its own"


async def test_a_whole_answer_in_one_read_is_one_body_write(server: tuple[DeltaApp, int]) -> None:
    app, port = server
    app.last_batch_ends = True
    app.batches = [[Delta(0, "Hi", [7]), Delta(0, "!", [8])]]
    _, events = await _get(port)
    assert [e["choices"][0]["delta"] for e in events[:-1]] == [
        {"role": "assistant", "content": ""}, {"content": "Hi"}, {"content": "!"}, {}]
    assert app.body_writes == 1


async def test_a_completion_has_no_role_chunk(server: tuple[DeltaApp, int]) -> None:
    app, port = server
    app.role_choices = 0
    app.batches = [[Delta(0, "", [7])], [Delta(0, "a", [8])]]
    _, events = await _get(port)
    assert [e["choices"][0]["delta"] for e in events[:-1]] == [{"content": "a"}, {}]


async def test_a_slow_client_holds_the_relay_back_and_gets_everything_in_order(
        server: tuple[DeltaApp, int]) -> None:
    app, port = server
    count = 4000  # 8 MB of text: far more than the socket buffers hold while the client does not read
    app.batches = [[Delta(0, f"{i:06d}{BIG_TEXT}", [i])] for i in range(count)]
    _, events = await _get(port, read_after_s=0.5)
    texts = [e["choices"][0]["delta"].get("content") for e in events[:-1]]
    assert texts[0] == "" and texts[1:-1] == [f"{i:06d}{BIG_TEXT}" for i in range(count)]
    assert events[-1] == "[DONE]"
    assert app.times_behind > 0, "the client never held the stream back: the test did not test backpressure"


async def test_lone_deltas_written_at_once_arrive_as_the_batched_ones(server: tuple[DeltaApp, int]) -> None:
    app, port = server
    app.batches = [[Delta(0, "", [7])], [Delta(0, "Hel", [8])], [Delta(0, 'lo "x"\n', [9])], [Delta(0, "", [10])],
                   [Delta(0, "!", [11])]]
    _, batched = await _get(port)
    app.per_token = True
    _, per_token = await _get(port)
    assert per_token == batched
    assert [e["choices"][0]["delta"] for e in per_token[:-1]] == [
        {"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": 'lo "x"\n'}, {"content": "!"}, {}]
    assert app.written_now == 4 and app.declined == 0


async def test_write_now_declines_while_a_slow_clients_transport_is_paused_and_order_is_kept(
        server: tuple[DeltaApp, int]) -> None:
    """Written past ASGI, a chunk would go into the transport's buffer whatever the client reads: without
    the paused-transport check every delta is taken and the gateway buffers the whole answer."""
    app, port = server
    app.per_token = True
    count = 4000  # 8 MB of text
    app.batches = [[Delta(0, "", [0])]] + [[Delta(0, f"{i:06d}{BIG_TEXT}", [i])] for i in range(count)]
    _, events = await _get(port, read_after_s=0.5)
    texts = [e["choices"][0]["delta"].get("content") for e in events[:-1]]
    assert texts[0] == "" and texts[1:-1] == [f"{i:06d}{BIG_TEXT}" for i in range(count)]
    assert events[-1] == "[DONE]"
    assert app.declined > 0 and app.times_behind > 0, "the slow client never paused the per-token path"
    assert app.written_now > 0


def test_no_direct_writer_for_a_send_that_is_not_uvicorns_own() -> None:
    async def wrapped(message: dict[str, Any]) -> None: ...

    assert direct_body_writer(wrapped) is None
    out = SSEOut(wrapped, ChunkWriter(True, "chatcmpl-test", "m", 0), 1, [])
    assert out.chunk_sink is None, "the relay would build every chunk only to be declined"
    out.started = True
    assert not out.write_now(b"1\r\nx\r\n"), "nothing but uvicorn's own send may be written past"
