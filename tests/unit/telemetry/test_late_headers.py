"""The engine call's trace headers as LateTrace writes them are what the configured propagators inject for
that context: the default W3C pair written directly, anything else (baggage, another propagator) by them."""

from __future__ import annotations

import pytest
from opentelemetry import baggage, context, trace
from opentelemetry.context import Context
from opentelemetry.propagate import extract, get_global_textmap, inject, set_global_textmap
from opentelemetry.propagators.textmap import CarrierT, Setter, TextMapPropagator, default_setter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan

from tessera.telemetry.late_spans import AnnouncedIds, LateTrace


class OwnPropagator(TextMapPropagator):
    """A propagator of someone's own: only the trace id, under its own header."""

    def extract(self, carrier: CarrierT, context: Context | None = None, getter: object = None) -> Context:
        return context or Context()

    def inject(self, carrier: CarrierT, context: Context | None = None,
               setter: Setter[CarrierT] = default_setter) -> None:  # type: ignore[assignment]
        span_context = trace.get_current_span(context).get_span_context()
        setter.set(carrier, "x-own-trace", f"{span_context.trace_id:032x}")

    @property
    def fields(self) -> set[str]:
        return {"x-own-trace"}


PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _late(parent: Context, sampler: object = None) -> LateTrace:
    provider = TracerProvider(sampler=sampler or ParentBased(TraceIdRatioBased(1.0)),  # type: ignore[arg-type]
                              id_generator=AnnouncedIds())
    return LateTrace(provider.get_tracer("test"), parent, {}, provider)


def _by_propagators(late: LateTrace) -> dict[str, str]:
    expected: dict[str, str] = {}
    assert late._call_context is not None
    inject(expected, context=trace.set_span_in_context(NonRecordingSpan(late._call_context)))
    return expected


@pytest.mark.parametrize("carrier", [{}, {"traceparent": PARENT}, {"traceparent": PARENT, "tracestate": "vendor=x,b=2"},
                                     {"traceparent": PARENT.removesuffix("01") + "00"}])
def test_the_default_propagators_headers(carrier: dict[str, str]) -> None:
    late = _late(extract(carrier))
    headers: dict[str, str] = {}
    late.engine_headers(headers)
    assert headers == _by_propagators(late) and "traceparent" in headers


def test_unsampled_headers() -> None:
    late = _late(Context(), ALWAYS_OFF)
    headers: dict[str, str] = {}
    late.engine_headers(headers)
    assert headers == _by_propagators(late) and headers["traceparent"].endswith("-00")


def test_baggage_goes_through_the_propagators() -> None:
    token = context.attach(baggage.set_baggage("team", "a"))
    try:
        late = _late(Context())
        headers: dict[str, str] = {}
        late.engine_headers(headers)
        assert headers == _by_propagators(late) and headers["baggage"] == "team=a"
    finally:
        context.detach(token)


def test_another_propagator_is_used() -> None:
    default = get_global_textmap()
    set_global_textmap(OwnPropagator())
    try:
        late = _late(Context())
        headers: dict[str, str] = {}
        late.engine_headers(headers)
        assert headers == _by_propagators(late) and "x-own-trace" in headers and "traceparent" not in headers
    finally:
        set_global_textmap(default)
