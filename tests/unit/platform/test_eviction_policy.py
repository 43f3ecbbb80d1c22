"""Only noeviction keeps Tessera's state: allkeys-* drop tenants and key hashes, volatile-* drop budgets,
usage and leases (the keys with a TTL)."""

from __future__ import annotations

import pytest

from tessera.redis_conn import eviction_problem


def test_noeviction_is_the_one_safe_policy() -> None:
    assert eviction_problem("noeviction") is None


@pytest.mark.parametrize("policy", ["allkeys-lru", "allkeys-lfu", "allkeys-random"])
def test_allkeys_policies_would_drop_tenants(policy: str) -> None:
    problem = eviction_problem(policy)
    assert problem is not None and "tenants and key hashes" in problem and "noeviction" in problem


@pytest.mark.parametrize("policy", ["volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl"])
def test_volatile_policies_would_drop_budgets_and_usage(policy: str) -> None:
    problem = eviction_problem(policy)
    assert problem is not None and "budgets, usage and concurrency leases" in problem
