"""The operator's seam to the Kubernetes API: the few calls the handlers make, behind ``KubeApi``.

``KubernetesApi`` is the real one (the official client, run in worker threads so the kopf event loop is
never blocked); tests inject an in-memory implementation of the same protocol.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

JSON = dict[str, Any]

RAY_GROUP = "ray.io"
RAY_VERSION = "v1"
RAY_SERVICES = "rayservices"


class KubeConflictError(Exception):
    """The object changed since it was read (HTTP 409): read it again and retry."""


class KubeUnavailableError(Exception):
    """The API server refused or failed the call for a reason a retry may fix."""


class KubeApi(Protocol):
    async def read_secret(self, namespace: str, name: str) -> JSON | None:
        """The Secret as a dict, or None when it does not exist."""
        ...

    async def write_secret(self, namespace: str, manifest: JSON) -> None:
        """Creates the Secret, or replaces the one of the same name."""
        ...

    async def delete_secret(self, namespace: str, name: str) -> None:
        """Deletes the Secret; a missing one is not an error."""
        ...

    async def read_ray_service(self, namespace: str, name: str) -> JSON | None:
        """The RayService as a dict, or None when it does not exist."""
        ...

    async def patch_ray_service(self, namespace: str, name: str, patch: JSON) -> None:
        """Applies a JSON merge patch; raises ``KubeConflictError`` when its resourceVersion is stale."""
        ...


class KubernetesApi:
    """``KubeApi`` over the official ``kubernetes`` client (in-cluster config, else kubeconfig)."""

    def __init__(self) -> None:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self._api_client = client.ApiClient()
        self._core = client.CoreV1Api(self._api_client)
        self._custom = client.CustomObjectsApi(self._api_client)

    async def read_secret(self, namespace: str, name: str) -> JSON | None:
        return await self._call_or_none(self._core.read_namespaced_secret, name, namespace)

    async def write_secret(self, namespace: str, manifest: JSON) -> None:
        name = manifest["metadata"]["name"]
        existing = await self.read_secret(namespace, name)
        if existing is None:
            await self._call(self._core.create_namespaced_secret, namespace, manifest)
        else:
            body = {**manifest, "metadata": {**manifest["metadata"], **_version(existing)}}
            await self._call(self._core.replace_namespaced_secret, name, namespace, body)

    async def delete_secret(self, namespace: str, name: str) -> None:
        await self._call_or_none(self._core.delete_namespaced_secret, name, namespace)

    async def read_ray_service(self, namespace: str, name: str) -> JSON | None:
        return await self._call_or_none(
            self._custom.get_namespaced_custom_object, RAY_GROUP, RAY_VERSION, namespace, RAY_SERVICES, name
        )

    async def patch_ray_service(self, namespace: str, name: str, patch: JSON) -> None:
        patch_fn = self._custom.patch_namespaced_custom_object
        await self._call(patch_fn, RAY_GROUP, RAY_VERSION, namespace, RAY_SERVICES, name, patch)

    async def _call(self, fn: Any, *args: Any) -> JSON:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            result = await asyncio.to_thread(fn, *args)
        except (HTTPError, OSError) as exc:
            raise KubeUnavailableError(f"Kubernetes API unreachable: {exc}") from exc
        except ApiException as exc:
            if exc.status == 409:
                raise KubeConflictError(str(exc.reason)) from exc
            if exc.status == 404:
                raise
            raise KubeUnavailableError(f"{exc.status} {exc.reason}") from exc
        serialized: JSON = self._api_client.sanitize_for_serialization(result)
        return serialized

    async def _call_or_none(self, fn: Any, *args: Any) -> JSON | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return await self._call(fn, *args)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise


def _version(existing: JSON) -> JSON:
    version = (existing.get("metadata") or {}).get("resourceVersion")
    return {"resourceVersion": version} if version else {}
