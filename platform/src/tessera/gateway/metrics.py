"""Prometheus metrics of the gateway: each worker's series, and the listener that serves them.

The series name tenants, so they are served on a port of their own (``tessera gateway --metrics-port``, the
chart's ``gateway.metricsPort``), which only the scrapers reach; the API port answers 404 for ``/metrics``.
A connection to that port reaches ``metrics_app`` and nothing else (``connection_limits.py`` picks the app
by the port a connection came to). It sums every worker's samples (prometheus_client's multiprocess mode,
which ``launch.py`` sets up before the workers start).

A request's completion is tallied in the worker (``completed``: a few additions) and written to the series
on the worker's server tick (``flush``, every two seconds: lean_server.py), one write per series and tenant
whatever the number of requests. Written per request, each of its six values (two counters, two histograms'
bucket and sum) took the multiprocess value's lock and a ``getpid`` system call to notice a fork: 5-6 % of a
streamed request's samples in profiles of the gateway (docs/performance.md section 9). A scrape therefore sees
a worker's completions up to one tick late; the worker flushes what is left when it shuts down.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tessera.asgi import Receive, Scope, Send, send_response
from tessera.gateway.errors import APIError
from tessera.telemetry import gc_heap

# Tenants whose series children ``GatewayMetrics.flush`` keeps bound (all forgotten at once past it).
MAX_BOUND_TENANTS = 10_000
LATENCY_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)
# Where the app leaves what the server's tick flushes in the lifespan state (lean_server.py): this module's
# ``GatewayMetrics.flush``, and the request spans' lines (app.py ``Gateway._each_tick``).
FLUSH_STATE_KEY = "tessera.metrics_flush"


@dataclass(slots=True)
class HistogramTally:
    """Observations of one histogram child not yet written: a count per bucket and their sum.

    ``write_to`` adds them to the child as its own ``observe`` would have, one by one (a value goes to the
    first bucket whose upper bound is at or above it; the child's count is its buckets' sum), with one write
    per touched bucket. It reaches into prometheus_client's ``Histogram`` child (``_upper_bounds``,
    ``_buckets``, ``_sum``), which has no call for many observations at once;
    tests/unit/gateway/test_metrics_children.py renders both ways and fails if that layout changes."""

    upper_bounds: tuple[float, ...]  # the child's, +Inf last
    counts: list[int] = field(init=False)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.upper_bounds)

    def add(self, value: float) -> None:
        self.total += value
        self.counts[bisect.bisect_left(self.upper_bounds, value)] += 1

    def write_to(self, child: Any) -> None:
        if not any(self.counts):
            return
        child._sum.inc(self.total)
        for bucket, count in zip(child._buckets, self.counts, strict=True):
            if count:
                bucket.inc(count)


@dataclass(slots=True)
class CompletionTally:
    """One tenant's completions since the last flush."""

    latency: HistogramTally
    ttft: HistogramTally
    requests: int = 0
    tokens: int = 0


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("tessera_gateway_requests_total", "Completed generation requests",
                                ["tenant"], registry=self.registry)
        self.tokens = Counter("tessera_gateway_completion_tokens_total", "Completion tokens streamed",
                              ["tenant"], registry=self.registry)
        self.rejections = Counter("tessera_gateway_rejections_total", "Admission rejections (429)",
                                  ["tenant", "limit"], registry=self.registry)
        self.fail_open_total = Counter("tessera_gateway_fail_open_total",
                                       "Requests admitted without Redis (fail-open mode)", ["tenant"],
                                       registry=self.registry)
        self.latency = Histogram("tessera_gateway_request_seconds", "Request latency, seconds", ["tenant"],
                                 registry=self.registry,
                                 buckets=LATENCY_BUCKETS_S)
        self.ttft = Histogram("tessera_gateway_ttft_seconds", "Time to first token as the gateway relays it, "
                              "seconds (request start to the first delta from the engine)", ["tenant"],
                              registry=self.registry,
                              buckets=TTFT_BUCKETS_S)
        self._latency_bounds = (*map(float, LATENCY_BUCKETS_S), float("inf"))
        self._ttft_bounds = (*map(float, TTFT_BUCKETS_S), float("inf"))

        # tenant -> its children of the four series ``flush`` writes: ``labels()`` looks a child up under a
        # lock with its label values checked and stringified.
        self._completed_children: dict[str, tuple[Any, Any, Any, Any]] = {}
        self._pending: dict[str, CompletionTally] = {}

    def completed(self, tenant: str, tokens: int, seconds: float, ttft_s: float | None = None) -> None:
        """Tallies one request's completion; the series show it at the next ``flush``."""
        tally = self._pending.get(tenant)
        if tally is None:
            tally = self._pending[tenant] = CompletionTally(HistogramTally(self._latency_bounds),
                                                            HistogramTally(self._ttft_bounds))
        tally.requests += 1
        tally.tokens += tokens
        tally.latency.add(seconds)
        if ttft_s is not None:
            tally.ttft.add(max(0.0, ttft_s))

    def flush(self) -> None:
        """Writes the completions tallied since the last call to the series (the server's tick calls it)."""
        if not self._pending:
            return  # an idle tick: nothing to write, nothing to allocate
        pending, self._pending = self._pending, {}
        for tenant, tally in pending.items():
            children = self._completed_children.get(tenant)
            if children is None:
                if len(self._completed_children) >= MAX_BOUND_TENANTS:
                    self._completed_children.clear()
                children = self._completed_children[tenant] = (
                    self.requests.labels(tenant), self.tokens.labels(tenant), self.latency.labels(tenant),
                    self.ttft.labels(tenant))
            requests, completion_tokens, latency, ttft = children
            requests.inc(tally.requests)
            completion_tokens.inc(tally.tokens)
            tally.latency.write_to(latency)
            tally.ttft.write_to(ttft)

    def rejected(self, tenant: str, limit: str) -> None:
        self.rejections.labels(tenant, limit).inc()

    def fail_open(self, tenant: str) -> None:
        self.fail_open_total.labels(tenant).inc()

    def render(self) -> tuple[bytes, str]:
        """This process's metrics, what it has tallied included (a gateway built in a test); ``tessera
        gateway`` serves every worker's summed with ``metrics_app``."""
        self.flush()
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def gc_pause_exporter() -> Callable[[list[tuple[int, float]]], None]:
    """Where a worker's garbage-collector pauses go: a histogram written to the multiprocess directory, so
    ``/metrics`` sums every worker's, as it does the request series. It is fed from the worker's server tick
    with what ``gc_heap.GcPauses.take_pending`` kept, never from the collector's callback (the multiprocess
    values' lock, see gc_heap.GcPauses). Call it once the worker has frozen its heap: it also records how
    many objects that froze."""
    histogram = Histogram(gc_heap.METRIC_NAME, gc_heap.METRIC_HELP, ["generation"], registry=None,
                          buckets=gc_heap.PAUSE_BUCKETS_S)
    by_generation = [histogram.labels(str(generation)) for generation in range(3)]
    # Set once, when the worker has frozen its heap (lean_server.LeanServer.startup); summed over the workers.
    Gauge(gc_heap.FROZEN_METRIC_NAME, gc_heap.FROZEN_METRIC_HELP, registry=None,
          multiprocess_mode="livesum").set(gc_heap.frozen_objects())

    def export(pauses: list[tuple[int, float]]) -> None:
        for generation, pause_s in pauses:
            by_generation[generation].observe(pause_s)

    return export


def render_all_workers() -> bytes:
    """Every worker's samples, summed (the directory ``launch.py`` names in PROMETHEUS_MULTIPROC_DIR)."""
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, os.environ["PROMETHEUS_MULTIPROC_DIR"])
    return generate_latest(registry)


async def metrics_app(scope: Scope, receive: Receive, send: Send) -> None:
    """The metrics listener's ASGI app: ``GET /metrics``, 404 for anything else."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
        body = render_all_workers()
        await send_response(send, 200, body, [(b"content-type", CONTENT_TYPE_LATEST.encode()),
                                              (b"content-length", b"%d" % len(body))])
        return
    body = APIError(404, f"No route {scope['method']} {scope['path']} on the metrics port.", "not_found").body()
    await send_response(send, 404, body, [(b"content-type", b"application/json"),
                                          (b"content-length", b"%d" % len(body))])
