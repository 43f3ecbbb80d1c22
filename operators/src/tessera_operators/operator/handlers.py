"""kopf handlers for ``Tenant`` and ``Model``: thin and idempotent. Each one parses the object with a
builder, brings Redis or the RayService to what the object says, and reports ``status.phase``.

Errors in layers: an invalid object sets ``phase: Failed`` and raises ``kopf.PermanentError`` (retrying
cannot fix it); Redis or the API server being unreachable, a conflicting write or a RayService that does
not exist yet raise ``kopf.TemporaryError`` so kopf retries. Running a handler twice is harmless: it reads
what exists first (a tenant already in Redis, a key that still authenticates, an application already
applied) and writes only the difference.

The handlers reach Redis and Kubernetes through ``memo.tessera`` (an ``OperatorContext``), which
``operator_startup`` builds and tests construct with their own adapters.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import kopf
from pydantic import ValidationError
from redis.exceptions import RedisError

from tessera.registry import EngineRegistry
from tessera.tenancy.keys import hash_key
from tessera.tenancy.store import TenantExistsError, TenantNotFoundError, TenantStore

from .builders import (
    ApplicationOwnedElsewhereError,
    KeyMaterial,
    TenantSpec,
    build_model_status,
    build_serve_application,
    build_serve_config_patch,
    build_tenant_secret,
    build_tenant_status,
    default_secret_name,
    is_operator_secret,
    owner_reference,
    parse_model,
    parse_tenant,
    secret_key_material,
)
from .conditions import application_state, build_model_conditions, is_ready
from .crds import GROUP, VERSION
from .kube import KubeApi, KubeConflictError, KubeUnavailableError
from .tenant_sync import resync_reason

JSON = dict[str, Any]
_log = logging.getLogger(__name__)
REDIS_RETRY_DELAY_S = 10.0
KUBE_RETRY_DELAY_S = 5.0
RAY_SERVICE_MISSING_DELAY_S = 30.0
# Re-apply every Model and refresh its conditions this often. NOTE: not what keeps Models through a
# `helm upgrade`: with the operator enabled the chart renders no serveConfigV2 (templates/_serve.tpl), so an
# upgrade's three-way merge never touches it. This repairs what does rewrite it: a hand edit, `helm upgrade
# --force` (replaces the object), and the one upgrade from a release whose chart still rendered the field.
MODEL_RECONCILE_INTERVAL_S = 60.0


@dataclass(frozen=True, slots=True)
class OperatorContext:
    """What the handlers act on: the tenant store (Redis), the Kubernetes API and the RayService's name."""

    store: TenantStore
    kube: KubeApi
    ray_service: str
    # The engine registry (same Redis): a Model's EnginesRunning condition counts its heartbeating replicas.
    # None: the condition says Unknown.
    registry: EngineRegistry | None = None


def _context(memo: Any) -> OperatorContext:
    context = getattr(memo, "tessera", None)
    assert isinstance(context, OperatorContext), "operator_startup puts an OperatorContext in memo.tessera"
    return context


def _namespace(namespace: str | None) -> str:
    assert namespace, "Tenant and Model are namespaced resources"
    return namespace


def _report(patch: kopf.Patch, current: Mapping[str, Any] | None, status: JSON) -> None:
    """Writes only the status fields that differ, so periodic reconciles do not patch an unchanged object."""
    changed = {k: v for k, v in status.items() if (current or {}).get(k) != v}
    if changed:
        patch.status.update(changed)


def _fail(patch: kopf.Patch, generation: int | None, message: str) -> kopf.PermanentError:
    """Reports the object as Failed; the caller raises the returned error."""
    status: JSON = {"phase": "Failed", "message": message}
    if generation is not None:
        status["observedGeneration"] = generation
    patch.status.update(status)
    return kopf.PermanentError(message)


# --- Tenant ---------------------------------------------------------------------------------------------

