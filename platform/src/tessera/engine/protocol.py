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

from dataclasses import asdict, dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


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
