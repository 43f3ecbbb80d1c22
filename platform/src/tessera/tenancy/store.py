"""Tenants and keys in Redis. The durable records (tenants, keys) have no TTL; everything admission
writes does (see ``admission.py``).

Layout:
  tessera:tenants                    set of tenant names
  tessera:tenant:<name>              hash: policy (JSON), cache_salt, created_at
  tessera:tenant:<name>:keys         set of key ids
  tessera:apikey:<key_id>            hash: sha256, tenant, created_at, revoked_at (restored_at: see
                                     ``restore_key``)
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

if TYPE_CHECKING:
    from tessera.redis_wire import Command, RedisWire

from tessera.tenancy.keys import KEY_ID_HEX_CHARS, IssuedKey, key_matches, new_key, parse_key_id
from tessera.tenancy.policy import TenantPolicy, validate_tenant_name

TENANTS_SET = "tessera:tenants"


def tenant_key(name: str) -> str:
    return f"tessera:tenant:{name}"


def tenant_keys_set(name: str) -> str:
    return f"tessera:tenant:{name}:keys"


def apikey_key(key_id: str) -> str:
    return f"tessera:apikey:{key_id}"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# Re-installs a key record only where none exists: a revoked record (revoked_at set) is never brought back.
# One script, so no reader sees a record without its tenant field.
_RESTORE_KEY_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'sha256', ARGV[1], 'tenant', ARGV[2], 'created_at', ARGV[3], 'restored_at', ARGV[3])
redis.call('SADD', KEYS[2], ARGV[4])
return 1
"""
_SHA256_HEX_CHARS = 64


class TenantExistsError(ValueError):
    pass


class TenantNotFoundError(KeyError):
    pass


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    policy: TenantPolicy
    cache_salt: str
    created_at: float


@dataclass(frozen=True, slots=True)
class KeyInfo:
    key_id: str
    tenant: str
    created_at: float
    revoked: bool

    @property
    def display_prefix(self) -> str:
        return f"tsk-{self.key_id}-…"


@dataclass(frozen=True, slots=True)
class StoredKey:
    """A key record as Redis holds it: the hash, never the key."""

    key_id: str
    tenant: str
    sha256: str
    revoked: bool


