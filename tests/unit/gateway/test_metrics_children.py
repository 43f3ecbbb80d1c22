"""GatewayMetrics.completed writes through children bound once per tenant: the series read as before (counts,
token sums, histogram buckets) and a tenant past the cap still counts."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tessera.gateway import metrics as gateway_metrics
from tessera.gateway.metrics import GatewayMetrics


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
