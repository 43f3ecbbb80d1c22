"""The gateway↔engine-replica wire protocol: one POST per request, a stream of NDJSON lines back.

Why NDJSON and not SSE: the gateway parses every line anyway (to count tokens, bill and re-frame as
OpenAI SSE), and one ``orjson.loads`` per newline-terminated line is the cheapest framing there is.

Request body (``POST /generate``)::

    {"request_id", "prompt_token_ids": [...], "max_tokens", "temperature", "top_p", "top_k", "seed",
     "stop": [...], "ignore_eos", "cache_salt", "priority", "n"}

Response lines::

    {"i": <choice index>, "t": "<text delta>", "d": [<new token ids>]}                # zero or more
    {"done": true, "finish": {<index>: <reason>}, "stats": {...RequestStats...}}       # exactly one, last
    {"error": "<message>", "status": <int>, "retryable": <bool>, "stats": {...}}        # instead of done

Token ids travel with the text so that a request the KV-eviction controller aborts can be continued on
another replica from exactly where it stopped (prompt + generated ids), with nothing streamed twice.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

import orjson
from pydantic import BaseModel, ConfigDict, Field

# Both sides use only what is below: the gateway encodes with ``GenerateBody``/``encode_request`` and parses
# with ``parse_lines``; the engine validates with ``GenerateRequest`` and writes with ``delta_line``,
# ``done_line`` and ``error_line``. The short keys ("i", "t", "d") are on every streamed token.


class ProtocolError(ValueError):
    """A line from the engine that is not part of this protocol."""


class GenerateRequest(BaseModel):
    """What the gateway sends: already tokenized, already admitted, already routed."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=200)
    prompt_token_ids: list[int] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=16)
    cache_salt: str | None = None
    priority: int = 0
    # The prompt tokens the gateway expects this replica to prefill (those its cache does not hold, as the
    # prefix index saw it). The replica reports the sum over its requests not yet past their first token in
    # its heartbeat (``pending_prefill_tokens``), where every gateway worker's routing policy sees it.
    prefill_tokens: int = Field(default=0, ge=0)


@dataclass(slots=True)
class RequestStats:
    """Per-request engine timeline and counters, sent in the final line and put on the engine span."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    # Tokens beyond one per step and sequence: accepted drafts. An upper bound when vLLM merged deltas of
    # several steps (consumer behind); the engine-wide counters in /stats are exact.
    num_spec_accepted_tokens: int = 0
    num_spec_draft_tokens: int = 0  # proposed drafts (vLLM's per-request metrics; 0 without speculation)
    queued_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    e2e_s: float = 0.0
    # Wall-clock (epoch seconds) event times for the trace timeline; 0.0 when not reached.
    arrival_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    finished_ts: float = 0.0
    engine_id: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class GenerateBody(TypedDict, total=False):
    """The gateway's side of ``GenerateRequest``: a plain dict, so the hot path builds no model per request."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    ignore_eos: bool
    n: int
    cache_salt: str | None
    priority: int
    prefill_tokens: int


def encode_request(body: GenerateBody) -> bytes:
    return orjson.dumps(body)


def continuation(body: GenerateBody, generated: list[int], attempt: int) -> GenerateBody:
    """The same request on another replica after ``generated`` tokens came from the first one: the prompt
    grows by those ids, ``max_tokens`` shrinks by their number, and the request id gets an attempt suffix
    (vLLM refuses a request id it is still running)."""
    again: GenerateBody = {**body, "request_id": f"{body['request_id']}-r{attempt}"}
    if generated:
        again["prompt_token_ids"] = body["prompt_token_ids"] + generated
        again["max_tokens"] = body["max_tokens"] - len(generated)
    if "prefill_tokens" in body:  # another replica: what its cache holds was not looked up
        again["prefill_tokens"] = len(again["prompt_token_ids"])
    return again


def base_request_id(request_id: str) -> str:
    """The gateway's id of a request, without the attempt suffix ``continuation`` gives it."""
    head, sep, attempt = request_id.rpartition("-r")
    return head if sep and head and attempt.isdigit() else request_id


# -- engine -> Redis: what each request used, for the gateways' settler ----------------------------------
# When a request ends on a replica (done, failed, aborted, or its caller gone), the replica records its token
# counts under the gateway's request id, one hash field per attempt: a request whose gateway died is billed
# from it (tenancy/settlement.py).

USAGE_RECORD_PREFIX = "tessera:engine-usage:"


def usage_record_key(request_id: str) -> str:
    return f"{USAGE_RECORD_PREFIX}{base_request_id(request_id)}"


def encode_usage(num_prompt_tokens: int, num_output_tokens: int) -> str:
    return f"{num_prompt_tokens} {num_output_tokens}"


def parse_usage(record: dict[Any, Any]) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of each attempt in a usage record (as HGETALL returns it); a malformed
    field is skipped."""
    attempts = []
    for value in record.values():
        text = value.decode() if isinstance(value, bytes) else str(value)
        prompt, _, output = text.partition(" ")
        if prompt.isdigit() and output.isdigit():
            attempts.append((int(prompt), int(output)))
    return attempts


# -- engine -> gateway lines ---------------------------------------------------------------------------


def delta_line(index: int, text: str, token_ids: list[int]) -> bytes:
    return orjson.dumps({"i": index, "t": text, "d": token_ids})


def done_line(finish: dict[str, str | None], stats: RequestStats) -> bytes:
    return orjson.dumps({"done": True, "finish": finish, "stats": stats.to_dict()})


def error_line(message: str, status: int, retryable: bool, stats: RequestStats) -> bytes:
    return orjson.dumps({"error": message, "status": status, "retryable": retryable, "stats": stats.to_dict()})


@dataclass(slots=True)
class Delta:
    index: int
    text: str
    token_ids: list[int]


@dataclass(slots=True)
class Done:
    finish: dict[int, str]
    stats: dict[str, Any]


@dataclass(slots=True)
class Failed:
    message: str
    status: int
    retryable: bool
    stats: dict[str, Any] = field(default_factory=dict)


def parse_line(line: bytes) -> Delta | Done | Failed:
    """One response line; ``ProtocolError`` names a line that is not JSON or not one of the three kinds."""
    try:
        message = orjson.loads(line)
    except orjson.JSONDecodeError:
        raise ProtocolError(f"the engine sent a malformed line: {line[:200]!r}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"the engine sent a line that is not an object: {line[:200]!r}")
    if "t" in message:
        return Delta(message["i"], message["t"], message["d"])
    if message.get("done"):
        return Done({int(k): v for k, v in message["finish"].items()}, message["stats"])
    if "error" in message:
        return Failed(str(message["error"]), int(message.get("status", 502)), bool(message.get("retryable")),
                      message.get("stats") or {})
    raise ProtocolError(f"the engine sent a line of no known kind: {line[:200]!r}")
