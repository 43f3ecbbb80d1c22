"""The Tenant timer against a real Redis (issue #16): after Redis lost everything, ``tenant_resync`` puts the
tenant back with the *same* key, re-installed from the hash the operator keeps in ``status.keySha256``, so
the client's key from the Secret authenticates again; a revoked key, or a key someone wrote into the Secret,
is never installed; an intact Redis costs no API-server call."""

from __future__ import annotations

import base64
from typing import Any

import kopf
import pytest
import redis.asyncio as aioredis

from tessera.redis_conn import connect
from tessera.tenancy.keys import hash_key, new_key
from tessera.tenancy.policy import TenantPolicy
from tessera.tenancy.store import TenantStore
from tessera_operators.operator import handlers
from tessera_operators.operator.handlers import OperatorContext
from tests.integration.operator.test_operator_handlers import Resource
from tests.support.fake_kube import NAMESPACE, RAY_SERVICE, FakeKube
from tests.support.machine import free_port

SECRET = "tessera-tenant-team-a"
TEAM_A = {"policy": {"requestsPerMinute": 600, "tokenBudget": 1_000_000, "priorityClass": "high"}}


class CountingKube(FakeKube):
    """The in-memory API server, counting Secret reads: the timer must not read Secrets while Redis is intact."""

    def __init__(self) -> None:
        super().__init__()
        self.num_secret_reads = 0

    async def read_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.num_secret_reads += 1
        return await super().read_secret(namespace, name)


@pytest.fixture
def kube() -> CountingKube:
    fake = CountingKube()
    fake.add_ray_service(NAMESPACE, RAY_SERVICE)
    return fake


def _secret_key(kube: FakeKube) -> str:
    return base64.b64decode(kube.secrets[(NAMESPACE, SECRET)]["data"]["api-key"]).decode()


async def _created(memo: kopf.Memo) -> Resource:
    tenant = Resource("Tenant", "team-a", TEAM_A)
    await tenant.run(handlers.tenant_create, memo)
    return tenant


async def test_the_timer_brings_a_flushed_tenant_back_with_the_same_key(
    memo: kopf.Memo, store: TenantStore, kube: CountingKube, redis_client: aioredis.Redis
) -> None:
    tenant = await _created(memo)
    key = _secret_key(kube)
    assert tenant.status["keySha256"] == hash_key(key), "status keeps the hash, never the key"
    assert key not in str(tenant.status)

    await redis_client.flushall()  # Redis lost everything
    assert await store.authenticate(key) is None and await store.get_tenant("team-a") is None
    await tenant.run(handlers.tenant_resync, memo)

    assert await store.authenticate(key) == "team-a", "the client's key works again, unchanged"
    assert _secret_key(kube) == key, "the Secret was not rewritten"
    record = await store.get_tenant("team-a")
    assert record is not None and record.policy == TenantPolicy.model_validate(TEAM_A["policy"])
    assert [(k.key_id, k.revoked) for k in await store.list_keys("team-a")] == [(tenant.status["keyId"], False)]
    assert tenant.status["phase"] == "Ready"


async def test_the_timer_leaves_an_intact_tenant_alone(
    memo: kopf.Memo, store: TenantStore, kube: CountingKube
) -> None:
    tenant = await _created(memo)
    reads = kube.num_secret_reads
    patch = await tenant.run(handlers.tenant_resync, memo)
    assert kube.num_secret_reads == reads, "two Redis reads, no API-server call"
    assert not patch


async def test_a_lost_policy_alone_is_restored_without_touching_the_key(
    memo: kopf.Memo, store: TenantStore, kube: CountingKube, redis_client: aioredis.Redis
) -> None:
    tenant = await _created(memo)
    key = _secret_key(kube)
    await store.set_policy("team-a", TenantPolicy())  # someone changed it behind the operator's back
    await tenant.run(handlers.tenant_resync, memo)
    record = await store.get_tenant("team-a")
    assert record is not None and record.policy.requests_per_minute == 600
    assert await store.authenticate(key) == "team-a" and _secret_key(kube) == key


async def test_a_revoked_key_is_replaced_not_restored(
    memo: kopf.Memo, store: TenantStore, kube: CountingKube
) -> None:
    tenant = await _created(memo)
    key = _secret_key(kube)
    await store.revoke_key(tenant.status["keyId"])
    await tenant.run(handlers.tenant_resync, memo)
    assert await store.authenticate(key) is None, "a revocation is never undone"
    new = _secret_key(kube)
    assert new != key and await store.authenticate(new) == "team-a"
    assert tenant.status["keySha256"] == hash_key(new)


async def test_a_key_written_into_the_secret_is_never_installed(
    memo: kopf.Memo, store: TenantStore, kube: CountingKube, redis_client: aioredis.Redis
) -> None:
    tenant = await _created(memo)
    planted = new_key()  # someone with write access to the Secret, not to the Tenant's status
    secret = kube.secrets[(NAMESPACE, SECRET)]
    secret["data"]["api-key"] = base64.b64encode(planted.plaintext.encode()).decode()
    await redis_client.flushall()
    await tenant.run(handlers.tenant_resync, memo)
    assert await store.authenticate(planted.plaintext) is None
    issued = _secret_key(kube)
    assert issued != planted.plaintext and await store.authenticate(issued) == "team-a"


async def test_a_tenant_from_before_the_hash_gets_it_recorded_and_then_survives_a_flush(
    memo: kopf.Memo, store: TenantStore, kube: CountingKube, redis_client: aioredis.Redis
) -> None:
    tenant = await _created(memo)
    key = _secret_key(kube)
    del tenant.status["keySha256"]  # reconciled by an operator that did not keep it
    await tenant.run(handlers.tenant_resync, memo)
    assert tenant.status["keySha256"] == hash_key(key)
    await redis_client.flushall()
    await tenant.run(handlers.tenant_resync, memo)
    assert await store.authenticate(key) == "team-a"


async def test_resume_after_an_operator_restart_also_keeps_the_key(
    memo: kopf.Memo, store: TenantStore, kube: CountingKube, redis_client: aioredis.Redis
) -> None:
    tenant = await _created(memo)
    key = _secret_key(kube)
    await redis_client.flushall()
    await tenant.run(handlers.tenant_resume, memo)
    assert await store.authenticate(key) == "team-a" and _secret_key(kube) == key


async def test_restore_key_never_overwrites_a_record(store: TenantStore) -> None:
    await store.create_tenant("team-b")
    issued = await store.issue_key("team-b")
    await store.revoke_key(issued.key_id)
    assert await store.restore_key("team-b", issued.key_id, issued.sha256) is False
    assert await store.authenticate(issued.plaintext) is None
    with pytest.raises(ValueError, match="sha256"):
        await store.restore_key("team-b", "0123456789ab", issued.plaintext)
    with pytest.raises(ValueError, match="key id"):
        await store.restore_key("team-b", "XYZ", issued.sha256)


async def test_redis_down_is_a_temporary_error_for_the_timer(kube: CountingKube) -> None:
    client = connect(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    memo = kopf.Memo(tessera=OperatorContext(store=TenantStore(client), kube=kube, ray_service=RAY_SERVICE))
    try:
        with pytest.raises(kopf.TemporaryError, match="Redis unavailable"):
            await Resource("Tenant", "team-a", TEAM_A, status={"keyId": "0123456789ab"}).run(
                handlers.tenant_resync, memo)
    finally:
        await client.aclose()
