"""Prometheus scrapes every engine replica (templates/engine-scrape.yaml): the ScrapeConfig asks the
operator's discovery endpoint for the replicas' addresses, and the NetworkPolicy lets the scrapers, and only
them, reach the replica ports the engines pick their port from."""

from __future__ import annotations

from urllib.parse import urlsplit

import helm_python
import pytest

from tessera_operators.operator.scrape_targets import ENGINE_ID_LABEL, SCRAPE_TARGETS_PATH
from tests.support.chart import CHART_DIR, JSON, NAMESPACE, env_values, find, load_values, render

PRODUCTION = CHART_DIR / "ci" / "production-external-redis-values.yaml"


def test_the_scrape_config_finds_the_replicas_through_the_operator() -> None:
    docs = render(load_values(PRODUCTION))
    scrape = find(docs, "ScrapeConfig")["spec"]
    assert find(docs, "ScrapeConfig")["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (sd,) = scrape["httpSDConfigs"]
    url = urlsplit(sd["url"])
    assert scrape["metricsPath"] == "/metrics" and url.path == SCRAPE_TARGETS_PATH
    assert scrape["relabelings"] == [{"sourceLabels": [ENGINE_ID_LABEL], "targetLabel": "replica"}]
    # The URL names the operator's Service, whose port reaches the container port the operator serves on.
    service_name, namespace, _ = (url.hostname or "").split(".", 2)
    assert namespace == NAMESPACE
    service = find(docs, "Service", service_name)
    (port,) = service["spec"]["ports"]
    assert port["port"] == url.port
    operator = find(docs, "Deployment", "-operator")
    assert service["spec"]["selector"].items() <= operator["spec"]["template"]["metadata"]["labels"].items()
    (container,) = operator["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert str(ports[port["targetPort"]]) == env_values(container)["TESSERA_OPERATOR_DISCOVERY_PORT"]


def test_the_scrapers_reach_the_engine_replica_ports_and_the_discovery_port() -> None:
    values = load_values(PRODUCTION)
    docs = render(values)
    workers = find(docs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    start, end = env_values(workers["template"]["spec"]["containers"][0])["TESSERA_ENGINE_PORT_RANGE"].split("-")
    scrapers = values["networkPolicy"]["metricsFrom"]
    engine_policy = find(docs, "NetworkPolicy", "-engine")["spec"]["ingress"]
    scraper_ports = [r["ports"] for r in engine_policy if r.get("from") == scrapers]
    assert {"protocol": "TCP", "port": int(start), "endPort": int(end)} in scraper_ports[0]
    control_plane = find(docs, "NetworkPolicy", "-control-plane")["spec"]["ingress"]
    assert {"protocol": "TCP", "port": values.get("operator", {}).get("discoveryPort", 8081)} in [
        p for r in control_plane if r.get("from") == scrapers for p in r["ports"]
    ]


def test_off_by_default_and_the_replica_ports_stay_closed_to_scrapers() -> None:
    docs = render()
    assert not [d for d in docs if d["kind"] == "ScrapeConfig"]
    engine_policy = find(docs, "NetworkPolicy", "-engine")["spec"]["ingress"]
    (scrapers,) = [r for r in engine_policy if {"protocol": "TCP", "port": 8080} in r.get("ports", [])]
    assert scrapers["ports"] == [{"protocol": "TCP", "port": 8080}]  # Ray's metrics port, no replica port


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"operator": {"enabled": False}}, "needs operator.enabled"),
        ({"networkPolicy": {"metricsFrom": []}}, "needs networkPolicy.metricsFrom"),
    ],
)
def test_refused_without_the_operator_or_without_named_scrapers(values: JSON, message: str) -> None:
    base = load_values(PRODUCTION)
    merged = {**base, **{k: {**base.get(k, {}), **v} for k, v in values.items()}}
    with pytest.raises(helm_python.HelmRenderError, match=message):
        render(merged)
