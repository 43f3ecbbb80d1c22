"""redis.mode sentinel (issue #16): Valkey pods that are a primary and its replicas, each durable as the bundled
server is and each with a Sentinel, and every component given the redis+sentinel:// URL of all Sentinels.

The pods' start-up scripts are run here too, with sh, against a stub valkey-cli: the role a pod takes (the
primary the Sentinels name; pod 0 when none answers) is the part that decides where writes go."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from tessera.redis_sentinel import parse_sentinel_url
from tests.support.chart import NAMESPACE, find, render

JSON = dict[str, Any]
SENTINEL: JSON = {"redis": {"mode": "sentinel"}}
HEADLESS = f"tessera-redis-headless.{NAMESPACE}.svc"


def _statefulset(values: JSON | None = None) -> JSON:
    return find(render(values or SENTINEL), "StatefulSet", "-redis")


def _containers(statefulset: JSON) -> dict[str, JSON]:
    return {c["name"]: c for c in statefulset["spec"]["template"]["spec"]["containers"]}


def test_three_pods_each_with_a_durable_server_and_a_sentinel() -> None:
    statefulset = _statefulset()
    assert statefulset["spec"]["replicas"] == 3
    assert statefulset["spec"]["serviceName"] == "tessera-redis-headless"
    assert set(_containers(statefulset)) == {"redis", "sentinel"}
    script = _containers(statefulset)["redis"]["command"][2]
    for option in ("--appendonly yes", "--appendfsync everysec", '--save ""', "--maxmemory 600mb",
                   "--maxmemory-policy noeviction", "--min-replicas-to-write 1", "--min-replicas-max-lag 5",
                   '--masterauth "$REDIS_PASSWORD"'):
        assert option in script, option
    claims = statefulset["spec"]["volumeClaimTemplates"]
    assert [c["metadata"]["name"] for c in claims] == ["data"], "each pod's AOF on its own claim"
    sentinel = _containers(statefulset)["sentinel"]["command"][2]
    assert "sentinel monitor tessera $primary 6379 2" in sentinel
    assert "sentinel down-after-milliseconds tessera 5000" in sentinel


def test_every_component_gets_the_sentinel_url_of_every_pod() -> None:
    docs = render(SENTINEL)
    urls = {e["value"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")
            for c in d["spec"]["template"]["spec"].get("containers", []) for e in c.get("env", [])
            if e["name"] == "TESSERA_REDIS_URL"}
    # The engine replicas (the RayService's pods) too.
    urls |= set(re.findall(r"redis\+sentinel://[^\s'\"]+", yaml.safe_dump(find(docs, "RayService"))))
    assert len(urls) == 1, urls
    config = parse_sentinel_url(urls.pop().replace("$(REDIS_PASSWORD)", "pw"))
    assert config.sentinels == tuple((f"tessera-redis-{i}.{HEADLESS}", 26379) for i in range(3))
    assert (config.primary_name, config.db, config.password, config.sentinel_password) == ("tessera", 0, "pw", "pw")
    assert not [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "tessera-redis"], (
        "no Service in front of all pods: it would send writes to replicas")


def test_the_network_policy_opens_the_sentinel_port() -> None:
    policy = find(render(SENTINEL), "NetworkPolicy", "-redis")
    assert [p["port"] for p in policy["spec"]["ingress"][0]["ports"]] == [6379, 26379]


@pytest.mark.parametrize(("sentinel", "complaint"), [
    ({"replicas": 3, "quorum": 4}, "cannot exceed"),
    ({"replicas": 2, "quorum": 1, "minReplicasToWrite": 1}, "must be at most"),
])
def test_settings_that_could_never_fail_over_or_write_are_refused(sentinel: JSON, complaint: str) -> None:
    with pytest.raises(helm_python.HelmError, match=complaint):
        render({"redis": {"mode": "sentinel", "sentinel": sentinel}})


def test_ray_gcs_needs_its_own_address_with_sentinels() -> None:
    with pytest.raises(helm_python.HelmError, match="does not follow a failover"):
        render({**SENTINEL, "rayService": {"gcsFaultTolerance": {"enabled": True}}})


def test_an_external_sentinel_url_is_taken() -> None:
    docs = render({"redis": {"mode": "external", "external": {
        "url": "redis+sentinel://s1:26379,s2:26379/prod/2", "existingSecret": "creds"}}})
    container = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["TESSERA_REDIS_URL"]["value"] == "redis+sentinel://:$(REDIS_PASSWORD)@s1:26379,s2:26379/prod/2"


def _run_start_script(script: str, tmp_path: Path, hostname: str, sentinel_answer: str) -> list[str]:
    """Runs a container's start-up script with stub hostname, valkey-cli and valkey-server: the Sentinels
    answer ``sentinel_answer`` (empty: none answers); returns valkey-server's arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stubs = {"hostname": f"echo {hostname}",
             "valkey-cli": f"[ -n '{sentinel_answer}' ] && printf '%s\\n6379\\n' '{sentinel_answer}' || exit 1",
             "valkey-server": f'for a in "$@"; do printf "%s\\n" "$a"; done > {tmp_path}/args'}
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "REDIS_PASSWORD": "pw"}
    subprocess.run(["sh", "-c", script], env=env, check=True, timeout=10)
    return (tmp_path / "args").read_text().splitlines()


@pytest.mark.parametrize(("pod", "answer", "replica_of"), [
    ("tessera-redis-0", "", None),  # first install: pod 0 is the primary
    ("tessera-redis-1", "", f"tessera-redis-0.{HEADLESS}"),
    ("tessera-redis-0", f"tessera-redis-2.{HEADLESS}", f"tessera-redis-2.{HEADLESS}"),  # pod 0 back after a failover
    ("tessera-redis-2", f"tessera-redis-2.{HEADLESS}", None),  # the Sentinels still name it: it stays primary
    ("tessera-redis-1", "ERR something", f"tessera-redis-0.{HEADLESS}"),  # an error is not an answer
])
def test_a_pod_takes_the_role_the_sentinels_give_it(pod: str, answer: str, replica_of: str | None,
                                                    tmp_path: Path) -> None:
    script = _containers(_statefulset())["redis"]["command"][2]
    args = _run_start_script(script, tmp_path, f"{pod}.{HEADLESS}".split(".")[0], answer)
    assert args[args.index("--replica-announce-ip") + 1] == f"{pod}.{HEADLESS}"
    if replica_of is None:
        assert "--replicaof" not in args
    else:
        assert args[args.index("--replicaof") + 1: args.index("--replicaof") + 3] == [replica_of, "6379"]


def test_a_sentinel_monitors_the_primary_the_others_name(tmp_path: Path) -> None:
    script = _containers(_statefulset())["sentinel"]["command"][2]
    script = script.replace("/sentinel/sentinel.conf", str(tmp_path / "sentinel.conf"))
    _run_start_script(script, tmp_path, "tessera-redis-1", f"tessera-redis-2.{HEADLESS}")
    conf = (tmp_path / "sentinel.conf").read_text().splitlines()
    assert f"sentinel monitor tessera tessera-redis-2.{HEADLESS} 6379 2" in conf
    assert f"sentinel announce-ip tessera-redis-1.{HEADLESS}" in conf
    assert shlex.split(conf[conf.index("requirepass pw")])[1] == "pw"
