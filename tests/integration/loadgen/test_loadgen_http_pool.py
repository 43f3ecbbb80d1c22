"""The client's connection pool against a hand-written HTTP/1.1 server: reuse, stale keep-alive retry,
the cap on connection attempts in progress."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tessera_loadgen._http import MAX_CONNECTING, Connection, ConnectionPool

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"
REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


class Handler:
    def __init__(self, done: asyncio.Future[str]) -> None:
        self.done = done
        self.body = b""
        self.sends = 0

    def on_sent(self, t_send: float, connection: Connection) -> None:
        self.sends += 1

    def on_headers(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        assert status == 200

    def on_body(self, data: bytes) -> None:
        self.body += data

    def on_complete(self) -> None:
        self.done.set_result(self.body.decode())

    def on_error(self, kind: str, detail: str) -> None:
        self.done.set_result(f"error:{kind}")


class Server:
    """Answers ``ok``; with ``one_per_connection`` it closes a connection, unanswered, at its second
    request, like a server whose keep-alive timeout fires just as the client reuses the connection."""

    def __init__(self, one_per_connection: bool) -> None:
        self.one_per_connection = one_per_connection
        self.requests = 0
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            self.requests += 1
            if self.one_per_connection and served == 1:
                break
            writer.write(RESPONSE)
            await writer.drain()
            served += 1
        writer.close()


@pytest.fixture
async def server_factory() -> AsyncIterator[list[asyncio.Server]]:
    servers: list[asyncio.Server] = []
    yield servers
    for server in servers:
        server.close()
        await server.wait_closed()


async def start(servers: list[asyncio.Server], one_per_connection: bool = False) -> tuple[Server, int]:
    state = Server(one_per_connection)
    server = await asyncio.start_server(state.handle, "127.0.0.1", 0)
    servers.append(server)
    return state, server.sockets[0].getsockname()[1]


async def send(pool: ConnectionPool) -> tuple[str, Handler]:
    handler = Handler(asyncio.get_running_loop().create_future())
    pool.request(REQUEST, handler)
    return await asyncio.wait_for(handler.done, 10), handler


async def test_keep_alive_connection_is_reused(server_factory: list[asyncio.Server]) -> None:
    state, port = await start(server_factory)
    pool = ConnectionPool("127.0.0.1", port)
    for _ in range(5):
        body, _ = await send(pool)
        assert body == "ok"
    assert pool.num_connects == 1 and state.connections == 1
    await pool.close()


async def test_request_on_a_connection_the_server_dropped_is_sent_again(
    server_factory: list[asyncio.Server],
) -> None:
    state, port = await start(server_factory, one_per_connection=True)
    pool = ConnectionPool("127.0.0.1", port)
    first, _ = await send(pool)
    assert first == "ok"
    second, handler = await send(pool)
    assert second == "ok"
    assert handler.sends == 2  # once on the dropped connection, once on a new one
    assert state.requests == 3 and pool.num_connects == 2
    await pool.close()


async def test_connection_attempts_in_progress_are_capped(server_factory: list[asyncio.Server]) -> None:
    _, port = await start(server_factory)
    pool = ConnectionPool("127.0.0.1", port)
    handlers = [Handler(asyncio.get_running_loop().create_future()) for _ in range(MAX_CONNECTING + 40)]
    for handler in handlers:
        pool.request(REQUEST, handler)
    assert pool.num_connecting == MAX_CONNECTING
    assert pool.num_waiting == 40
    bodies = await asyncio.wait_for(asyncio.gather(*(h.done for h in handlers)), 10)
    assert bodies == ["ok"] * len(handlers)
    assert pool.num_connecting == 0 and pool.num_waiting == 0
    await pool.close()


async def test_max_connections_queues_requests_in_order(server_factory: list[asyncio.Server]) -> None:
    _, port = await start(server_factory)
    pool = ConnectionPool("127.0.0.1", port, max_connections=2)
    handlers = [Handler(asyncio.get_running_loop().create_future()) for _ in range(10)]
    for handler in handlers:
        pool.request(REQUEST, handler)
    assert pool.num_open == 2 and pool.num_waiting == 8
    await asyncio.wait_for(asyncio.gather(*(h.done for h in handlers)), 10)
    assert pool.num_connects == 2
    await pool.close()
