"""Fault paths that are hard to provoke on cue: a Redis that fails N times, then answers. (The real outage,
with real processes, is tests/integration/tenancy/test_redis_faults.py.)"""

from __future__ import annotations

import asyncio
from datetime import datetime

import pytest

from tessera.gateway.auth import Authenticator
from tessera.tenancy import billing
from tessera.tenancy.admission import Lease
from tessera.tenancy.billing import FinishQueue
from tessera.tenancy.policy import TenantPolicy
from tessera.tenancy.store import Tenant

LEASE = Lease("lease-1", "acme", 100, ("k1", "k2", "k3", "k4", "k5"))
KEY = "tsk-0123456789ab-secret"


class FlakyAdmission:
    """Fails the first ``failures`` finishes with ``error``, then records them."""

    def __init__(self, failures: int, error: BaseException) -> None:
        self.failures, self.error = failures, error
        self.recorded: list[tuple[str, int, int, datetime | None]] = []

    async def finish(self, lease: Lease, prompt: int, completion: int, now: datetime | None = None) -> bool:
        if self.failures:
            self.failures -= 1
            raise self.error
        self.recorded.append((lease.lease_id, prompt, completion, now))
        return True

    async def send_finish(self, lease: Lease, prompt: int, completion: int, now: datetime) -> None:
        await self.finish(lease, prompt, completion, now)  # as ``Admission`` without a lean connection

    def read_replies(self) -> None:
        pass


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(billing, "RETRY_INITIAL_S", 0.001)
    monkeypatch.setattr(billing, "RETRY_MAX_S", 0.004)


async def test_a_finish_that_fails_is_retried_until_recorded() -> None:
    admission = FlakyAdmission(failures=5, error=ConnectionError("down"))
    queue = FinishQueue(admission, lambda exc: isinstance(exc, ConnectionError))  # type: ignore[arg-type]
    await queue.finish(LEASE, 10, 7)
    assert queue.num_parked == 1 and not admission.recorded
    for _ in range(200):
        if admission.recorded:
            break
        await asyncio.sleep(0.005)
    assert [r[:3] for r in admission.recorded] == [("lease-1", 10, 7)]
    assert queue.num_parked == 0
    # The usage period is the one the request finished in, not the one the retry happened in.
    assert admission.recorded[0][3] is not None


async def test_a_finish_that_succeeds_is_not_parked() -> None:
    admission = FlakyAdmission(failures=0, error=ConnectionError())
    queue = FinishQueue(admission, lambda exc: True)  # type: ignore[arg-type]
    await queue.finish(LEASE, 1, 2)
    assert queue.num_parked == 0 and len(admission.recorded) == 1


async def test_a_non_transient_error_is_raised_not_parked() -> None:
    admission = FlakyAdmission(failures=1, error=ValueError("bug"))
    queue = FinishQueue(admission, lambda exc: isinstance(exc, ConnectionError))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bug"):
        await queue.finish(LEASE, 1, 2)
    assert queue.num_parked == 0


class FlakyStore:
    def __init__(self) -> None:
        self.down = False
        self.calls = 0

    async def authenticate(self, key: str) -> str | None:
        self.calls += 1
        if self.down:
            raise ConnectionError("redis down")
        return "acme" if key == KEY else None

    async def get_tenant(self, name: str) -> Tenant:
        return Tenant(name, TenantPolicy(), "salt", 0.0)


@pytest.mark.parametrize("fail_open", [False, True])
async def test_auth_without_redis_fails_closed_unless_fail_open_knows_the_key(fail_open: bool) -> None:
    store = FlakyStore()
    auth = Authenticator(store, ttl_s=0.0, fail_open=fail_open)  # type: ignore[arg-type]
    header = f"Bearer {KEY}"
    assert (await auth.tenant_for(header)).name == "acme"  # type: ignore[union-attr]
    store.down = True
    if fail_open:
        assert (await auth.tenant_for(header)).name == "acme"  # type: ignore[union-attr]
    else:
        with pytest.raises(ConnectionError):
            await auth.tenant_for(header)
    with pytest.raises(ConnectionError):  # a key never seen is never let in without Redis
        await auth.tenant_for("Bearer tsk-ba9876543210-other")


async def test_malformed_keys_never_reach_redis() -> None:
    store = FlakyStore()
    auth = Authenticator(store, ttl_s=1.0)  # type: ignore[arg-type]
    for header in (None, "", "Bearer", "Bearer nope", "Token " + KEY, "Bearer tsk-XYZ-abc"):
        assert await auth.tenant_for(header) is None
    assert store.calls == 0


async def test_results_are_cached_for_the_ttl_including_rejections() -> None:
    store = FlakyStore()
    auth = Authenticator(store, ttl_s=60.0)  # type: ignore[arg-type]
    wrong = "Bearer tsk-0123456789ab-wrong"
    for _ in range(3):
        assert await auth.tenant_for(f"Bearer {KEY}") is not None
        assert await auth.tenant_for(wrong) is None
    assert store.calls == 2


