"""One owner for serveConfigV2 (issue #14): with the operator enabled the chart renders its models as Model
objects and no serveConfigV2, so a `helm upgrade` (Helm's three-way merge, tests/support/helm_upgrade.py)
never drops an application; the operator's handlers, against a real Redis, keep every Model's application
through install, upgrade and reconcile."""

from __future__ import annotations

import copy
from typing import Any

import kopf
import yaml

from tessera_operators.operator import handlers
from tests.integration.operator.test_operator_handlers import LLAMA, Resource
from tests.support.chart import find, render
from tests.support.fake_kube import NAMESPACE, RAY_SERVICE, FakeKube
from tests.support.helm_upgrade import helm_upgrade

JSON = dict[str, Any]


def _values(replicas: int, sample_ratio: float) -> JSON:
    return {
        "models": [
            {"name": "small", "replicas": replicas,
             "engine": {"model": "pvc://weights/small", "servedModelName": "small"}},
            {"name": "qwen", "engine": {"model": "/models/qwen", "servedModelName": "qwen"}},
        ],
        "telemetry": {"sampleRatio": sample_ratio},
        "rayService": {"engineWorkers": {"gpusPerPod": 4}},
    }


def _applications(kube: FakeKube) -> dict[str, JSON]:
    text = kube.ray_services[(NAMESPACE, RAY_SERVICE)]["spec"].get("serveConfigV2") or ""
    return {a["name"]: a for a in (yaml.safe_load(text) or {}).get("applications", [])}


def _models(docs: list[JSON]) -> dict[str, Resource]:
    return {d["metadata"]["name"]: Resource("Model", d["metadata"]["name"], d["spec"])
            for d in docs if d["kind"] == "Model"}


async def test_helm_upgrade_keeps_every_models_application(memo: kopf.Memo, kube: FakeKube) -> None:
    # helm install: the RayService without serveConfigV2, and the values' models as Model objects.
    installed = render(_values(replicas=1, sample_ratio=1.0))
    ray_service = find(installed, "RayService")
    assert ray_service["metadata"]["name"] == RAY_SERVICE and "serveConfigV2" not in ray_service["spec"]
    kube.put_ray_service(ray_service)
    models = _models(installed)
    assert set(models) == {"small", "qwen"}
    # A Model applied with kubectl, which the values know nothing about.
    models["llama-3-8b"] = Resource("Model", "llama-3-8b", LLAMA)
    for model in models.values():
        await model.run(handlers.model_create, memo)
    assert set(_applications(kube)) == {"small", "qwen", "llama-3-8b"}
    assert _applications(kube)["small"]["args"]["engine"]["model"] == "/mnt/pvc/weights/small"

    # helm upgrade: a telemetry change (lands in the pods' env) and more replicas of one model.
    upgraded = render(_values(replicas=3, sample_ratio=0.5))
    live = kube.ray_services[(NAMESPACE, RAY_SERVICE)]
    kube.put_ray_service(helm_upgrade(ray_service, find(upgraded, "RayService"), live))
    # The upgrade itself dropped nothing: no reconcile has run yet.
    assert set(_applications(kube)) == {"small", "qwen", "llama-3-8b"}
    env = kube.ray_services[(NAMESPACE, RAY_SERVICE)]["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert {"name": "TESSERA_TRACE_SAMPLE_RATIO", "value": "0.5"} in env["template"]["spec"]["containers"][0]["env"]

    # kopf then sees the changed Model spec (helm patched the object) and runs its periodic reconcile.
    new_small = _models(upgraded)["small"]
    models["small"].change(new_small.spec)
    await models["small"].run(handlers.model_update, memo)
    for model in models.values():
        await model.run(handlers.model_reconcile, memo)
    applications = _applications(kube)
    assert set(applications) == {"small", "qwen", "llama-3-8b"}
    assert applications["small"]["args"]["replicas"] == 3
    assert applications["llama-3-8b"]["args"] == {"engine": LLAMA["engine"], "replicas": 2}


async def test_the_one_upgrade_from_a_chart_owned_serve_config_is_repaired_by_the_reconcile(
    memo: kopf.Memo, kube: FakeKube
) -> None:
    """From a release whose chart rendered serveConfigV2 (operator disabled, or a chart before #14), Helm's
    three-way merge deletes the field once; the operator puts every Model's application back."""
    before = render({**_values(replicas=1, sample_ratio=1.0), "operator": {"enabled": False}})
    old_ray_service = find(before, "RayService")
    assert "serveConfigV2" in old_ray_service["spec"]
    kube.put_ray_service(old_ray_service)
    after = render(_values(replicas=1, sample_ratio=1.0))
    live = copy.deepcopy(kube.ray_services[(NAMESPACE, RAY_SERVICE)])
    kube.put_ray_service(helm_upgrade(old_ray_service, find(after, "RayService"), live))
    assert _applications(kube) == {}
    for model in _models(after).values():
        await model.run(handlers.model_create, memo)  # the upgrade created the Model objects
    assert set(_applications(kube)) == {"small", "qwen"}
