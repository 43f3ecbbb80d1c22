"""values.schema.json: strict (unknown keys and wrong types fail with the field's path in the message), and
generated from the Python models, so the chart cannot drift from EngineConfig and TenantPolicy."""

from __future__ import annotations

import importlib.util
import json
from types import ModuleType
from typing import Any

import helm_python
import pytest
from tests.support.chart import CHART_DIR, REPO, render

from tessera.engine.config import EngineConfig


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_chart_schema", REPO / "scripts" / "gen_chart_schema.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _load_generator()


def _rejection(values: dict[str, Any]) -> str:
    with pytest.raises(helm_python.HelmValuesError) as caught:
        render(values)
    return str(caught.value)


def test_committed_files_equal_the_generated_ones() -> None:
    """Fails when EngineConfig, TenantPolicy or the chart's schema changed without re-running
    `python scripts/gen_chart_schema.py`."""
    stale = [str(p.relative_to(REPO)) for p in GEN.stale_files()]
    assert stale == [], f"stale generated files {stale}: run python scripts/gen_chart_schema.py"


def test_engine_schema_is_engine_config_schema() -> None:
    committed = json.loads((CHART_DIR / "values.schema.json").read_text())
    engine = committed["$defs"]["engine.EngineConfig"]
    assert set(engine["properties"]) == set(EngineConfig.model_json_schema(by_alias=True)["properties"])
    assert engine["required"] == ["model"]
    items = committed["properties"]["models"]["items"]
    assert items["properties"]["engine"] == {"$ref": "#/$defs/engine.EngineConfig"}


def _objects(node: Any, where: str = "#") -> list[tuple[str, dict[str, Any]]]:
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        if node.get("type") == "object" or (isinstance(node.get("type"), list) and "object" in node["type"]):
            found.append((where, node))
        for key, value in node.items():
            found.extend(_objects(value, f"{where}/{key}"))
    elif isinstance(node, list):
        for i, item in enumerate(node):
            found.extend(_objects(item, f"{where}/{i}"))
    return found


def test_every_object_in_the_schema_is_closed() -> None:
    """An object either lists its properties and forbids others, or is a map with typed values."""
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    for where, node in _objects(schema):
        extra = node.get("additionalProperties")
        if "properties" in node:
            assert extra is False, f"{where} accepts unknown keys"
        else:
            assert isinstance(extra, dict) and extra, f"{where} is an untyped map"


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"gateway": {"replica": 3}}, "replica"),
        ({"redis": {"mode": "bundled", "bundeld": {}}}, "bundeld"),
        ({"models": [{"name": "m", "engine": {"model": "/m", "kvCacheDtyp": "fp8"}}]}, "kvCacheDtyp"),
        (
            {"models": [{"name": "m", "engine": {"model": "/m", "speculative": {"numTokens": 2}}}]},
            "numTokens",
        ),
        ({"rayService": {"engineWorkers": {"gpuPerPod": 2}}}, "gpuPerPod"),
    ],
)
def test_a_typo_is_rejected_naming_the_field(values: dict[str, Any], field: str) -> None:
    message = _rejection(values)
    assert f"'{field}'" in message and "not allowed" in message, message


@pytest.mark.parametrize(
    ("values", "path"),
    [
        (
            {"models": [{"name": "m", "engine": {"model": "/m", "tensorParallelSize": "two"}}]},
            "/models/0/engine/tensorParallelSize",
        ),
        (
            {"models": [{"name": "m", "engine": {"model": "/m", "kvCacheDtype": "fp4"}}]},
            "/models/0/engine/kvCacheDtype",
        ),
        (
            {"models": [{"name": "m", "engine": {"model": "/m", "gpuMemoryUtilization": 1.5}}]},
            "/models/0/engine/gpuMemoryUtilization",
        ),
        (
            {"models": [{"name": "m", "engine": {"model": "/m", "speculative": {"method": "medusa"}}}]},
            "/models/0/engine/speculative",
        ),
        ({"models": [{"name": "m", "engine": {"servedModelName": "x"}}]}, "/models/0/engine"),
        ({"models": [{"name": "Bad_Name", "engine": {"model": "/m"}}]}, "/models/0/name"),
        ({"gateway": {"port": "8000"}}, "/gateway/port"),
        ({"redis": {"mode": "cluster"}}, "/redis/mode"),
        ({"redis": {"mode": "external"}}, "/redis/external/url"),
        ({"telemetry": {"traceExporter": "otlp-grpc"}}, "/telemetry/otlpEndpoint"),
        ({"image": {"digest": "sha256:abc"}}, "/image/digest"),
        ({"gateway": {"resources": {"limits": {"memory": []}}}}, "/gateway/resources/limits/memory"),
        (
            {"rayService": {"engineWorkers": {"tolerations": [{"key": "a", "operater": "Exists"}]}}},
            "/rayService/engineWorkers/tolerations/0",
        ),
    ],
)
def test_a_wrong_value_is_rejected_naming_the_field(values: dict[str, Any], path: str) -> None:
    message = _rejection(values)
    assert f"'{path}'" in message, message


def test_draft_model_rule_is_in_the_schema() -> None:
    """EAGLE without a draft model fails at the schema, naming the missing field."""
    message = _rejection(
        {"models": [{"name": "m", "engine": {"model": "/m", "speculative": {"method": "eagle"}}}]}
    )
    assert "draftModel" in message, message


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        (
            {"models": [{"name": "m", "engine": {"model": "/m", "tensorParallelSize": 2}}]},
            "tensorParallelSize=2 does not fit rayService.engineWorkers.gpusPerPod=1",
        ),
        (
            {"models": [{"name": "a", "engine": {"model": "/m"}}, {"name": "a", "engine": {"model": "/n"}}]},
            'the model name "a" is used twice',
        ),
        ({"rayService": {"engineWorkers": {"replicas": 9}}}, "replicas=9 must be within"),
        (
            {"redis": {"mode": "external", "external": {"url": "redis://:hunter2@redis:6379/0"}}},
            "must not carry credentials",
        ),
    ],
)
def test_template_checks_name_the_field(values: dict[str, Any], needle: str) -> None:
    with pytest.raises(helm_python.HelmRenderError) as caught:
        render(values)
    assert needle in str(caught.value), str(caught.value)
