"""The chart runs one KV controller per shard: ``kvcontrol.shards`` Deployments, each told its shard and the
count, with selectors of their own; the gateway is told the same count (it reads one demotion flag per
shard). One shard keeps the Deployment's name and selector of before (a selector cannot change on upgrade)."""

from __future__ import annotations

from typing import Any

from tests.support.chart import RELEASE, render

MODELS = [{"name": "m", "engine": {"model": "Qwen/Qwen2.5-0.5B-Instruct", "servedModelName": "m"}}]


def _env(deployment: dict[str, Any], container: str) -> dict[str, str]:
    (spec,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == container]
    return {e["name"]: e.get("value") for e in spec["env"]}


def _deployments(docs: list[dict[str, Any]], component: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == "Deployment"
            and d["metadata"]["labels"].get("app.kubernetes.io/component") == component]


def test_three_shards_are_three_controllers_each_with_its_own_shard_and_selector() -> None:
    docs = render({"models": MODELS, "kvcontrol": {"shards": 3}})
    controllers = _deployments(docs, "kvcontrol")
    assert [d["metadata"]["name"] for d in controllers] == [f"{RELEASE}-kvcontrol-{i}" for i in range(3)]
    selectors = [tuple(sorted(d["spec"]["selector"]["matchLabels"].items())) for d in controllers]
    assert len(set(selectors)) == 3, "two Deployments with one selector would fight over their pods"
    for i, deployment in enumerate(controllers):
        env = _env(deployment, "kvcontrol")
        assert (env["TESSERA_KVCONTROL_SHARD"], env["TESSERA_KVCONTROL_SHARDS"]) == (str(i), "3")
        assert deployment["spec"]["strategy"]["type"] == "Recreate" and deployment["spec"]["replicas"] == 1
    (gateway,) = _deployments(docs, "gateway")
    assert _env(gateway, "gateway")["TESSERA_KVCONTROL_SHARDS"] == "3"
    # One Service scrapes every shard's metrics.
    (service,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == f"{RELEASE}-kvcontrol"]
    for deployment in controllers:
        assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_one_shard_keeps_the_deployment_it_had() -> None:
    (controller,) = _deployments(render({"models": MODELS}), "kvcontrol")
    assert controller["metadata"]["name"] == f"{RELEASE}-kvcontrol"
    assert "tessera.io/kvcontrol-shard" not in controller["spec"]["selector"]["matchLabels"]
    assert _env(controller, "kvcontrol")["TESSERA_KVCONTROL_SHARDS"] == "1"
