"""The engine pods' extension points (the RayService's head and GPU worker groups): the values arrive in the
pod specs, model sources become volumes and engine paths, the startup probe says what it claims, and each
cross-field check fails `helm template` with its message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import helm_python
import pytest
from tests.support.chart import (
    CHART_DIR,
    JSON,
    find,
    load_values,
    pod_specs,
    render,
    restricted_violations,
    secret_handling_violations,
    serve_config,
)

SERVING_IMAGE = "tessera/serving:0.1.0"


def _ray_pods(values: JSON | None = None) -> tuple[JSON, JSON, JSON]:
    """(head pod spec, worker pod spec, the worker group) of the rendered RayService."""
    ray_service = find(render(values), "RayService")
    cluster = ray_service["spec"]["rayClusterConfig"]
    (workers,) = cluster["workerGroupSpecs"]
    return cluster["headGroupSpec"]["template"]["spec"], workers["template"]["spec"], workers


def _scenario(name: str) -> JSON:
    return load_values(CHART_DIR / "ci" / f"{name}-values.yaml")


def _env(container: JSON) -> dict[str, JSON]:
    return {e["name"]: e for e in container.get("env") or []}


def _by_name(items: list[JSON]) -> dict[str, JSON]:
    return {item["name"]: item for item in items}


def _mounts(container: JSON) -> dict[str, JSON]:
    return {m["mountPath"]: m for m in container.get("volumeMounts") or []}


# --- scenarios ---------------------------------------------------------------------------------------------


def test_gpu_nodes_scenario() -> None:
    values = _scenario("gpu-nodes")
    workers_values = values["rayService"]["engineWorkers"]
    head, spec, group = _ray_pods(values)
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["priorityClassName"] == "tessera-gpu"
    assert head["priorityClassName"] == "tessera-control" and "runtimeClassName" not in head
    assert spec["affinity"] == workers_values["affinity"]
    assert spec["tolerations"] == workers_values["tolerations"]
    assert group["rayStartParams"]["num-gpus"] == "2"

    (container,) = spec["containers"]
    env = _env(container)
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert env["HF_HOME"]["value"] == "/cache/huggingface"
    assert env["NCCL_DEBUG"]["value"] == "WARN"
    assert env["NCCL_TOPO_FILE"]["value"] == "/etc/nccl/topology.xml"
    assert [e["name"] for e in container["env"]][-2:] == ["NCCL_DEBUG", "NCCL_TOPO_FILE"], "extra env comes last"
    assert container["envFrom"] == [{"configMapRef": {"name": "vllm-settings"}}]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2

    volumes = _by_name(spec["volumes"])
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert volumes["hf-cache"]["persistentVolumeClaim"] == {"claimName": "hf-cache"}, "the cache is writable"
    assert volumes["nccl-topology"]["configMap"] == {"name": "nccl-topology"}
    mounts = _mounts(container)
    assert mounts["/dev/shm"]["name"] == "dshm"
    assert mounts["/cache/huggingface"]["name"] == "hf-cache"
    assert mounts["/etc/nccl"] == {"name": "nccl-topology", "mountPath": "/etc/nccl", "readOnly": True}

    # The fetch init container downloads the hub model into the cache with the token, before Ray starts.
    (fetch,) = spec["initContainers"]
    assert fetch["name"] == "fetch-models" and fetch["image"] == SERVING_IMAGE
    assert fetch["command"][:2] == ["python3", "-c"] and "snapshot_download" in fetch["command"][2]
    assert fetch["command"][3:] == ["meta-llama/Llama-3.1-8B-Instruct"]
    fetch_env = _env(fetch)
    assert fetch_env["HF_TOKEN"] == env["HF_TOKEN"] and fetch_env["HF_HOME"] == env["HF_HOME"]
    assert set(_mounts(fetch)) == {"/cache/huggingface", "/etc/nccl"}
    assert restricted_violations(spec) == [] and secret_handling_violations(spec) == []

    probe = container["startupProbe"]
    assert probe["failureThreshold"] == 360 and probe["periodSeconds"] == 10
    # The gateway reads tokenizers from the same cache, read-only.
    gateway = find(render(values), "Deployment", "-gateway")["spec"]["template"]["spec"]
    assert _mounts(gateway["containers"][0])["/cache/huggingface"]["readOnly"] is True
    assert _by_name(gateway["volumes"])["hf-cache"]["persistentVolumeClaim"]["readOnly"] is True


def test_pvc_model_scenario() -> None:
    values = _scenario("pvc-model")
    docs = render(values)
    _, spec, _ = _ray_pods(values)
    gateway = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]
    for pod in (spec, gateway):
        volumes = _by_name(pod["volumes"])
        mounts = _mounts(pod["containers"][0])
        for claim in ("model-weights", "qwen-weights"):
            assert volumes[f"pvc-{claim}"]["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
            assert mounts[f"/mnt/pvc/{claim}"] == {
                "name": f"pvc-{claim}",
                "mountPath": f"/mnt/pvc/{claim}",
                "readOnly": True,
            }
    assert "initContainers" not in spec
    engines = {a["name"]: a["args"]["engine"] for a in serve_config(docs)["applications"]}
    eagle, qwen = engines["llama-3-8b-eagle"], engines["qwen-7b"]
    assert eagle["model"] == "/mnt/pvc/model-weights/llama-3.1-8b-instruct"
    assert eagle["speculative"]["draftModel"] == "/mnt/pvc/model-weights/eagle-llama-3.1-8b-instruct"
    assert qwen["model"] == "/mnt/pvc/qwen-weights/Qwen2.5-7B-Instruct"
    assert qwen["tokenizer"] == "/mnt/pvc/qwen-weights/Qwen2.5-7B-Instruct/tokenizer"


def test_pvc_mount_root_and_long_claim_names() -> None:
    claim = "weights." + "a" * 60
    engine = {"model": f"pvc://{claim}/m", "servedModelName": "m"}
    values = {"models": [{"name": "m", "engine": engine}], "modelStorage": {"pvcMountRoot": "/weights/"}}
    docs = render(values)
    _, spec, _ = _ray_pods(values)
    (volume,) = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
    assert volume["persistentVolumeClaim"]["claimName"] == claim
    assert len(volume["name"]) <= 63 and volume["name"].startswith("pvc-")
    assert _mounts(spec["containers"][0])[f"/weights/{claim}"]["name"] == volume["name"]
    assert serve_config(docs)["applications"][0]["args"]["engine"]["model"] == f"/weights/{claim}/m"


def test_model_fetch_scenario() -> None:
    values = _scenario("model-fetch")
    fetch_values = values["modelStorage"]["fetch"]
    head, spec, _ = _ray_pods(values)
    (fetch,) = spec["initContainers"]
    assert fetch["image"] == "registry.example.com/tools/s5cmd:v2.3.0"
    assert fetch["command"] == fetch_values["command"]
    assert fetch["resources"] == fetch_values["resources"]
    env = _env(fetch)
    assert "HF_TOKEN" not in env and env["HF_HOME"]["value"] == "/cache/huggingface"
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "model-bucket"
    assert _by_name(spec["volumes"])["hf-cache"] == {"name": "hf-cache", "emptyDir": {"sizeLimit": "100Gi"}}
    assert _env(head["containers"][0])["RAY_SERVE_LOG_ENCODING"]["value"] == "JSON"
    assert _env(spec["containers"][0])["VLLM_LOGGING_LEVEL"]["value"] == "DEBUG"
    # A per-pod emptyDir cache is not the gateway's; the shared tokenizer claim is.
    gateway = find(render(values), "Deployment", "-gateway")["spec"]["template"]["spec"]
    assert "hf-cache" not in _by_name(gateway["volumes"])
    assert _mounts(gateway["containers"][0])["/models"]["readOnly"] is True


def test_defaults() -> None:
    head, spec, _ = _ray_pods()
    for pod in (head, spec):
        assert "priorityClassName" not in pod and "runtimeClassName" not in pod and "initContainers" not in pod
        assert "envFrom" not in pod["containers"][0]
    assert _by_name(spec["volumes"])["hf-cache"] == {"name": "hf-cache", "emptyDir": {}}
    env = _env(spec["containers"][0])
    assert env["HF_HOME"]["value"] == "/cache/huggingface" and "HF_TOKEN" not in env
    probe = spec["containers"][0]["startupProbe"]
    assert (probe["initialDelaySeconds"], probe["periodSeconds"], probe["failureThreshold"]) == (30, 10, 180)
    assert "startupProbe" not in head["containers"][0]
    _, off, _ = _ray_pods({"rayService": {"engineWorkers": {"startupProbe": {"enabled": False}}}})
    assert "startupProbe" not in off["containers"][0]


def test_hub_token_without_a_cache_claim_and_env_the_chart_does_not_set() -> None:
    """HF_TOKEN may come from the user's own env (secretKeyRef) when hfTokenSecret is not set."""
    own_token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "mine", "key": "t"}}}
    _, spec, _ = _ray_pods({"rayService": {"engineWorkers": {"env": [own_token]}}})
    assert _env(spec["containers"][0])["HF_TOKEN"] == own_token


