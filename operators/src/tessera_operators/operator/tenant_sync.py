"""Does Redis still say what a Tenant says? The pure check behind the Tenant timer (handlers.tenant_resync).

Redis can lose a tenant without the operator noticing: a Redis without persistence restarts, someone
flushes it, a failover promotes an empty replica. The timer reads two Redis records per Tenant and compares
them with the Tenant's spec and status here; only when something differs does it run the full reconcile
(which reads the Secret from the API server and writes what is missing). So a quiet cluster costs two Redis
reads per Tenant per interval and no API-server call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tessera.tenancy.policy import TenantPolicy
from tessera.tenancy.store import StoredKey

from .builders import TenantSpec


def resync_reason(
    spec: TenantSpec,
    status: Mapping[str, Any],
    stored_policy: TenantPolicy | None,
    stored_key: StoredKey | None,
) -> str | None:
    """Why the Tenant must be reconciled, for the log; None when Redis already holds its tenant, its
    policy and its current key (``status.keyId``, with the hash ``status.keySha256``)."""
    if stored_policy is None:
        return "the tenant is missing from Redis"
    if stored_policy != spec.policy:
        return "the policy in Redis differs from spec.policy"
    key_id = status.get("keyId")
    if not key_id:
        return "no key has been issued yet"
    if stored_key is None:
        return f"key {key_id} is missing from Redis"
    if stored_key.tenant != spec.name or stored_key.revoked:
        return f"key {key_id} no longer authenticates as this tenant"
    if status.get("keySha256") != stored_key.sha256:
        # A Tenant reconciled before status kept the hash: record it now, while Redis still has it.
        return f"status does not hold the hash of key {key_id}"
    return None
