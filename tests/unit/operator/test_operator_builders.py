"""The operator's pure builders on hand-made Tenant and Model specs."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from tessera.tenancy.keys import new_key
from tessera_operators.operator.builders import (
    OWNED_APPLICATIONS_ANNOTATION,
    ApplicationOwnedElsewhereError,
    build_model_status,
    build_serve_application,
    build_serve_config_patch,
    build_tenant_secret,
    build_tenant_status,
    is_operator_secret,
    owner_reference,
    parse_model,
    parse_tenant,
    secret_key_material,
)

TENANT_BODY: dict[str, Any] = {
    "apiVersion": "tessera.dev/v1alpha1",
    "kind": "Tenant",
    "metadata": {"name": "team-a", "namespace": "llm", "uid": "0b6c-uid", "generation": 1},
    "spec": {"policy": {"requestsPerMinute": 60, "priorityClass": "high", "kvQuota": 0.25}},
}


def test_parse_tenant_reads_policy_and_defaults() -> None:
    tenant = parse_tenant("team-a", TENANT_BODY["spec"])
    assert tenant.policy.requests_per_minute == 60
    assert tenant.policy.priority_class == "high" and tenant.policy.kv_quota == 0.25
    assert tenant.secret_name == "tessera-tenant-team-a"
    assert tenant.key_generation == 0
    custom = parse_tenant("team-a", {"secretName": "keys-a", "keyGeneration": 2})
    assert custom.secret_name == "keys-a" and custom.key_generation == 2
    assert custom.policy.priority_class == "normal"


@pytest.mark.parametrize(
    ("name", "spec"),
    [
        ("Team_A", {}),
        ("team-a", {"policy": {"requestsPerMinute": 0}}),
        ("team-a", {"policy": {"priorityClass": "urgent"}}),
        ("team-a", {"policy": {"requestsPerMinut": 60}}),
        ("team-a", {"policy": {"requestsPerMinute": "60"}}),
        ("team-a", {"keyGeneration": -1}),
    ],
)
def test_parse_tenant_rejects_invalid_specs(name: str, spec: dict[str, Any]) -> None:
    with pytest.raises((ValueError, ValidationError)):
        parse_tenant(name, spec)


def test_tenant_secret_holds_the_key_and_is_owned_by_the_tenant() -> None:
    tenant = parse_tenant("team-a", TENANT_BODY["spec"])
    key = new_key()
    secret = build_tenant_secret("llm", tenant, key, owner=owner_reference(TENANT_BODY))
    assert secret["metadata"]["name"] == "tessera-tenant-team-a" and secret["metadata"]["namespace"] == "llm"
    assert base64.b64decode(secret["data"]["api-key"]).decode() == key.plaintext
    assert base64.b64decode(secret["data"]["key-id"]).decode() == key.key_id
    assert secret["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "tessera.dev/v1alpha1",
            "kind": "Tenant",
            "name": "team-a",
            "uid": "0b6c-uid",
            "controller": True,
            "blockOwnerDeletion": False,
        }
    ]
    assert is_operator_secret(secret, "team-a") and not is_operator_secret(secret, "team-b")
    material = secret_key_material(secret)
    assert material is not None and material.key_id == key.key_id and material.plaintext == key.plaintext


def test_secret_key_material_tolerates_missing_or_foreign_data() -> None:
    assert secret_key_material(None) is None
    assert secret_key_material({"data": {}}) is None
    assert secret_key_material({"data": {"api-key": "not base64!"}}) is None
    garbage = base64.b64encode(b"not-a-tessera-key").decode()
    assert secret_key_material({"data": {"api-key": garbage}}) is None


def test_statuses() -> None:
    assert build_tenant_status("Ready", generation=3, key_id="abc", key_generation=1, secret_name="s") == {
        "phase": "Ready",
        "message": "",
        "observedGeneration": 3,
        "keyId": "abc",
        "keyGeneration": 1,
        "secretName": "s",
    }
    assert build_model_status("Applied", ray_service="rs", application="m") == {
        "phase": "Applied",
        "message": "",
        "rayService": "rs",
        "application": "m",
    }


MODEL_SPEC: dict[str, Any] = {
    "replicas": 2,
    "engine": {
        "model": "/models/llama-3-8b",
        "servedModelName": "llama-3-8b",
        "kvCacheDtype": "fp8",
        "speculative": {
            "method": "eagle",
            "draftModel": "/models/eagle-llama-3-8b",
            "numSpeculativeTokens": 4,
        },
    },
}


def test_parse_model_validates_with_engine_config() -> None:
    model = parse_model("llama-3-8b", MODEL_SPEC)
    assert model.replicas == 2
    assert model.engine.speculative is not None and model.engine.speculative.method == "eagle"
    assert model.engine_values == MODEL_SPEC["engine"]


@pytest.mark.parametrize(
    ("name", "spec"),
    [
        ("llama.3", MODEL_SPEC),
        ("m", {"replicas": 1}),
        ("m", {"replicas": 0, "engine": {"model": "/m"}}),
        ("m", {"engine": {"model": "/m", "speculative": {"method": "eagle"}}}),
        ("m", {"engine": {"model": "/m", "kvCacheDtyp": "fp8"}}),
        ("m", {"engine": {"model": "/m", "numGpuBlocksOverride": 4}}),
        ("m", {"replicas": True, "engine": {"model": "/m"}}),
        ("m", {"engine": {"model": "/m", "autoscaling": {"minReplicas": 3, "maxReplicas": 2}}}),
    ],
)
def test_parse_model_rejects_invalid_specs(name: str, spec: dict[str, Any]) -> None:
    with pytest.raises((ValueError, ValidationError)):
        parse_model(name, spec)


def test_autoscaled_model_has_no_fixed_count_and_is_ready_at_its_floor() -> None:
    engine = {"model": "/m", "autoscaling": {"minReplicas": 2, "maxReplicas": 5}}
    model = parse_model("m", {"engine": engine})
    assert model.replicas is None and model.wanted_replicas == 2
    assert build_serve_application("m", model.engine_values, model.replicas)["args"] == {"engine": engine}
    fixed = parse_model("m", {"engine": {"model": "/m"}})
    assert fixed.replicas == 1 and fixed.wanted_replicas == 1
    with pytest.raises(ValueError, match=r"spec\.replicas=2 and spec\.engine\.autoscaling are mutually exclusive"):
        parse_model("m", {"replicas": 2, "engine": engine})


def _ray_service(applications: list[dict[str, Any]], owned: list[str] | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": "tessera-engine", "resourceVersion": "41"}
    if owned is not None:
        metadata["annotations"] = {OWNED_APPLICATIONS_ANNOTATION: json.dumps(owned)}
    return {"metadata": metadata, "spec": {"serveConfigV2": yaml.safe_dump({"applications": applications})}}


def test_serve_patch_adds_an_application_and_records_ownership() -> None:
    from_values = build_serve_application("tessera-small", {"model": "/models/s"}, 1)
    ray_service = _ray_service([from_values])
    app = build_serve_application("llama-3-8b", MODEL_SPEC["engine"], 2)
    patch = build_serve_config_patch(ray_service, upsert=app)
    assert patch is not None
    assert patch["metadata"]["resourceVersion"] == "41"
    assert json.loads(patch["metadata"]["annotations"][OWNED_APPLICATIONS_ANNOTATION]) == ["llama-3-8b"]
    applications = yaml.safe_load(patch["spec"]["serveConfigV2"])["applications"]
    assert applications == [from_values, app], "the values' application is kept, the Model's appended"


def test_serve_patch_is_none_when_already_applied() -> None:
    app = build_serve_application("llama-3-8b", MODEL_SPEC["engine"], 2)
    assert build_serve_config_patch(_ray_service([app], owned=["llama-3-8b"]), upsert=app) is None


def test_serve_patch_replaces_a_changed_application() -> None:
    old = build_serve_application("llama-3-8b", MODEL_SPEC["engine"], 1)
    new = build_serve_application("llama-3-8b", MODEL_SPEC["engine"], 3)
    patch = build_serve_config_patch(_ray_service([old], owned=["llama-3-8b"]), upsert=new)
    assert patch is not None
    assert yaml.safe_load(patch["spec"]["serveConfigV2"])["applications"] == [new]


def test_serve_patch_never_takes_over_a_values_application() -> None:
    from_values = build_serve_application("llama-3-8b", {"model": "/m"}, 1)
    with pytest.raises(ApplicationOwnedElsewhereError, match="Helm values"):
        build_serve_config_patch(
            _ray_service([from_values]), upsert=build_serve_application("llama-3-8b", {}, 1)
        )


def test_serve_patch_removes_only_its_own_application() -> None:
    mine = build_serve_application("mine", {"model": "/m"}, 1)
    theirs = build_serve_application("theirs", {"model": "/t"}, 1)
    ray_service = _ray_service([theirs, mine], owned=["mine"])
    patch = build_serve_config_patch(ray_service, remove="mine")
    assert patch is not None
    assert yaml.safe_load(patch["spec"]["serveConfigV2"])["applications"] == [theirs]
    assert json.loads(patch["metadata"]["annotations"][OWNED_APPLICATIONS_ANNOTATION]) == []
    assert build_serve_config_patch(ray_service, remove="theirs") is None
    assert build_serve_config_patch(_ray_service([]), remove="mine") is None


def test_serve_patch_starts_from_an_empty_serve_config() -> None:
    app = build_serve_application("m", {"model": "/m"}, 1)
    patch = build_serve_config_patch({"metadata": {}, "spec": {}}, upsert=app)
    assert patch is not None and "resourceVersion" not in patch["metadata"]
    assert yaml.safe_load(patch["spec"]["serveConfigV2"]) == {"applications": [app]}
    with pytest.raises(ValueError, match="exactly one"):
        build_serve_config_patch({}, upsert=app, remove="m")
