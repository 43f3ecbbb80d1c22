"""Prometheus metrics of one gateway process."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


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
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))
        self.ttft = Histogram("tessera_gateway_ttft_seconds", "Time to first token as the gateway relays it, "
                              "seconds (request start to the first delta from the engine)", ["tenant"],
                              registry=self.registry,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))

    def completed(self, tenant: str, tokens: int, seconds: float, ttft_s: float | None = None) -> None:
        self.requests.labels(tenant).inc()
        self.tokens.labels(tenant).inc(tokens)
        self.latency.labels(tenant).observe(seconds)
        if ttft_s is not None:
            self.ttft.labels(tenant).observe(max(0.0, ttft_s))

    def rejected(self, tenant: str, limit: str) -> None:
        self.rejections.labels(tenant, limit).inc()

    def fail_open(self, tenant: str) -> None:
        self.fail_open_total.labels(tenant).inc()

    def render(self) -> tuple[bytes, str]:
        """This process's metrics, or, under ``tessera gateway`` (several workers), every worker's summed."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
