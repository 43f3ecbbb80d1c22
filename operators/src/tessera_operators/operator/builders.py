"""Pure functions that parse the operator's objects and build what it writes: the tenant's key Secret, the
Serve application of a Model, the RayService patch, and the ``status`` blocks. No I/O here; the handlers
apply what these return.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from tessera.engine.config import EngineConfig
from tessera.tenancy.keys import IssuedKey, parse_key_id
from tessera.tenancy.policy import TENANT_NAME_PATTERN, TenantPolicy, validate_tenant_name

from .crds import GROUP

JSON = dict[str, Any]

MANAGED_BY = "tessera-operator"
TENANT_LABEL = f"{GROUP}/tenant"
KEY_ID_ANNOTATION = f"{GROUP}/key-id"
SECRET_KEY_FIELD = "api-key"
SECRET_KEY_ID_FIELD = "key-id"
DEFAULT_SECRET_PREFIX = "tessera-tenant-"
# Serve applications the operator owns, so it never edits one that came from the Helm values.
OWNED_APPLICATIONS_ANNOTATION = f"{GROUP}/operator-applications"
BUILD_APP_IMPORT_PATH = "tessera.engine.deployment:build_app"


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """A parsed ``Tenant``: its name is the tenant's name in Redis."""

    name: str
    policy: TenantPolicy
    secret_name: str
    key_generation: int


