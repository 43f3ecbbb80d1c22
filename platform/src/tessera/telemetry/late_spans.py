"""A gateway request's spans, noted cheaply on its hot path and made with the OpenTelemetry SDK after it.

Making SDK spans on the spot costs the request's hot path more than noting tuples, most on a process that
has been idle (how a lightly loaded gateway meets each request); ``make bench-wires`` measures the noting,
and the noting plus ``emit``, against SDK spans made on the spot (bench/bench_wires.py). So the request
notes plain tuples with real wall-clock times (``gateway.request``, its ``admission``, ``route`` and
``engine.call`` children, attributes, the ``first_token`` event, an exception) and ``emit`` makes the SDK
spans once the response is done: same names, parents, times, attributes, status and sampling decision as
spans made on the spot.

One thing must be known before the spans exist: the trace context the engine call carries, so that the
engine's spans are children of ``engine.call``. ``LateTrace`` draws that span's id (and a new trace's id)
up front and announces them to ``AnnouncedIds``, the provider's id generator, which hands exactly those ids
to the spans when they are made. Without an SDK provider using ``AnnouncedIds`` (tracing off, or a
provider configured elsewhere) nothing is announced and the incoming context, if any, is passed on as is.

With the local ``jsonl`` exporter ``emit`` skips the SDK's span objects altogether and writes the lines the
SDK path would have written (span_lines.py); an exception to record or a value to clean still goes the SDK way.
"""

from __future__ import annotations

import random
import time
from contextvars import ContextVar
from typing import Any

import orjson
from opentelemetry import baggage, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagate import get_global_textmap, inject
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tessera.telemetry.span_lines import PLAIN_VALUES, LineTracerProvider, SpanLines

_next_trace_id: ContextVar[int | None] = ContextVar("tessera_next_trace_id", default=None)
_next_span_id: ContextVar[int | None] = ContextVar("tessera_next_span_id", default=None)


class AnnouncedIds(RandomIdGenerator):
    """The SDK's random ids, except for the next span made right after ``announce`` (see ``LateTrace``)."""

    def generate_trace_id(self) -> int:
        announced = _next_trace_id.get()
        if announced is not None:
            _next_trace_id.set(None)
            return announced
        return super().generate_trace_id()

    def generate_span_id(self) -> int:
        announced = _next_span_id.get()
        if announced is not None:
            _next_span_id.set(None)
            return announced
        return super().generate_span_id()


def _announce(trace_id: int | None, span_id: int | None) -> None:
    _next_trace_id.set(trace_id)
    _next_span_id.set(span_id)


Child = tuple[str, int, int, dict[str, Any], BaseException | None]


