"""Spans written as JSONL lines straight from plain values, without OpenTelemetry SDK span objects.

The gateway notes each request's spans as tuples and makes them after the response (late_spans.py). Made
through the SDK, each of a request's four spans costs a ``Span`` (sampler, id generator, attribute
validation, locks), the batch processor's queue, and then ``span_to_dict`` in the export thread; with the
local ``jsonl`` exporter none of that is needed to write the line ``tessera traces analyze`` reads. So a
provider that ``configure_tracing`` sets up for the ``jsonl`` exporter (``LineTracerProvider``) carries a
``SpanLines``: ``LateTrace.emit`` hands it the request's spans as the dicts ``span_to_dict`` would have made
of the SDK's spans, and it appends them to the same file, in batches: from a gateway worker's tick once it
has one (``flush_from_caller``), else from a thread of its own (``quiet_batches.QuietBatches``: ``delay_s``
after the first line of a batch; no wake-ups while nothing comes).

What the SDK path still does (``LateTrace.emit`` falls back to it): a request or a child that ended with an
exception (the SDK's exception event and status), attribute values other than str/bool/int/float, and any
provider on which a span processor was added after ``configure_tracing`` (that processor must see every span:
the lines are then off). ``make bench-gateway-cpu`` measures the gateway's CPU per request with the lines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

from tessera.telemetry.quiet_batches import QuietBatches

# Span processors ``configure_tracing`` adds itself; another one added later turns the lines off.
_OWN_PROCESSORS = 2
# The attribute value types a line carries as the SDK would (exactly these; anything else, a subclass too,
# goes the SDK path, which cleans it).
PLAIN_VALUES = frozenset({str, bool, int, float})
# A request's lines are one item: a write takes at most this many requests', and this many may wait (a
# worker's requests over ~30 s at its fastest) before a request's spans are dropped.
LINES_PER_WRITE = 4096
MAX_WAITING_LINES = 65536


class SpanLines(SpanProcessor):
    """Encoded span lines waiting for their batch's write. A span processor only to be flushed and shut down
    with the provider's others (``flush_tracing``, the provider's exit hook): it sees no SDK span."""

    def __init__(self, write: Callable[[bytes], None], service_name: str, delay_s: float = 0.5) -> None:
        """``write``: appends bytes to the span file (``JsonlSpanExporter.write``, under its lock)."""
        self._write = write
        self.service_name = service_name
        self._batches: QuietBatches[bytes] = QuietBatches(self._write_batch, delay_s, "tessera-span-lines",
                                                          max_batch=LINES_PER_WRITE, max_items=MAX_WAITING_LINES)

    def add(self, lines: bytes) -> None:
        """Takes one or more encoded lines (each ending in a newline)."""
        self._batches.add(lines)

    def flush_from_caller(self) -> None:
        """Writes what waits, now, and leaves the writing to the caller from then on. A process with a periodic
        tick of its own calls it each tick (a gateway worker, every two seconds: ``lean_server``), and the batch
        thread's two wake-ups a batch go (~0.5 ms/s of a worker's CPU at 4 requests a second on this project's
        VMs, docs/performance.md section 9); the lines reach the file within a tick instead of ``delay_s``."""
        self._batches.hand_to_caller()
        self._batches.flush()

    def _write_batch(self, lines: list[bytes]) -> None:
        self._write(b"".join(lines))

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        return None

    def on_end(self, span: Any) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._batches.flush()
        return True

    def shutdown(self) -> None:
        self._batches.stop()


class LineTracerProvider(TracerProvider):
    """The SDK's provider with ``lines``: where spans made without the SDK go (None: none may, see above)."""

    lines: SpanLines | None = None
    _num_processors = 0

    def add_span_processor(self, span_processor: SpanProcessor) -> None:
        super().add_span_processor(span_processor)
        self._num_processors += 1
        if self._num_processors > _OWN_PROCESSORS:
            self.lines = None  # a processor of someone else's: it must see the SDK's spans of every request