def test_every_engine_pod_stays_restricted_with_every_extension() -> None:
    for name in ("gpu-nodes", "pvc-model", "model-fetch"):
        for doc in render(_scenario(name)):
            for where, spec in pod_specs(doc):
                assert restricted_violations(spec) == [], (name, where)


# --- the startup probe -------------------------------------------------------------------------------------


class _FakeRay:
    """Stands in for the local dashboard agent and the head's dashboard on one port."""

    def __init__(self) -> None:
        self.raylet = b"success"
        self.applications: JSON = {}
        self.dashboard_status = 200
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path == "/api/local_raylet_healthz":
                    status, body = 200, fake.raylet
                elif self.path == "/api/serve/applications/":
                    status, body = fake.dashboard_status, json.dumps({"applications": fake.applications}).encode()
                else:
                    status, body = 404, b""
                self.send_response(status)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def fake_ray() -> Iterator[_FakeRay]:
    fake = _FakeRay()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


POD_IP = "10.1.2.3"


def _probe(fake: _FakeRay) -> subprocess.CompletedProcess[str]:
    """Runs the rendered probe's script as kubelet would, pointed at the stand-in."""
    _, spec, _ = _ray_pods()
    command = spec["containers"][0]["startupProbe"]["exec"]["command"]
    assert command[0] == "python3" and command[1] == "-c"
    assert command[3:] == ["http://localhost:52365", "8265"], "the raylet's agent and the head's dashboard"
    env = {**os.environ, "FQ_RAY_IP": "127.0.0.1", "TESSERA_ADVERTISE_HOST": POD_IP}
    argv = [sys.executable, "-c", command[2], f"http://127.0.0.1:{fake.port}", str(fake.port)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=False)