class LateTrace:
    """The ``gateway.request`` span and its children, noted now and made by ``emit``."""

    def __init__(self, tracer: Tracer, parent_context: Context, attributes: dict[str, Any],
                 provider: trace.TracerProvider | None = None) -> None:
        """``provider``: the one ``tracer`` comes from (default: the global one)."""
        self._tracer = tracer
        self._parent_context = parent_context
        self.start_ns = time.time_ns()
        self.attributes = attributes
        self._children: list[Child] = []
        self._events: list[tuple[str, int]] = []
        self._call_started_ns: int | None = None
        self._call_context: SpanContext | None = None
        self._new_trace_id: int | None = None
        self._parent_span_id: int | None = None
        self._provider = provider = provider or trace.get_tracer_provider()
        if isinstance(provider, TracerProvider) and isinstance(provider.id_generator, AnnouncedIds):
            self._call_context = self._announced_call_context(provider)

    def _announced_call_context(self, provider: TracerProvider) -> SpanContext | None:
        parent = trace.get_current_span(self._parent_context).get_span_context()
        ids = provider.id_generator
        trace_id = parent.trace_id if parent.is_valid else ids.generate_trace_id()
        if parent.is_valid:
            self._parent_span_id = parent.span_id
        else:
            self._new_trace_id = trace_id
        # The sampler decides again, alike, when ``emit`` makes the span (the SDK's samplers are functions of
        # the parent and the trace id); the engine needs the decision now, in the flags it receives.
        decision = provider.sampler.should_sample(self._parent_context, trace_id, "gateway.request",
                                                  SpanKind.SERVER, self.attributes)
        flags = TraceFlags(TraceFlags.SAMPLED if decision.decision.is_sampled() else TraceFlags.DEFAULT)
        return SpanContext(trace_id, ids.generate_span_id(), is_remote=False, trace_flags=flags,
                           trace_state=decision.trace_state)

    def engine_headers(self, headers: dict[str, str]) -> None:
        """Adds the trace context of the (future) ``engine.call`` span to the engine request's headers."""
        call = self._call_context
        if call is not None:
            if _w3c_propagators(get_global_textmap()) and not baggage.get_all():
                # What the default propagators write for this context, without making one to read it from.
                headers["traceparent"] = f"00-{call.trace_id:032x}-{call.span_id:016x}-{call.trace_flags:02x}"
                if call.trace_state:
                    headers["tracestate"] = call.trace_state.to_header()
                return
            inject(headers, context=trace.set_span_in_context(NonRecordingSpan(call)))
        else:
            inject(headers, context=self._parent_context)

    def child(self, name: str, start_ns: int, attributes: dict[str, Any], error: BaseException | None = None) -> None:
        """A finished child span: from ``start_ns`` (``time.time_ns()``) until now."""
        self._children.append((name, start_ns, time.time_ns(), attributes, error))

    def call_started(self) -> None:
        self._call_started_ns = time.time_ns()

    def call_ended(self, attributes: dict[str, Any], error: BaseException | None) -> None:
        if self._call_started_ns is not None:
            self.child("engine.call", self._call_started_ns, attributes, error)
            self._call_started_ns = None

    def event(self, name: str, ts_ns: int | None = None) -> None:
        """An event on the request span, at ``ts_ns`` (``time.time_ns()``; default: now)."""
        self._events.append((name, time.time_ns() if ts_ns is None else ts_ns))

    def emit(self, error: BaseException | None = None) -> None:
        """Makes the spans (once); ``error``: the exception the request ended with, as the SDK records it."""
        end_ns = time.time_ns()
        provider = self._provider
        lines = provider.lines if isinstance(provider, LineTracerProvider) else None
        if lines is not None and self._emit_lines(lines, end_ns, error):
            self._children.clear()
            self._events.clear()
            return
        _announce(self._new_trace_id, None)
        request = self._tracer.start_span("gateway.request", context=self._parent_context, kind=SpanKind.SERVER,
                                          attributes=self.attributes, start_time=self.start_ns)
        _announce(None, None)
        if request.is_recording():
            context = trace.set_span_in_context(request)
            for name, start_ns, child_end_ns, attributes, child_error in self._children:
                if name == "engine.call" and self._call_context is not None:
                    _announce(None, self._call_context.span_id)
                span = self._tracer.start_span(name, context=context, start_time=start_ns, attributes=attributes)
                _announce(None, None)
                _record(span, child_error, child_end_ns)
                span.end(end_time=child_end_ns)
            for name, ts_ns in self._events:
                request.add_event(name, timestamp=ts_ns)
        _record(request, error, end_ns)
        request.end(end_time=end_ns)
        self._children.clear()
        self._events.clear()

    def _emit_lines(self, lines: SpanLines, end_ns: int, error: BaseException | None) -> bool:
        """The spans as ``span_to_dict`` makes them of the SDK's, straight to the span file (span_lines.py);
        False, having done nothing, where the SDK must make them (an exception to record, a value to clean)."""
        call = self._call_context
        if call is None or error is not None or not _plain(self.attributes):
            return False
        for _, _, _, attributes, child_error in self._children:
            if child_error is not None or not _plain(attributes):
                return False
        if not call.trace_flags.sampled:
            return True  # the SDK would record nothing either (the sampler decides alike, see __init__)
        trace_id = f"{call.trace_id:032x}"
        request_id = _span_id()
        service = lines.service_name
        out = []
        for name, start_ns, child_end_ns, attributes, _ in self._children:
            span_id = call.span_id if name == "engine.call" else _span_id()
            out.append(orjson.dumps({
                "trace_id": trace_id, "span_id": f"{span_id:016x}", "parent_span_id": f"{request_id:016x}",
                "name": name, "service": service, "start_ns": start_ns, "end_ns": child_end_ns, "status": "UNSET",
                "attributes": attributes, "events": [], "links": []}, default=str))
        parent = self._parent_span_id
        out.append(orjson.dumps({
            "trace_id": trace_id, "span_id": f"{request_id:016x}",
            "parent_span_id": None if parent is None else f"{parent:016x}", "name": "gateway.request",
            "service": service, "start_ns": self.start_ns, "end_ns": end_ns, "status": "UNSET",
            "attributes": self.attributes,
            "events": [{"name": name, "ts_ns": ts_ns, "attributes": {}} for name, ts_ns in self._events],
            "links": []}, default=str))
        out.append(b"")
        lines.add(b"\n".join(out))
        return True


def _w3c_propagators(textmap: TextMapPropagator) -> bool:
    """Whether ``textmap`` is the API's default: W3C trace context, then W3C baggage."""
    return (type(textmap) is CompositePropagator
            and [type(p) for p in textmap._propagators] == [TraceContextTextMapPropagator, W3CBaggagePropagator])


def _plain(attributes: dict[str, Any]) -> bool:
    """Values the SDK keeps as they are (it turns bytes to str and lists to tuples, warns about others)."""
    return PLAIN_VALUES.issuperset(map(type, attributes.values()))


def _span_id() -> int:
    """A span id as the SDK's ``RandomIdGenerator`` draws it."""
    span_id = random.getrandbits(64)
    while span_id == 0:
        span_id = random.getrandbits(64)
    return span_id


def _record(span: trace.Span, error: BaseException | None, ts_ns: int) -> None:
    """What ``start_as_current_span`` records for an exception that leaves the span."""
    if error is not None and span.is_recording():
        span.record_exception(error, timestamp=ts_ns)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
