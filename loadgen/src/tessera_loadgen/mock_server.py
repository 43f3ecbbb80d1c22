"""An OpenAI-compatible mock server with known timing, to calibrate and test the load generator.

A bare ASGI app (no framework) under uvicorn with uvloop and httptools, so that on one core it serves
thousands of streamed completions per second and is never the bottleneck of the client's benchmark.

Timing model: the first content chunk is sent ``ttft_s`` after the request arrived; tokens are produced
every ``itl_s`` and flushed ``tokens_per_chunk`` at a time, so chunks are ``tokens_per_chunk * itl_s``
apart and the per-token ITL is ``itl_s``. Like vLLM, a chat stream opens with a role-only chunk carrying
empty content (immediately), ends with a usage-only chunk when ``stream_options.include_usage`` is set,
then ``data: [DONE]``; ``continuous_usage_stats`` adds cumulative usage to every chunk. With zero delays
the whole stream goes out in one write. The output length is the request's ``max_tokens`` (default 16).

Faults, drawn per request from a seeded generator: ``error_rate`` (an OpenAI error body with
``error_status``), ``reject_rate`` (429, with ``Retry-After`` unless ``retry_after_s`` is null),
``break_rate`` (the connection drops mid-stream), and a stall: after ``stall_after_requests`` requests
the server holds every response for ``stall_s`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import re
import socket
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec
from pydantic import BaseModel, ConfigDict, Field

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_TRACEPARENT = re.compile(rb"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_JSON = [(b"content-type", b"application/json")]


class MockConfig(BaseModel):
    """Behaviour of the mock server."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field("mock-model", description="Model id served and listed by /v1/models.")
    ttft_s: float = Field(0.0, ge=0, description="Delay from request to the first content chunk, s.")
    itl_s: float = Field(0.0, ge=0, description="Delay between tokens, s; chunks are tokens_per_chunk of them.")
    tokens_per_chunk: int = Field(1, ge=1, description="Tokens per streamed chunk (speculative decoding).")
    default_max_tokens: int = Field(16, ge=1, description="Output tokens when the request sets no max_tokens.")
    error_rate: float = Field(0.0, ge=0, le=1, description="Share of requests answered with error_status.")
    error_status: int = Field(500, ge=400, le=599, description="Status of injected errors.")
    reject_rate: float = Field(0.0, ge=0, le=1, description="Share of requests answered 429.")
    retry_after_s: float | None = Field(1.0, ge=0, description="Retry-After of a 429; null: no header.")
    break_rate: float = Field(0.0, ge=0, le=1, description="Share of streams cut after their first chunk.")
    stall_after_requests: int | None = Field(None, ge=1, description="Start a stall at the Nth request.")
    stall_s: float = Field(0.0, ge=0, description="How long the stall holds every response, s.")
    seed: int = Field(0, description="Seed of the fault draws.")


class _StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Message(msgspec.Struct):
    content: Any = None


class _Request(msgspec.Struct):
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    messages: list[_Message] | None = None
    prompt: Any = None


_decode_request = msgspec.json.Decoder(_Request).decode
_encode = msgspec.json.Encoder().encode


class _BrokenStream(Exception):
    """Raised to make uvicorn drop the connection mid-stream (``break_rate``)."""


def _count_words(value: Any) -> int:
    if isinstance(value, str):
        return value.count(" ") + 1 if value else 0
    if isinstance(value, list):
        return sum(_count_words(v.get("text", "") if isinstance(v, dict) else v) for v in value)
    return 0


def _prompt_words(request: _Request) -> int:
    """Prompt length in words, standing in for prompt tokens."""
    if request.messages is not None:
        return sum(_count_words(m.content) for m in request.messages)
    return _count_words(request.prompt)


