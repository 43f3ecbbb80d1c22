"""The gateway's connection limits (gateway/connection_limits.py) on uvicorn's own protocol, fed bytes through a
transport that records what it was sent: each limit crossed by one byte, and what stays under it."""

from __future__ import annotations

import asyncio
import time
from email.utils import parsedate_to_datetime
from typing import Any

import orjson
import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState

from tessera.gateway.connection_limits import ConnectionLimits, LimitedHttpToolsProtocol
from tests.support.poll import async_wait_until

API_PORT, METRICS_PORT = 8000, 9464
LIMITS = ConnectionLimits(max_url_bytes=256, max_header_bytes=1024, header_timeout_s=10.0, max_connections=4,
                          max_in_flight=2)


class RecordingTransport(asyncio.Transport):
    def __init__(self, port: int = API_PORT) -> None:
        super().__init__()
        self.port = port
        self.sent = bytearray()
        self.closed = self.eof = self.paused = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", self.port), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.sent += data

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        pass


class Stack:
    """The app behind the protocol: answers 200 with the path, or holds its requests open while ``hold``."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.hold: asyncio.Event | None = None
        self.state = ServerState()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.paths.append(scope["path"])
        if self.hold is not None:
            await self.hold.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    def connect(self, port: int = API_PORT, limits: ConnectionLimits = LIMITS) -> tuple[LimitedHttpToolsProtocol,
                                                                                         RecordingTransport]:
        config = Config(self, http="httptools", ws="none", lifespan="off", log_level="warning", proxy_headers=False)
        config.load()
        protocol = LimitedHttpToolsProtocol(config, self.state, {}, asyncio.get_running_loop(), limits=limits,
                                            metrics_port=METRICS_PORT)
        transport = RecordingTransport(port)
        protocol.connection_made(transport)
        return protocol, transport


def status_of(transport: RecordingTransport) -> int:
    return int(bytes(transport.sent).split(b" ", 2)[1])


def error_of(transport: RecordingTransport) -> dict[str, Any]:
    head, _, body = bytes(transport.sent).partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower()
    return dict(orjson.loads(body)["error"])


def request(path: str = "/v1/models", headers: list[tuple[str, str]] = ()) -> bytes:  # type: ignore[assignment]
    lines = [f"GET {path} HTTP/1.1", "host: gw", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def complete(transport: RecordingTransport) -> bool:
    head, sep, body = bytes(transport.sent).partition(b"\r\n\r\n")
    length = [line.split(b":")[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
    return bool(sep) and bool(length) and len(body) >= int(length[0])


async def answered(transport: RecordingTransport) -> int:
    await async_wait_until(lambda: complete(transport), 5, "a whole response")
    return status_of(transport)


async def test_a_request_within_the_limits_reaches_the_app_and_arms_no_timer() -> None:
    stack = Stack()
    protocol, transport = stack.connect()
    protocol.data_received(request("/" + "a" * 200, [("x-pad", "b" * 900)]))
    assert await answered(transport) == 200 and stack.paths == ["/" + "a" * 200]
    # The head came in one read: the header timer of the connection's start is gone and none replaced it.
    assert protocol._head_timer is None and not transport.closed


async def test_a_url_one_byte_over_the_limit_is_414_and_closes() -> None:
    stack = Stack()
    protocol, transport = stack.connect()
    protocol.data_received(request("/" + "a" * 256))
    assert await answered(transport) == 414 and error_of(transport)["code"] == "url_too_long"
    assert b"connection: close" in transport.sent and transport.closed and stack.paths == []


async def test_a_url_still_arriving_is_414_once_over_the_limit_and_the_rest_is_dropped() -> None:
    stack = Stack()
    protocol, transport = stack.connect()
    protocol.data_received(b"GET /" + b"a" * 200)
    assert not transport.sent
    protocol.data_received(b"a" * 100)
    assert status_of(transport) == 414 and error_of(transport)["code"] == "url_too_long"
    assert transport.eof and transport.paused and not transport.closed  # answered, reading stopped, closed soon
    before = len(transport.sent)
    protocol.data_received(b"a" * 1000 + b" HTTP/1.1\r\n\r\n" + request())  # in flight as reading paused: dropped
    assert len(transport.sent) == before and stack.paths == []


@pytest.mark.parametrize("headers", [
    [("x-big", "v" * 1024)],  # one header
    [(f"x-h{i}", "v" * 20) for i in range(60)],  # many small ones
    [("x-dup", "v" * 100)] * 12,  # one name again and again
])
async def test_headers_over_the_limit_are_431(headers: list[tuple[str, str]]) -> None:
    stack = Stack()
    protocol, transport = stack.connect()
    protocol.data_received(request(headers=headers))
    assert await answered(transport) == 431 and error_of(transport)["code"] == "headers_too_large"
    assert stack.paths == [] and transport.closed


@pytest.mark.parametrize("num_header_bytes, status", [(1024, 200), (1025, 431)])
async def test_the_header_limit_holds_to_the_byte(num_header_bytes: int, status: int) -> None:
    stack = Stack()
    protocol, transport = stack.connect()
    # Each header counts its name, its value, ": " and CRLF: "host: gw" is 10 bytes, "x-pad: " + CRLF 9 more.
    protocol.data_received(request(headers=[("x-pad", "p" * (num_header_bytes - 19))]))
    assert await answered(transport) == status


@pytest.mark.parametrize("first_read_bytes", [100, 600, 1000])
async def test_headers_over_the_limit_split_over_reads_are_431(first_read_bytes: int) -> None:
    """Wherever the reads split a head, its headers are counted whole (a head that began in a large first
    read and ended in a small second one was once measured by the second alone)."""
    stack = Stack()
    protocol, transport = stack.connect()
    raw = request(headers=[(f"x-h{i}", "v" * 20) for i in range(60)])
    protocol.data_received(raw[:first_read_bytes])
    protocol.data_received(raw[first_read_bytes:])
    assert await answered(transport) == 431 and stack.paths == []


async def test_a_pipelined_head_is_not_charged_for_the_request_before_it() -> None:
    stack = Stack()
    protocol, transport = stack.connect()
    first = b"POST /first HTTP/1.1\r\nhost: gw\r\ncontent-length: 1000\r\n\r\n" + b"x" * 1000
    second = request("/second", [("x-pad", "p" * 900)])
    protocol.data_received(first + second[:100])  # 1,100 bytes in one read, the second head only begun
    protocol.data_received(second[100:])
    await async_wait_until(lambda: stack.paths == ["/first", "/second"], 5, "both requests served")
    assert b" 431 " not in transport.sent


async def test_a_header_value_that_never_ends_is_431_before_it_is_read_whole() -> None:
    """httptools keeps a header's value to itself until its CRLF: the per-read count stops it."""
    stack = Stack()
    protocol, transport = stack.connect()
    protocol.data_received(b"GET / HTTP/1.1\r\nx-bomb: ")
    reads = 0
    while not transport.sent:
        protocol.data_received(b"v" * 512)
        reads += 1
        assert reads < 10
    assert status_of(transport) == 431 and stack.paths == []


