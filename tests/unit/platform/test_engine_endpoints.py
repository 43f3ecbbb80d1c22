"""The engine replica's routes without vLLM: a fake engine streams, the routes validate bodies (400 naming the
wrong field, 413 over ``max_body_bytes``), list and abort in-flight requests, and write only protocol lines."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from tessera.data_plane_auth import SIGNATURE_HEADER, ReplicaGuard, Signer
from tessera.engine import held_head
from tessera.engine.endpoints import EngineEndpoints
from tessera.engine.in_flight import InFlightRequests
from tessera.engine.protocol import Delta, Done, Failed, parse_line
from tessera.engine.stats import EngineLoad
from tessera.engine.vllm_metrics import VllmMetrics

LIMIT = 2048
KEY = b"k" * 32


class FakeEngine:
    """vLLM's ``AsyncLLM`` as the routes use it: ``generate`` yields DELTA outputs, ``abort`` records."""

    def __init__(self, tokens: list[int], gate: asyncio.Event | None = None) -> None:
        self.tokens = tokens
        self.gate = gate
        self.aborted: list[str] = []

    async def generate(self, prompt: dict[str, Any], params: Any, request_id: str, priority: int = 0) -> Any:
        for i, token in enumerate(self.tokens):
            if self.gate is not None and i == 1:
                await self.gate.wait()
            last = i == len(self.tokens) - 1
            yield SimpleNamespace(
                outputs=[SimpleNamespace(index=0, text=f"<{token}>", token_ids=[token],
                                         finish_reason="length" if last else None, spec_decode_metrics=None)],
                finished=last, num_cached_tokens=0, metrics=None)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


@dataclass
class FakeReplica:
    engine: Any
    engine_id: str = "fake-engine"
    served_model_name: str = "fake-model"
    healthy: bool = True
    speculation: Any = None
    vllm_metrics: VllmMetrics = field(default_factory=VllmMetrics)

    def is_healthy(self) -> bool:
        return self.healthy

    def load(self) -> EngineLoad:
        return EngineLoad(num_running=1, block_size=32, num_gpu_blocks=10)

    def facts(self, load: EngineLoad | None = None) -> dict[str, Any]:
        return {"kv_cache_dtype": "fp8", "kv_cache_dtype_requested": "fp8", "kv_capacity_tokens": 320,
                "speculative_method": "ngram", "fallbacks": []}


@dataclass
class Response:
    status: int = 0
    headers: dict[bytes, bytes] = field(default_factory=dict)
    chunks: list[bytes] = field(default_factory=list)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def json(self) -> Any:
        return orjson.loads(self.body)


async def call(endpoints: EngineEndpoints, method: str, path: str, body: bytes = b"",
               headers: list[tuple[bytes, bytes]] | None = None, chunk: int = 0,
               disconnect: asyncio.Event | None = None, signed: bool = True) -> Response:
    if signed:  # as the gateway and the controller call (test_engine_auth.py plays the unsigned caller)
        headers = [*(headers or []), (SIGNATURE_HEADER.encode(), Signer(KEY).sign(method, path, body).encode())]
    chunks = [body[i:i + chunk] for i in range(0, len(body), chunk)] if chunk else [body]
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    response = Response()

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        if disconnect is not None:
            await disconnect.wait()
        else:
            await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            response.status = message["status"]
            response.headers = dict(message["headers"])
        else:
            response.chunks.append(message.get("body", b""))

    scope = {"type": "http", "method": method, "path": path, "headers": headers or []}
    await endpoints.asgi(scope, receive, send)
    return response


def make(engine: Any = None, healthy: bool = True) -> tuple[EngineEndpoints, InFlightRequests, FakeReplica]:
    replica = FakeReplica(engine or FakeEngine([7, 8, 9]), healthy=healthy)
    in_flight = InFlightRequests()
    return EngineEndpoints(replica, in_flight, LIMIT, ReplicaGuard(KEY, b"m" * 32)), in_flight, replica


def generate_body(**fields: Any) -> bytes:
    return orjson.dumps({"request_id": "r1", "prompt_token_ids": [1, 2, 3], "max_tokens": 3, **fields})


