"""The gateway's key cache is refreshed off the request path, against real Redis: a key in use stays
cached past its TTL without a Redis call on the request, a revoked key stops working at the next refresh,
and unknown keys get no background work."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from tessera.gateway.auth import Authenticator
from tessera.redis_conn import EmbeddedRedis, connect
from tessera.redis_wire import RedisWire
from tessera.tenancy.store import TenantStore

TTL_S = 0.4  # refreshed every 0.4 s


@pytest.fixture
async def store(redis_server: EmbeddedRedis) -> AsyncIterator[TenantStore]:
    redis: aioredis.Redis = connect(redis_server.url, timeout_s=5.0)
    yield TenantStore(redis)
    await redis.aclose()


def _no_inline_reads(store: TenantStore, monkeypatch: pytest.MonkeyPatch, attempts: list[float] | None = None) -> None:
    """Any read of Redis on the request path fails the request's check; ``attempts`` gets each one's time."""
    async def inline(*_: Any) -> None:
        if attempts is not None:
            attempts.append(time.monotonic())
        raise AssertionError("the request path read Redis itself")
    monkeypatch.setattr(store, "authenticate", inline)
    monkeypatch.setattr(store, "get_tenant", inline)


async def test_a_key_in_use_stays_fresh_and_a_revoked_one_stops_at_the_next_refresh(
        store: TenantStore, monkeypatch: pytest.MonkeyPatch) -> None:
    tenant = await store.create_tenant(f"kc-{uuid.uuid4().hex[:8]}")
    issued = await store.issue_key(tenant.name)
    auth = Authenticator(store, ttl_s=TTL_S)
    header = f"Bearer {issued.plaintext}"
    assert (await auth.tenant_for(header)).name == tenant.name  # type: ignore[union-attr]  # inline, first use
    # Every answer from a cache the refresher keeps fresh. A read on the request is allowed only as the designed
    # fallback for a refresh that started late (a machine that starved the loop, as a loaded 2-core test run
    # does): the entry then expired with no refresh begun within a TTL before the request.
    refreshes: list[float] = []
    inline_reads: list[float] = []
    real_read_keys = store.read_keys

    async def timed_read_keys(keys: list[str], tenant_names: list[str]) -> Any:
        refreshes.append(time.monotonic())
        return await real_read_keys(keys, tenant_names)

    monkeypatch.setattr(store, "read_keys", timed_read_keys)
    _no_inline_reads(store, monkeypatch, inline_reads)
    for _ in range(8):  # 1.2 s, three TTLs
        await asyncio.sleep(TTL_S / 2.5)
        try:
            assert (await auth.tenant_for(header)).name == tenant.name  # type: ignore[union-attr]
        except AssertionError:
            read_at = inline_reads[-1] if inline_reads else None
            late = read_at is not None and not any(read_at - TTL_S < t <= read_at for t in refreshes)
            if not late:
                raise
    assert len(refreshes) >= 2, f"the refresher ran {len(refreshes)} times in three TTLs"
    await store.revoke_key(issued.key_id)
    for _ in range(100):
        if await auth.tenant_for(header) is None:
            break
        await asyncio.sleep(0.05)
    assert await auth.tenant_for(header) is None
    await auth.close()


async def test_a_deleted_tenant_drops_out_of_the_refresh(store: TenantStore) -> None:
    tenant = await store.create_tenant(f"kc-{uuid.uuid4().hex[:8]}")
    issued = await store.issue_key(tenant.name)
    auth = Authenticator(store, ttl_s=TTL_S)
    assert await auth.tenant_for(f"Bearer {issued.plaintext}") is not None
    await store.delete_tenant(tenant.name)
    await auth.refresh_active()
    assert await auth.tenant_for(f"Bearer {issued.plaintext}") is None
    assert issued.plaintext not in auth._active  # nothing left to keep fresh
    await auth.close()


async def test_unknown_keys_get_no_background_refresh(store: TenantStore, monkeypatch: pytest.MonkeyPatch) -> None:
    batches: list[list[str]] = []
    real = store.read_keys

    async def recorded(keys: list[str], tenant_names: list[str]) -> Any:
        batches.append(keys)
        return await real(keys, tenant_names)

    monkeypatch.setattr(store, "read_keys", recorded)
    auth = Authenticator(store, ttl_s=TTL_S)
    for i in range(5):
        assert await auth.tenant_for(f"Bearer tsk-{i:012x}-unknownsecret") is None
    await asyncio.sleep(TTL_S)
    assert batches == [] and auth.refresher is not None and not auth.refresher.running
    await auth.close()


@pytest.mark.parametrize("over_wire", [False, True], ids=["redis-py", "wire"])
async def test_batch_reads_match_the_single_ones(redis_server: EmbeddedRedis, store: TenantStore,
                                                 over_wire: bool) -> None:
    tenant = await store.create_tenant(f"kc-{uuid.uuid4().hex[:8]}")
    good, revoked = await store.issue_key(tenant.name), await store.issue_key(tenant.name)
    await store.revoke_key(revoked.key_id)
    keys = [good.plaintext, revoked.plaintext, "tsk-000000000000-nosuchkey", "not a key"]
    wire = RedisWire(redis_server.url, 5.0) if over_wire else None
    reader = TenantStore(store._redis, wire)
    owners, tenants = await reader.read_keys(keys, [tenant.name, "kc-missing"])
    assert owners == {k: await store.authenticate(k) for k in keys}
    assert owners[good.plaintext] == tenant.name and owners[revoked.plaintext] is None
    assert tenants == {tenant.name: tenant, "kc-missing": None}
    # A tenant not named is read in a second round trip.
    assert await reader.read_keys([good.plaintext], []) == ({good.plaintext: tenant.name}, {tenant.name: tenant})
    if wire is not None:
        await wire.close()


async def test_a_request_at_the_expiry_waits_for_the_refresh_instead_of_reading(
        store: TenantStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The refresh falls on the instant its entries expire: a request in between waits for its answer."""
    tenant = await store.create_tenant(f"kc-{uuid.uuid4().hex[:8]}")
    issued = await store.issue_key(tenant.name)
    auth = Authenticator(store, ttl_s=60.0)  # the refresher never runs by itself here
    header = f"Bearer {issued.plaintext}"
    assert await auth.tenant_for(header) == tenant
    release = asyncio.Event()
    real = store.read_keys

    async def slow(keys: list[str], tenant_names: list[str]) -> Any:
        await release.wait()
        return await real(keys, tenant_names)

    monkeypatch.setattr(store, "read_keys", slow)
    auth._cache[issued.plaintext].expires_at = 0.0  # expired
    refresh = asyncio.ensure_future(auth.refresh_active())
    await asyncio.sleep(0)
    _no_inline_reads(store, monkeypatch)
    request = asyncio.ensure_future(auth.tenant_for(header))
    await asyncio.sleep(0.05)
    assert not request.done()  # waiting for the refresh, not reading Redis
    release.set()
    assert await request == tenant
    await refresh
    await auth.close()
