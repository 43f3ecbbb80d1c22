"""The simulated replica's response writers (engine/sim/server.py) end every stream they start: where the engine
finishes a request while the writer's ``send`` waits (a client reading slowly, a held head), the next turn still
writes the closing line (``/generate``) or ``[DONE]`` (the OpenAI stream), with the response's end."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, cast

import orjson

from tessera.data_plane_auth import ReplicaGuard
from tessera.engine.protocol import GenerateRequest
from tessera.engine.sim.config import SimEngineConfig
from tessera.engine.sim.engine import RequestStream, SimClock, SimEngine
from tessera.engine.sim.server import SimEndpoints
from tessera.engine.sim.step_time import MeasuredStepTime

CONFIG = SimEngineConfig(num_gpu_blocks=64, block_size=16, max_model_len=512,
                         step_time=MeasuredStepTime(step_s=0.002, per_seq_s=0.0, per_prefill_token_s=0.0))
Writer = Callable[[SimEndpoints, RequestStream, Any], Coroutine[Any, Any, None]]


def written_while_the_first_send_waits_for_the_end(write: Writer) -> list[dict[str, Any]]:
    """Runs ``write`` on a real simulated engine's request whose first body write returns only once the engine
    has ended the request; the messages it sent."""
    async def run() -> list[dict[str, Any]]:
        engine = SimEngine(CONFIG, "e", SimClock(1.0))
        endpoints = SimEndpoints(engine, "sim-model", 1 << 20, cast(ReplicaGuard, None))
        stepping = asyncio.create_task(engine.run())
        stream = engine.add(GenerateRequest(request_id="r", prompt_token_ids=list(range(40)), max_tokens=6))
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if len(sent) == 1:
                async with asyncio.timeout(10):
                    while not stream.done:  # the client reads slowly: the engine finishes meanwhile
                        await asyncio.sleep(0.001)

        try:
            async with asyncio.timeout(10):
                await write(endpoints, stream, send)
        finally:
            stepping.cancel()
        return sent

    return asyncio.run(run())


def test_the_replica_protocol_stream_ends_with_its_closing_line_when_the_engine_finished_during_a_write() -> None:
    sent = written_while_the_first_send_waits_for_the_end(lambda ep, stream, send: ep._write_lines(stream, send))
    assert sent[0]["more_body"] and len(sent) == 2
    assert sent[-1]["more_body"] is False
    lines = [orjson.loads(line) for m in sent for line in m["body"].splitlines()]
    assert lines[-1]["done"] and lines[-1]["stats"]["num_output_tokens"] == 6
    assert sum(len(line.get("d", [])) for line in lines[:-1]) == 6  # every token sent once


def test_the_openai_stream_ends_with_done_when_the_engine_finished_during_a_write() -> None:
    sent = written_while_the_first_send_waits_for_the_end(
        lambda ep, stream, send: ep._write_sse(stream, send, "chat.completion", 0))
    assert sent[0]["more_body"] and len(sent) == 2
    assert sent[-1]["more_body"] is False and sent[-1]["body"].endswith(b"data: [DONE]\n\n")
    events = [orjson.loads(e[6:]) for m in sent for e in m["body"].split(b"\n\n") if e and e != b"data: [DONE]"]
    assert events[-1]["choices"][0]["finish_reason"] == "length" and events[-1]["usage"]["completion_tokens"] == 6


def test_a_writer_that_fails_is_logged_with_its_error(caplog: Any) -> None:
    async def run() -> None:
        engine = SimEngine(CONFIG, "e", SimClock(1.0))
        endpoints = SimEndpoints(engine, "sim-model", 1 << 20, cast(ReplicaGuard, None))
        stream = engine.add(GenerateRequest(request_id="r", prompt_token_ids=list(range(40)), max_tokens=6))

        async def broken_writer() -> None:
            raise RuntimeError("Unexpected ASGI message")

        async def client_stays() -> dict[str, Any]:
            await asyncio.sleep(10)
            return {"type": "http.disconnect"}

        async with asyncio.timeout(5):
            await endpoints._until_done_or_gone(stream, broken_writer(), client_stays)

    asyncio.run(run())
    failed = [r for r in caplog.records if "the response writer failed" in r.getMessage()]
    assert len(failed) == 1 and "request r" in failed[0].getMessage()
    assert failed[0].exc_info is not None and "Unexpected ASGI message" in str(failed[0].exc_info[1])