async def test_a_head_not_complete_in_time_is_408() -> None:
    stack = Stack()
    protocol, transport = stack.connect()
    protocol.data_received(b"GET / HTTP/1.1\r\nhost: gw\r\n")
    assert protocol._head_timer is not None
    protocol._head_timer.cancel()
    protocol._head_timed_out()  # what the timer calls
    assert status_of(transport) == 408 and error_of(transport)["code"] == "header_timeout"


async def test_a_connection_that_sends_nothing_is_timed_from_its_start() -> None:
    stack = Stack()
    protocol, transport = stack.connect()
    timer = protocol._head_timer
    assert timer is not None and timer.when() - asyncio.get_running_loop().time() > LIMITS.header_timeout_s - 1
    timer.cancel()
    protocol._head_timed_out()
    assert status_of(transport) == 408 and transport.eof


async def test_a_kept_alive_connection_arms_the_timer_only_for_a_head_split_over_reads() -> None:
    stack = Stack()
    protocol, transport = stack.connect()
    protocol.data_received(request())
    await answered(transport)
    assert protocol._head_timer is None
    protocol.data_received(b"GET /second HTTP/1.1\r\n")
    assert protocol._head_timer is not None
    protocol.data_received(b"host: gw\r\n\r\n")
    assert protocol._head_timer is None
    await async_wait_until(lambda: stack.paths == ["/v1/models", "/second"], 5, "both requests")


