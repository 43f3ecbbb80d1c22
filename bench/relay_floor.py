"""The floor under the gateway's CPU per streamed chunk on this machine: the least a Python process on uvloop
spends to take one NDJSON line from an upstream socket and write it to a downstream one (no parsing, no
HTTP, one ``data_received`` callback and one ``write`` per line), lines 2 ms apart as in bench-gateway-cpu.

What is left is the kernel's share (epoll wake-up, ``recv``, a loopback ``send`` that runs the receiver's
side too) and uvloop's: a compiled router pays about the same per chunk. Run alone:
``python bench/relay_floor.py``; ``bench_gateway_cpu.py`` prints it beside the gateway's figures.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import uvloop

LINES = 2000
LINE_GAP_S = 0.002


async def _upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    for i in range(LINES):
        writer.write(b'{"i":0,"t":" w%d","d":[%d]}\n' % (i, i))
        await asyncio.sleep(LINE_GAP_S)
    writer.close()


async def _sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while await reader.read(65536):
        pass
    writer.close()


class _Relay(asyncio.Protocol):
    def __init__(self, down: asyncio.WriteTransport, done: asyncio.Future[None]) -> None:
        self.down, self.done = down, done

    def data_received(self, data: bytes) -> None:
        self.down.write(b"data: " + data + b"\n\n")

    def connection_lost(self, exc: Exception | None) -> None:
        self.done.set_result(None)


async def _relay(up_port: int, down_port: int) -> None:
    loop = asyncio.get_running_loop()
    _, down = await asyncio.open_connection("127.0.0.1", down_port)
    done: asyncio.Future[None] = loop.create_future()
    cpu0 = time.process_time()
    await loop.create_connection(lambda: _Relay(down.transport, done), "127.0.0.1", up_port)  # type: ignore[arg-type]
    await done
    print(f"{(time.process_time() - cpu0) / LINES * 1e6:.1f}")


async def _measure() -> float:
    up = await asyncio.start_server(_upstream, "127.0.0.1", 0)
    down = await asyncio.start_server(_sink, "127.0.0.1", 0)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--relay", str(up.sockets[0].getsockname()[1]),
        str(down.sockets[0].getsockname()[1]), stdout=subprocess.PIPE)
    out, _ = await proc.communicate()
    up.close()
    down.close()
    return float(out)


def relay_floor_us() -> float:
    """CPU microseconds per relayed line of the minimal relay (a process of its own, so only it is counted)."""
    return uvloop.run(_measure())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--relay"]:
        uvloop.run(_relay(int(sys.argv[2]), int(sys.argv[3])))
    else:
        print(f"minimal uvloop relay: {relay_floor_us():.1f} us of CPU per line")