def _app(*replicas: tuple[str, str, str]) -> JSON:
    return {
        "deployments": {
            "engine-m": {
                "replicas": [{"replica_id": r, "node_ip": ip, "state": state} for r, ip, state in replicas]
            }
        }
    }


def test_startup_probe_passes_on_a_pod_without_replicas(fake_ray: _FakeRay) -> None:
    assert _probe(fake_ray).returncode == 0
    fake_ray.applications = {"m": _app(("r1", "10.9.9.9", "STARTING"))}
    assert _probe(fake_ray).returncode == 0, "a replica loading on another pod is not this pod's business"


def test_startup_probe_waits_for_this_pods_replicas_to_load(fake_ray: _FakeRay) -> None:
    fake_ray.applications = {"m": _app(("r1", POD_IP, "RUNNING"), ("r2", POD_IP, "STARTING"))}
    result = _probe(fake_ray)
    assert result.returncode == 1
    assert "engine replicas still starting on this pod: m/r2" in result.stderr
    fake_ray.applications = {"m": _app(("r1", POD_IP, "RUNNING"), ("r2", POD_IP, "RUNNING"))}
    assert _probe(fake_ray).returncode == 0


def test_startup_probe_fails_while_ray_cannot_answer(fake_ray: _FakeRay) -> None:
    fake_ray.raylet = b"not yet"
    result = _probe(fake_ray)
    assert result.returncode == 1 and "the raylet is not healthy yet" in result.stderr
    fake_ray.raylet = b"success"
    fake_ray.dashboard_status = 503
    result = _probe(fake_ray)
    assert result.returncode == 1 and "cannot tell yet" in result.stderr


def test_startup_probe_reads_fields_ray_serve_reports() -> None:
    """The probe's field and state names are those of Ray Serve's REST schema (GET /api/serve/applications/)."""
    from ray.serve._private.common import ReplicaState
    from ray.serve.schema import ApplicationDetails, DeploymentDetails, ReplicaDetails, ServeInstanceDetails

    assert "applications" in ServeInstanceDetails.model_fields
    assert "deployments" in ApplicationDetails.model_fields
    assert "replicas" in DeploymentDetails.model_fields
    assert {"replica_id", "node_ip", "state"} <= set(ReplicaDetails.model_fields)
    assert {"STARTING", "UPDATING", "RECOVERING"} <= {s.value for s in ReplicaState}