# How often every Tenant is checked against Redis (tenant_resync): bounds how long a Tenant's key answers 401
# after Redis came back empty (a restart without persistence, a flush, a failover to an empty replica). Each
# check is two Redis reads per Tenant; the API server is called only when something must be repaired.
TENANT_RESYNC_INTERVAL_S = 30.0


@kopf.on.create(GROUP, VERSION, "tenants")
async def tenant_create(
    name: str,
    namespace: str | None,
    spec: kopf.Spec,
    body: kopf.Body,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: Any,
    **_: Any,
) -> None:
    """A new Tenant: the tenant in Redis with its policy, and a key in its Secret."""
    await _ensure_tenant(name, namespace, spec, body, status, patch, _context(memo))


@kopf.on.update(GROUP, VERSION, "tenants", field="spec")
async def tenant_update(
    name: str,
    namespace: str | None,
    spec: kopf.Spec,
    body: kopf.Body,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: Any,
    **_: Any,
) -> None:
    """A changed Tenant: the new policy; a new key when keyGeneration rose or the Secret moved."""
    await _ensure_tenant(name, namespace, spec, body, status, patch, _context(memo))


@kopf.on.resume(GROUP, VERSION, "tenants")
async def tenant_resume(
    name: str,
    namespace: str | None,
    spec: kopf.Spec,
    body: kopf.Body,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: Any,
    **_: Any,
) -> None:
    """After an operator restart: repairs whatever is missing (the tenant, its key, its Secret)."""
    await _ensure_tenant(name, namespace, spec, body, status, patch, _context(memo))


@kopf.timer(GROUP, VERSION, "tenants", interval=TENANT_RESYNC_INTERVAL_S, initial_delay=TENANT_RESYNC_INTERVAL_S)
async def tenant_resync(
    name: str,
    namespace: str | None,
    spec: kopf.Spec,
    body: kopf.Body,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: Any,
    **_: Any,
) -> None:
    """Periodic: when Redis lost the tenant, its policy or its key, puts them back, the key unchanged (its
    hash from status.keySha256), so clients holding the Secret's key are served again without a new key."""
    context = _context(memo)
    try:
        tenant = parse_tenant(name, spec)
    except (ValueError, ValidationError):
        return  # create/update already reported it Failed; a timer cannot fix a spec
    key_id = status.get("keyId")
    try:
        stored = await context.store.get_tenant(name)
        stored_key = await context.store.get_key(key_id) if key_id else None
    except RedisError as exc:
        raise kopf.TemporaryError(f"Redis unavailable: {exc}", delay=REDIS_RETRY_DELAY_S) from exc
    reason = resync_reason(tenant, status, stored.policy if stored is not None else None, stored_key)
    if reason is None:
        return
    _log.warning("tenant %s: %s; resynchronising", name, reason)
    await _ensure_tenant(name, namespace, spec, body, status, patch, context)


@kopf.on.delete(GROUP, VERSION, "tenants")
async def tenant_delete(
    name: str, namespace: str | None, spec: kopf.Spec, status: kopf.Status, memo: Any, **_: Any
) -> None:
    """The tenant leaves Redis with all its keys (revoked on every gateway within the key-cache TTL), and
    its Secret is deleted (the ownerReference would also let Kubernetes collect it)."""
    context, namespace = _context(memo), _namespace(namespace)
    secret_names = {spec.get("secretName") or default_secret_name(name)}
    if status.get("secretName"):
        secret_names.add(status["secretName"])
    try:
        try:
            await context.store.delete_tenant(name)
        except TenantNotFoundError:
            pass  # never created, or an earlier attempt already deleted it
        for secret_name in sorted(secret_names):
            secret = await context.kube.read_secret(namespace, secret_name)
            if secret is not None and is_operator_secret(secret, name):
                await context.kube.delete_secret(namespace, secret_name)
    except RedisError as exc:
        raise kopf.TemporaryError(f"Redis unavailable: {exc}", delay=REDIS_RETRY_DELAY_S) from exc
    except KubeUnavailableError as exc:
        raise kopf.TemporaryError(str(exc), delay=KUBE_RETRY_DELAY_S) from exc


