"""The gateway's request spans written without SDK span objects (span_lines.py) are the lines the SDK path
writes (``span_to_dict`` of the SDK's spans): same trace, parents, names, times, attributes, events, status;
the SDK path still makes what needs it (an exception, a value to clean, someone else's span processor)."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import orjson
from opentelemetry.context import Context
from opentelemetry.propagate import extract
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased

from tessera.telemetry.late_spans import AnnouncedIds, LateTrace
from tessera.telemetry.span_lines import LineTracerProvider, SpanLines
from tessera.telemetry.tracing import JsonlSpanExporter, span_to_dict

REMOTE_TRACE = "0af7651916cd43dd8448eb211c80319c"
SERVICE = "tessera-gateway"


class Written:
    def __init__(self) -> None:
        self.data = b""

    def __call__(self, data: bytes) -> None:
        self.data += data

    def spans(self) -> list[dict[str, Any]]:
        return [orjson.loads(line) for line in self.data.splitlines() if line]


def _line_provider(sampler: Any = None) -> tuple[LineTracerProvider, Written, InMemorySpanExporter]:
    from opentelemetry.sdk.resources import Resource

    written, exporter = Written(), InMemorySpanExporter()
    provider = LineTracerProvider(resource=Resource.create({"service.name": SERVICE}),
                                  sampler=sampler or ParentBased(TraceIdRatioBased(1.0)), id_generator=AnnouncedIds())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    lines = SpanLines(written, SERVICE, delay_s=60)
    provider.add_span_processor(lines)
    provider.lines = lines
    return provider, written, exporter


def _sdk_twin(late: LateTrace, sdk: TracerProvider) -> LateTrace:
    """The same noted request, made by the SDK (a provider without lines, the same sampler)."""
    twin = copy.copy(late)
    twin._tracer, twin._provider = sdk.get_tracer("test"), sdk
    twin._children, twin._events, twin.attributes = list(late._children), list(late._events), dict(late.attributes)
    return twin


def _note_a_request(late: LateTrace) -> None:
    late.engine_headers({})
    late.attributes.update({"tessera.tenant": "acme", "gen_ai.usage.input_tokens": 12, "tessera.admission_wait_s": 0.5,
                            "tessera.demoted": False})
    late.child("admission", time.time_ns(), {"tessera.admitted": True})
    late.child("route", time.time_ns(), {"tessera.route.reason": "prefix", "tessera.prompt_blocks": 3})
    late.call_started()
    late.event("first_token")
    late.call_ended({"tessera.engines_tried": "e1"}, None)


def _by_name(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in spans}


def _same_spans(lines: list[dict[str, Any]], sdk: list[dict[str, Any]]) -> None:
    """Equal but for the random ids of the spans nobody was told of in advance (and the request's end)."""
    ours, theirs = _by_name(lines), _by_name(sdk)
    assert set(ours) == set(theirs) == {"gateway.request", "admission", "route", "engine.call"}
    for name in ours:
        a, b = dict(ours[name]), dict(theirs[name])
        if name == "gateway.request":
            assert a.pop("end_ns") >= b.pop("end_ns")  # our twin emitted first
        if name != "engine.call":
            a.pop("span_id"), b.pop("span_id")
        a.pop("parent_span_id") if name != "gateway.request" else None
        b.pop("parent_span_id") if name != "gateway.request" else None
        assert a == b, name
        if name != "gateway.request":
            assert ours[name]["parent_span_id"] == ours["gateway.request"]["span_id"]


def test_lines_are_what_the_sdk_path_writes() -> None:
    provider, written, _ = _line_provider()
    sdk, sdk_out = _sdk_provider()
    late = LateTrace(provider.get_tracer("test"), Context(), {"tessera.request_id": "r1"}, provider)
    _note_a_request(late)
    twin = _sdk_twin(late, sdk)
    twin.emit()
    late.emit()
    provider.force_flush()
    _same_spans(written.spans(), [span_to_dict(s) for s in sdk_out.get_finished_spans()])
    [root] = [s for s in written.spans() if s["name"] == "gateway.request"]
    assert root["parent_span_id"] is None and root["events"][0]["name"] == "first_token"


def test_an_incoming_trace_is_continued_in_the_lines() -> None:
    provider, written, _ = _line_provider()
    sdk, sdk_out = _sdk_provider()
    parent = extract({"traceparent": f"00-{REMOTE_TRACE}-b7ad6b7169203331-01"})
    late = LateTrace(provider.get_tracer("test"), parent, {"tessera.request_id": "r1"}, provider)
    headers: dict[str, str] = {}
    late.engine_headers(headers)
    _note_a_request(late)
    twin = _sdk_twin(late, sdk)
    twin.emit()
    late.emit()
    provider.force_flush()
    spans = _by_name(written.spans())
    _same_spans(list(spans.values()), [span_to_dict(s) for s in sdk_out.get_finished_spans()])
    assert spans["gateway.request"]["trace_id"] == REMOTE_TRACE
    assert spans["gateway.request"]["parent_span_id"] == "b7ad6b7169203331"
    assert headers["traceparent"] == f"00-{REMOTE_TRACE}-{spans['engine.call']['span_id']}-01"


def _sdk_provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    from opentelemetry.sdk.resources import Resource

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE}),
                              sampler=ParentBased(TraceIdRatioBased(1.0)), id_generator=AnnouncedIds())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_an_error_goes_the_sdk_way() -> None:
    provider, written, exporter = _line_provider()
    late = LateTrace(provider.get_tracer("test"), Context(), {}, provider)
    late.call_started()
    failure = RuntimeError("engine gone")
    late.call_ended({}, failure)
    late.emit(failure)
    provider.force_flush()
    assert written.data == b""
    assert {s.name for s in exporter.get_finished_spans()} == {"gateway.request", "engine.call"}
    assert all(s.status.status_code.name == "ERROR" for s in exporter.get_finished_spans())