# --- cross-field checks ------------------------------------------------------------------------------------


def _model(name: str = "m", replicas: int = 1, **engine: Any) -> JSON:
    return {"name": name, "replicas": replicas, "engine": {"model": "/models/m", **engine}}


def _workers(**values: Any) -> JSON:
    return {"rayService": {"engineWorkers": values}}


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        (
            {"models": [_model("a"), _model("b")]},
            "the models need 2 GPUs (replicas x tensorParallelSize: a: 1 x 1, b: 1 x 1) but "
            "rayService.engineWorkers can have at most 1: replicas=1 pods",
        ),
        (
            {"models": [_model(replicas=3, tensorParallelSize=3)], **_workers(gpusPerPod=8)},
            "models[0] (m): replicas=3 do not fit: a pod of gpusPerPod=8 GPUs holds 2 replica(s) of "
            "tensorParallelSize=3",
        ),
        (
            {
                "models": [_model(replicas=3)],
                "rayService": {"enableInTreeAutoscaling": True, "engineWorkers": {"maxReplicas": 2}},
            },
            "can have maxReplicas=2 pods",
        ),
        ({"hfTokenSecret": {"name": "hf-token"}}, 'hfTokenSecret.key is required when hfTokenSecret.name is set'),
        ({"hfTokenSecret": {"key": "token"}}, 'hfTokenSecret.key="token" is set but hfTokenSecret.name is empty'),
        (
            {"models": [_model(model="pvc:///llama-3-8b")]},
            'models[0] (m).engine.model="pvc:///llama-3-8b" names no claim: write pvc://<claim>/<path>',
        ),
        ({"models": [_model(model="pvc://")]}, "names no claim"),
        (
            {"models": [_model(speculative={"method": "eagle", "draftModel": "pvc://"})]},
            'models[0] (m).engine.speculative.draftModel="pvc://" names no claim',
        ),
        (
            {"models": [_model(model="pvc://Model_Weights/m")]},
            '"Model_Weights" is not a PersistentVolumeClaim name',
        ),
        (
            _workers(shmSizeLimit="16GB"),
            'rayService.engineWorkers.shmSizeLimit="16GB" is not a Kubernetes quantity: write e.g. 16Gi',
        ),
        (_workers(shmSizeLimit=16), "rayService.engineWorkers.shmSizeLimit=16 is below 64Mi"),
        (
            _workers(shmSizeLimit="64Gi"),
            "shmSizeLimit=64Gi must be below resources.limits.memory=48Gi: /dev/shm is memory-backed",
        ),
        (
            _workers(shmSizeLimit="2Gi", resources={"limits": {"memory": "2G"}}),
            "shmSizeLimit=2Gi must be below resources.limits.memory=2G",
        ),
        ({"modelStorage": {"hubCache": {"sizeLimit": "lots"}}}, 'modelStorage.hubCache.sizeLimit="lots" is not'),
        ({"modelStorage": {"fetch": {"enabled": True}}}, "modelStorage.fetch is enabled with no command"),
        (
            {"modelStorage": {"fetch": {"enabled": True, "command": ["true"], "env": [{"name": "HF_HOME"}]}}},
            "modelStorage.fetch.env[0]: HF_HOME is set by the chart",
        ),
        (
            _workers(env=[{"name": "HF_HOME", "value": "/x"}]),
            "rayService.engineWorkers.env[0]: HF_HOME is set by the chart (use modelStorage.hubCache.mountPath)",
        ),
        (
            {
                "hfTokenSecret": {"name": "hf", "key": "t"},
                **_workers(env=[{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "x", "key": "y"}}}]),
            },
            "rayService.engineWorkers.env[0]: HF_TOKEN is set by the chart (use hfTokenSecret)",
        ),
        (
            {"rayService": {"head": {"env": [{"name": "TESSERA_REDIS_URL", "value": "redis://r"}]}}},
            "rayService.head.env[0]: TESSERA_REDIS_URL is set by the chart",
        ),
        (
            _workers(extraVolumes=[{"name": "dshm", "emptyDir": {}}]),
            'rayService.engineWorkers.extraVolumes[0]: the volume name "dshm" is the chart\'s',
        ),
        (
            _workers(extraVolumes=[{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}]),
            'rayService.engineWorkers.extraVolumes[1]: the volume name "a" is used twice',
        ),
        (
            _workers(extraVolumeMounts=[{"name": "scratch", "mountPath": "/scratch"}]),
            'rayService.engineWorkers.extraVolumeMounts[0]: volume "scratch" is not in '
            "rayService.engineWorkers.extraVolumes",
        ),
        (
            _workers(
                extraVolumes=[{"name": "scratch", "emptyDir": {}}],
                extraVolumeMounts=[{"name": "scratch", "mountPath": "/dev/shm"}],
            ),
            "rayService.engineWorkers.extraVolumeMounts[0]: /dev/shm is already the mount path of the chart's "
            "dshm volume",
        ),
        (
            {"modelStorage": {"existingClaim": "weights", "hubCache": {"mountPath": "/models"}}},
            "rayService.engineWorkers: the chart mounts two volumes at /models",
        ),
    ],
)
def test_cross_field_checks_fail_with_their_message(values: JSON, needle: str) -> None:
    with pytest.raises(helm_python.HelmRenderError) as caught:
        render(values)
    assert needle in str(caught.value), str(caught.value)