async def _ensure_tenant(
    name: str,
    namespace: str | None,
    spec: Mapping[str, Any],
    body: Mapping[str, Any],
    status: Mapping[str, Any],
    patch: kopf.Patch,
    context: OperatorContext,
) -> None:
    generation = (body.get("metadata") or {}).get("generation")
    try:
        tenant = parse_tenant(name, spec)
    except (ValueError, ValidationError) as exc:
        raise _fail(patch, generation, f"invalid Tenant: {exc}") from exc
    try:
        await _ensure_tenant_record(tenant, context)
        key_id, key_sha256 = await _ensure_tenant_key(tenant, _namespace(namespace), body, status, context)
    except RedisError as exc:
        patch.status.update({"phase": "Pending", "message": f"waiting for Redis: {exc}"})
        raise kopf.TemporaryError(f"Redis unavailable: {exc}", delay=REDIS_RETRY_DELAY_S) from exc
    except (KubeUnavailableError, KubeConflictError) as exc:
        raise kopf.TemporaryError(str(exc), delay=KUBE_RETRY_DELAY_S) from exc
    except _SecretTakenError as exc:
        raise _fail(patch, generation, str(exc)) from exc
    _report(
        patch,
        status,
        build_tenant_status(
            "Ready",
            generation=generation,
            key_id=key_id,
            key_sha256=key_sha256,
            key_generation=tenant.key_generation,
            secret_name=tenant.secret_name,
        ),
    )


async def _ensure_tenant_record(tenant: TenantSpec, context: OperatorContext) -> None:
    existing = await context.store.get_tenant(tenant.name)
    if existing is None:
        try:
            await context.store.create_tenant(tenant.name, tenant.policy)
            return
        except TenantExistsError:
            pass  # created concurrently (a retried handler): fall through to set the policy
    elif existing.policy == tenant.policy:
        return
    await context.store.set_policy(tenant.name, tenant.policy)


class _SecretTakenError(Exception):
    """A Secret of the wanted name exists and was not written by the operator for this tenant."""


async def _ensure_tenant_key(
    tenant: TenantSpec,
    namespace: str,
    body: Mapping[str, Any],
    status: Mapping[str, Any],
    context: OperatorContext,
) -> tuple[str, str]:
    """The id and hash of the tenant's working key: the Secret's key, re-installed when Redis lost it, or a
    new one (issued, and the old one revoked) when it was revoked, rotated or is gone with its Secret."""
    store, kube = context.store, context.kube
    secret = await kube.read_secret(namespace, tenant.secret_name)
    if secret is not None and not is_operator_secret(secret, tenant.name):
        raise _SecretTakenError(
            f"Secret {tenant.secret_name!r} exists and is not managed by the Tessera operator for tenant "
            f"{tenant.name!r}; set spec.secretName to another name"
        )
    current = secret_key_material(secret)
    current_works = current is not None and await store.authenticate(current.plaintext) == tenant.name
    rotate = status.get("keyGeneration") is not None and status["keyGeneration"] != tenant.key_generation
    if current is not None and current_works and not rotate:
        return current.key_id, hash_key(current.plaintext)
    if current is not None and not rotate and await _restore_tenant_key(tenant, current, status, store):
        _log.warning("tenant %s: key %s was missing from Redis; re-installed from its hash", tenant.name,
                     current.key_id)
        return current.key_id, hash_key(current.plaintext)

    # Keys this replaces: the one in this Secret, the one in the Secret used before spec.secretName moved,
    # and the one the status last reported (its Secret may have been deleted by hand).
    old_secret_name: str = status.get("secretName") or ""
    moved = bool(old_secret_name) and old_secret_name != tenant.secret_name
    replaced = {current.key_id} if current is not None else set()
    if moved:
        old_material = secret_key_material(await kube.read_secret(namespace, old_secret_name))
        replaced |= {old_material.key_id} if old_material is not None else set()
    if status.get("keyId"):
        replaced.add(status["keyId"])

    issued = await store.issue_key(tenant.name)
    try:
        await kube.write_secret(
            namespace, build_tenant_secret(namespace, tenant, issued, owner=_owner_or_none(body))
        )
    except Exception:
        await store.revoke_key(issued.key_id)  # never handed out: do not leave a live key behind
        raise
    live_ids = {info.key_id for info in await store.list_keys(tenant.name) if not info.revoked}
    for key_id in sorted((replaced & live_ids) - {issued.key_id}):
        await store.revoke_key(key_id)
    if moved:
        old_secret = await kube.read_secret(namespace, old_secret_name)
        if old_secret is not None and is_operator_secret(old_secret, tenant.name):
            await kube.delete_secret(namespace, old_secret_name)
    _log.info("tenant %s: key %s written to Secret %s", tenant.name, issued.key_id, tenant.secret_name)
    return issued.key_id, issued.sha256