async def test_a_stream_is_protocol_lines_ending_in_done() -> None:
    endpoints, in_flight, _ = make()
    response = await call(endpoints, "POST", "/generate", generate_body())
    assert response.status == 200 and response.headers[b"content-type"] == b"application/x-ndjson"
    lines = [parse_line(line) for line in response.body.splitlines()]
    assert lines[:-1] == [Delta(0, "<7>", [7]), Delta(0, "<8>", [8]), Delta(0, "<9>", [9])]
    done = lines[-1]
    assert isinstance(done, Done) and done.finish == {0: "length"}
    assert done.stats["num_output_tokens"] == 3 and done.stats["engine_id"] == "fake-engine"
    assert len(in_flight) == 0


@pytest.mark.parametrize(("body", "named"), [
    (orjson.dumps({"request_id": "r1", "max_tokens": 3}), "prompt_token_ids: Field required"),
    (generate_body(max_tokens=0), "max_tokens: Input should be greater than or equal to 1"),
    (generate_body(prefill_tokens=-1), "prefill_tokens: Input should be greater than or equal to 0"),
    (generate_body(temperature="hot"), "temperature: Input should be a valid number"),
    (generate_body(tempreature=1.0), "tempreature: Extra inputs are not permitted"),
    (b"{not json", "Invalid JSON"),
])
async def test_a_bad_generate_body_is_400_naming_what_is_wrong(body: bytes, named: str) -> None:
    endpoints, _, _ = make()
    response = await call(endpoints, "POST", "/generate", body)
    assert response.status == 400
    assert response.json()["error"].startswith("invalid GenerateRequest: ") and named in response.json()["error"]


async def test_a_body_over_the_limit_is_413_whether_declared_or_streamed() -> None:
    endpoints, _, _ = make()
    big = generate_body(stop=["x" * LIMIT])
    declared = await call(endpoints, "POST", "/generate", big, headers=[(b"content-length", str(len(big)).encode())])
    assert declared.status == 413 and f"of {len(big)} bytes exceeds the limit of {LIMIT}" in declared.json()["error"]
    streamed = await call(endpoints, "POST", "/generate", big, chunk=512)
    assert streamed.status == 413 and f"limit of {LIMIT} bytes" in streamed.json()["error"]
    at_limit = generate_body(stop=["x" * (LIMIT - len(generate_body(stop=[""])))])
    assert len(at_limit) == LIMIT
    assert (await call(endpoints, "POST", "/generate", at_limit)).status == 200


async def test_an_unhealthy_engine_answers_503_and_unknown_routes_404() -> None:
    endpoints, _, _ = make(healthy=False)
    assert (await call(endpoints, "POST", "/generate", generate_body())).status == 503
    health = await call(endpoints, "GET", "/health")
    assert health.status == 503 and health.json() == {"healthy": False, "engine_id": "fake-engine"}
    missing = await call(endpoints, "GET", "/nope")
    assert missing.status == 404 and missing.json() == {"error": "no route GET /nope"}


async def test_stats_and_metrics_carry_load_and_facts() -> None:
    endpoints, _, _ = make()
    stats = (await call(endpoints, "GET", "/stats")).json()
    assert stats["engine_id"] == "fake-engine" and stats["num_running"] == 1 and stats["kv_cache_dtype"] == "fp8"
    metrics = await call(endpoints, "GET", "/metrics")
    assert metrics.status == 200 and b"tessera_engine_" in metrics.body


async def test_metrics_end_with_the_replicas_own_vllm_series() -> None:
    endpoints, _, replica = make()
    counter = replica.vllm_metrics.stat_logger._counter_cls("vllm:num_preemptions", "Preemptions", ["engine"])
    counter.labels("0").inc(3)
    body = (await call(endpoints, "GET", "/metrics")).body
    assert body.index(b"tessera_engine_") < body.index(b'vllm:num_preemptions_total{engine="0"} 3.0')


