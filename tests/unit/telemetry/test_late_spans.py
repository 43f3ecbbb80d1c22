"""LateSpans through the real OpenTelemetry SDK: spans noted on the hot path come out as children of the
request span with the times, attributes and events they were noted with; nothing is made for a span that
does not record."""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

from tessera.telemetry.late_spans import LateSpans


def _provider(**kwargs: object) -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(**kwargs)  # type: ignore[arg-type]
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_noted_spans_become_children_with_their_own_times_attributes_and_events() -> None:
    provider, exporter = _provider()
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("gateway.request") as request_span:
        notes = LateSpans(request_span)
        started = time.time_ns()
        notes.child("admission", started, {"tessera.admitted": True})
        notes.attributes["tessera.tenant"] = "acme"
        notes.event("first_token")
        noted_until = time.time_ns()
        time.sleep(0.01)  # the SDK work happens later than the noted times
        notes.emit(tracer)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    admission, request = spans["admission"], spans["gateway.request"]
    assert admission.parent is not None and admission.parent.span_id == request.context.span_id
    assert admission.context.trace_id == request.context.trace_id
    assert admission.start_time == started and started <= admission.end_time <= noted_until  # type: ignore[operator]
    assert dict(admission.attributes or {}) == {"tessera.admitted": True}
    assert request.attributes["tessera.tenant"] == "acme"  # type: ignore[index]
    [event] = request.events
    assert event.name == "first_token" and started <= event.timestamp <= noted_until


def test_emit_is_idempotent_and_a_non_recording_span_costs_nothing() -> None:
    provider, exporter = _provider()
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("gateway.request") as request_span:
        notes = LateSpans(request_span)
        notes.child("route", time.time_ns(), {})
        notes.emit(tracer)
        notes.emit(tracer)  # already emitted: nothing twice
    assert sorted(s.name for s in exporter.get_finished_spans()) == ["gateway.request", "route"]

    off, off_exporter = _provider(sampler=ALWAYS_OFF)
    with off.get_tracer("test").start_as_current_span("gateway.request") as unsampled:
        notes = LateSpans(unsampled)
        notes.child("route", time.time_ns(), {})
        notes.emit(off.get_tracer("test"))
    assert off_exporter.get_finished_spans() == ()
    assert not trace.get_current_span().is_recording()
