"""make bench-flood: does one source flooding a gateway with slow and oversized request heads hurt another
tenant's time to first token? Issue #15's goal: the victim's p99 TTFT under the flood within 1.5x its quiet
value. Writes bench/results/flood.json and prints a table.

One gateway worker (``tessera gateway``, as the chart starts it), an embedded Redis and a fake engine replica
in this process (``tests/support/fake_engine.py``: 16 delta lines 5 ms apart, no vLLM: the gateway is what is
under test). The victim, in this process, sends streamed completions with its own key, one every
``GAP_S``, over a kept-alive connection, and records the TTFT (request sent to first delta event); first with
the gateway quiet, then while the attacker, a process of its own (``--attacker``), floods it without a key:

- ``SLOW_CONNECTIONS`` connections that send a request head a byte every 0.5 s and never finish it
  (reopened when the gateway closes them);
- ``BOMBERS`` connections at a time, each sending an 8 MiB header value;
- ``WIDE`` connections at a time, each sending 5,000 small headers.

It runs twice: the gateway with its default limits (``TESSERA_HEADER_TIMEOUT_S`` 10 s, 32 KiB of headers,
...), and with the limits out of reach (as the gateway was before issue #15: no header limit, no header
timeout). The attacker runs on the first core and everything else on the others (``--no-pinning``: unpinned):
what is measured is what the flood costs the gateway, not what generating it costs the machine. The machine
is shared: read the ratio with the load beside it (``os.getloadavg`` is recorded).

Before the flood, the limits' cost on the hot path: uvicorn's own httptools protocol and the gateway's
(``connection_limits.LimitedHttpToolsProtocol``) parse the same kept-alive chat requests (a 600-byte head and
body, an app that answers at once) in this process, in alternating rounds; the CPU per request of each and
the difference are printed.

Options: ``--requests`` per phase (default 150), ``--only-defaults`` (skip the no-limits run),
``--protocol-only`` (only the hot-path comparison), ``--slow``, ``--bombers``, ``--wide`` (the attack's size).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import (
    REPO,
    bench_model,
    issue_keys,
    percentiles,
    print_table,
    start_gateway,
    stop,
    stop_on_sigterm,
    write_results,
)

from tests.support.machine import pin_this_process, pinned, split_cores

GAP_S = 0.1
MAX_TOKENS = 16
LINE_GAP_S = 0.005
SLOW_CONNECTIONS = 300
BOMBERS = 4
WIDE = 2
BOMB_BYTES = 8 * 1024 * 1024
GOAL_RATIO = 1.5
# The attacker starts this long before the victim's flood phase, so the flood is at full strength.
RAMP_S = 3.0
NO_LIMITS_ENV = {"TESSERA_MAX_URL_BYTES": str(2**40), "TESSERA_MAX_HEADER_BYTES": str(2**40),
                 "TESSERA_HEADER_TIMEOUT_S": str(10**9), "TESSERA_MAX_CONNECTIONS_PER_WORKER": str(10**9),
                 "TESSERA_MAX_IN_FLIGHT_PER_WORKER": str(10**9)}


# The attacker (its own process: its CPU is not the victim's client's)

async def _answer_status(reader: asyncio.StreamReader) -> str:
    try:
        line = await asyncio.wait_for(reader.readline(), 15)
    except (TimeoutError, ConnectionError):
        return "no_answer"
    return line.split(b" ")[1].decode() if line.startswith(b"HTTP/1.1 ") else "closed"


async def _slow(port: int, end: float, stats: Counter[str]) -> None:
    while time.monotonic() < end:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            stats["slow_connect_failed"] += 1
            await asyncio.sleep(0.5)
            continue
        stats["slow_opened"] += 1
        writer.write(b"GET /v1/models HTTP/1.1\r\nhost: gateway\r\n")
        try:
            while time.monotonic() < end and not reader.at_eof():
                await asyncio.sleep(0.5)
                writer.write(b"x")
                await writer.drain()  # fails once the gateway closes (after its 408 and a linger)
        except ConnectionError:
            pass
        if time.monotonic() < end:
            stats[f"slow_answered_{await _answer_status(reader)}"] += 1
        writer.close()


async def _send_and_read(port: int, pieces: list[bytes], stats: Counter[str], kind: str) -> None:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
        stats[f"{kind}_answered_{await _answer_status(reader)}"] += 1
        writer.close()
    except ConnectionError:
        stats[f"{kind}_reset"] += 1


async def _repeat(port: int, end: float, pieces: list[bytes], stats: Counter[str], kind: str) -> None:
    while time.monotonic() < end:
        await _send_and_read(port, pieces, stats, kind)


async def attack(port: int, duration_s: float, out: Path, num_slow: int, num_bombers: int, num_wide: int) -> None:
    end = time.monotonic() + duration_s
    stats: Counter[str] = Counter()
    bomb = [b"GET /v1/models HTTP/1.1\r\nhost: gateway\r\nx-bomb: "]
    bomb += [b"a" * 65536] * (BOMB_BYTES // 65536) + [b"\r\n\r\n"]
    wide = [b"GET /v1/models HTTP/1.1\r\nhost: gateway\r\n" + b"".join(b"x-h%d: v\r\n" % i for i in range(5000))
            + b"\r\n"]
    await asyncio.gather(*(_slow(port, end, stats) for _ in range(num_slow)),
                         *(_repeat(port, end, bomb, stats, "bomb") for _ in range(num_bombers)),
                         *(_repeat(port, end, wide, stats, "wide") for _ in range(num_wide)))
    out.write_text(json.dumps(dict(stats)))


# The hot path: the protocol's CPU per request, uvicorn's and ours

PROTOCOL_ROUNDS = 10
PROTOCOL_REQUESTS = 2000


class _NullTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.num_bytes = 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def write(self, data: Any) -> None:
        self.num_bytes += len(data)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def protocol_cost_us() -> dict[str, float]:
    """CPU per request (microseconds) of uvicorn's httptools protocol and of the gateway's, same requests."""
    import functools

    from uvicorn.config import Config
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    from tessera.gateway.connection_limits import ConnectionLimits, LimitedHttpToolsProtocol
    from tessera.settings import TesseraSettings

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    body = orjson.dumps({"model": "tessera-small", "messages": [{"role": "user", "content": "Hello " * 40}],
                         "max_tokens": 16, "stream": True})
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway:8000\r\nuser-agent: python-httpx/0.28\r\n"
               b"accept: */*\r\naccept-encoding: gzip, deflate\r\nconnection: keep-alive\r\n"
               b"authorization: Bearer tsk-0123456789ab-" + b"k" * 43 + b"\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n" % len(body)) + body
    settings = TesseraSettings()
    limits = ConnectionLimits(settings.max_url_bytes, settings.max_header_bytes, settings.header_timeout_s,
                              settings.max_connections_per_worker, settings.max_in_flight_per_worker)
    makers: dict[str, Callable[..., HttpToolsProtocol]] = {
        "uvicorn httptools": HttpToolsProtocol,
              "gateway (limits)": functools.partial(LimitedHttpToolsProtocol, limits=limits)}
    spent: dict[str, list[float]] = {name: [] for name in makers}

    async def rounds() -> None:
        config = Config(app, http="httptools", ws="none", lifespan="off", log_level="warning", proxy_headers=False)
        config.load()
        loop = asyncio.get_running_loop()
        for _ in range(PROTOCOL_ROUNDS):
            for name, make in makers.items():
                protocol = make(config, ServerState(), {}, loop)
                transport = _NullTransport()
                protocol.connection_made(transport)
                started = time.process_time_ns()
                for _ in range(PROTOCOL_REQUESTS):
                    protocol.data_received(request)
                    while protocol.cycle is None or not protocol.cycle.response_complete:
                        await asyncio.sleep(0)
                spent[name].append((time.process_time_ns() - started) / PROTOCOL_REQUESTS / 1e3)
                protocol.connection_lost(None)

    import uvloop

    uvloop.run(rounds())
    out = {name: round(sorted(values)[len(values) // 2], 2) for name, values in spent.items()}
    out["added_us"] = round(out["gateway (limits)"] - out["uvicorn httptools"], 2)
    return out


# The victim

async def victim(url: str, key: str, num_requests: int) -> list[float]:
    body = orjson.dumps({"model": "tessera-small", "prompt": "Tell me about the KV cache.", "max_tokens": MAX_TOKENS,
                         "temperature": 0.0, "stream": True})
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    ttfts: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4)) as session:
        next_at = time.monotonic()
        for _ in range(num_requests):
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            next_at += GAP_S
            sent, first = time.perf_counter(), 0.0
            async with session.post(f"{url}/v1/completions", data=body, headers=headers) as resp:
                assert resp.status == 200, await resp.text()
                async for line in resp.content:
                    if not first and line.startswith(b"data: {"):
                        first = time.perf_counter()
            ttfts.append(first - sent)
    return ttfts


def run_case(name: str, extra_env: dict[str, str], redis_url: str, key: str, work: Path,
             args: argparse.Namespace, cpus: tuple[str | None, str | None]) -> dict[str, Any]:
    num_requests = args.requests
    attacker_cpus, defender_cpus = cpus
    gateway, url = start_gateway({"TESSERA_REDIS_URL": redis_url, "TESSERA_TRACE_EXPORTER": "none", **extra_env},
                                 work / f"gateway-{name}.log", cpus=defender_cpus)
    try:
        asyncio.run(victim(url, key, 20))  # warm: caches, connections
        quiet = asyncio.run(victim(url, key, num_requests))
        duration_s = RAMP_S + num_requests * GAP_S * 1.5 + 5
        stats_path = work / f"attack-{name}.json"
        attacker = subprocess.Popen(pinned([sys.executable, __file__, "--attacker", url.rsplit(":", 1)[1],
                                            str(duration_s), str(stats_path), str(args.slow), str(args.bombers),
                                            str(args.wide)], attacker_cpus))
        time.sleep(RAMP_S)
        load = os.getloadavg()[0]
        flooded = asyncio.run(victim(url, key, num_requests))
        attacker.wait(timeout=duration_s + 60)
        alive = gateway.poll() is None
    finally:
        stop(gateway)
    q50, q99 = percentiles([t * 1e3 for t in quiet])
    f50, f99 = percentiles([t * 1e3 for t in flooded])
    return {"case": name, "quiet_ttft_ms": {"p50": round(q50, 2), "p99": round(q99, 2)},
            "flood_ttft_ms": {"p50": round(f50, 2), "p99": round(f99, 2)}, "p99_ratio": round(f99 / q99, 2),
            "goal_ratio": GOAL_RATIO, "met": f99 / q99 <= GOAL_RATIO, "gateway_survived": alive,
            "load_1min_at_flood": round(load, 2), "attack": json.loads(stats_path.read_text()),
            "attackers": {"slow_connections": args.slow, "bombers": args.bombers, "wide": args.wide},
            "attacker_cpus": attacker_cpus, "defender_cpus": defender_cpus,
            "requests_per_phase": num_requests}


def main() -> None:
    stop_on_sigterm()
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--only-defaults", action="store_true")
    parser.add_argument("--protocol-only", action="store_true")
    parser.add_argument("--slow", type=int, default=SLOW_CONNECTIONS, help="slow-head connections")
    parser.add_argument("--bombers", type=int, default=BOMBERS, help="connections sending 8 MiB headers at a time")
    parser.add_argument("--wide", type=int, default=WIDE, help="connections sending 5,000 headers at a time")
    parser.add_argument("--no-pinning", action="store_true")
    args = parser.parse_args()
    cost = protocol_cost_us()
    print_table(["protocol", "CPU per request, us (median of rounds)"], list(cost.items()))
    if args.protocol_only:
        write_results("flood", {"protocol_cost_us": cost})
        return
    from tessera.redis_conn import EmbeddedRedis
    from tests.support.fake_engine import running_fake_engine

    # The attacker on a core of its own (its machine, in a real attack), the rest here: what is measured is
    # what the flood costs the gateway, not what generating it costs the machine.
    cpus = (None, None) if args.no_pinning else split_cores()
    pin_this_process(cpus[1])
    work = Path(REPO / ".tessera" / "bench-flood")
    work.mkdir(parents=True, exist_ok=True)
    model_dir = bench_model("tessera-small")
    redis = EmbeddedRedis().start()
    results = []
    try:
        key = issue_keys(redis.url, {"victim": None})["victim"]
        with running_fake_engine(redis.url, "tessera-small", model_dir, LINE_GAP_S):
            cases: list[tuple[str, dict[str, str]]] = [("default limits", {})]
            if not args.only_defaults:
                cases.append(("no limits (before #15)", NO_LIMITS_ENV))
            for name, env in cases:
                results.append(run_case(name, env, redis.url, key, work, args, cpus))
    finally:
        redis.stop()
    print_table(["gateway", "quiet p50/p99 ms", "flood p50/p99 ms", "p99 ratio (goal <= 1.5)", "load", "attack"],
                [[r["case"], f"{r['quiet_ttft_ms']['p50']} / {r['quiet_ttft_ms']['p99']}",
                  f"{r['flood_ttft_ms']['p50']} / {r['flood_ttft_ms']['p99']}",
                  f"{r['p99_ratio']} {'met' if r['met'] else 'NOT met'}", r["load_1min_at_flood"],
                  ", ".join(f"{k}={v}" for k, v in sorted(r["attack"].items()))] for r in results])
    write_results("flood", {"protocol_cost_us": cost, "cases": results,
                            "machine_note": "shared 2-core VM: other work runs beside it"})


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "--attacker":
        asyncio.run(attack(int(sys.argv[2]), float(sys.argv[3]), Path(sys.argv[4]), *map(int, sys.argv[5:8])))
    else:
        main()