async def test_abort_ends_a_running_request_with_a_retryable_error_line() -> None:
    gate = asyncio.Event()
    engine = FakeEngine([7, 8, 9], gate)
    endpoints, _, _ = make(engine)
    stream = asyncio.create_task(call(endpoints, "POST", "/generate", generate_body(priority=20),
                                      headers=[(b"x-tessera-tenant", b"bob")]))
    while not (listing := (await call(endpoints, "GET", "/requests")).json()):
        await asyncio.sleep(0.01)
    assert [(r["request_id"], r["tenant"], r["priority"]) for r in listing] == [("r1", "bob", 20)]
    unknown = await call(endpoints, "POST", "/abort", orjson.dumps({"request_id": "other"}))
    assert unknown.status == 404 and "'other' is not running here" in unknown.json()["error"]
    bad = await call(endpoints, "POST", "/abort", orjson.dumps({"reason": "x"}))
    assert bad.status == 400 and bad.json()["error"] == "invalid AbortRequest: request_id: Field required"
    ok = await call(endpoints, "POST", "/abort", orjson.dumps({"request_id": "r1", "reason": "kv pressure"}))
    assert ok.status == 200 and engine.aborted == ["r1"]
    # The fake engine ends its stream unfinished for an aborted request as vLLM does: cut it short here.
    engine.tokens = engine.tokens[:1]
    gate.set()
    lines = [parse_line(line) for line in (await stream).body.splitlines()]
    assert isinstance(lines[-1], Failed) and lines[-1].retryable and lines[-1].status == 503
    assert lines[-1].message == "request aborted by the engine: kv pressure"
    assert (await call(endpoints, "GET", "/requests")).json() == []


class FirstTokenGate(FakeEngine):
    """Holds its first output until ``first`` is set (the prompt's prefill), its second until ``rest``."""

    def __init__(self, tokens: list[int], first: asyncio.Event, rest: asyncio.Event) -> None:
        super().__init__(tokens, rest)
        self.first = first

    async def generate(self, prompt: dict[str, Any], params: Any, request_id: str, priority: int = 0) -> Any:
        await self.first.wait()
        async for output in super().generate(prompt, params, request_id, priority):
            yield output


async def test_a_request_counts_its_declared_prefill_tokens_until_its_first_token() -> None:
    """What the heartbeat reports as the replica's prefill backlog (``pending_prefill_tokens``): the tokens
    the gateway declared, at most the prompt's, until each request's first output."""
    first, rest = asyncio.Event(), asyncio.Event()
    endpoints, in_flight, _ = make(FirstTokenGate([7, 8, 9], first, rest))
    prompt = list(range(300))  # within the test's body limit (LIMIT bytes)
    streams = [asyncio.create_task(call(endpoints, "POST", "/generate", body)) for body in (
        generate_body(prompt_token_ids=prompt, prefill_tokens=250),
        generate_body(request_id="r2", prompt_token_ids=prompt, prefill_tokens=10**6))]  # no more than its prompt

    async def until(condition: Callable[[], bool]) -> None:
        async with asyncio.timeout(10):
            while not condition():
                assert not any(stream.done() for stream in streams), [s.result().status for s in streams if s.done()]
                await asyncio.sleep(0.01)

    await until(lambda: len(in_flight) == 2)
    assert in_flight.pending_prefill_tokens == 550
    first.set()
    await until(lambda: not in_flight.pending_prefill_tokens)  # each one's first output: prefilled, still running
    assert len(in_flight) == 2
    rest.set()
    for stream in streams:
        assert (await stream).status == 200
    assert in_flight.pending_prefill_tokens == 0 and len(in_flight) == 0


async def test_a_caller_that_leaves_aborts_its_request() -> None:
    gate, left = asyncio.Event(), asyncio.Event()
    engine = FakeEngine([7, 8, 9], gate)
    endpoints, in_flight, _ = make(engine)
    stream = asyncio.create_task(call(endpoints, "POST", "/generate", generate_body(), disconnect=left))
    while not len(in_flight):
        await asyncio.sleep(0.01)
    left.set()
    await stream
    assert engine.aborted == ["r1"] and len(in_flight) == 0


