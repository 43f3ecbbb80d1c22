"""Rendering the chart with Helm's own engine (helm-python-sdk) and the checks run on what it renders."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "tessera"
CI_VALUES = sorted((CHART_DIR / "ci").glob("*-values.yaml"))
# KubeRay's RayService CRD, which the project does not copy in: the workspace's shared/ folder, beside the
# checkout (a workspace) or inside it (a device run's copy).
RAY_SERVICE_CRD_CANDIDATES = tuple(base / "shared" / "crds" / "ray.io_rayservices.yaml" for base in (REPO.parent, REPO))


def ray_service_crd() -> Path:
    """The first of ``RAY_SERVICE_CRD_CANDIDATES`` that exists; a missing one is an error that says where to put
    it (the schema check of every rendered RayService cannot run without it)."""
    for path in RAY_SERVICE_CRD_CANDIDATES:
        if path.is_file():
            return path
    raise FileNotFoundError("KubeRay's RayService CRD (ray.io_rayservices.yaml) is not in shared/crds/ beside or "
                            "inside the checkout; looked at: " + ", ".join(map(str, RAY_SERVICE_CRD_CANDIDATES)))


KUBE_VERSION = "1.30.0"
RELEASE = "tessera"
NAMESPACE = "llm"
JSON = dict[str, Any]


@functools.cache
def chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART_DIR)


def load_values(path: Path) -> JSON:
    values: JSON = yaml.safe_load(path.read_text()) or {}
    return values


def render_files(values: JSON | None = None, *, release: str = RELEASE) -> dict[str, str]:
    return chart().render(values or {}, name=release, namespace=NAMESPACE, is_install=True)


def render(values: JSON | None = None, *, release: str = RELEASE) -> list[JSON]:
    """Every object the chart renders (NOTES.txt excluded), in template order."""
    docs: list[JSON] = []
    for path, text in sorted(render_files(values, release=release).items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def env_values(container: JSON) -> dict[str, str]:
    """A container's plain env values by name ("" for one taken from a Secret or a field)."""
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


def find(docs: list[JSON], kind: str, name_suffix: str = "") -> JSON:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(matches) == 1, (
        f"expected one {kind} named *{name_suffix}, found {[m['metadata']['name'] for m in matches]}"
    )
    return matches[0]


def serve_config(docs: list[JSON]) -> JSON:
    """The Serve config these objects make, whoever owns it: the RayService's serveConfigV2 when the chart
    renders it (operator disabled), else what the operator writes for the rendered Model objects."""
    from tessera_operators.operator.builders import build_serve_application

    spec = find(docs, "RayService")["spec"]
    if "serveConfigV2" in spec:
        config: JSON = yaml.safe_load(spec["serveConfigV2"])
        return config
    models = [d for d in docs if d["kind"] == "Model"]
    return {
        "applications": [
            build_serve_application(m["metadata"]["name"], m["spec"]["engine"], m["spec"].get("replicas"))
            for m in models
        ]
    }


PVC_MOUNT_ROOT = "/mnt/pvc"  # values.yaml modelStorage.pvcMountRoot


def served_engine(engine: JSON, pvc_mount_root: str = PVC_MOUNT_ROOT) -> JSON:
    """The engine settings the chart puts in the serve config for these values: the same, except that a
    pvc://<claim>/<path> model, tokenizer or draft model becomes <pvc_mount_root>/<claim>/<path>."""

    def resolve(path: Any) -> Any:
        if isinstance(path, str) and path.startswith("pvc://"):
            return f"{pvc_mount_root.rstrip('/')}/{path.removeprefix('pvc://').rstrip('/')}"
        return path

    served = {**engine, **{key: resolve(engine[key]) for key in ("model", "tokenizer") if key in engine}}
    speculative = engine.get("speculative")
    if isinstance(speculative, dict) and "draftModel" in speculative:
        served["speculative"] = {**speculative, "draftModel": resolve(speculative["draftModel"])}
    return served


def pod_specs(doc: JSON) -> Iterator[tuple[str, JSON]]:
    """(where, pod spec) for each pod template in an object: workloads and the RayService's groups."""
    kind, name = doc["kind"], doc["metadata"]["name"]
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        yield f"{kind}/{name}", doc["spec"]["template"]["spec"]
    elif kind == "RayService":
        cluster = doc["spec"]["rayClusterConfig"]
        yield f"{kind}/{name}/head", cluster["headGroupSpec"]["template"]["spec"]
        for group in cluster.get("workerGroupSpecs") or []:
            yield f"{kind}/{name}/{group['groupName']}", group["template"]["spec"]
    elif kind == "Pod":
        yield f"{kind}/{name}", doc["spec"]


