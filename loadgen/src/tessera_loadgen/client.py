"""The OpenAI-compatible request: body and headers out, a filled ``RequestRecord`` back.

One ``TenantClient`` per tenant (its key, its connection cap). ``submit`` writes the request through the
pooled transport of ``_http.py`` and calls ``on_done(record)`` exactly once, on success or failure.

Timestamps (``shared/metrics.md``): ``t_send`` is taken right after the request bytes were handed to the
socket, a chunk's time when its bytes arrived. A content chunk is one whose text (``delta.content``,
``delta.reasoning_content`` / ``reasoning``, or ``text``) is non-empty; the role-only first chunk of a chat
stream and the usage-only last chunk are not content. When the server streams cumulative usage in every
chunk (``continuous_usage_stats``), each content chunk's token count is the growth of
``usage.completion_tokens`` since the previous content chunk, so tokens of text-less chunks are credited
to the next chunk that shows them.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import random
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec

from tessera_loadgen._http import Connection, ConnectionPool
from tessera_loadgen._version import __version__
from tessera_loadgen.records import (
    ERROR_BAD_RESPONSE,
    ERROR_EMPTY_OUTPUT,
    ERROR_STREAM_ERROR,
    ERROR_TIMEOUT,
    N_OUT_FROM_CHUNKS,
    RequestRecord,
    http_error_kind,
)
from tessera_loadgen.workload import RetryPolicy

_perf_counter = time.perf_counter
_MAX_ERROR_BODY = 2048

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True, slots=True)
class Target:
    """Where the server is: scheme, host, port and a path prefix (``/v1`` is added per endpoint)."""

    scheme: str
    host: str
    port: int
    base_path: str

    @classmethod
    def parse(cls, url: str) -> Target:
        """``http://host:port[/prefix]``; a trailing ``/v1`` is dropped. ``ValueError`` on other schemes."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"target must be an http:// or https:// URL, got {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        base = parts.path.rstrip("/")
        base = base.removesuffix("/v1")
        return cls(parts.scheme, parts.hostname, port, base)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.base_path}"

    def ssl_context(self) -> ssl.SSLContext | None:
        return ssl.create_default_context() if self.scheme == "https" else None


