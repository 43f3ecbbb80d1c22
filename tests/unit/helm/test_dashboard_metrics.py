"""Every Grafana panel queries metrics the code emits: the names in the dashboard's PromQL expressions
against the metric families the gateway and the KV-eviction controller register."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from tessera.gateway.metrics import GatewayMetrics
from tessera_operators.kvcontrol.metrics import ControllerMetrics

DASHBOARD = Path(__file__).resolve().parents[3] / "helm" / "tessera" / "dashboards" / "tessera.json"
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
                "unless"}
# The sample names a metric family exports (a counter's _total, a histogram's _bucket/_sum/_count).
SAMPLE_SUFFIXES = ("", "_total", "_created", "_bucket", "_sum", "_count")


def expressions(node: object) -> list[str]:
    if isinstance(node, dict):
        own = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return own + [e for value in node.values() for e in expressions(value)]
    if isinstance(node, list):
        return [e for item in node for e in expressions(item)]
    return []


def metric_names(expr: str) -> set[str]:
    """The metric names of a PromQL expression: identifiers that are not functions, keywords, label names
    (inside {} or a by/without clause), ranges or numbers."""
    text = re.sub(r'"[^"]*"', "", expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        following = text[match.end():].lstrip()[:1]
        if following != "(" and match.group() not in PROMQL_WORDS:
            names.add(match.group())
    return names


def emitted(*registries: CollectorRegistry) -> set[str]:
    families = {family.name for registry in registries for family in registry.collect()}
    return {family + suffix for family in families for suffix in SAMPLE_SUFFIXES}


def test_metric_names_of_an_expression() -> None:
    expr = 'histogram_quantile(0.99, sum by (le, tenant) (rate(a_bucket{tenant=~"$t"}[$__rate_interval]))) / b'
    assert metric_names(expr) == {"a_bucket", "b"}


def test_every_panel_queries_a_metric_the_code_emits() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = expressions(dashboard)
    assert exprs, "no PromQL expressions found"
    known = emitted(GatewayMetrics().registry, ControllerMetrics().registry)
    missing = {(name, expr) for expr in exprs for name in metric_names(expr) if name not in known}
    assert not missing, f"dashboard metrics no code emits: {sorted(missing)}"
