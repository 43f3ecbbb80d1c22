"""OpenTelemetry setup shared by the gateway, the engine host and the controller.

Exporters: ``jsonl`` (the local default: one file per process under the run directory, one span per line,
read by ``tessera traces analyze``), ``otlp-http`` and ``otlp-grpc`` (a collector by URL), ``none``.
Sampling is parent-based with a ratio, so an engine follows the gateway's decision for each request.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from tessera.telemetry.late_spans import AnnouncedIds
from tessera.telemetry.quiet_batches import QuietSpanProcessor
from tessera.telemetry.span_lines import LineTracerProvider, SpanLines

_configured_lock = threading.Lock()
_configured = False


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    assert ctx is not None
    parent = span.parent
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent else None,
        "name": span.name,
        "service": span.resource.attributes.get("service.name"),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "ts_ns": e.timestamp, "attributes": dict(e.attributes or {})} for e in span.events
        ],
        "links": [
            {"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}",
             "attributes": dict(link.attributes or {})}
            for link in span.links
        ],
    }


class JsonlSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file owned by this process."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.write(b"".join(orjson.dumps(span_to_dict(s), default=str) + b"\n" for s in spans))
        return SpanExportResult.SUCCESS

    def write(self, data: bytes) -> None:
        """Appends encoded lines (also ``SpanLines``', the spans made without the SDK: span_lines.py)."""
        with self._lock, open(self._path, "ab") as handle:
            handle.write(data)

    def shutdown(self) -> None:
        return None


def configure_tracing(service_name: str, exporter: str, run_dir: Path | None = None,
                      otlp_endpoint: str | None = None, sample_ratio: float = 1.0) -> TracerProvider | None:
    """Installs the global tracer provider once per process; later calls are no-ops."""
    global _configured
    with _configured_lock:
        if _configured or exporter == "none":
            return None
        provider = LineTracerProvider(
            resource=Resource.create({"service.name": service_name}),
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
            # Random ids, and the ones the gateway announced for spans it makes after the fact (late_spans.py).
            id_generator=AnnouncedIds(),
        )
        span_exporter: SpanExporter
        if exporter == "jsonl":
            directory = run_dir or Path(".tessera/traces")
            span_exporter = JsonlSpanExporter(directory / f"spans-{service_name}-{os.getpid()}.jsonl")
        elif exporter == "otlp-http":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

            span_exporter = HttpExporter(endpoint=otlp_endpoint) if otlp_endpoint else HttpExporter()
        elif exporter == "otlp-grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

            span_exporter = GrpcExporter(endpoint=otlp_endpoint) if otlp_endpoint else GrpcExporter()
        else:
            raise ValueError(f"unknown trace exporter {exporter!r}; valid: jsonl, otlp-http, otlp-grpc, none")
        # Not the SDK's BatchSpanProcessor, which wakes every 0.5 s with nothing to export (quiet_batches.py).
        provider.add_span_processor(QuietSpanProcessor(span_exporter, delay_s=0.5))
        if isinstance(span_exporter, JsonlSpanExporter):
            # The gateway's request spans skip the SDK's span objects on the way to this file (span_lines.py).
            lines = SpanLines(span_exporter.write, service_name, delay_s=0.5)
            provider.add_span_processor(lines)
            provider.lines = lines
        trace.set_tracer_provider(provider)
        _configured = True
        return provider


def span_lines() -> SpanLines | None:
    """The process's span lines (the ``jsonl`` exporter's, span_lines.py), or None."""
    provider = trace.get_tracer_provider()
    return provider.lines if isinstance(provider, LineTracerProvider) else None


def flush_tracing() -> None:
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.force_flush()
