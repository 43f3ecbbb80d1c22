"""The bundled Redis is durable by default (issue #16): an append-only file fsync'd every second on a
PersistentVolumeClaim, a memory ceiling with noeviction, and a startup probe that lets a large AOF load."""

from __future__ import annotations

import shlex
from typing import Any

import helm_python
import pytest

from tests.support.chart import find, render

JSON = dict[str, Any]


def _redis(values: JSON | None = None) -> JSON:
    return find(render(values), "StatefulSet", "-redis")


def _server_args(statefulset: JSON) -> list[str]:
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:2] == ["sh", "-c"]
    args = shlex.split(container["command"][2])
    assert args[:2] == ["exec", "valkey-server"]
    return args[2:]


def _option(args: list[str], name: str) -> str:
    assert args.count(name) == 1, f"{name} given {args.count(name)} times in {args}"
    return args[args.index(name) + 1]


def test_defaults_write_an_aof_fsynced_every_second_and_never_evict() -> None:
    args = _server_args(_redis())
    assert _option(args, "--appendonly") == "yes"
    assert _option(args, "--appendfsync") == "everysec"
    assert _option(args, "--save") == "", "no RDB snapshots beside the AOF"
    assert _option(args, "--dir") == "/data"
    assert _option(args, "--maxmemory") == "600mb"
    assert _option(args, "--maxmemory-policy") == "noeviction"


def test_defaults_keep_the_data_on_a_claim() -> None:
    statefulset = _redis()
    claims = statefulset["spec"]["volumeClaimTemplates"]
    assert [c["metadata"]["name"] for c in claims] == ["data"]
    assert claims[0]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claims[0]["spec"]["resources"]["requests"]["storage"] == "8Gi"
    assert "storageClassName" not in claims[0]["spec"], "empty storageClass: the cluster default"
    volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"]["volumes"]}
    assert "data" not in volumes, "the claim, not an emptyDir, backs /data"
    mounts = statefulset["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "data", "mountPath": "/data"} in mounts


def test_size_storage_class_and_maxmemory_come_from_values() -> None:
    statefulset = _redis({"redis": {"bundled": {
        "persistence": {"size": "20Gi", "storageClass": "fast-ssd"}, "maxmemory": "4gb",
        "resources": {"limits": {"memory": "8Gi"}, "requests": {"cpu": "1", "memory": "8Gi"}}}}})
    claim = statefulset["spec"]["volumeClaimTemplates"][0]["spec"]
    assert claim["storageClassName"] == "fast-ssd"
    assert claim["resources"]["requests"]["storage"] == "20Gi"
    assert _option(_server_args(statefulset), "--maxmemory") == "4gb"


def test_without_a_claim_the_aof_still_survives_a_container_restart() -> None:
    statefulset = _redis({"redis": {"bundled": {"persistence": {"enabled": False}}}})
    assert "volumeClaimTemplates" not in statefulset["spec"]
    volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"]["volumes"]}
    assert volumes["data"] == {"name": "data", "emptyDir": {}}
    # An emptyDir outlives an OOM-killed or crashed container of the same pod: the AOF is still worth it.
    assert _option(_server_args(statefulset), "--appendonly") == "yes"


def test_a_long_aof_load_is_not_killed_by_the_liveness_probe() -> None:
    container = _redis()["spec"]["template"]["spec"]["containers"][0]
    startup = container["startupProbe"]
    # While the server replays its AOF it answers LOADING, not PONG: give it minutes, and let liveness (which
    # Kubernetes holds back until the startup probe passes) start only then.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    assert "PONG" in startup["exec"]["command"][-1]
    assert "initialDelaySeconds" not in container["livenessProbe"]


@pytest.mark.parametrize("maxmemory", ["0", "0mb", "1 gb", "lots", "-1"])
def test_the_schema_refuses_an_unbounded_or_malformed_maxmemory(maxmemory: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match="maxmemory"):
        render({"redis": {"bundled": {"maxmemory": maxmemory}}})


@pytest.mark.parametrize("maxmemory", ["1073741824", "512mb", "2GB", "1g", "100kb"])
def test_the_schema_takes_valkey_memory_units(maxmemory: str) -> None:
    assert _option(_server_args(_redis({"redis": {"bundled": {"maxmemory": maxmemory}}})), "--maxmemory") == maxmemory