class TenantStore:
    """Async CRUD over tenants and keys. Thin: validation lives in the pydantic policy.

    ``wire``: a lean Redis connection (redis_wire.py), when the caller has one; the gateway's key-cache
    refresh (``read_keys``) then goes over it instead of through redis-py."""

    def __init__(self, redis: aioredis.Redis, wire: RedisWire | None = None) -> None:
        self._redis = redis
        self._wire = wire

    async def create_tenant(self, name: str, policy: TenantPolicy | None = None) -> Tenant:
        validate_tenant_name(name)
        policy = policy or TenantPolicy()
        now = time.time()
        salt = secrets.token_hex(16)
        # HSETNX on a marker field makes create idempotent-safe across concurrent callers.
        created = await self._redis.hsetnx(tenant_key(name), "created_at", repr(now))
        if not created:
            raise TenantExistsError(f"tenant {name!r} already exists")
        await self._redis.hset(
            tenant_key(name), mapping={"policy": policy.model_dump_json(), "cache_salt": salt}
        )
        await self._redis.sadd(TENANTS_SET, name)
        return Tenant(name=name, policy=policy, cache_salt=salt, created_at=now)

    async def get_tenant(self, name: str) -> Tenant | None:
        return _tenant_from(name, await self._redis.hgetall(tenant_key(name)))

    async def require_tenant(self, name: str) -> Tenant:
        tenant = await self.get_tenant(name)
        if tenant is None:
            raise TenantNotFoundError(f"tenant {name!r} does not exist")
        return tenant

    async def list_tenants(self) -> list[Tenant]:
        names = sorted(_text(n) for n in await self._redis.smembers(TENANTS_SET))
        tenants = [await self.get_tenant(n) for n in names]
        return [t for t in tenants if t is not None]

    async def set_policy(self, name: str, policy: TenantPolicy) -> Tenant:
        await self.require_tenant(name)
        await self._redis.hset(tenant_key(name), "policy", policy.model_dump_json())
        return await self.require_tenant(name)

    async def delete_tenant(self, name: str) -> None:
        """Deletes the tenant and revokes all its keys (they stop working within the key-cache TTL)."""
        await self.require_tenant(name)
        key_ids = [_text(k) for k in await self._redis.smembers(tenant_keys_set(name))]
        pipe = self._redis.pipeline(transaction=True)
        for key_id in key_ids:
            pipe.delete(apikey_key(key_id))
        pipe.delete(tenant_keys_set(name), tenant_key(name))
        pipe.srem(TENANTS_SET, name)
        await pipe.execute()

    async def issue_key(self, tenant: str) -> IssuedKey:
        await self.require_tenant(tenant)
        issued = new_key()
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(
            apikey_key(issued.key_id),
            mapping={"sha256": issued.sha256, "tenant": tenant, "created_at": repr(time.time())},
        )
        pipe.sadd(tenant_keys_set(tenant), issued.key_id)
        await pipe.execute()
        return issued

    async def restore_key(self, tenant: str, key_id: str, sha256: str) -> bool:
        """Re-installs a key that Redis lost (a flush, a restart without persistence) from its id and hash,
        so the client's key authenticates again unchanged. False, writing nothing, when a record of that id
        exists (live or revoked: a revocation is never undone here)."""
        await self.require_tenant(tenant)
        if not _is_hex(key_id, KEY_ID_HEX_CHARS):
            raise ValueError(f"key id {key_id!r} is not {KEY_ID_HEX_CHARS} lowercase hex characters")
        if not _is_hex(sha256, _SHA256_HEX_CHARS):
            raise ValueError(f"sha256 must be {_SHA256_HEX_CHARS} lowercase hex characters")
        restored = await self._redis.eval(_RESTORE_KEY_LUA, 2, apikey_key(key_id), tenant_keys_set(tenant),
                                          sha256, tenant, repr(time.time()), key_id)
        return bool(restored)

    async def get_key(self, key_id: str) -> StoredKey | None:
        raw = await self._redis.hgetall(apikey_key(key_id))
        if not raw or b"sha256" not in raw:
            return None
        return StoredKey(key_id=key_id, tenant=_text(raw[b"tenant"]), sha256=_text(raw[b"sha256"]),
                         revoked=b"revoked_at" in raw)

    async def list_keys(self, tenant: str) -> list[KeyInfo]:
        await self.require_tenant(tenant)
        infos = []
        for raw_id in sorted(await self._redis.smembers(tenant_keys_set(tenant))):
            key_id = _text(raw_id)
            raw = await self._redis.hgetall(apikey_key(key_id))
            if raw:
                infos.append(
                    KeyInfo(
                        key_id=key_id,
                        tenant=tenant,
                        created_at=float(raw[b"created_at"]),
                        revoked=b"revoked_at" in raw,
                    )
                )
        return infos

    async def revoke_key(self, key_id: str) -> str:
        """Revokes a key; returns its tenant. The record stays (audit) but no longer authenticates."""
        raw = await self._redis.hgetall(apikey_key(key_id))
        if not raw:
            raise KeyError(f"key {key_id!r} does not exist")
        await self._redis.hset(apikey_key(key_id), "revoked_at", repr(time.time()))
        return str(_text(raw[b"tenant"]))

    async def authenticate(self, plaintext: str) -> str | None:
        """The tenant a key belongs to, or None for an unknown, malformed or revoked key."""
        key_id = parse_key_id(plaintext)
        if key_id is None:
            return None
        return _key_owner(plaintext, await self._redis.hgetall(apikey_key(key_id)))

    async def read_keys(self, plaintexts: list[str], tenant_names: list[str]
                        ) -> tuple[dict[str, str | None], dict[str, Tenant | None]]:
        """Each key's tenant (as ``authenticate`` answers) and each named tenant (as ``get_tenant``), in one
        round trip: the gateway's key-cache refresher names the tenants its keys last authenticated as. A
        key whose tenant was not named costs a second round trip for that tenant (a key's tenant never
        changes, so only a caller that did not know it pays it)."""
        key_ids = {k: parse_key_id(k) for k in plaintexts}
        wellformed = [k for k, key_id in key_ids.items() if key_id is not None]
        commands: list[Command] = [("HGETALL", apikey_key(key_ids[k] or "")) for k in wellformed]
        commands += [("HGETALL", tenant_key(name)) for name in tenant_names]
        replies = await self._execute(commands)
        owners: dict[str, str | None] = dict.fromkeys(plaintexts)
        for plaintext, raw in zip(wellformed, replies[:len(wellformed)], strict=True):
            owners[plaintext] = _key_owner(plaintext, _as_map(raw))
        tenants = {name: _tenant_from(name, _as_map(raw))
                   for name, raw in zip(tenant_names, replies[len(wellformed):], strict=True)}
        missing = sorted({name for name in owners.values() if name is not None and name not in tenants})
        if missing:
            replies = await self._execute([("HGETALL", tenant_key(name)) for name in missing])
            tenants.update({name: _tenant_from(name, _as_map(raw)) for name, raw in zip(missing, replies, strict=True)})
        return owners, tenants

    async def _execute(self, commands: list[Command]) -> list[Any]:
        """The commands in one round trip, over the wire when there is one; an error reply raises."""
        if not commands:
            return []
        if self._wire is not None:
            replies = await self._wire.execute(commands)
        else:
            pipe = self._redis.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            replies = await pipe.execute()
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies


def _is_hex(text: str, num_chars: int) -> bool:
    return len(text) == num_chars and all(c in "0123456789abcdef" for c in text)


def _as_map(reply: Any) -> Mapping[Any, Any]:
    """A hash as either client returns it: redis-py a dict, the wire a flat [field, value, ...] list."""
    return reply if isinstance(reply, Mapping) else dict(zip(reply[::2], reply[1::2], strict=True))


def _tenant_from(name: str, raw: Mapping[Any, Any]) -> Tenant | None:
    if not raw or b"policy" not in raw:
        return None
    return Tenant(
        name=name,
        policy=TenantPolicy.model_validate_json(raw[b"policy"]),
        cache_salt=_text(raw[b"cache_salt"]),
        created_at=float(raw[b"created_at"]),
    )


def _key_owner(plaintext: str, raw: Mapping[Any, Any]) -> str | None:
    """The tenant of a key record, if the record exists, is not revoked and matches the plaintext."""
    if not raw or b"revoked_at" in raw:
        return None
    if not key_matches(plaintext, _text(raw[b"sha256"])):
        return None
    return str(_text(raw[b"tenant"]))


def policy_from_json(text: str) -> TenantPolicy:
    return TenantPolicy.model_validate(json.loads(text))
