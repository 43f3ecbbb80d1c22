"""The Tenant and Model CustomResourceDefinitions, built from the pydantic models they carry.

``spec.policy`` of a Tenant is ``TenantPolicy`` and ``spec.engine`` of a Model is ``EngineConfig``, so the
CRDs' OpenAPI schemas are generated from those models (``to_structural``) rather than written by hand;
scripts/gen_chart_schema.py writes them to helm/tessera/crds/ and a test checks the files are current.

Kubernetes needs *structural* schemas: every node typed, ``nullable`` instead of a ``null`` type, no
``additionalProperties`` beside ``properties``. Unknown fields are pruned by the API server and rejected
by ``kubectl apply`` (strict server-side field validation); the cross-field rules pydantic checks are
enforced by the handlers, which answer a ``PermanentError`` and ``status.phase: Failed``.
"""

from __future__ import annotations

from typing import Any

from tessera.engine.config import EngineConfig
from tessera.tenancy.policy import TenantPolicy

GROUP = "tessera.dev"
VERSION = "v1alpha1"
JSON = dict[str, Any]

TENANT_PHASES = ["Pending", "Ready", "Failed", "Deleting"]
MODEL_PHASES = ["Pending", "Applied", "Ready", "Failed", "Deleting"]
# Secret names are DNS subdomains.
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def to_structural(schema: JSON) -> JSON:
    """A pydantic JSON schema as a Kubernetes structural OpenAPI v3 schema (refs inlined)."""
    defs: dict[str, JSON] = schema.get("$defs", {})

    def convert(node: JSON) -> JSON:
        if "$ref" in node:
            target = defs[node["$ref"].removeprefix("#/$defs/")]
            siblings = {k: v for k, v in node.items() if k != "$ref"}
            return convert({**target, **siblings})
        if "anyOf" in node:
            options = [o for o in node["anyOf"] if o != {"type": "null"}]
            if len(options) != 1:
                raise ValueError(f"cannot express anyOf with {len(options)} non-null options structurally")
            merged = {**{k: v for k, v in node.items() if k != "anyOf"}, **options[0]}
            converted = convert(merged)
            if len(options) < len(node["anyOf"]):
                converted["nullable"] = True
            return converted
        out: JSON = {}
        for key, value in node.items():
            if key in ("title", "default", "$defs", "additionalProperties"):
                # Defaults stay pydantic's (applied by the handler): a stored object is what its author wrote.
                continue
            if key in ("exclusiveMinimum", "exclusiveMaximum"):
                bound = "minimum" if key == "exclusiveMinimum" else "maximum"
                out[bound] = value
                out[key] = True
            elif key == "properties":
                out[key] = {name: convert(sub) for name, sub in value.items()}
            elif key == "items":
                out[key] = convert(value)
            else:
                out[key] = value
        if "type" not in out:
            raise ValueError(f"untyped schema node {node!r}: structural schemas need a type")
        return out

    return convert(schema)


def _printer_column(name: str, json_path: str, kind: str = "string") -> JSON:
    return {"name": name, "type": kind, "jsonPath": json_path}


def _crd(
    kind: str, plural: str, short_names: list[str], spec: JSON, status: JSON, columns: list[JSON]
) -> JSON:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "tessera", "app.kubernetes.io/part-of": "tessera"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": short_names,
                "categories": ["tessera"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        *columns,
                        _printer_column("Age", ".metadata.creationTimestamp", "date"),
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec,
                                "status": status,
                            },
                        }
                    },
                }
            ],
        },
    }


# The Kubernetes condition shape (metav1.Condition): Applied, EnginesRunning, Ready (operator/conditions.py).
_CONDITIONS: JSON = {
    "type": "array",
    "x-kubernetes-list-type": "map",
    "x-kubernetes-list-map-keys": ["type"],
    "items": {
        "type": "object",
        "required": ["type", "status", "reason", "lastTransitionTime"],
        "properties": {
            "type": {"type": "string", "maxLength": 316},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": {"type": "string", "maxLength": 1024},
            "message": {"type": "string", "maxLength": 32768},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
            "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
        },
    },
}


def _status(phases: list[str], extra: dict[str, JSON]) -> JSON:
    return {
        "type": "object",
        # NOTE: kopf keeps handler progress under status when annotations cannot hold it; do not prune it.
        "x-kubernetes-preserve-unknown-fields": True,
        "properties": {
            "phase": {"type": "string", "enum": phases},
            "message": {"type": "string"},
            "observedGeneration": {"type": "integer", "format": "int64"},
            **extra,
        },
    }