class RecordingSpeculation:
    """``SpeculationControl`` as the routes use it: finished requests observed, metrics appended."""

    def __init__(self) -> None:
        self.observed: list[tuple[str, int]] = []

    def observe(self, stats: Any, tenant: str) -> None:
        self.observed.append((tenant, stats.num_output_tokens))

    def prometheus_text(self, engine_id: str, model: str) -> bytes:
        return f'tessera_engine_speculation_on{{engine_id="{engine_id}"}} 1.0\n'.encode()


async def test_finished_requests_feed_speculation_control_and_aborted_ones_do_not() -> None:
    endpoints, _, replica = make()
    replica.speculation = RecordingSpeculation()
    await call(endpoints, "POST", "/generate", generate_body(), headers=[(b"x-tessera-tenant", b"ann")])
    assert replica.speculation.observed == [("ann", 3)]
    metrics = await call(endpoints, "GET", "/metrics")
    assert b'tessera_engine_speculation_on{engine_id="fake-engine"} 1.0' in metrics.body

    gate = asyncio.Event()
    engine = FakeEngine([7, 8, 9], gate)
    endpoints, _, replica = make(engine)
    replica.speculation = RecordingSpeculation()
    stream = asyncio.create_task(call(endpoints, "POST", "/generate", generate_body()))
    while not (await call(endpoints, "GET", "/requests")).json():
        await asyncio.sleep(0.01)
    await call(endpoints, "POST", "/abort", orjson.dumps({"request_id": "r1", "reason": "kv pressure"}))
    engine.tokens = engine.tokens[:1]
    gate.set()
    await stream
    assert replica.speculation.observed == []


class SlowFirstToken(FakeEngine):
    """Its first output comes ``first_after_s`` after the request (a prefill, or vLLM's queue)."""

    def __init__(self, tokens: list[int], first_after_s: float) -> None:
        super().__init__(tokens)
        self.first_after_s = first_after_s
        self.first_at = 0.0

    async def generate(self, prompt: dict[str, Any], params: Any, request_id: str, priority: int = 0) -> Any:
        await asyncio.sleep(self.first_after_s)
        self.first_at = asyncio.get_running_loop().time()
        async for output in super().generate(prompt, params, request_id, priority):
            yield output


async def timeline(endpoints: EngineEndpoints) -> list[tuple[float, str]]:
    """(loop time, message type) of each message ``POST /generate`` sends."""
    sent: list[tuple[float, str]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append((asyncio.get_running_loop().time(), message["type"]))

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    body = generate_body()
    signature = Signer(KEY).sign("POST", "/generate", body).encode()
    scope = {"type": "http", "method": "POST", "path": "/generate", "headers": [(SIGNATURE_HEADER.encode(), signature)]}
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def first_receive() -> dict[str, Any]:
        return messages.pop(0) if messages else await receive()

    await endpoints.asgi(scope, first_receive, send)
    return sent


async def test_the_head_leaves_with_the_first_line_not_ahead_of_the_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    """One wake-up of the gateway for both (engine/held_head.py): without the hold the 200 went out at once."""
    monkeypatch.setattr(held_head, "HEAD_HOLD_S", 5.0)  # far beyond the prefill, however loaded the machine
    engine = SlowFirstToken([7, 8, 9], first_after_s=0.2)
    endpoints, _, _ = make(engine)
    sent = await timeline(endpoints)
    assert [kind for _, kind in sent[:2]] == ["http.response.start", "http.response.body"]
    assert sent[0][0] >= engine.first_at  # not before the first output existed


async def test_the_head_is_held_no_longer_than_the_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that waits in vLLM's queue gets its 200 at ``HEAD_HOLD_S``, as the gateway's head timeout
    expects of a replica that is alive."""
    monkeypatch.setattr(held_head, "HEAD_HOLD_S", 0.05)
    engine = SlowFirstToken([7], first_after_s=0.4)
    endpoints, _, _ = make(engine)
    sent = await timeline(endpoints)
    assert [kind for _, kind in sent[:2]] == ["http.response.start", "http.response.body"]
    assert sent[0][0] < engine.first_at <= sent[1][0]  # the hold ended first; the line followed its output
