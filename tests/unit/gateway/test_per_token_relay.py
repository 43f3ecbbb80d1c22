"""The relay's per-token path (``_Attempt.chunk_received``): once a response streams, each read that is one
chunk of one delta becomes the client's chunk and goes to the chunk sink before the parser sees it, counted
for billing and kept for a continuation elsewhere, exactly as the batched path would; the first delta, reads
it cannot take and chunks the sink declines go the batched way, and between the two the client sees every
token once, in order. The engines here are socket servers writing the protocol's lines one chunk at a time."""

from __future__ import annotations

import asyncio
import re

import orjson
import pytest

from tessera.engine.protocol import Delta, RequestStats, delta_line, done_line
from tessera.gateway import engine_client
from tessera.gateway.delta_chunk import NATIVE_SPLIT, split_delta_chunk_py
from tessera.gateway.engine_client import EngineClient, StreamResult, _Attempt
from tests.support.machine import free_port

LINE_GAP_S = 0.01  # apart enough that each line is read alone


async def _engine(lines: list[bytes], requests: list[dict[str, object]], die: bool) -> asyncio.AbstractServer:
    """Answers each request with ``lines``, one chunk each, ``LINE_GAP_S`` apart; ``die``: then drops the
    connection instead of ending the body. Keeps the request bodies it got."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(h.split(b":", 1)[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
        requests.append(orjson.loads(await reader.readexactly(length)))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n")
        for line in lines:
            writer.write(b"%x\r\n%s\r\n" % (len(line), line))
            await writer.drain()
            await asyncio.sleep(LINE_GAP_S)
        if die:
            writer.transport.abort()
            return
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, "127.0.0.1", free_port())


def _url(server: asyncio.AbstractServer) -> str:
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.mark.asyncio
@pytest.mark.parametrize("step", ["c", "python"])
async def test_lone_deltas_go_to_the_chunk_sink_are_billed_and_continued_elsewhere_once(
        monkeypatch: pytest.MonkeyPatch, step: str) -> None:
    if step == "c" and NATIVE_SPLIT is None:
        pytest.skip("the C step is not built here")
    monkeypatch.setattr(engine_client, "split_delta_chunk", NATIVE_SPLIT if step == "c" else split_delta_chunk_py)
    offered: list[bytes] = []  # what the per-token path was offered: reads between chunks only (http_wire)
    real_chunk_received = _Attempt.chunk_received

    def chunk_received(self: _Attempt, data: bytes) -> bool:
        offered.append(data)
        return real_chunk_received(self, data)

    monkeypatch.setattr(_Attempt, "chunk_received", chunk_received)
    first_requests: list[dict[str, object]] = []
    second_requests: list[dict[str, object]] = []
    # The first replica streams four deltas (one of them with two ids), then dies; the second finishes.
    first = await _engine([delta_line(0, "a", [5]) + b"\n", delta_line(0, "b", [6]) + b"\n",
                           delta_line(0, 'c"\n', [7, 8]) + b"\n", delta_line(0, "d", [9]) + b"\n"],
                          first_requests, die=True)
    second = await _engine([delta_line(0, "e", [10]) + b"\n",
                            delta_line(0, "f", [11]) + b"\n" + done_line({"0": "length"}, RequestStats()) + b"\n"],
                           second_requests, die=False)
    seen: list[tuple[str, str]] = []  # (path, text) in the order the client would see them
    declines = {"d"}  # the text sink declines this one (a client that is behind): it goes batched

    def on_deltas(deltas: list[Delta], last: bool) -> None:
        seen.extend(("batched", d.text) for d in deltas)

    class ClientSide:  # a ChunkSink whose chunks hold the text as a JSON array: [<text>]
        text_frame = (b"[", b"]")

        def write_now(self, framed: bytes) -> bool:
            size, _, chunk = framed.partition(b"\r\n")
            assert len(chunk) == int(size, 16) + 2 and chunk.endswith(b"\r\n")
            text = orjson.loads(chunk[:-2])[0]
            if text in declines:
                return False
            seen.append(("per-token", text))
            return True

    result = StreamResult()
    client = EngineClient()
    try:
        await client.relay([("e0", _url(first)), ("e1", _url(second))],
                           {"request_id": "t/r1", "prompt_token_ids": [1, 2], "max_tokens": 7}, {}, result,
                           on_deltas, ClientSide())
    finally:
        await client.close()
        first.close()
        second.close()
    # "e" may come in the read that brought the second response's head, before the relay began (batched);
    # "f" came with the closing line (two lines in one chunk: batched).
    assert seen[:4] == [("batched", "a"), ("per-token", "b"), ("per-token", 'c"\n'), ("batched", "d")]
    assert seen[4][1] == "e" and seen[5] == ("batched", "f") and len(seen) == 6
    assert result.completion_tokens == 7 and result.retries == 1
    # The continuation carries every id the first replica made, those the per-token path took included.
    assert second_requests[0]["prompt_token_ids"] == [1, 2, 5, 6, 7, 8, 9]
    assert second_requests[0]["max_tokens"] == 2
    # Each read offered started where the parser stood between two chunks (a chunk's size line).
    assert offered and all(re.match(rb"[0-9a-f]+\r\n", data) for data in offered)


@pytest.mark.asyncio
async def test_without_a_text_sink_every_delta_goes_batched() -> None:
    requests: list[dict[str, object]] = []
    engine = await _engine([delta_line(0, "a", [5]) + b"\n", delta_line(0, "b", [6]) + b"\n",
                            done_line({"0": "length"}, RequestStats()) + b"\n"], requests, die=False)
    got: list[str] = []
    result = StreamResult()
    client = EngineClient()
    try:
        await client.relay([("e0", _url(engine))], {"request_id": "t/r1", "prompt_token_ids": [1], "max_tokens": 2},
                           {}, result, lambda deltas, last: got.extend(d.text for d in deltas))
    finally:
        await client.close()
        engine.close()
    assert got == ["a", "b"] and result.completion_tokens == 2 and result.finish == {0: "length"}