async def _restore_tenant_key(
    tenant: TenantSpec, current: KeyMaterial, status: Mapping[str, Any], store: TenantStore
) -> bool:
    """Re-installs the Secret's key when Redis has no record of it at all (not when it is revoked) and it is
    the key the operator last reported: its id is status.keyId and its hash status.keySha256. The Secret
    alone is not trusted: whoever may write a Secret must not be able to make the operator install a key."""
    sha256 = hash_key(current.plaintext)
    if status.get("keyId") != current.key_id or status.get("keySha256") != sha256:
        return False
    return await store.restore_key(tenant.name, current.key_id, sha256)


def _owner_or_none(body: Mapping[str, Any]) -> JSON | None:
    metadata = body.get("metadata") or {}
    return owner_reference(body) if metadata.get("uid") and body.get("kind") else None


# --- Model ----------------------------------------------------------------------------------------------


@kopf.on.create(GROUP, VERSION, "models")
async def model_create(
    name: str, namespace: str | None, spec: kopf.Spec, body: kopf.Body, patch: kopf.Patch, memo: Any, **_: Any
) -> None:
    """A new Model: its Serve application added to the RayService's serveConfigV2."""
    await _apply_model(name, namespace, spec, body, patch, _context(memo))


@kopf.on.update(GROUP, VERSION, "models", field="spec")
async def model_update(
    name: str, namespace: str | None, spec: kopf.Spec, body: kopf.Body, patch: kopf.Patch, memo: Any, **_: Any
) -> None:
    """Changed engine settings or replicas: the application replaced (KubeRay rolls the replicas)."""
    await _apply_model(name, namespace, spec, body, patch, _context(memo))


@kopf.on.resume(GROUP, VERSION, "models")
async def model_resume(
    name: str, namespace: str | None, spec: kopf.Spec, body: kopf.Body, patch: kopf.Patch, memo: Any, **_: Any
) -> None:
    """After an operator restart: the application re-applied if it went missing."""
    await _apply_model(name, namespace, spec, body, patch, _context(memo))


@kopf.timer(
    GROUP, VERSION, "models", interval=MODEL_RECONCILE_INTERVAL_S, initial_delay=MODEL_RECONCILE_INTERVAL_S
)
async def model_reconcile(
    name: str, namespace: str | None, spec: kopf.Spec, body: kopf.Body, patch: kopf.Patch, memo: Any, **_: Any
) -> None:
    """Periodic and idempotent (no write when nothing differs): refreshes the conditions and restores an
    application that someone else removed from serveConfigV2 (see MODEL_RECONCILE_INTERVAL_S)."""
    await _apply_model(name, namespace, spec, body, patch, _context(memo))


