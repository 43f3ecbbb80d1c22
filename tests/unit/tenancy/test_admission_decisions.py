"""The pure parts of admission: key layout (all under tessera:rl:), script results, rejection messages."""

from __future__ import annotations

import pytest

from tessera.tenancy.admission import (
    Admission,
    Rejection,
    finish_marker_key,
    leases_key,
    limiter_keys,
    rejection_from_script,
    usage_key,
)


def test_every_limiter_key_is_under_the_rl_prefix_and_per_tenant() -> None:
    keys = limiter_keys("acme", "2025-03")
    assert len(keys) == 5 and len(set(keys)) == 5
    assert all(k.startswith("tessera:rl:acme:") for k in keys)
    assert keys[3] == leases_key("acme")
    assert keys[4].endswith(":budget:2025-03")
    assert finish_marker_key("acme", "L1").startswith("tessera:rl:acme:")
    assert not set(keys) & set(limiter_keys("acme-2", "2025-03"))
    assert usage_key("acme", "2025-03") == "tessera:usage:acme:2025-03"


@pytest.mark.parametrize("retry_ms, retry_s", [(1, 1), (999, 1), (1000, 1), (1001, 2), (59_500, 60), (0, 0)])
def test_retry_after_rounds_up_to_whole_seconds(retry_ms: int, retry_s: int) -> None:
    rejection = rejection_from_script([0, b"requests_per_minute", retry_ms, 50, 50])
    assert rejection == Rejection("requests_per_minute", retry_s, 50, 50)


def test_messages_name_the_limit() -> None:
    rpm = Rejection("requests_per_minute", 12, 50, 50)
    assert "requests_per_minute is 50" in rpm.message and "retry after 12 s" in rpm.message
    conc = Rejection("max_concurrent_requests", 1, 4, 4)
    assert "max_concurrent_requests" in conc.message


@pytest.mark.parametrize("limit", ["tokens_per_minute", "token_budget"])
def test_a_request_larger_than_the_limit_is_told_to_lower_max_tokens(limit: str) -> None:
    rejection = rejection_from_script([0, limit.encode(), 0, 5000, 1000])
    assert rejection.retry_after_s == 0
    assert "lower max_tokens" in rejection.message and limit in rejection.message


def test_lease_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError, match="lease_ttl_s"):
        Admission(None, lease_ttl_s=0)  # type: ignore[arg-type]
