"""LateTrace through the real OpenTelemetry SDK: spans noted during a request come out as the spans made on
the spot would have been (names, parents, times, attributes, events, error status), the engine call's
announced context is the one its span gets, and an unsampled request sends the unsampled flag."""

from __future__ import annotations

import time

from opentelemetry.context import Context
from opentelemetry.propagate import extract
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased

from tessera.telemetry.late_spans import AnnouncedIds, LateTrace

REMOTE_TRACE = "0af7651916cd43dd8448eb211c80319c"


def _provider(sampler: object = None) -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler or ParentBased(TraceIdRatioBased(1.0)),  # type: ignore[arg-type]
                              id_generator=AnnouncedIds())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _late(provider: TracerProvider, context: Context | None = None) -> LateTrace:
    return LateTrace(provider.get_tracer("test"), context or Context(), {"tessera.request_id": "r1"}, provider)


def test_noted_spans_come_out_as_children_with_their_times_attributes_and_events() -> None:
    provider, exporter = _provider()
    late = _late(provider)
    headers: dict[str, str] = {}
    late.engine_headers(headers)
    started = time.time_ns()
    late.child("admission", started, {"tessera.admitted": True})
    late.call_started()
    late.event("first_token")
    late.call_ended({"tessera.engines_tried": "e1"}, None)
    late.attributes["tessera.tenant"] = "acme"
    noted_until = time.time_ns()
    time.sleep(0.01)  # the SDK work happens later than the noted times
    late.emit()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    request, admission, call = spans["gateway.request"], spans["admission"], spans["engine.call"]
    for child in (admission, call):
        assert child.parent is not None and child.parent.span_id == request.context.span_id
        assert child.context.trace_id == request.context.trace_id
    assert admission.start_time == started and started <= admission.end_time <= noted_until  # type: ignore[operator]
    assert dict(admission.attributes or {}) == {"tessera.admitted": True}
    assert dict(request.attributes or {}) == {"tessera.request_id": "r1", "tessera.tenant": "acme"}
    assert request.start_time <= started and request.end_time > noted_until  # type: ignore[operator]
    [event] = request.events
    assert event.name == "first_token" and started <= event.timestamp <= noted_until
    # The engine was told, before the span existed, exactly the context engine.call got.
    assert headers["traceparent"] == f"00-{call.context.trace_id:032x}-{call.context.span_id:016x}-01"


def test_an_incoming_trace_is_continued() -> None:
    provider, exporter = _provider()
    late = _late(provider, extract({"traceparent": f"00-{REMOTE_TRACE}-b7ad6b7169203331-01"}))
    headers: dict[str, str] = {}
    late.engine_headers(headers)
    late.call_started()
    late.call_ended({}, None)
    late.emit()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert f"{spans['gateway.request'].context.trace_id:032x}" == REMOTE_TRACE
    assert spans["gateway.request"].parent.span_id == 0xB7AD6B7169203331  # type: ignore[union-attr]
    assert headers["traceparent"].startswith(f"00-{REMOTE_TRACE}-{spans['engine.call'].context.span_id:016x}")


def test_an_error_is_recorded_as_the_sdk_records_it() -> None:
    provider, exporter = _provider()
    late = _late(provider)
    late.call_started()
    failure = RuntimeError("engine gone")
    late.call_ended({}, failure)
    late.emit(failure)
    for span in exporter.get_finished_spans():
        assert span.status.status_code.name == "ERROR"
        assert span.status.description == "RuntimeError: engine gone"
        assert [e.name for e in span.events] == ["exception"]


def test_an_unsampled_request_records_nothing_and_tells_the_engine() -> None:
    provider, exporter = _provider(ALWAYS_OFF)
    late = _late(provider)
    headers: dict[str, str] = {}
    late.engine_headers(headers)
    late.child("route", time.time_ns(), {})
    late.emit()
    assert exporter.get_finished_spans() == ()
    assert headers["traceparent"].endswith("-00")


def test_without_an_announcing_provider_the_incoming_context_passes_through() -> None:
    plain = TracerProvider()  # ids of its own: nothing can be announced
    late = LateTrace(plain.get_tracer("test"), extract({"traceparent": f"00-{REMOTE_TRACE}-b7ad6b7169203331-01"}),
                     {}, plain)
    headers: dict[str, str] = {}
    late.engine_headers(headers)
    assert headers["traceparent"] == f"00-{REMOTE_TRACE}-b7ad6b7169203331-01"
