"""The simulated replica's HTTP routes (raw ASGI): the replica protocol the gateway speaks, and a minimal
OpenAI API so routers other than Tessera's can sit in front of the same fleet.

  POST /generate              NDJSON lines (engine/protocol.py: delta_line … done_line | error_line)
  POST /v1/completions        OpenAI completions, streamed (SSE) or whole
  POST /v1/chat/completions   OpenAI chat completions, streamed (SSE) or whole
  POST /v1/completions/render, /v1/chat/completions/render
                              vLLM's render routes: the prompt's token ids, generating nothing (vllm-router's
                              kv_aware policy asks a worker for them, then matches them to KV events)
  POST /abort                 {"request_id", "reason"}: the KV-eviction controller's abort (a retryable error)
  GET  /health, /stats, /requests (in-flight requests with tenant and priority, as the real replica lists them)

The replica protocol (/generate, /abort, /stats, /requests) takes only calls signed with the data-plane key,
checked as the real replica checks them (data_plane_auth.py). /health and the OpenAI routes stay open: those
are for routers other than Tessera's in benchmarks, which cannot sign (the fleet binds loopback by default).

NOTE: the OpenAI routes tokenize as one token per UTF-8 byte of the prompt (chat: of the messages joined
with their roles). The sim needs token ids only for block hashes, and bytes keep two prompts that share a
text prefix sharing a token prefix, which is what prefix caching and prefix-aware routers see. Generated
text is ``" t<id>"`` per token.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import asdict
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tessera.asgi import (
    BodyTooLarge,
    ClientDisconnected,
    Receive,
    Scope,
    Send,
    header_map,
    read_body,
    respond_json,
    wait_disconnect,
)
from tessera.data_plane_auth import ReplicaGuard, authenticated_body
from tessera.engine.held_head import HeldHead
from tessera.engine.in_flight import InFlightRequests
from tessera.engine.protocol import GenerateRequest, delta_line, done_line, error_line
from tessera.engine.sim.engine import RequestRejected, RequestStream, SimEngine

NDJSON_HEADERS = [(b"content-type", b"application/x-ndjson"), (b"cache-control", b"no-store")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-store")]

logger = logging.getLogger(__name__)


def token_text(token_ids: list[int]) -> str:
    return "".join(f" t{token_id}" for token_id in token_ids)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str


class OpenAIBody(BaseModel):
    """The fields of an OpenAI (chat) completion the sim uses; the rest is accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str = ""
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: int = Field(default=16, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    priority: int = 0
    cache_salt: str | None = None

    def token_ids(self) -> list[int]:
        if self.messages is not None:
            text = "".join(f"<|{m.role}|>{m.content}" for m in self.messages) + "<|assistant|>"
            return list(text.encode())
        if isinstance(self.prompt, list):
            return self.prompt
        return list((self.prompt or "").encode())


class AbortBody(BaseModel):
    """``POST /abort``, as the real replica reads it."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1)
    reason: str = "aborted"


def openai_error(message: str, status: int) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class SimEndpoints:
    """The routes of one simulated replica; ``asgi`` is what uvicorn serves."""

    def __init__(self, engine: SimEngine, model_name: str, max_body_bytes: int, guard: ReplicaGuard) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.guard = guard
        self.in_flight = InFlightRequests()

    async def asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path in ("/generate", "/abort", "/stats", "/requests"):
            headers = header_map(scope)
            body = await authenticated_body(self.guard, scope, receive, send, headers, self.max_body_bytes)
            if body is not None:
                await self.replica_protocol(path, method, body, headers, receive, send)
        elif path == "/v1/completions" and method == "POST":
            await self.openai(receive, send, "text_completion")
        elif path == "/v1/chat/completions" and method == "POST":
            await self.openai(receive, send, "chat.completion")
        elif path in ("/v1/completions/render", "/v1/chat/completions/render") and method == "POST":
            await self.render(receive, send, chat=path.startswith("/v1/chat/"))
        elif path == "/health":
            await respond_json(send, 200, {"healthy": True, "engine_id": self.engine.engine_id})
        elif path == "/v1/models":
            await respond_json(send, 200, {"object": "list", "data": [{"id": self.model_name, "object": "model"}]})
        else:
            await respond_json(send, 404, {"error": f"no route {method} {path}"})

    async def replica_protocol(self, path: str, method: str, body: bytes, headers: dict[str, str],
                               receive: Receive, send: Send) -> None:
        """A signed call of the replica protocol (``body`` already read and its signature checked)."""
        if path == "/generate" and method == "POST":
            await self.generate(body, headers, receive, send)
        elif path == "/stats":
            await respond_json(send, 200, self.stats())
        elif path == "/requests":
            await respond_json(send, 200, self.in_flight.listing())
        elif path == "/abort" and method == "POST":
            await self.abort(body, send)
        else:
            await respond_json(send, 404, {"error": f"no route {method} {path}"})

    def stats(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "engine_id": engine.engine_id, "num_running": engine.num_running, "num_waiting": engine.num_waiting,
            "kv_cache_usage": engine.kv_cache_usage, "num_gpu_blocks": engine.num_gpu_blocks,
            "block_size": engine.config.block_size, "num_preemptions": engine.scheduler.num_preemptions,
            "prefix_queries": engine.prefix_queries, "prefix_hits": engine.prefix_hits,
            "num_steps": engine.num_steps, "busy_s": engine.busy_s, "sim_now_s": engine.clock.now(),
            "kv_cache_dtype": getattr(engine.config.step_time, "kv_cache_dtype", ""),
            "kv_capacity_tokens": (engine.num_gpu_blocks - 1) * engine.config.block_size,
            "simulated": True,
        }

    async def _body(self, receive: Receive, send: Send) -> bytes | None:
        try:
            return await read_body(receive, self.max_body_bytes)
        except ClientDisconnected:
            return None
        except BodyTooLarge as exc:
            await respond_json(send, 413, {"error": str(exc)})
            return None

    async def _until_done_or_gone(self, stream: RequestStream, pump: Any, receive: Receive) -> None:
        """Runs ``pump`` (the response writer) until it finishes or the client leaves (then aborts)."""
        writer = asyncio.create_task(pump)
        gone = asyncio.create_task(wait_disconnect(receive))
        try:
            await asyncio.wait({writer, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not writer.done():
                writer.cancel()
            failed = (await asyncio.gather(writer, return_exceptions=True))[0]
            if isinstance(failed, Exception):
                # The client gets a response cut short: the log says why (swallowed, it left no trace at all).
                logger.error("request %s: the response writer failed", stream.request.request_id, exc_info=failed)
        finally:
            gone.cancel()
            self.engine.release(stream)

    # -- the replica protocol -----------------------------------------------------------------------------

    async def abort(self, raw: bytes, send: Send) -> None:
        try:
            body = AbortBody.model_validate_json(raw)
        except ValidationError as exc:
            await respond_json(send, 400, {"error": f"invalid AbortRequest: {exc.errors(include_url=False)}"})
            return
        entry = self.in_flight.get(body.request_id)
        if entry is None or not self.engine.abort(body.request_id, f"request aborted by the engine: {body.reason}"):
            await respond_json(send, 404, {"error": f"request {body.request_id!r} is not running here"})
            return
        entry.abort_reason = body.reason
        await respond_json(send, 200, {"aborted": body.request_id})

    async def generate(self, raw: bytes, headers: dict[str, str], receive: Receive, send: Send) -> None:
        try:
            body = GenerateRequest.model_validate_json(raw)
            stream = self.engine.add(body)
        except ValidationError as exc:
            await respond_json(send, 400, {"error": f"invalid GenerateRequest: {exc.errors(include_url=False)}"})
            return
        except ValueError as exc:  # RequestRejected, or a request id already running
            await respond_json(send, 400, {"error": str(exc)})
            return
        self.in_flight.start(body.request_id, headers.get("x-tessera-tenant", ""), body.priority)
        # The 200 leaves with the first line, as the real replica sends it (engine/held_head.py).
        held = HeldHead(send, {"type": "http.response.start", "status": 200, "headers": NDJSON_HEADERS})
        try:
            await self._until_done_or_gone(stream, self._write_lines(stream, held), receive)
        finally:
            held.close()
            self.in_flight.finish(body.request_id)

    async def _write_lines(self, stream: RequestStream, send: Send) -> None:
        request = stream.request
        while True:
            await stream.changed.wait()
            stream.changed.clear()
            # Read once a turn: the engine may end the stream while ``send`` waits (a client reading slowly, a
            # held head), and a turn that wrote a delta must not then return as if it had written the end.
            done = stream.done
            lines: list[bytes] = []
            new = request.output_token_ids[stream.num_sent:]
            if new:
                stream.num_sent += len(new)
                lines.append(delta_line(0, token_text(new), new))
            if done:
                stats = self.engine.stats_of(stream)
                if stream.error:
                    lines.append(error_line(stream.error, 503, True, stats))
                else:
                    lines.append(done_line({"0": "length"}, stats))
            # The last deltas leave with the closing line in one write, as the real replica does.
            if lines:
                await send({"type": "http.response.body", "body": b"\n".join(lines) + b"\n", "more_body": not done})
            if done:
                return

    # -- OpenAI ---------------------------------------------------------------------------------------------

    async def openai(self, receive: Receive, send: Send, kind: Literal["text_completion", "chat.completion"]) -> None:
        raw = await self._body(receive, send)
        if raw is None:
            return
        try:
            body = OpenAIBody.model_validate_json(raw)
            if kind == "chat.completion" and body.messages is None:
                raise ValueError("messages is required")
            token_ids = body.token_ids()
            if not token_ids:
                raise ValueError("the prompt is empty")
            request_id = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}"
            stream = self.engine.add(GenerateRequest(
                request_id=request_id, prompt_token_ids=token_ids,
                max_tokens=body.max_completion_tokens or body.max_tokens, priority=body.priority,
                cache_salt=body.cache_salt, ignore_eos=True))
        except ValidationError as exc:
            await respond_json(send, 400, openai_error(str(exc.errors(include_url=False)), 400))
            return
        except (RequestRejected, ValueError) as exc:
            await respond_json(send, 400, openai_error(str(exc), 400))
            return
        created = int(time.time())
        if body.stream:
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            await self._until_done_or_gone(stream, self._write_sse(stream, send, kind, created), receive)
        else:
            await self._until_done_or_gone(stream, self._write_whole(stream, send, kind, created), receive)

    async def render(self, receive: Receive, send: Send, chat: bool) -> None:
        """vLLM's ``/v1/(chat/)completions/render``: the request as vLLM would generate it (its
        ``GenerateRequest``: token ids and sampling parameters), a list of one for completions, as vLLM
        answers. Tokenized as the generating routes tokenize, so the ids are the ones the engine caches."""
        raw = await self._body(receive, send)
        if raw is None:
            return
        try:
            body = OpenAIBody.model_validate_json(raw)
            if chat and body.messages is None:
                raise ValueError("messages is required")
            token_ids = body.token_ids()
            if not token_ids:
                raise ValueError("the prompt is empty")
        except ValidationError as exc:
            await respond_json(send, 400, openai_error(str(exc.errors(include_url=False)), 400))
            return
        except ValueError as exc:
            await respond_json(send, 400, openai_error(str(exc), 400))
            return
        rendered = {"request_id": uuid.uuid4().hex, "token_ids": token_ids, "model": self.model_name,
                    "sampling_params": {"max_tokens": body.max_completion_tokens or body.max_tokens},
                    "cache_salt": body.cache_salt, "priority": body.priority, "stream": body.stream}
        await respond_json(send, 200, rendered if chat else [rendered])

    def _choice(self, kind: str, text: str, finish: str | None, delta: bool) -> dict[str, Any]:
        if kind == "text_completion":
            return {"index": 0, "text": text, "finish_reason": finish}
        key = "delta" if delta else "message"
        return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish}

    def _usage(self, stream: RequestStream) -> dict[str, Any]:
        stats = asdict(self.engine.stats_of(stream))
        return {"prompt_tokens": stats["num_prompt_tokens"], "completion_tokens": stats["num_output_tokens"],
                "total_tokens": stats["num_prompt_tokens"] + stats["num_output_tokens"],
                "prompt_tokens_details": {"cached_tokens": stats["num_cached_tokens"]}}

    async def _write_sse(self, stream: RequestStream, send: Send, kind: str, created: int) -> None:
        request = stream.request
        object_name = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
        while True:
            await stream.changed.wait()
            stream.changed.clear()
            done = stream.done  # read once a turn, as in _write_lines
            new = request.output_token_ids[stream.num_sent:]
            stream.num_sent += len(new)
            finish = ("length" if not stream.error else "abort") if done else None
            out = b""
            if new or finish:
                chunk: dict[str, Any] = {"id": request.request_id, "object": object_name, "created": created,
                                         "model": self.model_name,
                                         "choices": [self._choice(kind, token_text(new), finish, True)]}
                if finish:
                    chunk["usage"] = self._usage(stream)
                out += b"data: " + orjson.dumps(chunk) + b"\n\n"
            if done:
                out += b"data: [DONE]\n\n"
            await send({"type": "http.response.body", "body": out, "more_body": not done})
            if done:
                return

    async def _write_whole(self, stream: RequestStream, send: Send, kind: str, created: int) -> None:
        while not stream.done:
            await stream.changed.wait()
            stream.changed.clear()
        request = stream.request
        if stream.error:
            await respond_json(send, 503, openai_error(stream.error, 503))
            return
        await respond_json(send, 200, {
            "id": request.request_id, "object": kind, "created": created, "model": self.model_name,
            "choices": [self._choice(kind, token_text(request.output_token_ids), "length", False)],
            "usage": self._usage(stream)})
