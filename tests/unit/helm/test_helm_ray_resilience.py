"""The RayService's resilience and lockdown settings (issue #14): no field KubeRay ignores, GCS fault
tolerance and the head's PodDisruptionBudget, the upgrade strategy, Ray token auth, and the NetworkPolicy
that keeps Ray's own ports to this release and the KubeRay operator. test_helm_render.py validates every
ci/ scenario against KubeRay's CRD; these tests pin what the values render to."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python
import pytest
from tests.support.chart import CHART_DIR, CI_VALUES, find, load_values, render

JSON = dict[str, Any]
PRODUCTION = CHART_DIR / "ci" / "production-external-redis-values.yaml"
RAY_PORTS = [8265, 6379, 52365, 10001]  # dashboard / job API, GCS, dashboard agent, Ray client


def _cluster(docs: list[JSON]) -> JSON:
    cluster: JSON = find(docs, "RayService")["spec"]["rayClusterConfig"]
    return cluster


@pytest.mark.parametrize("values_file", [None, *CI_VALUES], ids=["defaults", *(p.stem for p in CI_VALUES)])
def test_the_ray_service_sets_no_field_kuberay_ignores(values_file: Path | None) -> None:
    spec = find(render(load_values(values_file) if values_file else None), "RayService")["spec"]
    assert "serviceUnhealthySecondThreshold" not in spec
    assert "deploymentUnhealthySecondThreshold" not in spec


def test_the_removed_threshold_values_are_refused() -> None:
    with pytest.raises(helm_python.HelmValuesError, match="serviceUnhealthySecondThreshold"):
        render({"rayService": {"serviceUnhealthySecondThreshold": 900}})


def test_head_resilience_is_off_by_default() -> None:
    docs = render()
    assert "gcsFaultToleranceOptions" not in _cluster(docs)
    assert not [d for d in docs if d["kind"] == "PodDisruptionBudget" and d["metadata"]["name"].endswith("-ray-head")]


def test_production_turns_on_gcs_fault_tolerance_and_the_head_budget() -> None:
    docs = render(load_values(PRODUCTION))
    options = _cluster(docs)["gcsFaultToleranceOptions"]
    # The external Redis of redis.external.url, TLS kept, database index dropped; the password by reference.
    assert options == {
        "redisAddress": "rediss://redis.prod.example.com:6380",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "tessera-redis-credentials", "key": "password"}}},
    }
    budget = find(docs, "PodDisruptionBudget", "-ray-head")["spec"]
    assert budget["maxUnavailable"] == 0
    assert budget["selector"]["matchLabels"]["app.kubernetes.io/component"] == "ray-head"
    head = _cluster(docs)["headGroupSpec"]["template"]["metadata"]["labels"]
    assert budget["selector"]["matchLabels"].items() <= head.items()


def test_gcs_fault_tolerance_defaults_to_the_bundled_redis() -> None:
    options = _cluster(render({"rayService": {"gcsFaultTolerance": {"enabled": True}}}))["gcsFaultToleranceOptions"]
    assert options == {
        "redisAddress": "tessera-redis.llm.svc:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "tessera-redis", "key": "redis-password"}}},
    }


def test_gcs_fault_tolerance_can_use_another_redis() -> None:
    values = {
        "rayService": {
            "gcsFaultTolerance": {
                "enabled": True,
                "redisAddress": "ray-gcs-redis.infra:6379",
                "passwordSecret": {"name": "gcs-redis", "key": "pw"},
                "externalStorageNamespace": "tessera-prod",
            }
        }
    }
    options = _cluster(render(values))["gcsFaultToleranceOptions"]
    assert options == {
        "redisAddress": "ray-gcs-redis.infra:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "gcs-redis", "key": "pw"}}},
        "externalStorageNamespace": "tessera-prod",
    }
    with pytest.raises(helm_python.HelmValuesError, match="redisAddress"):
        render({"rayService": {"gcsFaultTolerance": {"enabled": True, "redisAddress": "redis://u:p@h:1/0"}}})
    external = {"redis": {"mode": "external", "external": {"url": "redis://redis.example.com/2"}}}
    external["rayService"] = {"gcsFaultTolerance": {"enabled": True}}
    options = _cluster(render(external))["gcsFaultToleranceOptions"]
    assert options == {"redisAddress": "redis.example.com:6379"}, "no Secret: the server needs no password"


def test_upgrade_strategy_is_explicit() -> None:
    spec = find(render(), "RayService")["spec"]
    assert spec["upgradeStrategy"] == {"type": "NewCluster"}
    none = find(render({"rayService": {"upgradeStrategy": {"type": "None"}}}), "RayService")["spec"]
    assert none["upgradeStrategy"] == {"type": "None"}
    incremental = load_values(CHART_DIR / "ci" / "incremental-upgrade-values.yaml")
    strategy = find(render(incremental), "RayService")["spec"]["upgradeStrategy"]
    assert strategy == {
        "type": "NewClusterWithIncrementalUpgrade",
        "clusterUpgradeOptions": {
            "gatewayClassName": "istio",
            "stepSizePercent": 20,
            "intervalSeconds": 120,
            "maxSurgePercent": 50,
        },
    }


@pytest.mark.parametrize(
    ("upgrade", "error", "needle"),
    [
        ({"type": "Recreate"}, helm_python.HelmValuesError, "/rayService/upgradeStrategy/type"),
        (
            {"type": "NewClusterWithIncrementalUpgrade"},
            helm_python.HelmValuesError,
            "/rayService/upgradeStrategy/clusterUpgradeOptions/gatewayClassName",
        ),
        (
            {"type": "NewClusterWithIncrementalUpgrade", "clusterUpgradeOptions": {"gatewayClassName": "istio"}},
            helm_python.HelmRenderError,
            "needs rayService.enableInTreeAutoscaling: true",
        ),
    ],
)
def test_bad_upgrade_strategies_are_refused(upgrade: JSON, error: type[Exception], needle: str) -> None:
    with pytest.raises(error) as caught:
        render({"rayService": {"upgradeStrategy": upgrade}})
    assert needle in str(caught.value), str(caught.value)


def test_ray_token_auth() -> None:
    assert "authOptions" not in _cluster(render())
    docs = render({"rayService": {"auth": {"mode": "token"}}})
    assert _cluster(docs)["authOptions"] == {"mode": "token", "secretName": "tessera-ray-auth"}
    secret = find(docs, "Secret", "-ray-auth")
    assert set(secret["data"]) == {"auth_token"}  # the key KubeRay reads
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    production = render(load_values(PRODUCTION))
    assert _cluster(production)["authOptions"] == {"mode": "token", "secretName": "tessera-ray-auth-token"}
    assert not [d for d in production if d["kind"] == "Secret"]


def test_the_startup_probe_presents_the_ray_token(tmp_path: Path) -> None:
    """With token auth the probe's call to the head's Serve API carries KubeRay's RAY_AUTH_TOKEN."""
    cluster = _cluster(render({"rayService": {"auth": {"mode": "token"}}}))
    command = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["startupProbe"]["exec"]["command"]
    script = command[2]
    assert 'os.environ.get("RAY_AUTH_TOKEN")' in script and "Bearer" in script
    # The script stays valid Python whatever the environment.
    subprocess.run([sys.executable, "-c", f"import ast; ast.parse({script!r})"], check=True)


