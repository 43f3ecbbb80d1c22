"""Synthetic runs for the analyzer's tests: a tenant's typical requests, one slow request, and helpers."""

from __future__ import annotations

from typing import Any

from tessera.telemetry.analyze import AnalysisOptions, Report, analyze_spans
from tessera.telemetry.causes import Attribution
from tessera.telemetry.spanfile import SpanRecord
from tests.support.spans_factory import Req

SLOW_AT = 20_000.0  # ms: the slow request comes after 20 typical ones, one per second


def typical(n: int = 20, tenant: str = "victim") -> list[dict[str, Any]]:
    return [s for i in range(n) for s in Req(tenant=tenant, start=i * 1000.0).spans()]


def report_of(dicts: list[dict[str, Any]], percentile: float = 99, metric: str = "ttft") -> Report:
    spans = [SpanRecord.from_dict(d) for d in dicts]
    return analyze_spans(spans, AnalysisOptions(percentile=percentile, metric=metric))  # type: ignore[arg-type]


def only_slow(slow: Req, extra: list[dict[str, Any]] | None = None, metric: str = "ttft",
              tenant: str = "victim") -> Attribution:
    """The one attribution of ``tenant`` when ``slow`` comes after its typical requests (plus ``extra`` spans)."""
    slow.start = SLOW_AT
    report = report_of(typical() + slow.spans() + (extra or []), metric=metric)
    (attribution,) = [a for a in report.attributions if a.timeline.tenant == tenant]
    return attribution
