"""Autoscaling in the chart (templates/_autoscaling.tpl, ray-autoscaler.yaml): an autoscaled model has no
fixed count, the GPU check counts its maxReplicas, and KubeRay's in-tree autoscaler gets a restricted
container and an API identity that only it holds. The ci/autoscaling-values.yaml scenario also goes through
every check of the other chart tests (Kubernetes and KubeRay schemas, restricted PSS, build_app)."""

from __future__ import annotations

import re
from typing import Any

import helm_python
import pytest

from tests.support.chart import CHART_DIR, find, load_values, render, restricted_violations, serve_config

SCENARIO = CHART_DIR / "ci" / "autoscaling-values.yaml"
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
AUTOSCALED = {"model": "/models/m", "autoscaling": {"minReplicas": 1, "maxReplicas": 3}}


def _head(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = find(docs, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    return spec


def _head_as_kuberay_runs_it(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The head pod with the autoscaler container KubeRay adds from autoscalerOptions (ray-operator
    common/pod.go BuildAutoscalerContainer: name "autoscaler", the options' securityContext and mounts)."""
    options = find(docs, "RayService")["spec"]["rayClusterConfig"]["autoscalerOptions"]
    head = _head(docs)
    autoscaler = {"name": "autoscaler", "securityContext": options["securityContext"],
                  "resources": options["resources"], "volumeMounts": options["volumeMounts"]}
    return {**head, "containers": [*head["containers"], autoscaler]}


def _fails(values: dict[str, Any]) -> str:
    with pytest.raises((helm_python.HelmValuesError, helm_python.HelmRenderError)) as failure:
        render(values)
    return str(failure.value)


def test_the_scenario_autoscales_one_model_and_keeps_the_other_fixed() -> None:
    applications = {a["name"]: a["args"] for a in serve_config(render(load_values(SCENARIO)))["applications"]}
    assert "replicas" not in applications["llama-3-8b"]
    assert applications["llama-3-8b"]["engine"]["autoscaling"]["maxReplicas"] == 3
    assert applications["mistral-7b"]["replicas"] == 1


@pytest.mark.parametrize("operator_enabled", [True, False])
def test_an_autoscaled_model_has_no_fixed_count_wherever_it_is_rendered(operator_enabled: bool) -> None:
    docs = render({"operator": {"enabled": operator_enabled}, "models": [{"name": "m", "engine": AUTOSCALED}],
                   "rayService": {"engineWorkers": {"replicas": 3}}})
    (application,) = serve_config(docs)["applications"]
    assert application["args"] == {"engine": AUTOSCALED}
    if operator_enabled:
        assert "replicas" not in find(docs, "Model")["spec"]


def test_a_fixed_count_beside_autoscaling_fails_naming_both() -> None:
    message = _fails({"models": [{"name": "m", "replicas": 2, "engine": AUTOSCALED}],
                      "rayService": {"engineWorkers": {"replicas": 3}}})
    assert "models[0] (m): replicas=2 and engine.autoscaling are mutually exclusive" in message


def test_max_replicas_times_tp_beyond_the_workers_gpus_fails() -> None:
    engine = {**AUTOSCALED, "tensorParallelSize": 2, "autoscaling": {"maxReplicas": 3}}
    workers = {"gpusPerPod": 2, "replicas": 1, "minReplicas": 1, "maxReplicas": 2}
    # In-tree autoscaling: the group can grow to maxReplicas=2 pods = 4 GPUs; 3 x TP2 need 6.
    message = _fails({"models": [{"name": "m", "engine": engine}],
                      "rayService": {"enableInTreeAutoscaling": True, "engineWorkers": workers}})
    assert "models[0] (m): engine.autoscaling.maxReplicas=3 do not fit" in message
    assert "rayService.engineWorkers can have maxReplicas=2 pods" in message
    # Without it the group keeps replicas=1 pod: even 2 x TP2 do not fit.
    engine["autoscaling"] = {"maxReplicas": 2}
    message = _fails({"models": [{"name": "m", "engine": engine}], "rayService": {"engineWorkers": workers}})
    assert "engine.autoscaling.maxReplicas=2 do not fit" in message and "enableInTreeAutoscaling is false" in message
    # Summed over models: the message says which count is a maximum.
    two = [{"name": "a", "engine": {**AUTOSCALED, "autoscaling": {"maxReplicas": 2}}},
           {"name": "b", "replicas": 1, "engine": {"model": "/m"}}]
    message = _fails({"models": two, "rayService": {"engineWorkers": {"replicas": 2}}})
    parts = "a: 2 (engine.autoscaling.maxReplicas) x 1, b: 1 x 1"
    assert f"the models need 3 GPUs (replicas x tensorParallelSize: {parts})" in message


@pytest.mark.parametrize(("autoscaling", "message"), [
    ({"minReplicas": 3, "maxReplicas": 2}, "engine.autoscaling.minReplicas=3 must be <= maxReplicas=2"),
    ({"maxReplicas": 2, "initialReplicas": 3},
     "engine.autoscaling.initialReplicas=3 must be within minReplicas=1 and maxReplicas=2"),
    ({"maxReplicas": 2, "lookBackPeriodS": 5},
     "engine.autoscaling.metricsIntervalS=10 must be below lookBackPeriodS=5"),
])
def test_cross_field_rules_fail_helm_template_with_the_field(autoscaling: dict[str, Any], message: str) -> None:
    failure = _fails({"models": [{"name": "m", "engine": {"model": "/m", "autoscaling": autoscaling}}],
                      "rayService": {"engineWorkers": {"replicas": 3}}})
    assert f"models[0] (m): {message}" in failure


def test_in_tree_autoscaler_container_meets_the_restricted_standard() -> None:
    docs = render(load_values(SCENARIO))
    options = find(docs, "RayService")["spec"]["rayClusterConfig"]["autoscalerOptions"]
    assert options["version"] == "v2" and options["idleTimeoutSeconds"] == 300
    assert options["resources"]["limits"]["memory"]
    assert restricted_violations(_head_as_kuberay_runs_it(docs)) == []
    ctx = options["securityContext"]
    assert ctx["runAsNonRoot"] is True and ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"]["drop"] == ["ALL"] and ctx["seccompProfile"]["type"] == "RuntimeDefault"
    # The check would see KubeRay's default (no securityContext) for what it is.
    bare = {**_head(docs), "containers": [*_head(docs)["containers"], {"name": "autoscaler"}]}
    assert any("autoscaler" in problem for problem in restricted_violations(bare))


def test_only_the_autoscaler_container_holds_an_api_token_with_kuberays_rules() -> None:
    docs = render(load_values(SCENARIO))
    head = _head(docs)
    account = find(docs, "ServiceAccount", "-ray-autoscaler")
    name = account["metadata"]["name"]
    assert head["serviceAccountName"] == name
    assert head["automountServiceAccountToken"] is False and account["automountServiceAccountToken"] is False
    (volume,) = [v for v in head["volumes"] if "projected" in v]
    sources = volume["projected"]["sources"]
    assert {"serviceAccountToken", "configMap", "downwardAPI"} == {key for source in sources for key in source}
    options = find(docs, "RayService")["spec"]["rayClusterConfig"]["autoscalerOptions"]
    assert options["volumeMounts"] == [{"name": volume["name"], "mountPath": TOKEN_PATH, "readOnly": True}]
    for container in head["containers"]:  # the Ray head runs submitted code: no credentials there
        assert all(m["name"] != volume["name"] for m in container.get("volumeMounts") or [])
    role = find(docs, "Role", "-ray-autoscaler")
    rules = {(group, resource): sorted(rule["verbs"]) for rule in role["rules"]
             for group in rule["apiGroups"] for resource in rule["resources"]}
    assert rules == {("", "pods"): ["get", "list", "patch", "watch"], ("", "pods/resize"): ["patch"],
                     ("ray.io", "rayclusters"): ["get", "patch"]}
    binding = find(docs, "RoleBinding", "-ray-autoscaler")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": "llm"}]


def test_without_the_in_tree_autoscaler_nothing_of_it_is_rendered() -> None:
    docs = render({})
    cluster = find(docs, "RayService")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in cluster
    assert "serviceAccountName" not in _head(docs)
    assert not [v for v in _head(docs)["volumes"] if "projected" in v]
    assert not [d for d in docs if re.search(r"-ray-autoscaler$", d["metadata"]["name"])]
