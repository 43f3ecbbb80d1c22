"""A stream the engine closes with ``finish_reason: "abort"`` ends in an error the client can tell from a
normal stop (``request_aborted``), after the deltas that came before it; a normal closing line ends quietly.
The engine here is a socket server that writes the protocol's lines (``engine/protocol.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tessera.engine.protocol import Delta, RequestStats, delta_line, done_line
from tessera.gateway.engine_client import EngineClient, StreamResult
from tessera.gateway.errors import APIError
from tests.support.machine import free_port


async def _engine_answering(finish: str) -> AsyncIterator[str]:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(h.split(b":", 1)[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        body = delta_line(0, "partial", [5]) + b"\n" + done_line({"0": finish}, RequestStats()) + b"\n"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(body), body))
        await writer.drain()
        writer.close()

    port = free_port()
    server = await asyncio.start_server(answer, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


async def _relay(finish: str) -> tuple[list[tuple[list[Delta], bool]], StreamResult, Exception | None]:
    got: list[tuple[list[Delta], bool]] = []
    result = StreamResult()
    client = EngineClient()
    error: Exception | None = None
    async for url in _engine_answering(finish):
        try:
            await client.relay([("e0", url)], {"request_id": "t/r1", "prompt_token_ids": [1], "max_tokens": 4},
                               {}, result, lambda deltas, last: got.append((deltas, last)))
        except APIError as exc:
            error = exc
        finally:
            await client.close()
    return got, result, error


@pytest.mark.asyncio
async def test_an_aborted_stream_is_an_error_after_its_deltas() -> None:
    got, result, error = await _relay("abort")
    assert isinstance(error, APIError) and error.code == "request_aborted" and error.status == 502
    assert [d.text for deltas, _ in got for d in deltas] == ["partial"]
    assert got[0][1] is False  # not held for a tail: the stream ends in the error event instead
    assert result.completion_tokens == 1  # billed for what was generated


@pytest.mark.asyncio
async def test_a_finished_stream_ends_quietly_with_its_last_deltas_held_for_the_tail() -> None:
    got, result, error = await _relay("length")
    assert error is None and result.finish == {0: "length"}
    assert got == [([Delta(0, "partial", [5])], True)]


async def _dying_engine(lines: list[bytes], calls: list[int]) -> asyncio.AbstractServer:
    """Answers 200, writes ``lines`` as a chunked body, then drops the connection mid-stream."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        calls.append(1)
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(h.split(b":", 1)[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n")
        for line in lines:
            writer.write(b"%x\r\n%s\r\n" % (len(line), line))
        await writer.drain()
        writer.transport.abort()

    return await asyncio.start_server(answer, "127.0.0.1", free_port())


@pytest.mark.asyncio
async def test_n_above_one_is_not_restarted_elsewhere_after_its_answer_began() -> None:
    first_calls: list[int] = []
    second_calls: list[int] = []
    started = [delta_line(0, "a", [5]) + b"\n", delta_line(1, "b", [6]) + b"\n"]
    first = await _dying_engine(started, first_calls)
    second = await _dying_engine(started, second_calls)
    urls = [(f"e{i}", f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}") for i, s in enumerate((first, second))]
    result, got = StreamResult(), []
    client = EngineClient()
    try:
        with pytest.raises(APIError) as info:
            await client.relay(urls, {"request_id": "t/r1", "prompt_token_ids": [1], "max_tokens": 4, "n": 2},
                               {}, result, lambda deltas, last: got.append(deltas))
    finally:
        await client.close()
        first.close()
        second.close()
    assert info.value.status == 502 and "n > 1 cannot be continued" in info.value.message
    assert second_calls == [], "the choices were started again on another replica"
    assert result.completion_tokens == 2  # billed for what the first replica made, once
