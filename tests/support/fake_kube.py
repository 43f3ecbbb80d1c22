"""An in-memory ``KubeApi`` for the operator's handler tests (no API server can run here). It keeps
resourceVersions and answers a stale merge patch with a conflict, as the API server does."""

from __future__ import annotations

import copy
import itertools
from typing import Any

from tessera_operators.operator.kube import KubeConflictError, KubeUnavailableError

JSON = dict[str, Any]
NAMESPACE = "llm"
RAY_SERVICE = "tessera-engine"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class FakeKube:
    def __init__(self) -> None:
        self.secrets: dict[tuple[str, str], JSON] = {}
        self.ray_services: dict[tuple[str, str], JSON] = {}
        self.secret_writes = 0
        self.ray_service_patches = 0
        self.fail_secret_writes = False
        self._versions = itertools.count(1)

    def _stamp(self, obj: JSON) -> JSON:
        obj.setdefault("metadata", {})["resourceVersion"] = str(next(self._versions))
        return obj

    def add_ray_service(self, namespace: str, name: str, serve_config_v2: str = "") -> None:
        self.ray_services[(namespace, name)] = self._stamp(
            {
                "apiVersion": "ray.io/v1",
                "kind": "RayService",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"serveConfigV2": serve_config_v2},
            }
        )

    def put_ray_service(self, ray_service: JSON) -> None:
        """Stores a whole RayService (e.g. as the chart renders it, or after a `helm upgrade`)."""
        metadata = ray_service["metadata"]
        self.ray_services[(metadata["namespace"], metadata["name"])] = self._stamp(copy.deepcopy(ray_service))

    async def read_secret(self, namespace: str, name: str) -> JSON | None:
        found = self.secrets.get((namespace, name))
        return copy.deepcopy(found) if found is not None else None

    async def write_secret(self, namespace: str, manifest: JSON) -> None:
        if self.fail_secret_writes:
            raise KubeUnavailableError("503 Service Unavailable (injected)")
        self.secret_writes += 1
        self.secrets[(namespace, manifest["metadata"]["name"])] = self._stamp(copy.deepcopy(manifest))

    async def delete_secret(self, namespace: str, name: str) -> None:
        self.secrets.pop((namespace, name), None)

    async def read_ray_service(self, namespace: str, name: str) -> JSON | None:
        found = self.ray_services.get((namespace, name))
        return copy.deepcopy(found) if found is not None else None

    async def patch_ray_service(self, namespace: str, name: str, patch: JSON) -> None:
        current = self.ray_services[(namespace, name)]
        wanted = (patch.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != current["metadata"]["resourceVersion"]:
            raise KubeConflictError(
                "the object has been modified; please apply your changes to the latest version"
            )
        self.ray_service_patches += 1
        self.ray_services[(namespace, name)] = self._stamp(merge_patch(current, patch))