# Response shapes, decoded by msgspec into structs (unknown fields are ignored).
class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _Message(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    message: _Message | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode
_encode_json = msgspec.json.Encoder().encode


def choice_text(choice: _Choice) -> str | None:
    """The generated text a choice carries, whichever field the endpoint uses."""
    if choice.text is not None:
        return choice.text
    delta = choice.delta
    if delta is not None:
        return delta.content or delta.reasoning_content or delta.reasoning
    message = choice.message
    if message is not None:
        return message.content or message.reasoning_content
    return None


def parse_retry_after(value: bytes | None, now_unix: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value: delta-seconds or an HTTP date; ``None`` if absent/bad."""
    if value is None:
        return None
    text = value.decode("latin-1").strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    now = time.time() if now_unix is None else now_unix
    return max(0.0, when.timestamp() - now)


class TenantClient:
    """Sends one tenant's requests; ``in_flight`` counts submitted requests not yet done."""

    def __init__(
        self,
        target: Target,
        api_key: str | None,
        *,
        timeout_s: float,
        retry: RetryPolicy,
        max_connections: int | None = None,
        extra_headers: dict[str, str] | None = None,
        trace_seed: int | None = None,
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.retry = retry
        self.pool = ConnectionPool(target.host, target.port, target.ssl_context(), max_connections)
        self.in_flight = 0
        self._rng = random.Random(trace_seed)
        headers = [f"Host: {target.host}:{target.port}", f"User-Agent: tessera-loadgen/{__version__}"]
        headers.append("Content-Type: application/json")
        if api_key:
            headers.append(f"Authorization: Bearer {api_key}")
        headers.extend(f"{name}: {value}" for name, value in (extra_headers or {}).items())
        self._prefixes = {
            (endpoint, stream): (
                f"POST {target.base_path}{path} HTTP/1.1\r\n"
                + "\r\n".join(headers)
                + ("\r\nAccept: text/event-stream" if stream else "\r\nAccept: application/json")
                + "\r\ntraceparent: 00-"
            ).encode()
            for endpoint, path in PATHS.items()
            for stream in (True, False)
        }

    def submit(
        self,
        record: RequestRecord,
        body: dict[str, Any],
        on_done: Callable[[RequestRecord], None],
        collect_text: bool = False,
    ) -> None:
        """Send the request for ``record`` now; ``on_done(record)`` is called once when it has ended."""
        payload = _encode_json(body)
        trace_id = f"{self._rng.getrandbits(128) | 1:032x}"
        span_id = f"{self._rng.getrandbits(64) | 1:016x}"
        record.trace_id = trace_id
        data = b"".join(
            (
                self._prefixes[(record.endpoint, record.stream)],
                f"{trace_id}-{span_id}-01\r\nContent-Length: {len(payload)}\r\n\r\n".encode(),
                payload,
            )
        )
        self.in_flight += 1
        call = _Call(self, record, data, on_done, collect_text)
        call.timer = asyncio.get_running_loop().call_later(self.timeout_s, call.on_timeout)
        self.pool.request(data, call)

    def _finished(self) -> None:
        self.in_flight -= 1

    async def close(self) -> None:
        await self.pool.close()


class _Call:
    """One request across its attempts (429 retries): the transport ``Handler`` and the stream parser."""

    __slots__ = (
        "attempts",
        "buf",
        "client",
        "collect_text",
        "connection",
        "data",
        "deadline",
        "finished",
        "is_sse",
        "last_cum",
        "on_done",
        "record",
        "retry_after",
        "retry_at",
        "status",
        "text_parts",
        "timer",
        "tokens",
        "tokens_known",
        "usage_out",
    )

    def __init__(
        self,
        client: TenantClient,
        record: RequestRecord,
        data: bytes,
        on_done: Callable[[RequestRecord], None],
        collect_text: bool,
    ) -> None:
        self.client = client
        self.record = record
        self.data = data
        self.on_done = on_done
        self.collect_text = collect_text
        self.timer: asyncio.TimerHandle | None = None
        self.deadline = _perf_counter() + client.timeout_s
        self.finished = False
        self.attempts = 0
        self.retry_at = 0.0
        self.connection: Connection | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.is_sse = False
        self.buf = b""
        self.retry_after: bytes | None = None
        self.last_cum = 0
        self.tokens: list[int] = []
        self.tokens_known = True
        self.usage_out: int | None = None
        self.text_parts: list[str] = []
        self.record.chunk_times = []

    # transport Handler ----------------------------------------------------------------------------------
    def on_sent(self, t_send: float, connection: Connection) -> None:
        record = self.record
        record.t_send = t_send
        if record.t_send_first is None:
            record.t_send_first = t_send
        self.connection = connection

    def on_headers(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.record.http_status = status
        for name, value in headers:
            lname = name.lower()
            if lname == b"x-request-id":
                self.record.server_request_id = value.decode("latin-1")
            elif lname == b"content-type":
                self.is_sse = b"text/event-stream" in value
            elif lname == b"retry-after":
                self.retry_after = value

    def on_body(self, data: bytes) -> None:
        if self.finished:
            return
        if self.status == 200 and self.is_sse:
            self._feed_sse(data, _perf_counter())
        elif len(self.buf) < (1 << 24):
            self.buf += data

    def on_complete(self) -> None:
        if self.finished:
            return
        now = _perf_counter()
        if self.status == 200:
            if self.is_sse:
                self._end_stream(now)
            else:
                self._end_json(now)
        elif self.status == 429:
            self._on_429(now)
        else:
            self._fail(http_error_kind(self.status), self._error_message(), now)

    def on_error(self, kind: str, detail: str) -> None:
        if not self.finished:
            self._keep_partial()
            self._fail(kind, detail, _perf_counter())

    def on_timeout(self) -> None:
        if self.finished:
            return
        self.timer = None
        if not self.client.pool.cancel(self) and self.connection is not None:
            self.connection.detach(self)
        self._keep_partial()
        self._fail(ERROR_TIMEOUT, f"no complete response after {self.client.timeout_s:g} s", _perf_counter())

    # streaming ------------------------------------------------------------------------------------------
    def _feed_sse(self, data: bytes, now: float) -> None:
        buf = self.buf + data if self.buf else data
        held = b""
        if b"\r" in buf:
            if buf.endswith(b"\r"):
                # NOTE: the "\n" of a "\r\n" pair may be in the next read; hold the "\r" back.
                buf, held = buf[:-1], b"\r"
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        events = buf.split(b"\n\n")
        self.buf = events.pop() + held
        for event in events:
            if not self.finished:
                self._event(event, now)

    def _event(self, event: bytes, now: float) -> None:
        if event.startswith(b"data: ") and b"\n" not in event:
            payload = event[6:]
        else:
            lines = [line for line in event.split(b"\n") if line.startswith(b"data:")]
            if not lines:
                return  # comments (keep-alive pings), event names, ids
            payload = b"\n".join(line[6:] if line.startswith(b"data: ") else line[5:] for line in lines)
        if payload == b"[DONE]":
            return
        try:
            chunk = _decode_chunk(payload)
        except msgspec.DecodeError as exc:
            self._abort(ERROR_BAD_RESPONSE, f"undecodable SSE data: {exc}: {payload[:200]!r}", now)
            return
        if chunk.error is not None:
            self._abort(ERROR_STREAM_ERROR, f"error in stream: {str(chunk.error)[:250]}", now)
            return
        usage = chunk.usage
        if chunk.choices:
            text = choice_text(chunk.choices[0])
            if text:
                self.record.chunk_times.append(now)
                if usage is not None and usage.completion_tokens is not None:
                    self.tokens.append(usage.completion_tokens - self.last_cum)
                    self.last_cum = usage.completion_tokens
                else:
                    self.tokens_known = False
                if self.collect_text:
                    self.text_parts.append(text)
        if usage is not None:
            if usage.prompt_tokens is not None:
                self.record.n_in = usage.prompt_tokens
            if usage.completion_tokens is not None:
                self.usage_out = usage.completion_tokens

    def _end_stream(self, now: float) -> None:
        tail = self.buf.strip()
        self.buf = b""
        if tail:
            self._event(tail, now)
        if self.finished:
            return
        record = self.record
        times = record.chunk_times
        if not times:
            self._fail(ERROR_EMPTY_OUTPUT, "the stream ended without any content", now)
            return
        record.t_first = times[0]
        record.t_last = times[-1]
        record.chunk_tokens = self.tokens if self.tokens_known else None
        if self.usage_out is not None:
            record.n_out = self.usage_out
        else:
            record.n_out = len(times)
            record.n_out_source = N_OUT_FROM_CHUNKS
        if self.collect_text:
            record.text = "".join(self.text_parts)
        record.t_done = now
        self._finish()

    def _end_json(self, now: float) -> None:
        record = self.record
        try:
            chunk = _decode_chunk(self.buf)
        except msgspec.DecodeError as exc:
            self._fail(ERROR_BAD_RESPONSE, f"undecodable JSON body: {exc}", now)
            return
        text = choice_text(chunk.choices[0]) if chunk.choices else None
        if not text:
            self._fail(ERROR_EMPTY_OUTPUT, "the response has no content", now)
            return
        if chunk.usage is not None:
            record.n_in = chunk.usage.prompt_tokens
            record.n_out = chunk.usage.completion_tokens
        if record.n_out is None:
            record.n_out_source = "none"
        if self.collect_text:
            record.text = text
        record.t_last = now
        record.t_done = now
        self._finish()

    # errors and retries ---------------------------------------------------------------------------------
    def _on_429(self, now: float) -> None:
        record = self.record
        record.num_429 += 1
        wait = parse_retry_after(self.retry_after)
        if wait is not None:
            record.num_429_retry_after += 1
        policy = self.client.retry
        if policy.on_429 == "respect" and self.attempts < policy.max_retries:
            wait = min(policy.max_wait_s, policy.default_wait_s if wait is None else wait)
            if now + wait < self.deadline:
                self.attempts += 1
                record.retry_wait_s += wait
                self.connection = None
                self._reset()
                self.retry_at = now + wait
                asyncio.get_running_loop().call_later(wait, self._resend)
                return
        self._fail(http_error_kind(429), self._error_message(), now)

    def _resend(self) -> None:
        if self.finished:
            return
        remaining = self.retry_at - _perf_counter()
        if remaining > 0:
            # NOTE: event-loop timers can fire up to a millisecond early, and Retry-After is a lower bound.
            asyncio.get_running_loop().call_later(math.ceil(remaining * 1000) / 1000, self._resend)
            return
        self.client.pool.request(self.data, self)

    def _error_message(self) -> str:
        body = self.buf[:_MAX_ERROR_BODY]
        try:
            message = msgspec.json.decode(body)["error"]["message"]
            return str(message)
        except (msgspec.DecodeError, KeyError, TypeError):
            return body.decode("utf-8", "replace")

    def _keep_partial(self) -> None:
        times = self.record.chunk_times
        if times:
            self.record.t_first = times[0]
            self.record.t_last = times[-1]

    def _abort(self, kind: str, detail: str, now: float) -> None:
        if self.connection is not None:
            self.connection.detach(self)
        self._keep_partial()
        self._fail(kind, detail, now)

    def _fail(self, kind: str, detail: str, now: float) -> None:
        self.record.fail(kind, detail, now)
        self._finish()

    def _finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        if self.timer is not None:
            self.timer.cancel()
        self.client._finished()
        self.on_done(self.record)


async def discover_model(target: Target, api_key: str | None, timeout_s: float = 10.0) -> str:
    """The first model id of ``GET /v1/models``; ``RuntimeError`` when the server lists none."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=timeout_s) as http:
        response = await http.get(f"{target.url}/v1/models", headers=headers)
        response.raise_for_status()
        models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{target.url}/v1/models lists no model; set 'model' in the workload")
    return str(models[0]["id"])
