"""Span work noted cheaply on a request's hot path and handed to the OpenTelemetry SDK once the request is
done with its latency-critical part.

Measured here: one SDK span with four attributes costs ~60 µs back to back and ~250 µs on a process that
has been idle for 100 ms, which is how a lightly loaded gateway meets each request. The gateway's spans
before the engine call (``admission``, ``route``) and its request-span attributes and ``first_token`` event
are therefore noted as plain tuples with their real wall-clock times, and become SDK spans and attributes
in ``emit``, after the response: same names, parents, times and attributes as if made on the spot.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, Tracer


class LateSpans:
    def __init__(self, parent: Span) -> None:
        self.parent = parent
        self.attributes: dict[str, Any] = {}
        self._children: list[tuple[str, int, int, dict[str, Any]]] = []
        self._events: list[tuple[str, int]] = []

    def child(self, name: str, start_ns: int, attributes: dict[str, Any]) -> None:
        """A finished child span of ``parent``: from ``start_ns`` (``time.time_ns()``) until now."""
        self._children.append((name, start_ns, time.time_ns(), attributes))

    def event(self, name: str) -> None:
        """An event on ``parent``, stamped now."""
        self._events.append((name, time.time_ns()))

    def emit(self, tracer: Tracer) -> None:
        parent = self.parent
        if not parent.is_recording():
            return
        if self.attributes:
            parent.set_attributes(self.attributes)
        context = trace.set_span_in_context(parent)
        for name, start_ns, end_ns, attributes in self._children:
            tracer.start_span(name, context=context, start_time=start_ns, attributes=attributes).end(end_time=end_ns)
        for name, ts_ns in self._events:
            parent.add_event(name, timestamp=ts_ns)
        self._children.clear()
        self._events.clear()
        self.attributes.clear()
