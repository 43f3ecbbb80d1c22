"""The controller's spans: one per eviction batch and tenant, one per action.

Attribute names (read by ``tessera traces analyze``):

  tessera.engine, tessera.tenant, tessera.cause
  tessera.kv.blocks               blocks evicted (eviction) / the tenant's blocks (demote, restore)
  tessera.kv.quota_blocks         the tenant's quota on this engine (demote, restore)
  tessera.kv.free_blocks_before   free blocks at the last poll before the eviction / action
  tessera.kv.free_blocks_after    free blocks at the first poll after it (the span ends there)
  tessera.kv.block_size           tokens per block
  tessera.kv.evicted_by           owners of the blocks stored right after the eviction (comma-separated)
  tessera.engine_request_id       the aborted request, by the engine's id for it (abort; the client's id,
                                  tessera.request_id, is on the engine.generate span it parents under)

An eviction span carries one ``evicted_prefix`` event per chain it touched: ``tessera.kv.prefix_root``
(the chain's first block hash, 16 hex digits, as the gateway's ``route`` span records it),
``tessera.kv.depth_min``/``depth_max`` (block positions in the chain, 0 = first) and ``tessera.kv.blocks``.

Links point at the spans of the requests involved: for an eviction the in-flight requests of the tenants
whose blocks replaced the evicted ones, for a demotion that tenant's requests seen in flight within the
policy's active window, for the pressure flag every in-flight request on the engine. An abort is a *child*
of the aborted request's ``engine.generate`` span, so it appears in that request's own trace.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

MAX_LINKS = 16
_PROPAGATOR = TraceContextTextMapPropagator()


def span_context_of(traceparent: str) -> SpanContext | None:
    """The remote span context a W3C ``traceparent`` names, or None when it is empty or malformed."""
    if not traceparent:
        return None
    ctx = trace.get_current_span(_PROPAGATOR.extract({"traceparent": traceparent})).get_span_context()
    return ctx if ctx.is_valid else None


def parent_context(traceparent: str) -> Context | None:
    span_context = span_context_of(traceparent)
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context)) if span_context else None


def links_to(traceparents: Iterable[str], role: str) -> list[Link]:
    links: list[Link] = []
    seen: set[tuple[int, int]] = set()
    for traceparent in traceparents:
        ctx = span_context_of(traceparent)
        if ctx is None or (ctx.trace_id, ctx.span_id) in seen:
            continue
        seen.add((ctx.trace_id, ctx.span_id))
        # A link must not make an unsampled request's trace look sampled.
        links.append(Link(SpanContext(ctx.trace_id, ctx.span_id, True, TraceFlags(ctx.trace_flags)),
                          {"tessera.link.role": role}))
        if len(links) >= MAX_LINKS:
            break
    return links


def traceparent_of(span: Any) -> str:
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def to_ns(ts_s: float) -> int:
    return int(ts_s * 1e9)
