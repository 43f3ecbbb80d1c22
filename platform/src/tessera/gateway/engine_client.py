"""Streams one generation from an engine replica over a pooled keep-alive HTTP connection (http_wire).

Retries: a replica that refuses the connection, answers 5xx before streaming, or ends the stream with a
``retryable`` error (the KV-eviction controller aborted it) is replaced by the next engine in the route's
ranking. A continued request sends prompt + the token ids already generated, with ``max_tokens`` reduced,
so the client sees every token once and usage counts every token once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from tessera.gateway.errors import APIError
from tessera.gateway.http_wire import EngineHTTP, EngineUnreachable

MAX_ATTEMPTS = 3


@dataclass(slots=True)
class Delta:
    index: int
    text: str
    token_ids: list[int]


@dataclass(slots=True)
class StreamResult:
    """Filled in as the stream progresses; read after the last delta (or after a failure)."""

    finish: dict[int, str] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    engines_tried: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    retries: int = 0
    first_delta_ns: int | None = None  # wall clock (time.time_ns) of the first delta received


class EngineClient:
    def __init__(self) -> None:
        self.http = EngineHTTP()

    async def close(self) -> None:
        await self.http.close()

    async def stream(self, urls: list[tuple[str, str]], body: dict[str, Any], headers: dict[str, str],
                     result: StreamResult) -> AsyncIterator[Delta]:
        """Yields deltas from the first engine that serves the request; ``urls`` is [(engine_id, url)]."""
        generated: list[int] = []
        original_prompt = body["prompt_token_ids"]
        last_error = "no engine available"
        for attempt, (engine_id, url) in enumerate(urls[:MAX_ATTEMPTS]):
            if attempt and generated:
                if body.get("n", 1) != 1:
                    break  # continuation is defined for one sequence only
                body = {**body, "prompt_token_ids": original_prompt + generated,
                        "max_tokens": body["max_tokens"] - len(generated),
                        "request_id": f"{body['request_id']}-r{attempt}"}
            elif attempt:
                body = {**body, "request_id": f"{body['request_id']}-r{attempt}"}
            result.engines_tried.append(engine_id)
            result.retries = attempt
            try:
                async with self.http.post(f"{url}/generate", orjson.dumps(body), headers) as resp:
                    if resp.status != 200:
                        last_error = f"engine {engine_id} answered {resp.status}: {(await resp.text())[:200]}"
                        if resp.status >= 500:
                            continue
                        raise APIError(502, last_error, "engine_error")
                    retry = False
                    single = body.get("n", 1) == 1
                    async for line in resp.lines():
                        message = orjson.loads(line)
                        if "t" in message:
                            ids = message["d"]
                            result.completion_tokens += len(ids)
                            if result.first_delta_ns is None:
                                result.first_delta_ns = time.time_ns()
                            if single:
                                generated.extend(ids)
                            yield Delta(message["i"], message["t"], ids)
                        elif message.get("done"):
                            result.finish = {int(k): v for k, v in message["finish"].items()}
                            result.stats = message["stats"]
                            await resp.drain()  # the closing chunk follows: then the connection is reusable
                            return
                        else:
                            last_error = str(message.get("error"))
                            result.stats = message.get("stats", {})
                            retry = bool(message.get("retryable"))
                            break
                    if not retry:
                        raise APIError(502, f"engine {engine_id} ended the stream early: {last_error}", "engine_error")
            except (EngineUnreachable, TimeoutError) as exc:
                last_error = f"engine {engine_id} unreachable: {exc}"
                continue
        raise APIError(503, f"No engine could serve the request ({last_error}); retry shortly.",
                       "engine_unavailable", headers={"Retry-After": "1"})
