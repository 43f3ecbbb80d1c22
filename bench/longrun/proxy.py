"""The Service in front of the gateways: a TCP proxy that deals client connections round-robin to the
gateways, skipping one that refuses the connection.

That is what a client of the chart sees (a Service or an ingress over the gateway pods): a connection stays
with the gateway it reached; when that gateway dies its connections close (its streams are cut), and new
connections go to the gateways that accept them. It runs on its own event loop in a thread, so the bench's
load generator and sampler do not share a loop with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading

_CHUNK = 1 << 16


class RoundRobinProxy:
    def __init__(self, upstream_ports: list[int], host: str = "127.0.0.1") -> None:
        self.host = host
        self.upstream_ports = upstream_ports
        self.port = 0
        self.num_refused = 0  # connection attempts to a gateway that refused them (skipped)
        self._next = itertools.cycle(range(len(upstream_ports)))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gateway-proxy", daemon=True)
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> RoundRobinProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, self.host, 0), self._loop).result(timeout=10)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _open_upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        for _ in self.upstream_ports:
            port = self.upstream_ports[next(self._next)]
            try:
                return await asyncio.open_connection(self.host, port)
            except OSError:
                self.num_refused += 1
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream = await self._open_upstream()
        if upstream is None:
            writer.close()  # no gateway accepts: the client sees its connection closed before a response
            return
        up_reader, up_writer = upstream
        pumps = [asyncio.create_task(_pump(reader, up_writer)), asyncio.create_task(_pump(up_reader, writer))]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
            for stream in (writer, up_writer):
                stream.close()


async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while data := await source.read(_CHUNK):
            sink.write(data)
            await sink.drain()
