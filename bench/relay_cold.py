"""The gateway's per-token relay in process: CPU per chunk, back to back and from cold caches.

One streamed response is set up as the gateway sets it up (an engine connection of ``http_wire`` relaying
to an ``engine_client._Attempt``, an ``SSEOut`` writing through uvicorn's httptools response cycle), with
transports that only count bytes; then engine chunks (one delta line each, as a decoding replica sends them)
are fed to the connection's ``data_received`` one at a time, timed with the thread's CPU clock:

- *hot*: back to back;
- *cold*: each after an 8 MiB sweep of memory and a 2 ms sleep, standing for what runs between two tokens
  in a deployment (the engine, the client, Redis, other requests: they evict the relay's code and data).

Four paths: ``per-token`` (``_Attempt.chunk_received``, the C ``split_delta_chunk``, ``SSEOut.write_now``
and ``direct_body``, what the gateway runs where the C step is built), ``per-token-py`` (the same with the
Python step, what runs where it is not), ``batched`` (the same response with no per-token path: every line
through the parser, ``lines_received``, ``parse_line``, ``SSEOut.deltas`` and ASGI's ``send``), and ``floor``
(a protocol whose ``data_received`` only frames and writes). The gateway paths must write the same bytes
(checked).
Run: ``python bench/relay_cold.py`` (~20 s). In-process medians over 600 chunks: far steadier than
``make bench-gateway-cpu``, which measures the whole gateway (and where this cost sits inside ~60-130 us of
CPU per chunk, the kernel's and uvloop's share included).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable

import uvloop
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from tessera.engine.protocol import delta_line
from tessera.gateway import engine_client
from tessera.gateway.delta_chunk import NATIVE_SPLIT, split_delta_chunk_py
from tessera.gateway.engine_client import StreamResult, _Attempt
from tessera.gateway.http_wire import StreamResponse, _Connection
from tessera.gateway.openai_format import ChunkWriter
from tessera.gateway.sse_out import SSEOut

CHUNKS = 600
WARM_CHUNKS = 50
PAUSE_S = 0.002
_SWEEP = bytearray(8 << 20)
ENGINE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"


class CountingTransport:
    """Takes what a protocol writes and keeps its bytes (the client's side) or nothing (the engine's)."""

    def __init__(self) -> None:
        self.written = bytearray()

    def write(self, data: bytes) -> None:
        self.written += data

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    def abort(self) -> None: ...
    def close(self) -> None: ...

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


def _evict() -> None:
    _SWEEP[::64] = bytes(len(_SWEEP) // 64)


def gateway_relay(per_token: bool, native: bool = True) -> tuple[Callable[[bytes], None], CountingTransport]:
    """The engine connection's ``data_received`` of one streamed chat, and the client's transport; ``native``:
    the C step, else the Python one (until the next call)."""
    engine_client.split_delta_chunk = NATIVE_SPLIT if native and NATIVE_SPLIT else split_delta_chunk_py
    client = CountingTransport()
    scope = {"type": "http", "method": "POST", "http_version": "1.1"}
    cycle = RequestResponseCycle(scope, client, FlowControl(client), logging.getLogger("relay_cold"),  # type: ignore[arg-type]
                                 logging.getLogger("relay_cold.access"), False, [], asyncio.Event(), False, True,
                                 lambda: None)
    out = SSEOut(cycle.send, ChunkWriter(True, "chatcmpl-relay", "tessera-small", 1_700_000_000), 1,  # type: ignore[arg-type]
                 [])
    conn = _Connection()
    conn.connection_made(CountingTransport())  # type: ignore[arg-type]
    conn.data_received(ENGINE_HEAD)
    response = StreamResponse(conn)
    response.relay(_Attempt(response, StreamResult(), [], out.deltas, out.chunk_sink if per_token else None))
    return conn.data_received, client


def floor_relay() -> tuple[Callable[[bytes], None], CountingTransport]:
    client = CountingTransport()

    def data_received(data: bytes) -> None:
        client.write(b"data: " + data + b"\n\n")

    return data_received, client


def per_chunk_us(feed: Callable[[bytes], None], chunks: list[bytes], cold: bool) -> float:
    for chunk in chunks[:WARM_CHUNKS]:
        feed(chunk)
    spent = []
    for chunk in chunks[WARM_CHUNKS:]:
        if cold:
            _evict()
            time.sleep(PAUSE_S)
        t0 = time.thread_time_ns()
        feed(chunk)
        spent.append(time.thread_time_ns() - t0)
    return statistics.median(spent) / 1e3


async def measure() -> dict[str, dict[str, float]]:
    lines = [delta_line(0, f" w{i}", [100 + i]) + b"\n" for i in range(WARM_CHUNKS + CHUNKS)]
    chunks = [b"%x\r\n%b\r\n" % (len(line), line) for line in lines]
    figures: dict[str, dict[str, float]] = {}
    written: dict[str, bytes] = {}
    for round_ in range(2):  # twice, interleaved: the machine's drift falls on all alike
        for name, make in (("per-token", lambda: gateway_relay(True)),
                           ("per-token-py", lambda: gateway_relay(True, native=False)),
                           ("batched", lambda: gateway_relay(False)), ("floor", floor_relay)):
            for cold in (False, True):
                feed, client = make()
                us = per_chunk_us(feed, chunks, cold)
                figures.setdefault(name, {}).setdefault("cold" if cold else "hot", 0.0)
                figures[name]["cold" if cold else "hot"] += us / 2
                if round_ == 0 and not cold:
                    written[name] = bytes(client.written)
    if not written["per-token"] == written["per-token-py"] == written["batched"]:
        raise AssertionError("the per-token paths wrote other bytes than the batched one")
    return figures


def main() -> None:
    if NATIVE_SPLIT is None:
        print("the C step is not built here (make install): per-token runs the Python step")
    figures = uvloop.run(measure())
    print(f"{'path':>10} | {'hot us/chunk':>12} | {'cold us/chunk':>13}")
    for name, row in figures.items():
        print(f"{name:>10} | {row['hot']:12.1f} | {row['cold']:13.1f}")


if __name__ == "__main__":
    main()
