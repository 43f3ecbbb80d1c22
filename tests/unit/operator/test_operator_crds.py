"""The Tenant and Model CRDs: structural schemas (the API server's rule) that reject invalid objects."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tessera_operators.operator.crds import build_model_crd, build_tenant_crd, validation_schema

CRD_DIR = Path(__file__).resolve().parents[3] / "helm" / "tessera" / "crds"


def _validator(crd: dict[str, Any]) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(validation_schema(crd))


TENANT = _validator(build_tenant_crd())
MODEL = _validator(build_model_crd())

GOOD_TENANT: dict[str, Any] = {
    "apiVersion": "tessera.dev/v1alpha1",
    "kind": "Tenant",
    "metadata": {"name": "team-a"},
    "spec": {
        "policy": {
            "requestsPerMinute": 600,
            "tokensPerMinute": 200000,
            "priorityClass": "high",
            "kvQuota": 0.5,
            "allowedModels": ["llama-3-8b"],
            "maxPromptTokens": None,
        },
        "keyGeneration": 0,
    },
}
GOOD_MODEL: dict[str, Any] = {
    "apiVersion": "tessera.dev/v1alpha1",
    "kind": "Model",
    "metadata": {"name": "llama-3-8b"},
    "spec": {
        "replicas": 2,
        "engine": {
            "model": "/models/llama-3-8b",
            "kvCacheDtype": "fp8",
            "tensorParallelSize": 2,
            "speculative": {"method": "ngram", "numSpeculativeTokens": 3},
            "numGpuBlocksOverride": None,
        },
    },
}


def _errors(validator: jsonschema.Draft202012Validator, obj: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator.iter_errors(obj)]


def test_committed_crds_are_the_built_ones() -> None:
    for path, build in (
        (CRD_DIR / "tessera.dev_tenants.yaml", build_tenant_crd),
        (CRD_DIR / "tessera.dev_models.yaml", build_model_crd),
    ):
        assert yaml.safe_load(path.read_text()) == build(), (
            f"{path.name} is stale: run scripts/gen_chart_schema.py"
        )


def _structural_problems(node: Any, where: str = "") -> list[str]:
    problems: list[str] = []
    if isinstance(node, dict):
        preserve = node.get("x-kubernetes-preserve-unknown-fields") or node.get("x-kubernetes-int-or-string")
        if "type" not in node and not preserve:
            problems.append(f"{where or '/'}: no type")
        if "properties" in node and "additionalProperties" in node:
            problems.append(f"{where}: properties and additionalProperties together")
        for bad in ("$ref", "anyOf", "oneOf", "allOf", "const", "title", "default"):
            if bad in node:
                problems.append(f"{where}: {bad} is not allowed here")
        if isinstance(node.get("type"), list) or node.get("type") == "null":
            problems.append(f"{where}: type must be one string")
        for key, sub in (node.get("properties") or {}).items():
            problems.extend(_structural_problems(sub, f"{where}/{key}"))
        if isinstance(node.get("items"), dict):
            problems.extend(_structural_problems(node["items"], f"{where}/items"))
    return problems


@pytest.mark.parametrize("build", [build_tenant_crd, build_model_crd])
def test_schemas_are_structural(build: Any) -> None:
    crd = build()
    (version,) = crd["spec"]["versions"]
    assert version["served"] and version["storage"] and version["subresources"] == {"status": {}}
    assert _structural_problems(version["schema"]["openAPIV3Schema"]) == []


def test_valid_objects_pass() -> None:
    assert _errors(TENANT, GOOD_TENANT) == []
    assert _errors(MODEL, GOOD_MODEL) == []
    assert _errors(TENANT, {**GOOD_TENANT, "spec": {}}) == [], "an empty policy means the defaults"


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"policy": {"requestsPerMinute": 0}}, "spec/policy/requestsPerMinute"),
        ({"policy": {"requestsPerMinute": "600"}}, "spec/policy/requestsPerMinute"),
        ({"policy": {"priorityClass": "urgent"}}, "spec/policy/priorityClass"),
        ({"policy": {"kvQuota": 0}}, "spec/policy/kvQuota"),
        ({"policy": {"kvQuota": 1.5}}, "spec/policy/kvQuota"),
        ({"policy": {"maxN": 17}}, "spec/policy/maxN"),
        ({"policy": {"requestsPerMinut": 1}}, "spec/policy"),
        ({"keyGeneration": -1}, "spec/keyGeneration"),
        ({"secretName": "Not_A_Name"}, "spec/secretName"),
        ({"keyz": 1}, "spec"),
    ],
)
def test_invalid_tenants_are_rejected(change: dict[str, Any], where: str) -> None:
    obj = copy.deepcopy(GOOD_TENANT)
    obj["spec"] = change
    errors = _errors(TENANT, obj)
    assert errors and all(e.startswith(where) for e in errors), errors


@pytest.mark.parametrize(
    ("engine", "where"),
    [
        ({"kvCacheDtype": "fp8"}, "spec/engine"),  # model is required
        ({"model": "/m", "kvCacheDtype": "int4"}, "spec/engine/kvCacheDtype"),
        ({"model": "/m", "tensorParallelSize": 0}, "spec/engine/tensorParallelSize"),
        ({"model": "/m", "gpuMemoryUtilization": 0}, "spec/engine/gpuMemoryUtilization"),
        ({"model": "/m", "gpuMemoryUtilization": 1.2}, "spec/engine/gpuMemoryUtilization"),
        ({"model": "/m", "speculative": {"method": "medusa"}}, "spec/engine/speculative/method"),
        (
            {"model": "/m", "speculative": {"numSpeculativeTokens": 32}},
            "spec/engine/speculative/numSpeculativeTokens",
        ),
        ({"model": "/m", "kvEvents": {"enabled": "yes"}}, "spec/engine/kvEvents/enabled"),
        ({"model": "/m", "maxNumSeq": 8}, "spec/engine"),
    ],
)
def test_invalid_models_are_rejected(engine: dict[str, Any], where: str) -> None:
    obj = copy.deepcopy(GOOD_MODEL)
    obj["spec"]["engine"] = engine
    errors = _errors(MODEL, obj)
    assert errors and all(e.startswith(where) for e in errors), errors


def test_model_needs_engine_and_positive_replicas() -> None:
    assert _errors(MODEL, {**GOOD_MODEL, "spec": {"replicas": 1}})
    assert _errors(MODEL, {**GOOD_MODEL, "spec": {**GOOD_MODEL["spec"], "replicas": 0}})
    assert _errors(MODEL, {**GOOD_MODEL, "spec": None})


def test_status_keeps_unknown_fields_for_kopf() -> None:
    obj = {**GOOD_TENANT, "status": {"phase": "Ready", "kopf": {"progress": {}}}}
    assert _errors(TENANT, obj) == []
    assert _errors(TENANT, {**GOOD_TENANT, "status": {"phase": "Sleeping"}})
