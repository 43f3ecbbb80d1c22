"""The client's response handling, fed by hand: SSE framing, content chunks, usage, errors, 429s."""

from __future__ import annotations

import asyncio
import email.utils
import json
from typing import Any

import pytest

from tessera_loadgen import client as client_module
from tessera_loadgen.client import Target, TenantClient, _Call, parse_retry_after
from tessera_loadgen.records import RequestRecord
from tessera_loadgen.workload import RetryPolicy

SSE = [(b"Content-Type", b"text/event-stream"), (b"X-Request-Id", b"req-42")]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeConnection:
    def __init__(self) -> None:
        self.detached = 0

    def detach(self, handler: Any) -> None:
        self.detached += 1


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(client_module, "_perf_counter", fake)
    return fake


def new_call(
    endpoint: str = "chat", retry: RetryPolicy | None = None, collect: bool = False
) -> tuple[_Call, RequestRecord, list[RequestRecord]]:
    client = TenantClient(Target.parse("http://127.0.0.1:9"), "key", timeout_s=30, retry=retry or RetryPolicy())
    record = RequestRecord("r1", "t", "c", endpoint, True, t_sched=99.0)
    done: list[RequestRecord] = []
    client.in_flight += 1
    call = _Call(client, record, b"POST ...", done.append, collect)
    return call, record, done


