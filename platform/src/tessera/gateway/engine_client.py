"""Streams one generation from an engine replica over a pooled keep-alive HTTP connection (http_wire).

The engine's NDJSON lines are relayed from the connection's callbacks (``StreamResponse.relay``): each batch
of deltas that one read brings goes to the caller's ``DeltaSink`` in the callback that read it. The sink
returns None when it took them, or a future when its consumer is behind: reading from the engine then
pauses until that future is done.

Retries: a replica that refuses the connection, answers 5xx before streaming, or ends the stream with a
``retryable`` error (the KV-eviction controller aborted it) is replaced by the next engine in the route's
ranking. A continued request sends prompt + the token ids already generated, with ``max_tokens`` reduced,
so the client sees every token once and usage counts every token once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tessera.data_plane_auth import Signer
from tessera.engine.protocol import (
    Delta,
    Done,
    GenerateBody,
    ProtocolError,
    continuation,
    encode_request,
    parse_line,
)
from tessera.gateway.delta_chunk import split_delta_chunk
from tessera.gateway.errors import APIError
from tessera.gateway.http_wire import (
    HEAD_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    EngineHTTP,
    EngineRefused,
    EngineTimeout,
    EngineUnreachable,
    StreamResponse,
)

MAX_ATTEMPTS = 3
# The longest a request may take from its first engine call to its last line, retries included, seconds.
TOTAL_TIMEOUT_S = 3600.0


@dataclass(slots=True)
class StreamResult:
    """Filled in as the stream progresses; read after the last delta (or after a failure)."""

    finish: dict[int, str] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    engines_tried: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    retries: int = 0
    first_delta_ns: int | None = None  # wall clock (time.time_ns) of the first delta received
    # Called once, with the first delta: the prompt is prefilled (the router's count of prefill tokens queued
    # at the engine drops it: routing/router.py ``InFlight.prefilled``).
    on_first_delta: Callable[[], None] | None = None
    # An engine may have seen the request: one answered, or a connection was made to one. False when every
    # attempt was refused a connection: nothing was served and settle undoes the admission (settle.py).
    reached_engine: bool = False


# Takes a batch of deltas (in stream order); returns None, or a future to wait for before the next batch.
# (deltas, last): ``last`` when the engine's closing line came in the same read, so that the sink may hold
# these deltas back and send them with the response's tail in one write.
DeltaSink = Callable[[list[Delta], bool], "asyncio.Future[None] | None"]


class ChunkSink(Protocol):
    """The per-token path's client side (``_Attempt.chunk_received``; sse_out.SSEOut): a lone delta of choice
    0, its client chunk made by gateway/delta_chunk.py, written at once."""

    # The client's chunk bytes before and after a choice-0 delta's JSON text (``ChunkWriter.text_frame``).
    text_frame: tuple[bytes, bytes]

    def write_now(self, framed: bytes) -> bool:
        """Writes one HTTP chunk of the client's body as it is (b"": nothing to write); False, having written
        nothing, when it cannot be now (the delta then goes to the DeltaSink)."""


class _Attempt:
    """One engine's answer, fed line by line from the connection's callbacks (http_wire's ``LineSink``).
    ``ended`` resolves once the response is over: its value is None when it completed, else the failure."""

    def __init__(self, response: StreamResponse, result: StreamResult, generated: list[int] | None,
                 on_deltas: DeltaSink, on_chunk: ChunkSink | None = None) -> None:
        self.response = response
        self.result = result
        self.generated = generated  # ids so far, for a continuation elsewhere (one sequence only)
        self.on_deltas = on_deltas
        self.on_chunk = on_chunk
        self._text_head, self._text_tail = on_chunk.text_frame if on_chunk is not None else (b"", b"")
        self.done = False  # the engine's closing line came
        self.error: str | None = None  # the engine's error line, if one came
        self.retryable = False
        self.ended: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    def chunk_received(self, data: bytes) -> bool:
        """The per-token path (http_wire's ``LineSink``): a socket read that is exactly one chunk holding one
        delta of choice 0, once the response streams, becomes the client's chunk in one call
        (``split_delta_chunk``) and is written at once, with no parse into a ``Delta``, batch or ASGI message;
        its ids are billed and kept for a continuation as ``_take`` would. A relayed chunk's steps run from
        cold caches (a pause of an inter-token latency comes before each), and each step costs a refill
        (``bench/relay_cold.py``). False, having changed nothing, for any other read (the first delta, the
        closing line, an error, two lines) or when the client is behind: the parser and ``lines_received``
        then take it."""
        on_chunk = self.on_chunk
        if on_chunk is None or self.result.first_delta_ns is None or self.ended.done():
            return False
        split = split_delta_chunk(data, self._text_head, self._text_tail)
        if split is None or not on_chunk.write_now(split[0]):
            return False
        ids = split[1]
        self.result.completion_tokens += len(ids)
        if self.generated is not None:
            self.generated.extend(ids)
        return True

    def lines_received(self, lines: list[bytes]) -> None:
        if self.ended.done():
            return  # failed already: the connection is being closed
        try:
            self._take(lines)
        except Exception as exc:  # raised in a protocol callback: hand it to the waiter
            self.ended.set_exception(exc)

    def _take(self, lines: list[bytes]) -> None:
        result, deltas = self.result, []
        aborted: list[int] = []
        for line in lines:
            try:
                message = parse_line(line)
            except ProtocolError as exc:
                raise APIError(502, "The engine replica sent a malformed answer.", "engine_error",
                               detail=str(exc)) from None
            if isinstance(message, Delta):
                ids = message.token_ids
                result.completion_tokens += len(ids)
                if self.generated is not None:
                    self.generated.extend(ids)
                deltas.append(message)
            elif isinstance(message, Done):
                result.finish = message.finish
                result.stats = message.stats
                self.done = True
                aborted = [i for i, reason in message.finish.items() if reason == "abort"]
            else:
                self.error = message.message
                result.stats = message.stats
                self.retryable = message.retryable
        if deltas:
            if result.first_delta_ns is None:
                result.first_delta_ns = time.time_ns()
                if result.on_first_delta is not None:
                    result.on_first_delta()
            behind = self.on_deltas(deltas, self.done and not aborted)
            if behind is not None:
                self.response.pause()
                behind.add_done_callback(self._caught_up)
        if aborted:
            raise APIError(502, f"The engine aborted choice {aborted[0]} before it finished; the text so far "
                           "is incomplete. Retry the request.", "request_aborted")

    def _caught_up(self, behind: asyncio.Future[None]) -> None:
        if behind.cancelled():
            self.ended.cancel()
            return
        if behind.exception() is not None:
            if not self.ended.done():
                self.ended.set_exception(behind.exception())  # type: ignore[arg-type]
            return
        self.response.resume()

    def body_ended(self, failure: BaseException | None) -> None:
        if not self.ended.done():
            self.ended.set_result(failure)


class EngineClient:
    def __init__(self, head_timeout_s: float = HEAD_TIMEOUT_S, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 total_timeout_s: float = TOTAL_TIMEOUT_S, signer: Signer | None = None) -> None:
        # ``signer``: the data-plane key every call to a replica is signed with (replicas refuse unsigned ones).
        self.http = EngineHTTP(head_timeout_s=head_timeout_s, idle_timeout_s=idle_timeout_s, signer=signer)
        self.total_timeout_s = total_timeout_s

    async def close(self) -> None:
        await self.http.close()

    async def relay(self, urls: list[tuple[str, str]], body: GenerateBody, headers: dict[str, str],
                    result: StreamResult, on_deltas: DeltaSink, on_chunk: ChunkSink | None = None) -> None:
        """Relays the deltas of the first engine that serves the request to ``on_deltas`` (and, once the
        response streams, each lone delta of choice 0 to ``on_chunk`` first, when given); ``urls`` is
        [(engine_id, url)] in the route's order. Returns once the engine's closing line came; 504 when that
        takes longer than ``total_timeout_s`` (the engine connection then closes: the replica aborts)."""
        try:
            async with asyncio.timeout(self.total_timeout_s):
                await self._relay(urls, body, headers, result, on_deltas, on_chunk)
        except TimeoutError:
            raise APIError(504, f"The request did not finish within the gateway's limit of "
                           f"{self.total_timeout_s:g} s; ask for fewer tokens or retry.", "engine_timeout") from None

    async def _relay(self, urls: list[tuple[str, str]], body: GenerateBody, headers: dict[str, str],
                     result: StreamResult, on_deltas: DeltaSink, on_chunk: ChunkSink | None) -> None:
        generated: list[int] = []
        # What went wrong, twice: in full for the logs and the span (engine ids, addresses, the engine's own
        # words), and as the client may read it (neither addresses nor engine output: see public_reason).
        last_error, last_reason = "no engine available", "none is registered"
        single = body.get("n", 1) == 1
        sent = body
        for attempt, (engine_id, url) in enumerate(urls[:MAX_ATTEMPTS]):
            if attempt:
                if not single and result.completion_tokens:
                    # Continuation is defined for one sequence only: starting n > 1 choices again elsewhere
                    # would stream their beginnings twice and bill them twice. The client retries, knowingly.
                    raise APIError(502, "The engine replica failed after the answer started; a request with "
                                   "n > 1 cannot be continued elsewhere. Retry the request.", "engine_error",
                                   detail=last_error)
                sent = continuation(body, generated, attempt)
            result.engines_tried.append(engine_id)
            result.retries = attempt
            try:
                async with self.http.post(f"{url}/generate", encode_request(sent), headers) as resp:
                    result.reached_engine = True
                    if resp.status != 200:
                        last_error = f"engine {engine_id} answered {resp.status}: {(await resp.text())[:200]}"
                        last_reason = f"a replica answered {resp.status}"
                        if resp.status >= 500:
                            continue
                        raise APIError(502, "The engine replica refused the request.", "engine_error",
                                       detail=last_error)
                    answer = _Attempt(resp, result, generated if single else None, on_deltas, on_chunk)
                    resp.relay(answer)
                    failure = await answer.ended
            except (EngineUnreachable, TimeoutError) as exc:
                result.reached_engine |= not isinstance(exc, EngineRefused)
                last_error, last_reason = f"engine {engine_id} unreachable: {exc}", public_reason(exc)
                continue
            if answer.done:
                return  # a connection lost after the closing line loses nothing
            if answer.error is not None:
                last_error, last_reason = f"engine {engine_id}: {answer.error}", "a replica ended the stream early"
                if answer.retryable:
                    continue
                raise APIError(502, "The engine replica ended the stream early.", "engine_error", detail=last_error)
            if failure is not None:
                last_error, last_reason = f"engine {engine_id} unreachable: {failure}", public_reason(failure)
                continue
            raise APIError(502, "The engine replica ended the stream early.", "engine_error",
                           detail=f"engine {engine_id}: no closing line")
        raise APIError(503, f"No engine replica could serve the request ({last_reason}); retry shortly.",
                       "engine_unavailable", headers={"Retry-After": "1"}, detail=last_error)


def public_reason(exc: BaseException) -> str:
    """Why a replica failed, as a client may read it: the kind of failure, never an address or errno text."""
    if isinstance(exc, EngineTimeout):  # its message names only the limit that passed
        return f"a replica timed out: {exc}"
    if isinstance(exc, TimeoutError):
        return "a replica timed out"
    return "a replica could not be reached"
