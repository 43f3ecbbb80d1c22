"""How ``stream_generation`` writes one request's lines: a write per vLLM step while it runs, and the last
step's deltas together with the closing line (one write for the engine, one read for the gateway). vLLM's own
output classes stand in for a running engine here; the engine-host tests run the same code on the real one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from vllm.outputs import CompletionOutput, RequestOutput

from tessera.engine.generation import stream_generation
from tessera.engine.in_flight import InFlight
from tessera.engine.protocol import GenerateRequest


def _step(text: str, token: int, finish_reason: str | None = None) -> RequestOutput:
    completion = CompletionOutput(0, text, [token], None, None, finish_reason=finish_reason)
    return RequestOutput("r1", None, [1, 2, 3], None, [completion], finished=finish_reason is not None)


class _Steps:
    def __init__(self, outputs: list[RequestOutput]) -> None:
        self.outputs = outputs

    async def generate(self, *_: Any, **__: Any) -> AsyncIterator[RequestOutput]:
        for output in self.outputs:
            yield output


async def _writes(outputs: list[RequestOutput], abort_reason: str | None = None) -> list[list[dict[str, Any]]]:
    writes: list[list[dict[str, Any]]] = []

    async def send(message: dict[str, Any]) -> None:
        writes.append([orjson.loads(line) for line in message["body"].splitlines()])

    entry = InFlight("r1", "t", 0, 0.0, abort_reason=abort_reason)
    request = GenerateRequest(request_id="r1", prompt_token_ids=[1, 2, 3], max_tokens=3)
    await stream_generation(_Steps(outputs), "e0", request, entry, send)
    return writes


async def test_the_last_step_leaves_with_the_closing_line() -> None:
    writes = await _writes([_step("a", 10), _step("b", 11), _step("c", 12, "length")])
    assert [[line.get("t") for line in write] for write in writes] == [["a"], ["b"], ["c", None]]
    assert writes[-1][-1]["done"] and writes[-1][-1]["finish"] == {"0": "length"}
    assert writes[-1][-1]["stats"]["num_output_tokens"] == 3


async def test_an_aborted_stream_sends_no_delta_twice() -> None:
    # Aborted before vLLM finished it: every step was written as it came; the error line comes alone.
    writes = await _writes([_step("a", 10), _step("b", 11)], abort_reason="kv quota")
    assert [[line.get("t") for line in write] for write in writes] == [["a"], ["b"], [None]]
    assert writes[-1][0]["retryable"] and "kv quota" in writes[-1][0]["error"]
