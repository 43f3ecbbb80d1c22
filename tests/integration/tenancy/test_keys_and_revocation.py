"""Keys: revocation reaches the other gateway replica within 2 s; Redis holds only hashes of keys."""

from __future__ import annotations

import time

import httpx
import redis.asyncio as aioredis

from tests.support.gateways import GatewayProcess
from tests.support.probe import probe_results, start_probe
from tests.support.tenancy import admin_headers, create_tenant
from tests.support.valkey import RestartableRedis

REVOCATION_WITHIN_S = 2.0


def first_rejection_after(results: list, since: float) -> float:  # type: ignore[type-arg]
    """Seconds from ``since`` (wall clock) to the first 401 answered to a request sent after it."""
    for r in results:
        if r.started >= since and r.status == 401:
            return float(r.started + r.latency_s - since)
    raise AssertionError(f"never rejected: {[(round(r.started - since, 2), r.status) for r in results][-10:]}")


def test_revoked_key_is_rejected_by_the_other_replica_within_2_s(gateways: list[GatewayProcess]) -> None:
    tenant = create_tenant(gateways[0])
    models = f"{gateways[1].url}/v1/models"
    assert httpx.get(models, headers=tenant.headers).status_code == 200  # replica 1 has the key cached
    probe = start_probe([models], tenant.headers, method="GET", duration_s=6.0, interval_s=0.02)
    time.sleep(1.5)
    revoked = httpx.delete(f"{gateways[0].url}/admin/keys/{tenant.key_id}", headers=admin_headers())
    revoked_at = time.time()
    assert revoked.status_code == 200 and revoked.json() == {"revoked": tenant.key_id, "tenant": tenant.name}
    results = probe_results(probe)
    assert any(r.status == 200 and r.started < revoked_at for r in results), "the key never worked"
    assert first_rejection_after(results, revoked_at) <= REVOCATION_WITHIN_S
    # Once rejected, never accepted again.
    after = [r.status for r in results if r.started > revoked_at + REVOCATION_WITHIN_S]
    assert after and set(after) == {401}


def test_deleting_a_tenant_revokes_its_keys_on_every_replica(gateways: list[GatewayProcess]) -> None:
    tenant = create_tenant(gateways[0])
    assert all(httpx.get(f"{g.url}/v1/models", headers=tenant.headers).status_code == 200 for g in gateways)
    deleted = httpx.delete(f"{gateways[0].url}/admin/tenants/{tenant.name}", headers=admin_headers())
    assert deleted.status_code == 200
    deadline = time.monotonic() + REVOCATION_WITHIN_S
    pending = {g.url for g in gateways}
    while pending and time.monotonic() < deadline:
        pending = {u for u in pending if httpx.get(f"{u}/v1/models", headers=tenant.headers).status_code != 401}
        time.sleep(0.05)
    assert not pending


async def test_redis_holds_no_plaintext_key(gateways: list[GatewayProcess], tenancy_redis: RestartableRedis,
                                            redis_client: aioredis.Redis) -> None:
    tenants = [create_tenant(gateways[i % 2]) for i in range(3)]
    extra = httpx.post(f"{gateways[1].url}/admin/tenants/{tenants[0].name}/keys", headers=admin_headers()).json()
    plaintexts = [t.key for t in tenants] + [extra["key"]]
    secrets = [k.split("-", 2)[2] for k in plaintexts]
    for tenant in tenants:  # the keys have been used, so every code path that touches them has run
        assert httpx.get(f"{gateways[0].url}/v1/models", headers=tenant.headers).status_code == 200

    # Uncompressed, so that a plaintext could not hide inside an LZF-compressed string.
    await redis_client.config_set("rdbcompression", "no")
    # Every key's serialized value (DUMP), its name, and its readable contents.
    dumped = b""
    async for key in redis_client.scan_iter(match="*", count=1000):
        dumped += key + (await redis_client.dump(key) or b"")
        kind = (await redis_client.type(key)).decode()
        if kind == "hash":
            dumped += b"".join(k + v for k, v in (await redis_client.hgetall(key)).items())
        elif kind == "string":
            dumped += await redis_client.get(key) or b""
        elif kind == "set":
            dumped += b"".join(await redis_client.smembers(key))
    # And the whole database as Redis writes it to disk.
    await redis_client.save()
    rdb = (tenancy_redis.data_dir / "dump.rdb").read_bytes()
    assert rdb.startswith((b"REDIS", b"VALKEY"))
    for blob in (dumped, rdb):
        assert tenants[0].name.encode() in blob  # the search does see stored strings
        for secret in secrets:
            assert secret.encode() not in blob
    # What is stored: the SHA-256 of the key, next to its public id.
    stored = await redis_client.hgetall(f"tessera:apikey:{tenants[0].key_id}")
    assert set(stored) >= {b"sha256", b"tenant", b"created_at"} and len(stored[b"sha256"]) == 64
