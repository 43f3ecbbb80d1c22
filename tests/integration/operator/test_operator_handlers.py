"""The kopf handlers against a real Redis: Tenant create/update/delete and key revocation, Model
create/update/delete on the RayService, idempotency, and kopf's temporary/permanent errors."""

from __future__ import annotations

import base64
import socket
from dataclasses import dataclass, field
from typing import Any

import kopf
import pytest
import yaml

from tessera.redis_conn import connect
from tessera.tenancy.policy import TenantPolicy
from tessera.tenancy.store import TenantStore
from tessera_operators.operator import handlers
from tessera_operators.operator.handlers import OperatorContext
from tests.support.fake_kube import NAMESPACE, RAY_SERVICE, FakeKube, merge_patch


@dataclass
class Resource:
    """A Tenant or Model as kopf hands it to a handler; ``status`` gets each handler's patch, as kopf
    applies it after the handler returns or fails."""

    kind: str
    name: str
    spec: dict[str, Any]
    status: dict[str, Any] = field(default_factory=dict)
    generation: int = 1

    @property
    def body(self) -> dict[str, Any]:
        return {
            "apiVersion": "tessera.dev/v1alpha1",
            "kind": self.kind,
            "metadata": {
                "name": self.name,
                "namespace": NAMESPACE,
                "uid": f"uid-{self.name}",
                "generation": self.generation,
            },
            "spec": self.spec,
            "status": self.status,
        }

    async def run(self, handler: Any, memo: kopf.Memo) -> kopf.Patch:
        patch = kopf.Patch()
        try:
            await handler(
                name=self.name,
                namespace=NAMESPACE,
                spec=self.spec,
                body=self.body,
                status=self.status,
                patch=patch,
                memo=memo,
            )
        finally:
            self.status = merge_patch(self.status, dict(patch.get("status") or {}))
        return patch

    def change(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.generation += 1


def _secret_key(kube: FakeKube, name: str) -> str:
    secret = kube.secrets[(NAMESPACE, name)]
    return base64.b64decode(secret["data"]["api-key"]).decode()


TEAM_A = {"policy": {"requestsPerMinute": 600, "priorityClass": "high", "kvQuota": 0.5}}


async def test_tenant_create_puts_policy_in_redis_and_key_in_a_secret(
    memo: kopf.Memo, store: TenantStore, kube: FakeKube
) -> None:
    tenant = Resource("Tenant", "team-a", TEAM_A)
    await tenant.run(handlers.tenant_create, memo)

    record = await store.get_tenant("team-a")
    assert record is not None
    assert record.policy == TenantPolicy(requests_per_minute=600, priority_class="high", kv_quota=0.5)
    key = _secret_key(kube, "tessera-tenant-team-a")
    assert await store.authenticate(key) == "team-a"
    secret = kube.secrets[(NAMESPACE, "tessera-tenant-team-a")]
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-team-a"
    assert tenant.status["phase"] == "Ready"
    assert tenant.status["keyId"] == key.split("-")[1]
    assert tenant.status["observedGeneration"] == 1
    # Redis holds only the hash: the plaintext appears nowhere in it.
    redis_dump = [await store._redis.hgetall(k) for k in await store._redis.keys("tessera:apikey:*")]
    assert key.encode() not in repr(redis_dump).encode()


async def test_tenant_handlers_are_idempotent(memo: kopf.Memo, store: TenantStore, kube: FakeKube) -> None:
    tenant = Resource("Tenant", "team-a", TEAM_A)
    await tenant.run(handlers.tenant_create, memo)
    key = _secret_key(kube, "tessera-tenant-team-a")
    # A retried create (e.g. after the status patch was lost) and an operator restart change nothing.
    assert not await tenant.run(handlers.tenant_create, memo)
    assert not await tenant.run(handlers.tenant_resume, memo)
    assert _secret_key(kube, "tessera-tenant-team-a") == key
    assert kube.secret_writes == 1
    assert [k.key_id for k in await store.list_keys("team-a")] == [tenant.status["keyId"]]


async def test_tenant_update_changes_the_policy_and_keeps_the_key(
    memo: kopf.Memo, store: TenantStore, kube: FakeKube
) -> None:
    tenant = Resource("Tenant", "team-a", TEAM_A)
    await tenant.run(handlers.tenant_create, memo)
    key = _secret_key(kube, "tessera-tenant-team-a")
    tenant.change(
        {"policy": {"requestsPerMinute": 60, "priorityClass": "batch", "allowedModels": ["llama-3-8b"]}}
    )
    await tenant.run(handlers.tenant_update, memo)

    record = await store.get_tenant("team-a")
    assert record is not None
    assert record.policy.requests_per_minute == 60 and record.policy.priority_class == "batch"
    assert record.policy.allowed_models == ["llama-3-8b"]
    assert await store.authenticate(key) == "team-a"
    assert tenant.status == {**tenant.status, "phase": "Ready", "observedGeneration": 2}


async def test_key_rotation_revokes_the_old_key(memo: kopf.Memo, store: TenantStore, kube: FakeKube) -> None:
    tenant = Resource("Tenant", "team-a", TEAM_A)
    await tenant.run(handlers.tenant_create, memo)
    old_key = _secret_key(kube, "tessera-tenant-team-a")
    tenant.change({**TEAM_A, "keyGeneration": 1})
    await tenant.run(handlers.tenant_update, memo)

    new_key = _secret_key(kube, "tessera-tenant-team-a")
    assert new_key != old_key
    assert await store.authenticate(new_key) == "team-a"
    assert await store.authenticate(old_key) is None, "a rotated-out key must stop working"
    assert tenant.status["keyGeneration"] == 1 and tenant.status["keyId"] == new_key.split("-")[1]
    revoked = {k.key_id: k.revoked for k in await store.list_keys("team-a")}
    assert revoked == {old_key.split("-")[1]: True, new_key.split("-")[1]: False}


async def test_moving_the_secret_revokes_the_old_key_and_deletes_the_old_secret(
    memo: kopf.Memo, store: TenantStore, kube: FakeKube
) -> None:
    tenant = Resource("Tenant", "team-a", TEAM_A)
    await tenant.run(handlers.tenant_create, memo)
    old_key = _secret_key(kube, "tessera-tenant-team-a")
    tenant.change({**TEAM_A, "secretName": "team-a-openai-key"})
    await tenant.run(handlers.tenant_update, memo)
    assert (NAMESPACE, "tessera-tenant-team-a") not in kube.secrets
    assert await store.authenticate(_secret_key(kube, "team-a-openai-key")) == "team-a"
    assert await store.authenticate(old_key) is None


async def test_resume_replaces_a_deleted_secret_and_revokes_the_lost_key(
    memo: kopf.Memo, store: TenantStore, kube: FakeKube
) -> None:
    tenant = Resource("Tenant", "team-a", TEAM_A)
    await tenant.run(handlers.tenant_create, memo)
    lost_key = _secret_key(kube, "tessera-tenant-team-a")
    await kube.delete_secret(NAMESPACE, "tessera-tenant-team-a")
    await tenant.run(handlers.tenant_resume, memo)
    assert await store.authenticate(_secret_key(kube, "tessera-tenant-team-a")) == "team-a"
    assert await store.authenticate(lost_key) is None


async def test_tenant_delete_revokes_every_key_and_deletes_the_secret(
    memo: kopf.Memo, store: TenantStore, kube: FakeKube
) -> None:
    tenant = Resource("Tenant", "team-a", TEAM_A)
    await tenant.run(handlers.tenant_create, memo)
    key = _secret_key(kube, "tessera-tenant-team-a")
    admin_issued = await store.issue_key("team-a")  # a key issued outside the operator goes too
    other = Resource("Tenant", "team-b", {})
    await other.run(handlers.tenant_create, memo)

    await tenant.run(handlers.tenant_delete, memo)
    assert await store.get_tenant("team-a") is None
    assert await store.authenticate(key) is None
    assert await store.authenticate(admin_issued.plaintext) is None
    assert (NAMESPACE, "tessera-tenant-team-a") not in kube.secrets
    # Deleting again (a retried handler) is harmless, and other tenants are untouched.
    await tenant.run(handlers.tenant_delete, memo)
    assert await store.authenticate(_secret_key(kube, "tessera-tenant-team-b")) == "team-b"


async def test_a_failed_secret_write_leaves_no_live_key(
    memo: kopf.Memo, store: TenantStore, kube: FakeKube
) -> None:
    kube.fail_secret_writes = True
    tenant = Resource("Tenant", "team-a", TEAM_A)
    with pytest.raises(kopf.TemporaryError):
        await tenant.run(handlers.tenant_create, memo)
    assert [k.revoked for k in await store.list_keys("team-a")] == [True]
    kube.fail_secret_writes = False
    await tenant.run(handlers.tenant_create, memo)
    assert tenant.status["phase"] == "Ready"
    assert await store.authenticate(_secret_key(kube, "tessera-tenant-team-a")) == "team-a"


@pytest.mark.parametrize(
    ("name", "spec", "needle"),
    [
        ("Team_A", {}, "tenant name"),
        ("team-a", {"policy": {"requestsPerMinute": -1}}, "requestsPerMinute"),
        ("team-a", {"policy": {"priorityClass": "vip"}}, "priorityClass"),
    ],
)
async def test_an_invalid_tenant_fails_permanently(
    memo: kopf.Memo, store: TenantStore, name: str, spec: dict[str, Any], needle: str
) -> None:
    tenant = Resource("Tenant", name, spec)
    with pytest.raises(kopf.PermanentError, match=needle):
        await tenant.run(handlers.tenant_create, memo)
    assert tenant.status["phase"] == "Failed" and needle in tenant.status["message"]
    assert await store.list_tenants() == []


async def test_a_foreign_secret_is_never_overwritten(memo: kopf.Memo, kube: FakeKube) -> None:
    await kube.write_secret(NAMESPACE, {"metadata": {"name": "tessera-tenant-team-a"}, "data": {"x": "eQ=="}})
    tenant = Resource("Tenant", "team-a", TEAM_A)
    with pytest.raises(kopf.PermanentError, match="not managed by the Tessera operator"):
        await tenant.run(handlers.tenant_create, memo)
    assert kube.secrets[(NAMESPACE, "tessera-tenant-team-a")]["data"] == {"x": "eQ=="}


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_redis_down_is_a_temporary_error(kube: FakeKube) -> None:
    client = connect(f"redis://127.0.0.1:{_closed_port()}/0", timeout_s=0.5)
    memo = kopf.Memo(tessera=OperatorContext(store=TenantStore(client), kube=kube, ray_service=RAY_SERVICE))
    tenant = Resource("Tenant", "team-a", TEAM_A)
    try:
        with pytest.raises(kopf.TemporaryError, match="Redis unavailable"):
            await tenant.run(handlers.tenant_create, memo)
        assert tenant.status["phase"] == "Pending"
        with pytest.raises(kopf.TemporaryError):
            await tenant.run(handlers.tenant_delete, memo)
    finally:
        await client.aclose()


# --- Model ----------------------------------------------------------------------------------------------

LLAMA: dict[str, Any] = {
    "replicas": 2,
    "engine": {
        "model": "/models/llama-3-8b",
        "servedModelName": "llama-3-8b",
        "kvCacheDtype": "fp8",
        "speculative": {"method": "ngram", "numSpeculativeTokens": 3},
    },
}


def _applications(kube: FakeKube) -> dict[str, Any]:
    text = kube.ray_services[(NAMESPACE, RAY_SERVICE)]["spec"]["serveConfigV2"]
    return {a["name"]: a for a in (yaml.safe_load(text) or {}).get("applications", [])}


async def test_model_create_update_delete(memo: kopf.Memo, kube: FakeKube) -> None:
    model = Resource("Model", "llama-3-8b", LLAMA)
    await model.run(handlers.model_create, memo)
    app = _applications(kube)["llama-3-8b"]
    assert app["import_path"] == "tessera.engine.deployment:build_app"
    assert app["args"] == {"engine": LLAMA["engine"], "replicas": 2}
    assert model.status["phase"] == "Applied" and model.status["rayService"] == RAY_SERVICE

    # Idempotent: the periodic reconcile and a restart write nothing when nothing differs, not even status.
    for handler in (handlers.model_reconcile, handlers.model_resume):
        patch = await model.run(handler, memo)
        assert not patch, patch
    assert kube.ray_service_patches == 1

    model.change({**LLAMA, "engine": {**LLAMA["engine"], "kvCacheDtype": "auto", "speculative": None}})
    await model.run(handlers.model_update, memo)
    assert _applications(kube)["llama-3-8b"]["args"]["engine"]["kvCacheDtype"] == "auto"
    assert _applications(kube)["llama-3-8b"]["args"]["engine"]["speculative"] is None

    await model.run(handlers.model_delete, memo)
    assert _applications(kube) == {}
    await model.run(handlers.model_delete, memo)  # again: harmless


async def test_model_reconcile_restores_an_application_a_helm_upgrade_dropped(
    memo: kopf.Memo, kube: FakeKube
) -> None:
    model = Resource("Model", "llama-3-8b", LLAMA)
    await model.run(handlers.model_create, memo)
    ray_service = kube.ray_services[(NAMESPACE, RAY_SERVICE)]
    ray_service["spec"]["serveConfigV2"] = yaml.safe_dump({"applications": []})  # what an upgrade renders
    await model.run(handlers.model_reconcile, memo)
    assert "llama-3-8b" in _applications(kube)


async def test_model_leaves_values_applications_alone(memo: kopf.Memo, kube: FakeKube) -> None:
    values_app = {
        "name": "tessera-small",
        "import_path": "tessera.engine.deployment:build_app",
        "route_prefix": "/tessera-small",
        "args": {"engine": {"model": "/models/s"}, "replicas": 1},
    }
    kube.add_ray_service(NAMESPACE, RAY_SERVICE, yaml.safe_dump({"applications": [values_app]}))
    await Resource("Model", "llama-3-8b", LLAMA).run(handlers.model_create, memo)
    assert _applications(kube)["tessera-small"] == values_app
    clash = Resource("Model", "tessera-small", LLAMA)
    with pytest.raises(kopf.PermanentError, match="Helm values"):
        await clash.run(handlers.model_create, memo)
    assert clash.status["phase"] == "Failed"
    await clash.run(handlers.model_delete, memo)
    assert _applications(kube)["tessera-small"] == values_app


async def test_an_invalid_model_fails_permanently(memo: kopf.Memo, kube: FakeKube) -> None:
    model = Resource("Model", "eagle", {"engine": {"model": "/m", "speculative": {"method": "eagle"}}})
    with pytest.raises(kopf.PermanentError, match="draft_model"):
        await model.run(handlers.model_create, memo)
    assert model.status["phase"] == "Failed"
    assert _applications(kube) == {}


async def test_missing_ray_service_and_conflicts_are_temporary(memo: kopf.Memo, kube: FakeKube) -> None:
    kube.ray_services.clear()
    model = Resource("Model", "llama-3-8b", LLAMA)
    with pytest.raises(kopf.TemporaryError, match="not found"):
        await model.run(handlers.model_create, memo)
    assert model.status["phase"] == "Pending"

    kube.add_ray_service(NAMESPACE, RAY_SERVICE)
    original_read = kube.read_ray_service

    async def stale_read(namespace: str, name: str) -> dict[str, Any] | None:
        found = await original_read(namespace, name)
        assert found is not None
        found["metadata"]["resourceVersion"] = "0"  # someone wrote since we read
        return found

    kube.read_ray_service = stale_read  # type: ignore[method-assign]
    with pytest.raises(kopf.TemporaryError, match="changed while patching"):
        await model.run(handlers.model_create, memo)
    kube.read_ray_service = original_read  # type: ignore[method-assign]
    await model.run(handlers.model_create, memo)
    assert model.status["phase"] == "Applied"