def build_tenant_crd() -> JSON:
    """Tenant: a tenant's policy (to Redis) and where the operator keeps its API key (a Secret)."""
    policy = to_structural(TenantPolicy.model_json_schema(by_alias=True))
    policy["description"] = "The tenant's limits (tessera.tenancy.policy.TenantPolicy, camelCase keys)."
    spec: JSON = {
        "type": "object",
        "properties": {
            "policy": policy,
            "secretName": {
                "type": "string",
                "maxLength": 253,
                "pattern": DNS_SUBDOMAIN,
                "description": "Secret receiving the API key (keys api-key, key-id); "
                "default tessera-tenant-<name>.",
            },
            "keyGeneration": {
                "type": "integer",
                "format": "int64",
                "minimum": 0,
                "description": "Raise it to rotate the key: a new key is written and the old one revoked.",
            },
        },
    }
    status = _status(
        TENANT_PHASES,
        {
            "keyId": {"type": "string", "description": "Public id of the current key (tsk-<keyId>-...)."},
            "keySha256": {
                "type": "string",
                "pattern": "^[0-9a-f]{64}$",
                "description": "SHA-256 of the current key (never the key): the operator re-installs it in a "
                "Redis that lost it, so the key in the Secret keeps working.",
            },
            "keyGeneration": {"type": "integer", "format": "int64"},
            "secretName": {"type": "string"},
        },
    )
    columns = [
        _printer_column("Phase", ".status.phase"),
        _printer_column("Key", ".status.keyId"),
        _printer_column("Priority", ".spec.policy.priorityClass"),
    ]
    return _crd("Tenant", "tenants", ["tnt"], spec, status, columns)


def build_model_crd() -> JSON:
    """Model: one engine deployment (a Serve application of the release's RayService)."""
    engine = to_structural(EngineConfig.model_json_schema(by_alias=True))
    engine["description"] = "Engine settings (tessera.engine.config.EngineConfig, camelCase keys)."
    spec: JSON = {
        "type": "object",
        "required": ["engine"],
        "properties": {
            "replicas": {"type": "integer", "minimum": 1,
                         "description": "Engine replicas; default 1. Exclusive with engine.autoscaling."},
            "engine": engine,
        },
    }
    status = _status(
        MODEL_PHASES,
        {"application": {"type": "string"}, "rayService": {"type": "string"}, "conditions": _CONDITIONS},
    )
    columns = [
        _printer_column("Phase", ".status.phase"),
        _printer_column("Ready", '.status.conditions[?(@.type=="Ready")].status'),
        _printer_column("Served as", ".spec.engine.servedModelName"),
        _printer_column("Replicas", ".spec.replicas", "integer"),
    ]
    return _crd("Model", "models", ["tmodel"], spec, status, columns)


def validation_schema(crd: JSON, version: str | None = None, *, strict: bool = True) -> JSON:
    """A JSON Schema (draft 2020-12) equivalent of one CRD version's OpenAPI schema, for offline checks.

    ``nullable`` becomes a ``null`` type and boolean ``exclusiveMinimum``/``exclusiveMaximum`` become
    numeric bounds. With ``strict`` every object that lists its properties rejects unknown ones, as the API
    server does under strict field validation (``kubectl apply``'s default); objects marked
    ``x-kubernetes-preserve-unknown-fields`` stay open. CEL rules (``x-kubernetes-validations``) are not
    evaluated.
    """
    versions = crd["spec"]["versions"]
    chosen = (
        next(v for v in versions if v["name"] == version)
        if version
        else next(v for v in versions if v.get("storage"))
    )

    def convert(node: Any) -> Any:
        if isinstance(node, list):
            return [convert(item) for item in node]
        if not isinstance(node, dict):
            return node
        dropped = ("nullable", "exclusiveMinimum", "exclusiveMaximum")
        out = {k: convert(v) for k, v in node.items() if k not in dropped}
        for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if node.get(key) is True and bound in out:
                out[key] = out.pop(bound)
        if node.get("nullable") and "type" in out:
            out["type"] = [out["type"], "null"]
        if node.get("x-kubernetes-int-or-string"):
            out.pop("type", None)
        if (
            strict
            and "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out

    schema: JSON = convert(chosen["schema"]["openAPIV3Schema"])
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema
