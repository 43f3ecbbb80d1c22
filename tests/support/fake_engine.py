"""A fake engine replica that speaks the engine protocol (``engine/protocol.py``) at a set pace, registered in
Redis like a real one: for gateway tests whose streams must outlast a deadline without vLLM's CPU.

``POST /generate`` answers ``max_tokens`` delta lines (one token each) ``line_gap_s`` apart, then the closing
line; it counts the lines each request was sent, so a test can hold billing against what the engine made.
It runs on an event loop of its own in a thread, and heartbeats the registry from there.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from redis.exceptions import RedisError

from tessera.engine.protocol import RequestStats, delta_line, done_line
from tessera.redis_conn import connect
from tessera.registry import EngineRecord, EngineRegistry, ModelInfo, register_model

HEARTBEAT_S = 0.5


@dataclass
class FakeEngine:
    model: str
    line_gap_s: float
    url: str = ""
    num_open: int = 0
    tokens_sent: dict[str, int] = field(default_factory=dict)  # request id -> delta lines written
    connections: set[asyncio.Task[None]] = field(default_factory=set)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = orjson.loads(await reader.readexactly(length))
                await self._generate(body, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.connections.discard(task)
            writer.close()

    async def close_connections(self) -> None:
        """Closes the open connections, as a replica process that exits does (its sockets go with it): left
        open with nobody reading, a gateway's pooled connection would wait on them for its full timeout."""
        for task in list(self.connections):
            task.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)

    async def _generate(self, body: dict[str, object], writer: asyncio.StreamWriter) -> None:
        request_id = str(body["request_id"])
        max_tokens = int(body["max_tokens"])  # type: ignore[call-overload]
        self.num_open += 1
        self.tokens_sent[request_id] = 0
        try:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            for i in range(max_tokens):
                line = delta_line(0, f" w{i}", [100 + i % 100]) + b"\n"
                if i == max_tokens - 1:
                    line += done_line({"0": "length"}, RequestStats(num_output_tokens=max_tokens)) + b"\n"
                writer.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.tokens_sent[request_id] += 1
                await writer.drain()  # a gateway that hung up fails here, as it would on a replica
                await asyncio.sleep(self.line_gap_s)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        finally:
            self.num_open -= 1


@contextmanager
def running_fake_engine(redis_url: str, model: str, tokenizer_dir: Path, line_gap_s: float) -> Iterator[FakeEngine]:
    """A registered fake replica of ``model`` (tokenized with ``tokenizer_dir``) until the block ends."""
    engine = FakeEngine(model, line_gap_s)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    stop = asyncio.Event()

    async def main() -> None:
        server = await asyncio.start_server(engine.handle, "127.0.0.1", 0)
        engine.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        redis = connect(redis_url, timeout_s=5.0)
        await register_model(redis, ModelInfo(model, str(tokenizer_dir), 4096, 16))
        registry = EngineRegistry(redis, HEARTBEAT_S)
        record = EngineRecord(f"fake-{server.sockets[0].getsockname()[1]}", engine.url, model, 16, 4096, 4096)
        try:
            while not stop.is_set():
                try:
                    await registry.heartbeat(record)
                    started.set()
                except RedisError:  # an outage or a failover: the next beat tries again, as a replica's does
                    pass
                try:
                    await asyncio.wait_for(stop.wait(), HEARTBEAT_S)
                except TimeoutError:
                    pass
            await registry.deregister(record.engine_id)
        finally:
            server.close()
            await engine.close_connections()
            await redis.aclose()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), name="fake-engine", daemon=True)
    thread.start()
    if not started.wait(30):
        raise TimeoutError("the fake engine did not register within 30 s")
    try:
        yield engine
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=10)
        if not thread.is_alive():
            loop.close()
