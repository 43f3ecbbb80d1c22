"""Admission: requests/min, tokens/min, concurrency and budget in one atomic Lua call on Redis.

Invariants (tested exactly in tests/integration/test_admission.py):
- Across any number of gateway processes, at most ``requests_per_minute`` requests are admitted in any
  sliding 60 s window of Redis time, and at most ``max_concurrent_requests`` hold an unexpired lease.
- Tokens/min and budget are charged ``prompt + max_tokens`` at admission and corrected to the actual
  usage by ``finish``; a failed request is charged what it really consumed (possibly 0).
- Every key written has a TTL: a gateway that dies mid-request leaks nothing past the lease TTL.
"""

from __future__ import annotations

import calendar
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources

import redis.asyncio as aioredis

from tessera.tenancy.policy import TenantPolicy

LEASE_TTL_S = 30
USAGE_TTL_S = 400 * 86400


def _lua(name: str) -> str:
    return resources.files("tessera.tenancy").joinpath(name).read_text()


def budget_period_id(period: str, now: datetime) -> tuple[str, int]:
    """The period's id and the seconds until it ends (the budget key's TTL)."""
    if period == "hour":
        end = now.replace(minute=0, second=0, microsecond=0).timestamp() + 3600
        return now.strftime("%Y-%m-%dT%H"), int(end - now.timestamp()) + 1
    if period == "day":
        end = now.replace(hour=0, minute=0, second=0, microsecond=0).timestamp() + 86400
        return now.strftime("%Y-%m-%d"), int(end - now.timestamp()) + 1
    if period == "month":
        days = calendar.monthrange(now.year, now.month)[1]
        start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0).timestamp()
        return now.strftime("%Y-%m"), int(start + days * 86400 - now.timestamp()) + 1
    raise ValueError(f"unknown budget period {period!r}: use hour, day or month")


def usage_key(tenant: str, period_id: str) -> str:
    return f"tessera:usage:{tenant}:{period_id}"


def limiter_keys(tenant: str, budget_period: str) -> list[str]:
    return [
        f"tessera:rl:{tenant}:rpm",
        f"tessera:rl:{tenant}:tpm",
        f"tessera:rl:{tenant}:tpm-tokens",
        f"tessera:rl:{tenant}:leases",
        f"tessera:rl:{tenant}:budget:{budget_period}",
    ]


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    tenant: str
    reserved_tokens: int
    keys: tuple[str, ...]
    usage_key: str


@dataclass(frozen=True, slots=True)
class Rejection:
    limit: str
    retry_after_s: int
    current: int
    maximum: int

    @property
    def message(self) -> str:
        if self.limit == "tokens_per_minute" and self.current > self.maximum:
            return (f"Request needs {self.current} tokens (prompt + max_tokens) but the tenant's "
                    f"tokens_per_minute limit is {self.maximum}: lower max_tokens.")
        return (f"Rate limit exceeded: {self.limit} is {self.maximum} (currently {self.current}); "
                f"retry after {self.retry_after_s} s.")


class Admission:
    def __init__(self, redis: aioredis.Redis, lease_ttl_s: int = LEASE_TTL_S) -> None:
        self._redis = redis
        self.lease_ttl_s = lease_ttl_s
        self._admit = redis.register_script(_lua("admission.lua"))
        self._finish = redis.register_script(_lua("finish.lua"))
        self._renew = redis.register_script(_lua("renew.lua"))

    async def admit(self, tenant: str, policy: TenantPolicy, reserve_tokens: int) -> Lease | Rejection:
        period_id, budget_ttl = budget_period_id(policy.budget_period, datetime.now(UTC))
        keys = limiter_keys(tenant, period_id)
        lease_id = uuid.uuid4().hex
        result = await self._admit(
            keys=keys,
            args=[
                policy.requests_per_minute or 0,
                policy.tokens_per_minute or 0,
                policy.max_concurrent_requests or 0,
                policy.token_budget or 0,
                reserve_tokens,
                lease_id,
                self.lease_ttl_s,
                budget_ttl,
            ],
        )
        if int(result[0]) == 1:
            return Lease(lease_id, tenant, reserve_tokens, tuple(keys), usage_key(tenant, period_id))
        limit = result[1].decode() if isinstance(result[1], bytes) else str(result[1])
        retry_ms = int(result[2])
        return Rejection(limit, max(1, -(-retry_ms // 1000)) if retry_ms else 0, int(result[3]), int(result[4]))

    async def renew(self, lease: Lease) -> bool:
        return bool(await self._renew(keys=[lease.keys[3]], args=[lease.lease_id, self.lease_ttl_s]))

    async def finish(self, lease: Lease, prompt_tokens: int, completion_tokens: int) -> None:
        await self._finish(
            keys=[*lease.keys, lease.usage_key],
            args=[lease.lease_id, lease.reserved_tokens, prompt_tokens + completion_tokens, prompt_tokens,
                  completion_tokens, USAGE_TTL_S],
        )

    async def usage(self, tenant: str, period: str, when: datetime | None = None) -> dict[str, int]:
        period_id, _ = budget_period_id(period, when or datetime.now(UTC))
        raw = await self._redis.hgetall(usage_key(tenant, period_id))
        usage = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
        return {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, **usage, "period": period_id}  # type: ignore[dict-item]