class MockServer:
    """The ASGI application; ``stats`` counts what it saw (exposed at ``GET /mock/stats``)."""

    def __init__(self, config: MockConfig | None = None) -> None:
        self.config = config or MockConfig()
        self._rng = random.Random(self.config.seed)
        self._stall_until = 0.0
        self.stats = {"requests": 0, "valid_traceparents": 0, "rejected_429": 0, "errors": 0, "broken": 0}
        self._models = _encode(
            {"object": "list", "data": [{"id": self.config.model, "object": "model", "owned_by": "mock"}]}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if scope["method"] == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            await self._completion(scope, receive, send, chat=path == "/v1/chat/completions")
        elif path == "/v1/models":
            await self._respond(send, 200, self._models)
        elif path == "/health":
            await self._respond(send, 200, b"{}")
        elif path == "/mock/stats":
            await self._respond(send, 200, _encode(self.stats))
        else:
            await self._respond(send, 404, _error_body("not found", "not_found_error"))

    @staticmethod
    async def _respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = _JSON) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _completion(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        t_arrival = time.perf_counter()
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        stats = self.stats
        stats["requests"] += 1
        number = stats["requests"]
        for name, value in scope["headers"]:
            if name == b"traceparent" and _TRACEPARENT.match(value):
                stats["valid_traceparents"] += 1
        try:
            request = _decode_request(body)
        except msgspec.DecodeError as exc:
            await self._respond(send, 400, _error_body(f"bad request body: {exc}", "invalid_request_error"))
            return
        config = self.config
        if config.stall_after_requests is not None and number == config.stall_after_requests:
            self._stall_until = t_arrival + config.stall_s
        await self._wait_stall()
        request_id = f"mock-{number}".encode()
        rng = self._rng
        if config.reject_rate and rng.random() < config.reject_rate:
            stats["rejected_429"] += 1
            headers = [*_JSON, (b"x-request-id", request_id)]
            if config.retry_after_s is not None:
                headers.append((b"retry-after", f"{config.retry_after_s:g}".encode()))
            await self._respond(send, 429, _error_body("rate limited", "rate_limit_error"), headers)
            return
        if config.error_rate and rng.random() < config.error_rate:
            stats["errors"] += 1
            headers = [*_JSON, (b"x-request-id", request_id)]
            await self._respond(send, config.error_status, _error_body("injected error", "server_error"), headers)
            return
        breaks = bool(config.break_rate) and rng.random() < config.break_rate
        n_out = request.max_completion_tokens or request.max_tokens or config.default_max_tokens
        n_in = _prompt_words(request)
        model = (request.model or config.model).encode()
        if request.stream:
            await self._stream(send, request, chat, request_id, model, n_in, n_out, t_arrival, breaks)
        else:
            await self._sleep_until(t_arrival + config.ttft_s + config.itl_s * (n_out - 1))
            await self._respond(
                send,
                200,
                _full_body(chat, request_id, model, n_in, n_out),
                [*_JSON, (b"x-request-id", request_id)],
            )

    async def _stream(
        self,
        send: Send,
        request: _Request,
        chat: bool,
        request_id: bytes,
        model: bytes,
        n_in: int,
        n_out: int,
        t_arrival: float,
        breaks: bool,
    ) -> None:
        config = self.config
        options = request.stream_options or _StreamOptions()
        k = config.tokens_per_chunk
        num_chunks = math.ceil(n_out / k)
        head = (
            b'data: {"id":"'
            + request_id
            + b'","object":"'
            + (b"chat.completion.chunk" if chat else b"text_completion")
            + b'","created":0,"model":"'
            + model
            + b'","choices":[{"index":0,'
        )
        events: list[bytes] = []
        if chat:
            events.append(head + b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n')
        for i in range(num_chunks):
            tokens = min(k, n_out - i * k)
            text = b"tok " * tokens
            content = b'"delta":{"content":"' + text + b'"}' if chat else b'"text":"' + text + b'"'
            finish = b'"length"' if i == num_chunks - 1 else b"null"
            usage = b""
            if options.continuous_usage_stats:
                done = min(n_out, (i + 1) * k)
                usage = b',"usage":' + _usage(n_in, done)
            events.append(head + content + b',"finish_reason":' + finish + b"}]" + usage + b"}\n\n")
        tail = b""
        if options.include_usage:
            tail = b'data: {"id":"' + request_id + b'","choices":[],"usage":' + _usage(n_in, n_out) + b"}\n\n"
        tail += b"data: [DONE]\n\n"
        headers = [*_SSE_HEADERS, (b"x-request-id", request_id)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if config.ttft_s == 0 and config.itl_s == 0 and not breaks and not self._stall_until:
            await send({"type": "http.response.body", "body": b"".join(events) + tail})
            return
        first = 1 if chat else 0
        if chat:
            await send({"type": "http.response.body", "body": events[0], "more_body": True})
        gap = config.itl_s * k
        sent_at = -math.inf
        for i, event in enumerate(events[first:]):
            # On schedule from the arrival, but never sooner than a gap after the last event: a server that ran late
            # (a busy machine) does not catch up by sending the next tokens closer together, as no engine's decode
            # steps could; a late token makes the stream late, never its gaps short.
            await self._sleep_until(max(t_arrival + config.ttft_s + i * gap, sent_at + gap))
            sent_at = time.perf_counter()
            await self._wait_stall()
            await send({"type": "http.response.body", "body": event, "more_body": True})
            if breaks:
                self.stats["broken"] += 1
                raise _BrokenStream("injected broken stream")
        await send({"type": "http.response.body", "body": tail})

    async def _wait_stall(self) -> None:
        delay = self._stall_until - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)

    @staticmethod
    async def _sleep_until(t: float) -> None:
        delay = t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)


def _usage(n_in: int, n_out: int) -> bytes:
    return b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}' % (n_in, n_out, n_in + n_out)


def _error_body(message: str, kind: str) -> bytes:
    return _encode({"error": {"message": message, "type": kind, "code": None}})


def _full_body(chat: bool, request_id: bytes, model: bytes, n_in: int, n_out: int) -> bytes:
    text = "tok " * n_out
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return _encode(
        {
            "id": request_id.decode(),
            "object": "chat.completion" if chat else "text_completion",
            "created": 0,
            "model": model.decode(),
            "choices": [choice],
            "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out},
        }
    )


class _DropInjectedFaults(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], _BrokenStream))


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free port; read it back with ``getsockname()``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.set_inheritable(True)
    return sock


def serve_socket(config: MockConfig, sock: socket.socket) -> None:
    """Serve on an already bound socket until interrupted (one process)."""
    import uvicorn

    logging.getLogger("uvicorn.error").addFilter(_DropInjectedFaults())
    server = uvicorn.Server(
        uvicorn.Config(
            MockServer(config),
            loop="uvloop",
            http="httptools",
            lifespan="off",
            access_log=False,
            log_level="warning",
            timeout_keep_alive=120,
            backlog=4096,
        )
    )
    server.run(sockets=[sock])


def serve(config: MockConfig, host: str = "127.0.0.1", port: int = 8100, workers: int = 1) -> None:
    """Serve with ``workers`` processes sharing one listening socket; prints the URL once bound."""
    import multiprocessing

    sock = bind(host, port)
    bound_port = sock.getsockname()[1]
    print(f"mock-server listening on http://{host}:{bound_port}", flush=True)
    if workers == 1:
        serve_socket(config, sock)
        return
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=serve_socket, args=(config.model_copy(update={"seed": config.seed + i}), sock))
        for i in range(workers)
    ]
    for process in processes:
        process.start()
    try:
        for process in processes:
            process.join()
    except KeyboardInterrupt:
        for process in processes:
            process.terminate()
            process.join()