def _head_policy(values: JSON | None = None) -> JSON:
    return find(render(values), "NetworkPolicy", "-ray-head")


def _port_numbers(rule: JSON) -> list[int]:
    return [p["port"] for p in rule.get("ports") or []]


def test_rays_ports_are_reachable_only_from_the_release_and_kuberay() -> None:
    rules = _head_policy()["spec"]["ingress"]
    for rule in rules:
        opens_ray_ports = "ports" not in rule or set(_port_numbers(rule)) & set(RAY_PORTS)
        assert not opens_ray_ports or "from" in rule, f"Ray's ports open to every source: {rule}"
    cluster_rule, ray_rule, metrics_rule = rules
    assert {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in cluster_rule["from"]} == {
        "ray-head",
        "engine",
    }
    assert _port_numbers(ray_rule) == RAY_PORTS
    assert ray_rule["from"] == [
        {
            "podSelector": {
                "matchLabels": {"app.kubernetes.io/name": "tessera", "app.kubernetes.io/instance": "tessera"}
            }
        },
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}}},
    ]
    assert _port_numbers(metrics_rule) == [8080]


def test_the_kuberay_namespace_and_ray_clients_are_values() -> None:
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ml-notebooks"}}}
    values = {"networkPolicy": {"kubeRayOperatorNamespace": "ray-system", "rayClientFrom": [peer]}}
    docs = render(values)
    rules = find(docs, "NetworkPolicy", "-ray-head")["spec"]["ingress"]
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ray-system"}}}
    assert operator in rules[1]["from"]
    (client_rule,) = [r for r in rules if r.get("from") == [peer]]
    assert _port_numbers(client_rule) == [8265, 10001]
    engine_rules = find(docs, "NetworkPolicy", "-engine")["spec"]["ingress"]
    (agent_rule,) = [r for r in engine_rules if _port_numbers(r) == [52365]]
    assert agent_rule["from"] == [operator]