@kopf.on.delete(GROUP, VERSION, "models")
async def model_delete(name: str, namespace: str | None, patch: kopf.Patch, memo: Any, **_: Any) -> None:
    """The application removed from the RayService (KubeRay stops its replicas)."""
    context, namespace = _context(memo), _namespace(namespace)
    patch.status.update({"phase": "Deleting", "message": ""})
    try:
        ray_service = await context.kube.read_ray_service(namespace, context.ray_service)
        if ray_service is None:
            return  # nothing serves it any more
        serve_patch = build_serve_config_patch(ray_service, remove=name)
        if serve_patch is not None:
            await context.kube.patch_ray_service(namespace, context.ray_service, serve_patch)
    except (KubeUnavailableError, KubeConflictError) as exc:
        raise kopf.TemporaryError(str(exc), delay=KUBE_RETRY_DELAY_S) from exc


async def _apply_model(
    name: str,
    namespace: str | None,
    spec: Mapping[str, Any],
    body: Mapping[str, Any],
    patch: kopf.Patch,
    context: OperatorContext,
) -> None:
    namespace = _namespace(namespace)
    generation = (body.get("metadata") or {}).get("generation")
    try:
        model = parse_model(name, spec)
    except (ValueError, ValidationError) as exc:
        raise _fail(patch, generation, f"invalid Model: {exc}") from exc
    application = build_serve_application(model.name, model.engine_values, model.replicas)
    try:
        ray_service = await context.kube.read_ray_service(namespace, context.ray_service)
        if ray_service is None:
            message = f"RayService {context.ray_service!r} not found in namespace {namespace!r}"
            pending = build_model_status("Pending", generation=generation, message=message)
            pending["conditions"] = build_model_conditions(
                applied=False, applied_message=message, app=application_state(None, model.name), live_engines=0,
                wanted_replicas=model.wanted_replicas, served_model_name=model.engine.served_model_name,
                generation=generation, previous=(body.get("status") or {}).get("conditions"), now=_now())
            patch.status.update(pending)
            raise kopf.TemporaryError(message, delay=RAY_SERVICE_MISSING_DELAY_S)
        serve_patch = build_serve_config_patch(ray_service, upsert=application)
        if serve_patch is not None:
            await context.kube.patch_ray_service(namespace, context.ray_service, serve_patch)
    except ApplicationOwnedElsewhereError as exc:
        raise _fail(patch, generation, str(exc)) from exc
    except KubeConflictError as exc:
        raise kopf.TemporaryError(f"RayService changed while patching: {exc}", delay=1.0) from exc
    except KubeUnavailableError as exc:
        raise kopf.TemporaryError(str(exc), delay=KUBE_RETRY_DELAY_S) from exc
    current = body.get("status") or {}
    served = model.engine.served_model_name
    conditions = build_model_conditions(
        applied=True,
        applied_message=f"application {model.name!r} is in RayService {context.ray_service!r}",
        app=application_state(ray_service, model.name),
        live_engines=await _live_engines(context, served),
        wanted_replicas=model.wanted_replicas,
        served_model_name=served,
        generation=generation,
        previous=current.get("conditions"),
        now=_now(),
    )
    status = build_model_status(
        "Ready" if is_ready(conditions) else "Applied",
        generation=generation,
        ray_service=context.ray_service,
        application=model.name,
    )
    status["conditions"] = conditions
    _report(patch, current, status)


async def _live_engines(context: OperatorContext, served_model_name: str) -> int:
    """Replicas of the model heartbeating in the registry; -1 (never enough) when Redis cannot say."""
    if context.registry is None:
        return -1
    try:
        return sum(1 for r in await context.registry.live_engines() if r.model == served_model_name)
    except RedisError as exc:
        _log.warning("engine registry unreadable for %s: %s", served_model_name, exc)
        return -1


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
