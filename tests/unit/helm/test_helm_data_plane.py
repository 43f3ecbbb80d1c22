"""The chart's data-plane credentials (docs/security.md "The data plane"): one Secret per release (or the
user's), mounted as files where replicas are called or served and nowhere else; Prometheus scrapes the
replicas with the read-only token; replicas bind the pod IP they register."""

from __future__ import annotations

import base64
from typing import Any

from tests.support.chart import CHART_DIR, find, load_values, pod_specs, render

PRODUCTION = CHART_DIR / "ci" / "production-external-redis-values.yaml"
MOUNT = "/etc/tessera/data-plane/"


def _credentials(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per pod container: its data-plane env and the Secret items its data-plane volume holds."""
    found: dict[str, dict[str, Any]] = {}
    for doc in docs:
        for where, spec in pod_specs(doc):
            volume = next((v for v in spec.get("volumes") or [] if v["name"] == "data-plane"), None)
            for container in spec.get("containers") or []:
                env = {e["name"]: e.get("value") for e in container.get("env") or []}
                mounts = [m for m in container.get("volumeMounts") or [] if m["name"] == "data-plane"]
                found[f"{where}/{container['name']}"] = {
                    "key_file": env.get("TESSERA_DATA_PLANE_KEY_FILE"),
                    "token_file": env.get("TESSERA_METRICS_TOKEN_FILE"),
                    "mount": mounts[0] if mounts else None,
                    "secret": volume["secret"] if volume else None,
                }
    return found


def test_a_generated_secret_holds_a_long_random_key_and_token_and_is_kept() -> None:
    secret = find(render(), "Secret", "-data-plane")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    key, token = (base64.b64decode(secret["data"][name]) for name in ("data-plane-key", "metrics-token"))
    assert len(key) == 64 and len(token) == 48 and key != token
    again = find(render(), "Secret", "-data-plane")
    assert again["data"]["data-plane-key"] != secret["data"]["data-plane-key"]  # random per offline render


def test_the_key_reaches_callers_and_replicas_only_and_the_token_only_replicas() -> None:
    by_component = _credentials(render())
    gateway = next(c for w, c in by_component.items() if "-gateway/" in w)
    kvcontrol = next(c for w, c in by_component.items() if "-kvcontrol/" in w)
    operator = next(c for w, c in by_component.items() if "-operator/" in w)
    ray = [c for w, c in by_component.items() if w.startswith("RayService/")]
    for caller in (gateway, kvcontrol):
        assert caller["key_file"] == MOUNT + "data-plane.key" and caller["token_file"] is None
        assert [item["path"] for item in caller["secret"]["items"]] == ["data-plane.key"]
        assert caller["mount"]["readOnly"] is True and caller["mount"]["mountPath"] == MOUNT.rstrip("/")
    assert ray and all(c["key_file"] == MOUNT + "data-plane.key" and c["token_file"] == MOUNT + "metrics-token"
                       for c in ray)
    assert all({i["path"] for i in c["secret"]["items"]} == {"data-plane.key", "metrics-token"} for c in ray)
    assert all(c["secret"]["secretName"] == "tessera-data-plane" for c in (gateway, kvcontrol, *ray))
    assert operator["key_file"] is None and operator["secret"] is None  # it never calls a replica
    redis = [c for w, c in by_component.items() if "-redis" in w]
    assert redis and all(c["secret"] is None and c["key_file"] is None for c in redis)


def test_an_existing_secret_is_used_and_none_is_generated() -> None:
    docs = render(load_values(PRODUCTION))
    assert not [d for d in docs if d["kind"] == "Secret"]
    secrets = {c["secret"]["secretName"] for c in _credentials(docs).values() if c["secret"]}
    assert secrets == {"tessera-data-plane-credentials"}


def test_prometheus_scrapes_replicas_with_the_read_only_token() -> None:
    scrape = find(render(load_values(PRODUCTION)), "ScrapeConfig")
    assert scrape["spec"]["authorization"] == {
        "type": "Bearer", "credentials": {"name": "tessera-data-plane-credentials", "key": "metrics-token"}}


def test_replicas_bind_the_pod_ip_they_register() -> None:
    # EngineConfig.httpHost is null unless set: a replica binds TESSERA_ADVERTISE_HOST, the pod IP.
    engine_containers = [{e["name"]: e for e in container["env"]}
                         for _, spec in pod_specs(find(render(), "RayService")) for container in spec["containers"]
                         if any(e["name"] == "TESSERA_ENGINE_PORT_RANGE" for e in container.get("env") or [])]
    assert engine_containers
    for env in engine_containers:
        assert env["TESSERA_ADVERTISE_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
