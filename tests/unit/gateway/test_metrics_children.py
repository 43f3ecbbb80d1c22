"""GatewayMetrics.completed tallies a request in the worker and ``flush`` writes the tallies through children
bound once per tenant: the series read as observing each request would (counts, token sums, histogram
buckets), nothing shows before the flush, and a tenant past the cap still counts."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tessera.gateway import metrics as gateway_metrics
from tessera.gateway.metrics import GatewayMetrics, HistogramTally


def _samples(m: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(m.render()[0].decode()) for s in family.samples}


def test_completed_counts_through_bound_children() -> None:
    m = GatewayMetrics()
    m.completed("acme", 16, 0.04, 0.02)
    m.completed("acme", 8, 0.3, None)
    m.completed("beta", 1, 0.004, 0.003)
    samples = _samples(m)
    assert samples[("tessera_gateway_requests_total", (("tenant", "acme"),))] == 2
    assert samples[("tessera_gateway_completion_tokens_total", (("tenant", "acme"),))] == 24
    assert samples[("tessera_gateway_request_seconds_count", (("tenant", "acme"),))] == 2
    assert samples[("tessera_gateway_request_seconds_bucket", (("le", "0.05"), ("tenant", "acme")))] == 1
    assert samples[("tessera_gateway_request_seconds_bucket", (("le", "0.5"), ("tenant", "acme")))] == 2
    assert samples[("tessera_gateway_ttft_seconds_count", (("tenant", "acme"),))] == 1
    assert samples[("tessera_gateway_requests_total", (("tenant", "beta"),))] == 1


def test_past_the_cap_the_children_are_bound_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway_metrics, "MAX_BOUND_TENANTS", 2)
    m = GatewayMetrics()
    for tenant in ("a", "b", "c", "a"):
        m.completed(tenant, 1, 0.01)
    samples = _samples(m)
    assert samples[("tessera_gateway_requests_total", (("tenant", "a"),))] == 2
    assert samples[("tessera_gateway_requests_total", (("tenant", "c"),))] == 1
    assert len(m._completed_children) <= 2


def test_nothing_is_written_until_the_flush() -> None:
    m = GatewayMetrics()
    m.completed("acme", 16, 0.04, 0.02)
    assert "acme" not in generate_latest(m.registry).decode()  # tallied in the worker only
    m.flush()
    assert 'tessera_gateway_requests_total{tenant="acme"} 1.0' in generate_latest(m.registry).decode()
    m.flush()  # nothing new: the counts stay
    assert 'tessera_gateway_requests_total{tenant="acme"} 1.0' in generate_latest(m.registry).decode()


def test_a_tally_written_at_once_reads_as_each_value_observed() -> None:
    """Pins the prometheus_client layout the tally writes through (a child's _upper_bounds, _buckets, _sum):
    values on the bucket bounds, between them, past the last, and zero, observed one by one into one
    registry and tallied into another, render the same text."""
    buckets = (0.01, 0.05, 0.1, 1.0)
    one_by_one, tallied = CollectorRegistry(), CollectorRegistry()
    direct = Histogram("h_seconds", "h", ["t"], registry=one_by_one, buckets=buckets).labels("x")
    child = Histogram("h_seconds", "h", ["t"], registry=tallied, buckets=buckets).labels("x")
    tally = HistogramTally(tuple(child._upper_bounds))
    rng = random.Random(0)
    values = [0.0, 0.01, 0.05, 0.1, 1.0, 2.5, *(rng.uniform(0, 1.2) for _ in range(200))]
    for value in values:
        direct.observe(value)
        tally.add(value)
    tally.write_to(child)

    def samples(registry: CollectorRegistry) -> list[str]:
        return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]

    assert samples(tallied) == samples(one_by_one)
    # A bound is inclusive: 0.01 counts in le=0.01, 0.05 in le=0.05.
    bounds_only = CollectorRegistry()
    child = Histogram("b_seconds", "b", ["t"], registry=bounds_only, buckets=buckets).labels("x")
    tally = HistogramTally(tuple(child._upper_bounds))
    for value in (0.01, 0.05, 0.06):
        tally.add(value)
    tally.write_to(child)
    assert {'b_seconds_bucket{le="0.01",t="x"} 1.0', 'b_seconds_bucket{le="0.05",t="x"} 2.0',
            'b_seconds_bucket{le="0.1",t="x"} 3.0', 'b_seconds_count{t="x"} 3.0'} <= set(samples(bounds_only))
