"""Every pod the chart renders meets the "restricted" Pod Security Standard and gets secrets only through
secretKeyRef or mounted Secrets; the NetworkPolicies isolate Redis and the engine replica ports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.support.chart import (
    CHART_DIR,
    CI_VALUES,
    find,
    load_values,
    pod_specs,
    render,
    restricted_violations,
    secret_handling_violations,
)

VALUES_IDS = [p.name.removesuffix("-values.yaml") for p in CI_VALUES]
AGENT_PORT = {"protocol": "TCP", "port": 52365}


@pytest.mark.parametrize("values_file", CI_VALUES, ids=VALUES_IDS)
def test_every_pod_is_restricted_and_handles_secrets(values_file: Path) -> None:
    docs = render(load_values(values_file))
    pods = [(where, spec) for doc in docs for where, spec in pod_specs(doc)]
    assert len(pods) >= 5, "gateway, operator, controller, Ray head and workers (and bundled Redis)"
    problems = [f"{where}: {p}" for where, spec in pods for p in restricted_violations(spec)]
    problems += [f"{where}: {p}" for where, spec in pods for p in secret_handling_violations(spec)]
    assert problems == []


def test_the_checks_catch_violations() -> None:
    """The checkers are not vacuous."""
    bad: dict[str, Any] = {
        "hostNetwork": True,
        "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
        "containers": [
            {
                "name": "c",
                "securityContext": {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}},
                "env": [
                    {"name": "DB_PASSWORD", "value": "hunter2"},
                    {"name": "URL", "value": "redis://:pw@h:1/0"},
                ],
                "envFrom": [{"secretRef": {"name": "s"}}],
                "ports": [{"containerPort": 80, "hostPort": 80}],
            }
        ],
    }
    pss = " | ".join(restricted_violations(bad))
    for needle in (
        "hostNetwork",
        "hostPath",
        "privileged",
        "allowPrivilegeEscalation",
        "drop ALL",
        "SYS_ADMIN",
        "runAsNonRoot",
        "seccomp",
        "hostPort",
    ):
        assert needle in pss
    secrets = " | ".join(secret_handling_violations(bad))
    for needle in ("DB_PASSWORD", "envFrom", "credentials in the URL"):
        assert needle in secrets


def test_redis_password_reaches_pods_only_by_secret_key_ref() -> None:
    for values_file in CI_VALUES:
        docs = render(load_values(values_file))
        for doc in docs:
            for where, spec in pod_specs(doc):
                for container in spec["containers"]:
                    env = {e["name"]: e for e in container.get("env") or []}
                    if "TESSERA_REDIS_URL" not in env:
                        continue
                    password = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
                    names = [e["name"] for e in container["env"]]
                    # Kubernetes expands $(REDIS_PASSWORD) only from variables defined earlier in the list.
                    assert names.index("REDIS_PASSWORD") < names.index("TESSERA_REDIS_URL"), where
                    assert "$(REDIS_PASSWORD)" in env["TESSERA_REDIS_URL"]["value"], where
                    assert password["name"] and password["key"], where


def test_generated_secrets_are_only_created_when_not_supplied() -> None:
    default = [d for d in render() if d["kind"] == "Secret"]
    assert {d["metadata"]["name"] for d in default} == {"tessera-admin", "tessera-redis", "tessera-data-plane"}
    for secret in default:
        assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    production = render(load_values(CHART_DIR / "ci" / "production-external-redis-values.yaml"))
    assert not [d for d in production if d["kind"] == "Secret"]
    gateway = find(production, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    token = next(e for e in gateway["env"] if e["name"] == "TESSERA_ADMIN_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "tessera-admin-token", "key": "token"}


def _policy(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    return find(docs, "NetworkPolicy", f"-{component}")


def test_redis_is_reachable_only_from_the_release() -> None:
    docs = render()
    policy = _policy(docs, "redis")
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "redis"
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert peer == {
        "podSelector": {
            "matchLabels": {"app.kubernetes.io/name": "tessera", "app.kubernetes.io/instance": "tessera"}
        }
    }
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]


def _rules_opening(policy: dict[str, Any], start: int, end: int) -> list[dict[str, Any]]:
    """Ingress rules that open any port of [start, end] (a rule without ports opens all)."""
    found = []
    for rule in policy["spec"]["ingress"]:
        ports = rule.get("ports")
        if ports is None or any(p["port"] <= end and p.get("endPort", p["port"]) >= start for p in ports):
            found.append(rule)
    return found


def _components(rule: dict[str, Any]) -> set[str]:
    peers = rule.get("from")
    if peers is None:
        return {"<anyone>"}
    return {
        p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in peers if "podSelector" in p
    }


def test_engine_replica_ports_only_from_the_gateway_and_the_controller() -> None:
    """With disjoint ranges, the replica ports open to the gateway and the controller (which polls and aborts
    there), and the Ray cluster, only; the KV event ports to the controller only."""
    values = {
        "rayService": {"engineWorkers": {"replicaPorts": {"start": 30000, "end": 30063}}},
        "kvcontrol": {"kvEventsPorts": {"start": 31000, "end": 31063}},
    }
    policy = _policy(render(values), "engine")
    replica_rules = _rules_opening(policy, 30000, 30063)
    assert [_components(r) for r in replica_rules] == [{"gateway", "kvcontrol"}, {"ray-head", "engine"}]
    kv_rules = _rules_opening(policy, 31000, 31063)
    assert [_components(r) for r in kv_rules] == [{"kvcontrol"}, {"ray-head", "engine"}]
    (gateway_rule,) = [r for r in replica_rules if "gateway" in _components(r)]
    assert gateway_rule["ports"] == [{"protocol": "TCP", "port": 30000, "endPort": 30063}]


def test_default_engine_ports_follow_the_engines_free_port_range() -> None:
    """By default both ranges are the ephemeral range where the engine host picks its free ports: still no
    peer but the gateway, the controller and the Ray cluster reaches them."""

    def reachers(values: dict[str, Any]) -> set[str]:
        policy = _policy(render(values), "engine")
        # Ray's dashboard agent owns 52365 (inside the range, so no replica can be given it): it is open to
        # the KubeRay operator's peers, and the check is about every other port.
        rules = [r for r in _rules_opening(policy, 32768, 60999) if r.get("ports") != [AGENT_PORT]]
        return set().union(*(_components(r) for r in rules))

    assert reachers({}) == {"gateway", "kvcontrol", "ray-head", "engine"}
    assert reachers({"kvcontrol": {"enabled": False}}) == {"gateway", "ray-head", "engine"}


def test_network_policies_can_be_turned_off() -> None:
    assert not [d for d in render({"networkPolicy": {"enabled": False}}) if d["kind"] == "NetworkPolicy"]