def chunk(content: str | None = None, cum: int | None = None, usage_only: bool = False, text: bool = False) -> bytes:
    body: dict[str, Any] = {"id": "x"}
    if usage_only:
        body["choices"] = []
    elif text:
        body["choices"] = [{"index": 0, "text": content}]
    elif content is None:
        body["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""}}]
    else:
        body["choices"] = [{"index": 0, "delta": {"content": content}}]
    if cum is not None:
        body["usage"] = {"prompt_tokens": 7, "completion_tokens": cum, "total_tokens": 7 + cum}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def feed(call: _Call, clock: FakeClock, at: float, data: bytes) -> None:
    clock.now = at
    call.on_body(data)


def test_empty_first_chunk_is_not_the_first_token(clock: FakeClock) -> None:
    call, record, done = new_call(collect=True)
    call.on_sent(100.0, FakeConnection())  # type: ignore[arg-type]
    call.on_headers(200, SSE)
    feed(call, clock, 100.05, chunk(None, cum=0))  # role-only chunk, empty content
    feed(call, clock, 100.20, chunk("Hel", cum=1))
    feed(call, clock, 100.25, chunk("", cum=2))  # a token whose text is held back
    feed(call, clock, 100.30, chunk("lo", cum=3))
    feed(call, clock, 100.31, chunk(usage_only=True, cum=3) + b"data: [DONE]\n\n")
    clock.now = 100.32
    call.on_complete()
    assert done == [record]
    assert record.ok
    assert record.t_send == 100.0 and record.t_send_first == 100.0
    assert record.t_first == 100.20
    assert record.t_last == 100.30
    assert record.t_done == 100.32
    assert record.chunk_times == [100.20, 100.30]
    # The held-back token is credited to the chunk that shows its text.
    assert record.chunk_tokens == [1, 2]
    assert record.n_out == 3 and record.n_out_source == "usage"
    assert record.n_in == 7
    assert record.server_request_id == "req-42"
    assert record.text == "Hello"


def test_crlf_framing_split_across_reads_and_non_data_lines(clock: FakeClock) -> None:
    call, record, done = new_call()
    call.on_sent(100.0, FakeConnection())  # type: ignore[arg-type]
    call.on_headers(200, SSE)
    first = chunk("a", cum=1).replace(b"\n\n", b"\r\n\r\n")
    feed(call, clock, 100.1, first[:-3])  # ends inside the "\r\n\r\n"
    feed(call, clock, 100.2, first[-3:] + b": keep-alive ping\r\n\r\n")
    feed(call, clock, 100.3, b"event: message\r\nid: 2\r\n" + chunk("b", cum=2).replace(b"\n\n", b"\r\n\r\n"))
    feed(call, clock, 100.4, b"data: [DONE]")  # the last event has no trailing blank line
    call.on_complete()
    assert record.ok
    assert record.chunk_times == [100.2, 100.3]
    assert record.chunk_tokens == [1, 1]
    assert done == [record]


def test_without_usage_n_out_is_counted_by_the_client_and_flagged(clock: FakeClock) -> None:
    call, record, _ = new_call(endpoint="completions")
    call.on_sent(100.0, FakeConnection())  # type: ignore[arg-type]
    call.on_headers(200, SSE)
    feed(call, clock, 100.1, chunk("x", text=True) + chunk("y", text=True))
    call.on_complete()
    assert record.ok
    assert record.n_out == 2
    assert record.n_out_source == "client_chunks"
    assert record.chunk_tokens is None
    assert record.chunk_times == [100.1, 100.1]


def test_error_inside_the_stream_fails_once(clock: FakeClock) -> None:
    call, record, done = new_call()
    connection = FakeConnection()
    call.on_sent(100.0, connection)  # type: ignore[arg-type]
    call.on_headers(200, SSE)
    feed(call, clock, 100.1, chunk("a", cum=1))
    feed(call, clock, 100.2, b'data: {"error": {"message": "engine died"}}\n\n')
    call.on_complete()
    call.on_error("broken_stream", "late")
    assert done == [record]
    assert record.error_kind == "stream_error"
    assert "engine died" in record.error_detail
    assert record.t_first == 100.1  # partial timing kept for the JSONL
    assert connection.detached == 1


def test_undecodable_data_is_a_bad_response(clock: FakeClock) -> None:
    call, record, _ = new_call()
    call.on_sent(100.0, FakeConnection())  # type: ignore[arg-type]
    call.on_headers(200, SSE)
    feed(call, clock, 100.1, b"data: {not json\n\n")
    assert record.error_kind == "bad_response"


def test_stream_without_content_is_empty_output(clock: FakeClock) -> None:
    call, record, _ = new_call()
    call.on_sent(100.0, FakeConnection())  # type: ignore[arg-type]
    call.on_headers(200, SSE)
    feed(call, clock, 100.1, chunk(None) + b"data: [DONE]\n\n")
    call.on_complete()
    assert record.error_kind == "empty_output"
    assert record.t_done == 100.1


def test_http_error_keeps_the_openai_message(clock: FakeClock) -> None:
    call, record, done = new_call()
    call.on_sent(100.0, FakeConnection())  # type: ignore[arg-type]
    call.on_headers(503, [(b"content-type", b"application/json")])
    call.on_body(b'{"error": {"message": "no engine", "type": "x", "code": null}}')
    call.on_complete()
    assert record.error_kind == "http_503"
    assert record.http_status == 503
    assert record.error_detail == "no engine"
    assert done == [record]


def test_non_streamed_response(clock: FakeClock) -> None:
    call, record, _ = new_call()
    record.stream = False
    call.on_sent(100.0, FakeConnection())  # type: ignore[arg-type]
    call.on_headers(200, [(b"content-type", b"application/json")])
    body = {
        "choices": [{"message": {"content": "hi there"}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    clock.now = 100.5
    call.on_body(json.dumps(body).encode())
    call.on_complete()
    assert record.ok
    assert record.t_first is None
    assert record.t_last == record.t_done == 100.5
    assert (record.n_in, record.n_out) == (3, 2)


def test_timeout_detaches_the_connection(clock: FakeClock) -> None:
    call, record, done = new_call()
    connection = FakeConnection()
    call.on_sent(100.0, connection)  # type: ignore[arg-type]
    clock.now = 130.0
    call.on_timeout()
    assert record.error_kind == "timeout"
    assert connection.detached == 1
    assert done == [record]


async def test_429_with_retry_after_is_respected_then_succeeds(clock: FakeClock) -> None:
    call, record, done = new_call(retry=RetryPolicy(on_429="respect", max_retries=2))
    resent: list[bytes] = []
    call.client.pool.request = lambda data, handler: resent.append(data)  # type: ignore[method-assign]
    call.on_sent(100.0, FakeConnection())  # type: ignore[arg-type]
    call.on_headers(429, [(b"Retry-After", b"0.01")])
    call.on_body(b'{"error": {"message": "slow down"}}')
    call.on_complete()
    assert done == []
    assert record.num_429 == 1 and record.num_429_retry_after == 1
    assert record.retry_wait_s == pytest.approx(0.01)
    await asyncio.sleep(0.03)
    assert resent == [], "not before Retry-After has passed on the client's clock"
    clock.now = 100.011
    await asyncio.sleep(0.03)
    assert resent == [b"POST ..."]
    call.on_sent(101.0, FakeConnection())  # type: ignore[arg-type]
    call.on_headers(200, SSE)
    feed(call, clock, 101.1, chunk("ok", cum=1))
    call.on_complete()
    assert record.ok
    assert record.t_send_first == 100.0 and record.t_send == 101.0
    assert record.http_status == 200
    assert done == [record]


async def test_429_count_policy_and_exhausted_retries_reject(clock: FakeClock) -> None:
    call, record, done = new_call(retry=RetryPolicy(on_429="count"))
    call.on_sent(100.0, FakeConnection())  # type: ignore[arg-type]
    call.on_headers(429, [])
    call.on_complete()
    assert record.error_kind == "http_429"
    assert (record.num_429, record.num_429_retry_after) == (1, 0)
    assert done == [record]

    call, record, done = new_call(retry=RetryPolicy(on_429="respect", max_retries=0))
    call.on_sent(100.0, FakeConnection())  # type: ignore[arg-type]
    call.on_headers(429, [(b"retry-after", b"1")])
    call.on_complete()
    assert record.error_kind == "http_429"


def test_parse_retry_after() -> None:
    assert parse_retry_after(None) is None
    assert parse_retry_after(b"2") == 2.0
    assert parse_retry_after(b" 0.5 ") == 0.5
    assert parse_retry_after(b"soon") is None
    date = email.utils.formatdate(1_000_030.0, usegmt=True).encode()
    assert parse_retry_after(date, now_unix=1_000_000.0) == pytest.approx(30.0)


def test_target_parse() -> None:
    assert Target.parse("http://127.0.0.1:8000/v1/").url == "http://127.0.0.1:8000"
    target = Target.parse("https://example.test/prefix")
    assert (target.port, target.base_path) == (443, "/prefix")
    with pytest.raises(ValueError, match="http"):
        Target.parse("ftp://x")
