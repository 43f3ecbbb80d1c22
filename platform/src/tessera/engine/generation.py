"""One ``/generate`` request on the engine: vLLM's output stream turned into protocol lines, the request's
``RequestStats``, and its ``engine.generate`` span joined to the gateway's trace.

Lines are written only through protocol.py's encoders (``delta_line``, ``done_line``, ``error_line``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.propagate import extract
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from tessera.asgi import Send
from tessera.engine.in_flight import InFlight
from tessera.engine.protocol import GenerateRequest, RequestStats, delta_line, done_line, error_line


def sampling_params(request: GenerateRequest) -> SamplingParams:
    return SamplingParams(
        n=request.n, max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
        top_k=request.top_k, seed=request.seed, stop=request.stop or None, ignore_eos=request.ignore_eos,
        output_kind=RequestOutputKind.DELTA,
    )


async def traced_generation(engine: Any, engine_id: str, request: GenerateRequest, entry: InFlight, send: Send,
                            carrier: dict[str, str]) -> RequestStats:
    """Runs ``stream_generation`` inside an ``engine.generate`` span whose parent is in ``carrier`` (the
    request's headers), and records the request's timeline on it."""
    tracer = trace.get_tracer("tessera.engine")
    with tracer.start_as_current_span("engine.generate", context=extract(carrier), kind=trace.SpanKind.SERVER,
                                      attributes={"tessera.engine": engine_id,
                                                  # The client's id, as on the gateway's spans (the
                                                  # gateway sends it as x-request-id); the engine's own
                                                  # id for the request beside it.
                                                  "tessera.request_id": carrier.get("x-request-id")
                                                  or request.request_id,
                                                  "tessera.engine_request_id": request.request_id,
                                                  "tessera.tenant": entry.tenant,
                                                  "tessera.priority": request.priority,
                                                  "gen_ai.request.max_tokens": request.max_tokens}) as span:
        ctx = span.get_span_context()
        if ctx.is_valid:
            entry.traceparent = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
        stats = await stream_generation(engine, engine_id, request, entry, send)
        record_engine_span(span, stats, entry.abort_reason)
        return stats


async def stream_generation(engine: Any, engine_id: str, request: GenerateRequest, entry: InFlight,
                            send: Send) -> RequestStats:
    """Streams the request's deltas as they come, then its ``done`` line — or, when the engine aborted it
    (``entry.abort_reason``, set by ``POST /abort``), a retryable ``error`` line the gateway continues from."""
    prompt: dict[str, Any] = {"prompt_token_ids": request.prompt_token_ids}
    if request.cache_salt:
        prompt["cache_salt"] = request.cache_salt
    stats = RequestStats(engine_id=engine_id, num_prompt_tokens=len(request.prompt_token_ids))
    entry.stats = stats  # counted as it streams: the usage record of a request cut short reads it
    finish: dict[str, str | None] = {}
    final: Any = None
    lines: list[bytes] = []
    async for output in engine.generate(prompt, sampling_params(request), request_id=request.request_id,
                                        priority=request.priority):
        final = output
        stats.num_steps += 1
        entry.prefill_tokens = 0  # an output: the prompt is prefilled
        lines = []
        for completion in output.outputs:
            num_new = len(completion.token_ids)
            stats.num_output_tokens += num_new
            if num_new or completion.text:
                lines.append(delta_line(completion.index, completion.text, completion.token_ids))
            if completion.finish_reason is not None:
                finish[str(completion.index)] = completion.finish_reason
        if output.finished:
            continue  # vLLM's last output: its deltas leave with the closing line (one write, one gateway read)
        if lines:
            await send({"type": "http.response.body", "body": b"\n".join(lines) + b"\n", "more_body": True})
            lines = []
        # NOTE: neither vLLM's output queue nor a non-full socket buffer suspends this coroutine, so a
        # stream would hold the event loop for its whole length and starve /stats, /requests and /abort
        # (the KV-eviction controller's view of the engine): give the loop a turn after every step.
        await asyncio.sleep(0)
    if entry.abort_reason is not None and (final is None or not final.finished or
                                           all(v in (None, "abort") for v in finish.values())):
        tail = error_line(f"request aborted by the engine: {entry.abort_reason}", 503, True, stats)
    else:
        fill_timeline(stats, final, request.n)
        tail = done_line(finish, stats)
    await send({"type": "http.response.body", "body": b"\n".join([*lines, tail]) + b"\n", "more_body": False})
    return stats


def fill_timeline(stats: RequestStats, final: Any, n: int) -> None:
    """Counters and timeline from vLLM's last output of the request (its metrics are on that one)."""
    if final is None:
        return
    stats.num_cached_tokens = int(final.num_cached_tokens or 0)
    # Every step yields one token per sequence without speculation; the rest are accepted drafts. vLLM's
    # per-request metrics (single-sequence requests) give the exact counts, drafted ones included.
    stats.num_spec_accepted_tokens = max(0, stats.num_output_tokens - stats.num_steps * n)
    spec = getattr(final.outputs[0], "spec_decode_metrics", None) if n == 1 and final.outputs else None
    if spec is not None:
        stats.num_spec_draft_tokens = int(spec.num_draft_tokens)
        stats.num_spec_accepted_tokens = sum(j * count for j, count in enumerate(spec.histogram))
    metrics = final.metrics
    if metrics is None:
        return
    stats.num_preemptions = int(getattr(metrics, "num_preemptions", 0))
    queued, scheduled = metrics.queued_ts, metrics.scheduled_ts
    first, last = metrics.first_token_ts, metrics.last_token_ts
    arrival = metrics.arrival_time

    def wall(ts: float) -> float:
        return arrival + (ts - queued) if ts and queued else 0.0

    stats.queued_s = max(0.0, scheduled - queued) if scheduled else 0.0
    stats.prefill_s = max(0.0, first - scheduled) if first and scheduled else 0.0
    stats.ttft_s = float(metrics.first_token_latency)
    stats.decode_s = max(0.0, last - first) if last and first else 0.0
    stats.arrival_ts = arrival
    stats.scheduled_ts = wall(scheduled)
    stats.first_token_ts = wall(first)
    stats.finished_ts = wall(last)
    stats.e2e_s = max(0.0, stats.finished_ts - arrival) if stats.finished_ts else 0.0


def record_engine_span(span: Any, stats: RequestStats, abort_reason: str | None) -> None:
    """The engine timeline as span events at their real times, plus GenAI and tessera.* attributes."""
    span.set_attributes({
        "gen_ai.usage.input_tokens": stats.num_prompt_tokens,
        "gen_ai.usage.output_tokens": stats.num_output_tokens,
        "tessera.cached_tokens": stats.num_cached_tokens,
        "tessera.preemptions": stats.num_preemptions,
        "tessera.spec.accepted_tokens": stats.num_spec_accepted_tokens,
        "tessera.spec.draft_tokens": stats.num_spec_draft_tokens,
        "tessera.engine.steps": stats.num_steps,
        "tessera.queue_s": stats.queued_s,
        "tessera.prefill_s": stats.prefill_s,
        "tessera.decode_s": stats.decode_s,
        "tessera.ttft_s": stats.ttft_s,
    })
    for name, ts in (("queued", stats.arrival_ts), ("scheduled", stats.scheduled_ts),
                     ("first_token", stats.first_token_ts), ("finished", stats.finished_ts)):
        if ts:
            span.add_event(name, timestamp=int(ts * 1e9))
    if stats.num_preemptions:
        # vLLM reports how often, not when: one event carries the count.
        span.add_event("preempted", attributes={"tessera.preemptions": stats.num_preemptions},
                       timestamp=int((stats.finished_ts or time.time()) * 1e9))
    if abort_reason:
        span.set_attribute("tessera.aborted", abort_reason)
        span.add_event("aborted", attributes={"tessera.cause": abort_reason})
