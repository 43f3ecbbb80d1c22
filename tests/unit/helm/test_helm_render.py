"""The chart renders with every values file in ci/, lints clean, and every object it renders is valid:
Kubernetes 1.30 schemas (strict: unknown fields are errors), the KubeRay RayService CRD, our own CRDs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from tessera_operators.operator.crds import build_model_crd, validation_schema
from tests.support.chart import (
    CHART_DIR,
    CI_VALUES,
    KUBE_VERSION,
    NAMESPACE,
    REPO,
    chart,
    find,
    load_values,
    pod_templates,
    ray_service_crd,
    render,
    render_files,
    serve_config,
)

# Kinds from CRDs that kubernetes-validate has no schema for, each checked by its own test below.
CRD_KINDS = {"RayService", "ServiceMonitor", "PodMonitor", "ScrapeConfig", "Model"}
VALUES_IDS = [p.name.removesuffix("-values.yaml") for p in CI_VALUES]


@pytest.fixture(scope="module")
def ray_service_validator() -> jsonschema.Draft202012Validator:
    crd = yaml.safe_load(ray_service_crd().read_text())
    return jsonschema.Draft202012Validator(validation_schema(crd, "v1"))


def test_ci_has_the_required_values_files() -> None:
    names = set(VALUES_IDS)
    assert {
        "minimal",
        "production-external-redis",
        "two-models",
        "eagle",
        "fp8-off",
        "planner",
        "gpu-nodes",
        "pvc-model",
        "model-fetch",
        "incremental-upgrade",
    } <= names


@pytest.mark.parametrize("values_file", CI_VALUES, ids=VALUES_IDS)
def test_lint_has_no_errors_or_warnings(values_file: Path) -> None:
    report = helm_python.lint(
        CHART_DIR, load_values(values_file), strict=True, kube_version=f"v{KUBE_VERSION}"
    )
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], problems


def test_lint_defaults() -> None:
    report = helm_python.lint(CHART_DIR, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values_file", CI_VALUES, ids=VALUES_IDS)
def test_every_object_is_valid_kubernetes(
    values_file: Path, ray_service_validator: jsonschema.Validator
) -> None:
    docs = render(load_values(values_file))
    kinds = {d["kind"] for d in docs}
    assert {
        "RayService",
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "Role",
        "RoleBinding",
    } <= kinds
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        assert doc["metadata"].get("namespace") == NAMESPACE, f"{where} has no namespace"
        if doc["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{values_file.name}: {where} at {list(exc.path)}: {exc.message}")
    ray_service = find(docs, "RayService")
    errors = [f"{list(e.path)}: {e.message}" for e in ray_service_validator.iter_errors(ray_service)]
    assert errors == [], errors
    # The models[] the chart renders as Model objects (the operator owns serveConfigV2): our own CRD.
    model_validator = jsonschema.Draft202012Validator(validation_schema(build_model_crd()))
    for model in (d for d in docs if d["kind"] == "Model"):
        errors = [f"{list(e.path)}: {e.message}" for e in model_validator.iter_errors(model)]
        assert errors == [], (model["metadata"]["name"], errors)


def test_ray_service_validator_catches_mistakes(ray_service_validator: jsonschema.Validator) -> None:
    """The CRD check is not vacuous: a misspelt field and a wrong type are both reported."""
    ray_service = find(render(), "RayService")
    ray_service["spec"]["serveConfigV3"] = "x"
    ray_service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "four"
    messages = [e.message for e in ray_service_validator.iter_errors(ray_service)]
    assert any("serveConfigV3" in m for m in messages)
    assert any("'four'" in m for m in messages)


def test_chart_crds_are_valid_kubernetes() -> None:
    crds = chart().crds
    assert {c["name"] for c in crds} >= {"crds/tessera.dev_tenants.yaml", "crds/tessera.dev_models.yaml"}
    for crd in crds:
        kubernetes_validate.validate(yaml.safe_load(crd["data"]), KUBE_VERSION, strict=True)


def test_ray_service_shape() -> None:
    values = load_values(CHART_DIR / "ci" / "production-external-redis-values.yaml")
    ray_service = find(render(values), "RayService")
    cluster = ray_service["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["rayStartParams"]["num-gpus"] == "8"
    container = workers["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 8
    spec = workers["template"]["spec"]
    # Helm merges maps with the defaults: the user's selector adds to nvidia.com/gpu.present.
    assert spec["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/gpu.present": "true",
    }
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    env = {e["name"]: e for e in container["env"]}
    assert env["TESSERA_ENGINE_PORT_RANGE"]["value"] == "32768-60999"
    assert env["TESSERA_KV_EVENTS_PORT_RANGE"]["value"] == "32768-60999"
    assert env["TESSERA_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["TESSERA_REDIS_URL"]["value"] == "rediss://:$(REDIS_PASSWORD)@redis.prod.example.com:6380/0"
    assert env["TESSERA_OTLP_ENDPOINT"]["value"] == "http://otel-collector.observability.svc:4317"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True
    image = container["image"]
    assert image.startswith("registry.example.com/tessera/serving@sha256:")


def test_each_model_is_one_serve_application() -> None:
    config = serve_config(render(load_values(CHART_DIR / "ci" / "two-models-values.yaml")))
    apps = {a["name"]: a for a in config["applications"]}
    assert set(apps) == {"llama-3-8b", "mistral-7b"}
    for name, app in apps.items():
        assert app["import_path"] == "tessera.engine.deployment:build_app"
        assert app["route_prefix"] == f"/{name}"
    assert apps["llama-3-8b"]["args"]["replicas"] == 2


def test_labels_and_names() -> None:
    long_release = "a-release-name-that-is-long-enough-to-need-truncation-x"
    for release in ("tessera", long_release[:53]):
        for doc in render(
            load_values(CHART_DIR / "ci" / "production-external-redis-values.yaml"), release=release
        ):
            meta = doc["metadata"]
            where = f"{doc['kind']}/{meta['name']}"
            assert len(meta["name"]) <= 63, where
            labels = meta.get("labels") or {}
            for key in (
                "app.kubernetes.io/name",
                "app.kubernetes.io/instance",
                "app.kubernetes.io/managed-by",
                "app.kubernetes.io/version",
                "app.kubernetes.io/component",
                "helm.sh/chart",
            ):
                assert key in labels, f"{where} lacks {key}"
            assert labels["team"] == "ml-platform", f"{where} lacks commonLabels"
            for tpl_where, template in pod_templates(doc):
                tpl_labels = template["metadata"]["labels"]
                assert tpl_labels["app.kubernetes.io/instance"] == release, tpl_where
                assert "app.kubernetes.io/component" in tpl_labels, tpl_where
        ray_service = find(render(release=release), "RayService")
        assert len(ray_service["metadata"]["name"]) <= 40


def test_selectors_match_their_pods() -> None:
    docs = render(load_values(CHART_DIR / "ci" / "production-external-redis-values.yaml"))
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            selector = doc["spec"]["selector"]["matchLabels"]
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert selector.items() <= labels.items(), doc["metadata"]["name"]
    gateway_service = find(docs, "Service", "-gateway")
    gateway = find(docs, "Deployment", "-gateway")
    assert (
        gateway_service["spec"]["selector"].items()
        <= gateway["spec"]["template"]["metadata"]["labels"].items()
    )


def test_every_container_has_probes_and_resources() -> None:
    for values_file in CI_VALUES:
        for doc in render(load_values(values_file)):
            for where, template in pod_templates(doc):
                for container in template["spec"]["containers"]:
                    label = f"{values_file.name}: {where}/{container['name']}"
                    assert "readinessProbe" in container and "livenessProbe" in container, label
                    resources = container.get("resources") or {}
                    assert resources.get("requests", {}).get("memory"), label
                    assert resources.get("limits", {}).get("memory"), label


def test_gateway_autoscaling_and_disruption_budgets() -> None:
    docs = render()
    hpa = find(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == find(docs, "Deployment", "-gateway")["metadata"]["name"]
    assert "replicas" not in find(docs, "Deployment", "-gateway")["spec"], "the HPA owns the replica count"
    budgets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert set(budgets) == {"tessera-gateway", "tessera-engine"}
    no_hpa = render({"gateway": {"autoscaling": {"enabled": False}, "replicas": 3}})
    assert not [d for d in no_hpa if d["kind"] == "HorizontalPodAutoscaler"]
    assert find(no_hpa, "Deployment", "-gateway")["spec"]["replicas"] == 3


def test_monitoring_objects() -> None:
    docs = render(load_values(CHART_DIR / "ci" / "production-external-redis-values.yaml"))
    monitor = find(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"metrics"}
    # Each endpoint port name exists on a Service the monitor selects.
    service_ports = {p["name"] for d in docs if d["kind"] == "Service" for p in d["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= service_ports
    # The gateway's metrics are on a Service of their own, never on the API's (issue #15: they name tenants).
    api, metrics = find(docs, "Service", "-gateway"), find(docs, "Service", "-gateway-metrics")
    assert [p["name"] for p in api["spec"]["ports"]] == ["http"]
    assert metrics["spec"]["type"] == "ClusterIP" and metrics["spec"]["ports"][0]["targetPort"] == "metrics"
    gateway = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert {p["name"]: p["containerPort"] for p in gateway["ports"]} == {"http": 8000, "metrics": 9464}
    assert "--metrics-port=9464" in gateway["command"]
    # With network policies on, the metrics port is open to the scrapers only (metricsFrom), the API to gatewayFrom.
    rules = find(docs, "NetworkPolicy", "-gateway")["spec"]["ingress"]
    peers = {rule["ports"][0]["port"]: str(rule["from"]) for rule in rules}
    assert set(peers) == {8000, 9464} and "monitoring" in peers[9464] and "ingress-nginx" in peers[8000]
    pod_monitor = find(docs, "PodMonitor")
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert not [d for d in render() if d["kind"] in ("ServiceMonitor", "PodMonitor")], "off by default"


def test_the_gateway_limits_reach_the_gateway() -> None:
    """gateway.limits become the gateway's TESSERA_* limit settings (docs/security.md)."""
    def env_of(values: dict[str, object]) -> dict[str, str]:
        container = find(render(values), "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
        return {e["name"]: e.get("value") for e in container["env"]}

    defaults = env_of({})
    assert (defaults["TESSERA_MAX_URL_BYTES"], defaults["TESSERA_MAX_HEADER_BYTES"],
            defaults["TESSERA_HEADER_TIMEOUT_S"], defaults["TESSERA_MAX_CONNECTIONS_PER_WORKER"],
            defaults["TESSERA_MAX_IN_FLIGHT_PER_WORKER"]) == ("8192", "32768", "10", "2048", "1024")
    tight = env_of({"gateway": {"limits": {"headerTimeoutS": 3, "maxInFlightPerWorker": 64}}})
    assert (tight["TESSERA_HEADER_TIMEOUT_S"], tight["TESSERA_MAX_IN_FLIGHT_PER_WORKER"]) == ("3", "64")


def test_grafana_dashboard() -> None:
    docs = render({"metrics": {"grafanaDashboard": {"enabled": True}}})
    config_map = find(docs, "ConfigMap", "-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["tessera.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    # Per-tenant p50/p99, KV usage, evictions and controller actions.
    assert "histogram_quantile(0.50" in exprs and "histogram_quantile(0.99" in exprs
    assert "by (le, tenant)" in exprs
    for metric in ("tessera_kv_blocks_used", "tessera_kv_evictions_total", "tessera_kvcontrol_actions_total"):
        assert metric in exprs
    assert not [d for d in render() if d["kind"] == "ConfigMap"], "off by default"
    # The gateway's metrics it reads are the ones the gateway exports (no silent drift to empty panels).
    gateway_source = (REPO / "platform" / "src" / "tessera" / "gateway" / "metrics.py").read_text()
    used = {re.sub(r"_bucket$", "", m) for m in re.findall(r"tessera_gateway_\w+", exprs)}
    assert used and all(f'"{name}"' in gateway_source for name in used), used


def test_operator_rbac_is_least_privilege() -> None:
    docs = render()
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    role = find(docs, "Role", "-operator")
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
    secrets = next(r for r in role["rules"] if r["resources"] == ["secrets"])
    assert "list" not in secrets["verbs"] and "watch" not in secrets["verbs"]
    ray = next(r for r in role["rules"] if r["apiGroups"] == ["ray.io"])
    assert ray["resourceNames"] == [find(docs, "RayService")["metadata"]["name"]]
    binding = find(docs, "RoleBinding", "-operator")
    assert binding["subjects"][0]["name"] == find(docs, "ServiceAccount", "-operator")["metadata"]["name"]
    without = render({"operator": {"enabled": False}})
    assert not [d for d in without if d["kind"] in ("Role", "RoleBinding", "ServiceAccount")]


def test_notes_say_how_to_get_a_key_and_call_the_api() -> None:
    notes = render_files()["tessera/templates/NOTES.txt"]
    assert "kind: Tenant" in notes
    assert "tessera-tenant-team-a" in notes and "base64 -d" in notes
    assert "/v1/chat/completions" in notes and "Authorization: Bearer" in notes
    assert '"model": "tessera-small"' in notes
    assert "modelStorage.existingClaim is empty" in notes, "the default model path needs a volume"
    assert (
        "existingClaim is empty"
        not in render_files({"modelStorage": {"existingClaim": "weights"}})["tessera/templates/NOTES.txt"]
    )
