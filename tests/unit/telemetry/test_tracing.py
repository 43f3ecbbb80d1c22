"""Tracing setup: sampling is configurable (and parent-based), and the OTLP exporters reach a collector by URL.

Each case runs in a fresh interpreter: the tracer provider is process-global and set once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

SCRIPT = r"""
import json, os, sys
from pathlib import Path
from opentelemetry import trace
from opentelemetry.propagate import extract
from tessera.settings import load_settings
from tessera.telemetry.tracing import configure_tracing, flush_tracing

settings = load_settings()  # TESSERA_TRACE_* from the environment, as every service reads them
configure_tracing("sampling-test", settings.trace_exporter, settings.trace_dir, settings.otlp_endpoint,
                  settings.trace_sample_ratio)
tracer = trace.get_tracer("test")
for i in range(int(sys.argv[1])):
    with tracer.start_as_current_span("root"):
        pass
for flags in ("01", "00"):
    for i in range(20):
        parent = extract({"traceparent": f"00-{i + 1:032x}-{i + 1:016x}-{flags}"})
        with tracer.start_as_current_span(f"child-of-{flags}", context=parent):
            pass
flush_tracing()
"""


def run_script(env: dict[str, str], roots: int = 200) -> None:
    import os

    subprocess.run([sys.executable, "-c", SCRIPT, str(roots)], env={**os.environ, **env}, check=True, timeout=120)


def spans_in(directory: Path) -> list[dict]:
    return [json.loads(line) for f in directory.glob("*.jsonl") for line in f.read_text().splitlines() if line]


@pytest.mark.parametrize(("ratio", "low", "high"), [("0", 0, 0), ("1", 200, 200), ("0.5", 60, 140)])
def test_sampling_ratio_is_configurable_and_follows_the_parent(tmp_path: Path, ratio: str, low: int, high: int) -> None:
    run_script({"TESSERA_TRACE_EXPORTER": "jsonl", "TESSERA_TRACE_DIR": str(tmp_path),
                "TESSERA_TRACE_SAMPLE_RATIO": ratio})
    spans = spans_in(tmp_path)
    roots = sum(1 for s in spans if s["name"] == "root")
    assert low <= roots <= high
    # Parent-based: a client's sampled traceparent is always honoured, an unsampled one never.
    assert sum(1 for s in spans if s["name"] == "child-of-01") == 20
    assert sum(1 for s in spans if s["name"] == "child-of-00") == 0
    assert all(s["trace_id"] == f"{int(s['parent_span_id'], 16):032x}" for s in spans if s["name"] == "child-of-01")


def test_no_exporter_writes_nothing(tmp_path: Path) -> None:
    run_script({"TESSERA_TRACE_EXPORTER": "none", "TESSERA_TRACE_DIR": str(tmp_path)}, roots=5)
    assert not list(tmp_path.iterdir())


class _Collector(BaseHTTPRequestHandler):
    received: list[bytes] = []

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length", 0))
        _Collector.received.append(self.path.encode() + b"|" + self.rfile.read(length))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def http_collector() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Collector.received = []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    server.shutdown()


def _span_names(payloads: list[bytes]) -> set[str]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    names = set()
    for payload in payloads:
        request = ExportTraceServiceRequest.FromString(payload)
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                names.update(s.name for s in scope_spans.spans)
    return names


def test_otlp_http_exporter_posts_to_the_collector_url(http_collector: str) -> None:
    run_script({"TESSERA_TRACE_EXPORTER": "otlp-http", "TESSERA_OTLP_ENDPOINT": http_collector,
                "TESSERA_TRACE_SAMPLE_RATIO": "1"}, roots=3)
    assert _Collector.received and all(p.startswith(b"/v1/traces|") for p in _Collector.received)
    assert {"root", "child-of-01"} <= _span_names([p.split(b"|", 1)[1] for p in _Collector.received])


def test_otlp_grpc_exporter_reaches_the_collector_address() -> None:
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list[bytes] = []

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: object, context: object) -> object:  # the gRPC method name
            received.append(request.SerializeToString())  # type: ignore[attr-defined]
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        run_script({"TESSERA_TRACE_EXPORTER": "otlp-grpc", "TESSERA_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                    "TESSERA_TRACE_SAMPLE_RATIO": "1"}, roots=3)
    finally:
        server.stop(grace=None)
    assert {"root", "child-of-01"} <= _span_names(received)
