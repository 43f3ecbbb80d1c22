"""``resync_reason``: the Tenant timer's pure check, one case per thing Redis can have lost."""

from __future__ import annotations

from typing import Any

import pytest

from tessera.tenancy.policy import TenantPolicy
from tessera.tenancy.store import StoredKey
from tessera_operators.operator.builders import parse_tenant
from tessera_operators.operator.tenant_sync import resync_reason

SPEC = parse_tenant("team-a", {"policy": {"requestsPerMinute": 600}})
KEY_ID, SHA = "0123456789ab", "ab" * 32
STATUS = {"keyId": KEY_ID, "keySha256": SHA}
KEY = StoredKey(key_id=KEY_ID, tenant="team-a", sha256=SHA, revoked=False)


def test_nothing_to_do_when_redis_holds_the_tenant_its_policy_and_its_key() -> None:
    assert resync_reason(SPEC, STATUS, SPEC.policy, KEY) is None


@pytest.mark.parametrize(
    ("status", "policy", "key", "reason"),
    [
        (STATUS, None, None, "the tenant is missing from Redis"),
        (STATUS, TenantPolicy(), KEY, "the policy in Redis differs from spec.policy"),
        ({}, SPEC.policy, None, "no key has been issued yet"),
        (STATUS, SPEC.policy, None, f"key {KEY_ID} is missing from Redis"),
        (STATUS, SPEC.policy, StoredKey(KEY_ID, "team-a", SHA, revoked=True),
         f"key {KEY_ID} no longer authenticates as this tenant"),
        (STATUS, SPEC.policy, StoredKey(KEY_ID, "team-b", SHA, revoked=False),
         f"key {KEY_ID} no longer authenticates as this tenant"),
        ({"keyId": KEY_ID}, SPEC.policy, KEY, f"status does not hold the hash of key {KEY_ID}"),
        ({**STATUS, "keySha256": "cd" * 32}, SPEC.policy, KEY, f"status does not hold the hash of key {KEY_ID}"),
    ],
)
def test_each_loss_has_its_reason(status: dict[str, Any], policy: TenantPolicy | None, key: StoredKey | None,
                                  reason: str) -> None:
    assert resync_reason(SPEC, status, policy, key) == reason