def pod_templates(doc: JSON) -> Iterator[tuple[str, JSON]]:
    """(where, pod template with metadata) for workloads and RayService groups."""
    kind, name = doc["kind"], doc["metadata"]["name"]
    if kind in ("Deployment", "StatefulSet", "DaemonSet"):
        yield f"{kind}/{name}", doc["spec"]["template"]
    elif kind == "RayService":
        cluster = doc["spec"]["rayClusterConfig"]
        yield f"{kind}/{name}/head", cluster["headGroupSpec"]["template"]
        for group in cluster.get("workerGroupSpecs") or []:
            yield f"{kind}/{name}/{group['groupName']}", group["template"]


# --- Pod Security Standard "restricted" (https://kubernetes.io/docs/concepts/security/pod-security-standards/)

RESTRICTED_VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}


def restricted_violations(spec: JSON) -> list[str]:
    """Every way a pod spec breaks the restricted (and so the baseline) Pod Security Standard."""
    problems: list[str] = []
    pod_ctx = spec.get("securityContext") or {}
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(host):
            problems.append(f"{host} is set")
    for volume in spec.get("volumes") or []:
        types = set(volume) - {"name"}
        if not types <= RESTRICTED_VOLUME_TYPES:
            problems.append(f"volume {volume['name']} has a disallowed type {sorted(types)}")
    for sysctl in pod_ctx.get("sysctls") or []:
        if sysctl["name"] not in SAFE_SYSCTLS:
            problems.append(f"unsafe sysctl {sysctl['name']}")
    if (pod_ctx.get("seLinuxOptions") or {}).get("user") or (pod_ctx.get("seLinuxOptions") or {}).get("role"):
        problems.append("pod seLinuxOptions sets user or role")
    if pod_ctx.get("runAsUser") == 0:
        problems.append("pod runAsUser is 0")
    containers = [
        *(spec.get("initContainers") or []),
        *(spec.get("containers") or []),
        *(spec.get("ephemeralContainers") or []),
    ]
    for container in containers:
        where = f"container {container['name']}"
        ctx = container.get("securityContext") or {}
        if ctx.get("privileged"):
            problems.append(f"{where} is privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where} does not set allowPrivilegeEscalation: false")
        caps = ctx.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            problems.append(f"{where} does not drop ALL capabilities")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append(f"{where} adds capabilities {caps['add']}")
        run_as_non_root = ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot"))
        if run_as_non_root is not True:
            problems.append(f"{where} may run as root (runAsNonRoot not true)")
        if ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
            problems.append(f"{where} runs as UID 0")
        seccomp = (ctx.get("seccompProfile") or pod_ctx.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{where} has seccomp profile {seccomp!r}, not RuntimeDefault/Localhost")
        if ctx.get("procMount", "Default") != "Default":
            problems.append(f"{where} sets procMount")
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                problems.append(f"{where} uses hostPort {port['hostPort']}")
    return problems


SECRET_WORDS = ("PASSWORD", "TOKEN", "SECRET", "API_KEY", "APIKEY", "CREDENTIAL")


def secret_handling_violations(spec: JSON) -> list[str]:
    """Secrets may reach a container only through secretKeyRef or a mounted Secret volume."""
    problems: list[str] = []
    secret_volumes = {v["name"] for v in spec.get("volumes") or [] if "secret" in v}
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        where = f"container {container['name']}"
        for source in container.get("envFrom") or []:
            if "secretRef" in source:
                problems.append(f"{where} imports a whole Secret with envFrom (use secretKeyRef)")
        secret_mounts = [m["mountPath"].rstrip("/") + "/" for m in container.get("volumeMounts") or []
                         if m["name"] in secret_volumes]
        for env in container.get("env") or []:
            name, value = env["name"], env.get("value")
            looks_secret = any(word in name.upper() for word in SECRET_WORDS)
            if looks_secret and name.upper().endswith("_FILE") and value is not None:
                # A path, not a value: it must lie in a mounted Secret volume.
                if not any(value.startswith(mount) for mount in secret_mounts):
                    problems.append(f"{where} sets {name} to {value}, outside every mounted Secret volume")
                continue
            if looks_secret and value is not None:
                problems.append(f"{where} sets {name} from a literal value")
            if looks_secret and value is None and "secretKeyRef" not in (env.get("valueFrom") or {}):
                problems.append(f"{where} sets {name} from something other than a secretKeyRef")
            if value and "://" in value and "@" in value and "$(REDIS_PASSWORD)" not in value:
                problems.append(f"{where} puts credentials in the URL {name}={value}")
        for arg in [*(container.get("command") or []), *(container.get("args") or [])]:
            if "--requirepass" in arg and "$REDIS_PASSWORD" not in arg:
                problems.append(f"{where} passes a literal password on its command line")
    return problems