async def test_the_timer_waits_for_a_response_under_way() -> None:
    stack = Stack()
    stack.hold = asyncio.Event()
    protocol, transport = stack.connect()
    protocol.data_received(request())
    await async_wait_until(lambda: stack.paths == ["/v1/models"], 5, "the first request")
    protocol.data_received(b"GET /next HTTP/1.1\r\n")  # pipelined, incomplete, while the first streams
    protocol._head_timed_out()
    assert not transport.sent and protocol._head_timer is not None
    stack.hold.set()
    assert await answered(transport) == 200


async def test_a_connection_beyond_the_cap_is_503_and_closed_but_health_is_served() -> None:
    stack = Stack()
    held = [stack.connect() for _ in range(LIMITS.max_connections)]
    protocol, transport = stack.connect()
    protocol.data_received(request())
    assert await answered(transport) == 503
    assert error_of(transport)["code"] == "too_many_connections"
    assert b"retry-after: 1" in transport.sent.lower() and transport.closed
    health_protocol, health = stack.connect()
    health_protocol.data_received(request("/health"))
    assert await answered(health) == 200 and stack.paths == ["/health"]
    # Within the cap, the first connections are served.
    held[0][0].data_received(request())
    assert await answered(held[0][1]) == 200


async def test_a_request_beyond_the_in_flight_cap_is_503() -> None:
    stack = Stack()
    stack.hold = asyncio.Event()
    running = [stack.connect() for _ in range(LIMITS.max_in_flight)]
    for protocol, _ in running:
        protocol.data_received(request())
    await async_wait_until(lambda: len(stack.paths) == LIMITS.max_in_flight, 5, "the held requests")
    protocol, transport = stack.connect()
    protocol.data_received(request())
    assert await answered(transport) == 503
    error = error_of(transport)
    assert error["code"] == "too_many_requests_in_flight" and str(LIMITS.max_in_flight) in error["message"]
    assert b"retry-after: 1" in transport.sent.lower() and not transport.closed  # the connection stays usable
    stack.hold.set()
    for _, held in running:
        assert await answered(held) == 200


async def test_the_metrics_port_reaches_only_the_metrics_app(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    stack = Stack()
    protocol, transport = stack.connect(METRICS_PORT)
    protocol.data_received(request("/metrics"))
    assert await answered(transport) == 200 and stack.paths == []
    protocol, transport = stack.connect(METRICS_PORT)
    protocol.data_received(request("/v1/models"))
    assert await answered(transport) == 404 and stack.paths == []
    protocol, transport = stack.connect(API_PORT)
    protocol.data_received(request("/metrics"))
    assert await answered(transport) == 200 and stack.paths == ["/metrics"]  # the gateway app's to answer


def test_limits_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        ConnectionLimits(max_url_bytes=1, max_header_bytes=1, header_timeout_s=1, max_connections=1, max_in_flight=0)
    with pytest.raises(ValueError, match="header_timeout_s"):
        ConnectionLimits(max_url_bytes=1, max_header_bytes=1, header_timeout_s=0, max_connections=1, max_in_flight=1)


async def test_a_response_is_dated_to_the_second_between_the_servers_ticks() -> None:
    # The gateway's server ticks every two seconds (lean_server.SERVER_TICK_S); uvicorn dates responses from the
    # default headers its tick refreshed. Left as the last tick dated them, a response could be two seconds old.
    stack = Stack()
    stack.state.default_headers = [(b"date", b"Thu, 01 Jan 1970 00:00:00 GMT")]
    protocol, transport = stack.connect()
    protocol.data_received(b"GET /dated HTTP/1.1\r\nhost: x\r\n\r\n")
    await async_wait_until(lambda: b"\r\n\r\nok" in transport.sent, 5.0, "the response")
    head = bytes(transport.sent).split(b"\r\n\r\n")[0].decode()
    (date,) = [line.split(": ", 1)[1] for line in head.split("\r\n") if line.lower().startswith("date:")]
    assert abs(parsedate_to_datetime(date).timestamp() - time.time()) <= 2.0, date