@dataclass(frozen=True, slots=True)
class KeyMaterial:
    """The key a tenant Secret holds."""

    key_id: str
    plaintext: str


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A parsed ``Model``: ``engine_values`` are the camelCase settings as written, already validated."""

    name: str
    engine: EngineConfig
    engine_values: JSON
    replicas: int | None  # None: what engine.autoscaling decides

    @property
    def wanted_replicas(self) -> int:
        """Replicas the Model is Ready with: the fixed count, or the autoscaling floor."""
        if self.replicas is not None:
            return self.replicas
        assert self.engine.autoscaling is not None, "parse_model gives a count to a model without autoscaling"
        return self.engine.autoscaling.min_replicas


def default_secret_name(tenant: str) -> str:
    return f"{DEFAULT_SECRET_PREFIX}{tenant}"


def parse_tenant(name: str, spec: Mapping[str, Any]) -> TenantSpec:
    """Raises ``ValueError`` (pydantic's ``ValidationError`` is one) for an invalid object."""
    validate_tenant_name(name)
    policy = TenantPolicy.model_validate(spec.get("policy") or {}, strict=True)
    key_generation = spec.get("keyGeneration", 0)
    if not isinstance(key_generation, int) or key_generation < 0:
        raise ValueError(f"spec.keyGeneration must be a non-negative integer, got {key_generation!r}")
    return TenantSpec(
        name=name,
        policy=policy,
        secret_name=spec.get("secretName") or default_secret_name(name),
        key_generation=key_generation,
    )


def owner_reference(body: Mapping[str, Any]) -> JSON:
    """An ownerReference to ``body``: Kubernetes deletes the owned object with its owner."""
    return {
        "apiVersion": body["apiVersion"],
        "kind": body["kind"],
        "name": body["metadata"]["name"],
        "uid": body["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": False,
    }


def build_tenant_secret(
    namespace: str, tenant: TenantSpec, key: IssuedKey, owner: JSON | None = None
) -> JSON:
    """The Secret holding a tenant's API key: the only place its plaintext is kept (Redis has the hash)."""
    metadata: JSON = {
        "name": tenant.secret_name,
        "namespace": namespace,
        "labels": {
            "app.kubernetes.io/managed-by": MANAGED_BY,
            "app.kubernetes.io/part-of": "tessera",
            TENANT_LABEL: tenant.name,
        },
        "annotations": {KEY_ID_ANNOTATION: key.key_id},
    }
    if owner is not None:
        metadata["ownerReferences"] = [owner]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": metadata,
        "data": {
            SECRET_KEY_FIELD: _b64(key.plaintext),
            SECRET_KEY_ID_FIELD: _b64(key.key_id),
        },
    }


def is_operator_secret(secret: Mapping[str, Any], tenant: str) -> bool:
    labels = (secret.get("metadata") or {}).get("labels") or {}
    return labels.get("app.kubernetes.io/managed-by") == MANAGED_BY and labels.get(TENANT_LABEL) == tenant


def secret_key_material(secret: Mapping[str, Any] | None) -> KeyMaterial | None:
    """The key a tenant Secret holds, or None when there is no Secret or it holds no well-formed key."""
    if not secret:
        return None
    data = secret.get("data") or {}
    try:
        plaintext = base64.b64decode(data[SECRET_KEY_FIELD], validate=True).decode()
    except (KeyError, ValueError):
        return None
    key_id = parse_key_id(plaintext)
    return KeyMaterial(key_id=key_id, plaintext=plaintext) if key_id else None


def build_tenant_status(
    phase: str,
    *,
    generation: int | None = None,
    message: str = "",
    key_id: str | None = None,
    key_sha256: str | None = None,
    key_generation: int | None = None,
    secret_name: str | None = None,
) -> JSON:
    """``key_sha256``: the hash Redis holds for ``key_id``; status keeps it so a Redis that lost everything
    gets the same key back (handlers.tenant_resync). Status, not the Secret: only the operator writes
    status, so nobody who may write the Secret can make the operator install a key of their choosing."""
    status: JSON = {"phase": phase, "message": message}
    if generation is not None:
        status["observedGeneration"] = generation
    if key_id is not None:
        status["keyId"] = key_id
    if key_sha256 is not None:
        status["keySha256"] = key_sha256
    if key_generation is not None:
        status["keyGeneration"] = key_generation
    if secret_name is not None:
        status["secretName"] = secret_name
    return status


def parse_model(name: str, spec: Mapping[str, Any]) -> ModelSpec:
    """Raises ``ValueError`` for an invalid object; the engine settings go through ``EngineConfig``."""
    if not TENANT_NAME_PATTERN.match(name):
        raise ValueError(f"Model name {name!r} must be a DNS label (it names the Serve application)")
    engine_values = spec.get("engine")
    if not isinstance(engine_values, Mapping):
        raise ValueError("spec.engine is required: the engine settings (EngineConfig, camelCase keys)")
    replicas = spec.get("replicas")
    if replicas is not None and (not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1):
        raise ValueError(f"spec.replicas must be a positive integer, got {replicas!r}")
    engine = EngineConfig.model_validate(engine_values, strict=True)
    if engine.autoscaling is not None and replicas is not None:
        raise ValueError(f"spec.replicas={replicas} and spec.engine.autoscaling are mutually exclusive: with "
                         "autoscaling, Serve owns the count (use autoscaling.minReplicas/maxReplicas/initialReplicas)")
    if engine.autoscaling is None and replicas is None:
        replicas = 1
    return ModelSpec(name=name, engine=engine, engine_values=_plain(engine_values), replicas=replicas)


def build_serve_application(name: str, engine_values: JSON, replicas: int | None) -> JSON:
    """One Serve application of the RayService: the same shape the chart renders for ``models[]``.
    ``replicas`` None (an autoscaled model): no fixed count in the args."""
    args: JSON = {"engine": engine_values}
    if replicas is not None:
        args["replicas"] = replicas
    return {"name": name, "route_prefix": f"/{name}", "import_path": BUILD_APP_IMPORT_PATH, "args": args}


class ApplicationOwnedElsewhereError(ValueError):
    """The RayService already has an application of that name that the Helm values define."""


def build_serve_config_patch(
    ray_service: Mapping[str, Any], *, upsert: JSON | None = None, remove: str | None = None
) -> JSON | None:
    """A JSON merge patch that adds/replaces (``upsert``) or removes an application in ``serveConfigV2``,
    or None when the RayService already says so. The patch carries the object's ``resourceVersion``, so a
    concurrent writer makes it fail with 409 instead of being overwritten.
    """
    if (upsert is None) == (remove is None):
        raise ValueError("give exactly one of upsert= or remove=")
    metadata = ray_service.get("metadata") or {}
    owned = _owned_applications(metadata)
    config = yaml.safe_load((ray_service.get("spec") or {}).get("serveConfigV2") or "") or {}
    applications: list[JSON] = list(config.get("applications") or [])
    names = [app.get("name") for app in applications]

    if upsert is not None:
        app_name = upsert["name"]
        if app_name in names and app_name not in owned:
            raise ApplicationOwnedElsewhereError(
                f"the RayService already serves an application {app_name!r} from the Helm values (the chart "
                "renders serveConfigV2 only with operator.enabled false); remove it from models[] or give "
                "the Model another name"
            )
        if app_name in names and applications[names.index(app_name)] == upsert and app_name in owned:
            return None
        if app_name in names:
            applications[names.index(app_name)] = upsert
        else:
            applications.append(upsert)
        new_owned = sorted(set(owned) | {app_name})
    else:
        assert remove is not None
        if remove not in owned:
            return None  # never created by the operator, or already removed
        applications = [app for app in applications if app.get("name") != remove]
        new_owned = sorted(set(owned) - {remove})

    config["applications"] = applications
    patch_metadata: JSON = {"annotations": {OWNED_APPLICATIONS_ANNOTATION: json.dumps(new_owned)}}
    if metadata.get("resourceVersion"):
        patch_metadata["resourceVersion"] = metadata["resourceVersion"]
    return {"metadata": patch_metadata, "spec": {"serveConfigV2": yaml.safe_dump(config, sort_keys=False)}}


def build_model_status(
    phase: str,
    *,
    generation: int | None = None,
    message: str = "",
    ray_service: str | None = None,
    application: str | None = None,
) -> JSON:
    status: JSON = {"phase": phase, "message": message}
    if generation is not None:
        status["observedGeneration"] = generation
    if ray_service is not None:
        status["rayService"] = ray_service
    if application is not None:
        status["application"] = application
    return status


def _owned_applications(metadata: Mapping[str, Any]) -> list[str]:
    raw = (metadata.get("annotations") or {}).get(OWNED_APPLICATIONS_ANNOTATION)
    if not raw:
        return []
    names = json.loads(raw)
    assert isinstance(names, list), f"{OWNED_APPLICATIONS_ANNOTATION} must hold a JSON list"
    return [str(n) for n in names]


def _plain(value: Any) -> Any:
    """A plain-dict copy of a (possibly kopf-wrapped) mapping, as YAML and JSON serialisers need."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()