def test_a_value_the_sdk_would_clean_goes_the_sdk_way() -> None:
    provider, written, exporter = _line_provider()
    late = LateTrace(provider.get_tracer("test"), Context(), {"tessera.user": None, "tessera.tags": ["a"]}, provider)
    late.emit()
    provider.force_flush()
    assert written.data == b""
    [span] = exporter.get_finished_spans()
    assert span.name == "gateway.request" and span.attributes["tessera.tags"] == ("a",)  # type: ignore[index]


def test_unsampled_writes_nothing() -> None:
    provider, written, exporter = _line_provider(ALWAYS_OFF)
    late = LateTrace(provider.get_tracer("test"), Context(), {}, provider)
    late.child("route", time.time_ns(), {})
    late.emit()
    provider.force_flush()
    assert written.data == b"" and exporter.get_finished_spans() == ()


def test_a_processor_added_later_sees_every_span() -> None:
    provider, written, _ = _line_provider()
    later = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(later))
    assert provider.lines is None
    late = LateTrace(provider.get_tracer("test"), Context(), {}, provider)
    late.emit()
    provider.force_flush()
    assert [s.name for s in later.get_finished_spans()] == ["gateway.request"] and written.data == b""


def test_lines_are_written_in_batches_after_the_delay_and_on_flush(tmp_path: Path) -> None:
    exporter = JsonlSpanExporter(tmp_path / "spans.jsonl")
    lines = SpanLines(exporter.write, SERVICE, delay_s=0.05)
    lines.add(b'{"a":1}\n')
    lines.add(b'{"a":2}\n')
    # Wait for the batch's bytes, not the file: the writer thread creates the file before it writes, and a
    # read in between saw it empty (a flake on a loaded 2-core machine).
    path, deadline = tmp_path / "spans.jsonl", time.monotonic() + 5
    while not (path.exists() and path.stat().st_size) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert path.read_bytes() == b'{"a":1}\n{"a":2}\n'
    lines.add(b'{"a":3}\n')
    lines.shutdown()  # flushes what waits
    assert (tmp_path / "spans.jsonl").read_bytes().endswith(b'{"a":3}\n')
    lines.add(b'{"a":4}\n')  # after shutdown: dropped, as the SDK's processors drop spans
    lines.force_flush()
    assert b'"a":4' not in (tmp_path / "spans.jsonl").read_bytes()


SCRIPT = r"""
import sys
from pathlib import Path
from opentelemetry import trace
from opentelemetry.context import Context
from tessera.telemetry.late_spans import LateTrace
from tessera.telemetry.tracing import configure_tracing, flush_tracing

configure_tracing("tessera-gateway", "jsonl", Path(sys.argv[1]))
late = LateTrace(trace.get_tracer("tessera.gateway"), Context(), {"tessera.request_id": "r1"})
late.engine_headers({})
late.child("route", late.start_ns, {"tessera.route.reason": "prefix"})
late.call_started()
late.call_ended({}, None)
assert trace.get_tracer_provider().lines is not None
late.emit()
flush_tracing()
"""


def test_configure_tracing_writes_the_gateway_spans_as_lines(tmp_path: Path) -> None:
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], check=True, timeout=60)
    [path] = tmp_path.glob("spans-tessera-gateway-*.jsonl")
    spans = _by_name([orjson.loads(line) for line in path.read_bytes().splitlines()])
    assert set(spans) == {"gateway.request", "route", "engine.call"}
    assert {s["service"] for s in spans.values()} == {"tessera-gateway"}
    assert spans["route"]["parent_span_id"] == spans["gateway.request"]["span_id"]


def test_lines_handed_to_the_caller_are_written_on_its_flushes_only(tmp_path: Path) -> None:
    """A gateway worker's tick writes its lines (lean_server.py): the batch thread then never wakes."""
    exporter = JsonlSpanExporter(tmp_path / "spans.jsonl")
    lines = SpanLines(exporter.write, SERVICE, delay_s=0.01)
    lines.add(b'{"a":1}\n')  # before the first tick: the thread takes the batch
    lines.flush_from_caller()  # the first tick: what waits is written, and the caller writes from now on
    time.sleep(0.1)  # the thread's batch under way ends (with nothing left to write)
    assert (tmp_path / "spans.jsonl").read_bytes() == b'{"a":1}\n'
    lines.add(b'{"a":2}\n')
    time.sleep(0.1)  # ten of the thread's delays
    assert (tmp_path / "spans.jsonl").read_bytes() == b'{"a":1}\n'
    lines.flush_from_caller()
    assert (tmp_path / "spans.jsonl").read_bytes() == b'{"a":1}\n{"a":2}\n'
    lines.shutdown()