@pytest.mark.parametrize(
    "values",
    [
        {"models": [_model(replicas=4)], **_workers(replicas=4)},
        {
            "models": [_model(replicas=2, tensorParallelSize=4)],
            **_workers(gpusPerPod=8, replicas=1, resources={"limits": {"memory": "400Gi"}}),
        },
        {
            "models": [_model(replicas=3)],
            "rayService": {"enableInTreeAutoscaling": True, "engineWorkers": {"maxReplicas": 3}},
        },
        _workers(shmSizeLimit="2G", resources={"limits": {"memory": "2Gi"}}),
        _workers(shmSizeLimit="1.5Gi", resources={"limits": {"memory": "2Gi"}}),
        _workers(shmSizeLimit=17179869184),
        {"models": [_model(model="pvc://weights")]},
        {"models": [_model("a"), _model("b", replicas=4, accelerator="cpu")]},
    ],
    ids=["replicas-fill-pods", "two-tp4-on-8", "autoscaler-max", "decimal-below-binary", "fraction", "bytes",
         "claim-root", "cpu-replicas-need-no-gpu"],
)
def test_what_fits_renders(values: JSON) -> None:
    render(values)


def test_shm_equal_to_the_memory_limit_is_refused() -> None:
    with pytest.raises(helm_python.HelmRenderError, match="must be below resources.limits.memory=1536Mi"):
        render(_workers(shmSizeLimit="1.5Gi", resources={"limits": {"memory": "1536Mi"}}))


def test_a_size_in_bytes_is_written_in_full() -> None:
    _, spec, _ = _ray_pods(_workers(shmSizeLimit=17179869184))
    assert _by_name(spec["volumes"])["dshm"]["emptyDir"]["sizeLimit"] == 17179869184


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        (_workers(extraVolumes=[{"name": "host", "hostPath": {"path": "/"}}]), "'hostPath' not allowed"),
        (
            _workers(extraVolumes=[{"name": "two", "emptyDir": {}, "configMap": {"name": "c"}}]),
            "/rayService/engineWorkers/extraVolumes/0",
        ),
        (_workers(extraVolumes=[{"name": "none"}]), "/rayService/engineWorkers/extraVolumes/0"),
        (_workers(envFrom=[{"secretRef": {"name": "s"}}]), "'secretRef' not allowed"),
        (_workers(runtimeClassName="NVIDIA"), "/rayService/engineWorkers/runtimeClassName"),
        ({"rayService": {"head": {"env": [{"value": "x"}]}}}, "/rayService/head/env/0"),
        ({"modelStorage": {"fetch": {"enabled": True, "imag": {}}}}, "'imag' not allowed"),
        ({"hfTokenSecret": {"name": "hf", "key": "a key"}}, "/hfTokenSecret/key"),
        (_workers(startupProbe={"failureThreshold": 0}), "/rayService/engineWorkers/startupProbe/failureThreshold"),
    ],
)
def test_the_schema_rejects_unsafe_or_mistyped_extensions(values: JSON, needle: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as caught:
        render(values)
    assert needle in str(caught.value), str(caught.value)
