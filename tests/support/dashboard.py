"""The metric names the Grafana dashboard's PromQL expressions query (helm/tessera/dashboards/tessera.json)."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "tessera" / "dashboards" / "tessera.json"
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
                "unless"}


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


def dashboard_metric_names() -> set[str]:
    return {name for expr in expressions(json.loads(DASHBOARD.read_text())) for name in metric_names(expr)}
