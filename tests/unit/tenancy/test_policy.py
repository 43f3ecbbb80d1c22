"""TenantPolicy: strict fields, camelCase aliases, priority mapping, partial updates."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tessera.tenancy.policy import DEMOTION_STEP, PRIORITY_VALUES, TenantPolicy, validate_tenant_name


def test_defaults_are_unlimited_with_isolation_on() -> None:
    policy = TenantPolicy()
    assert policy.requests_per_minute is None and policy.tokens_per_minute is None
    assert policy.max_concurrent_requests is None and policy.token_budget is None
    assert policy.prefix_cache_isolation is True
    assert policy.priority_class == "normal" and policy.kv_quota == 1.0
    assert policy.allows_model("anything")


def test_unknown_field_is_an_error_not_a_silent_default() -> None:
    with pytest.raises(ValidationError, match="Extra inputs"):
        TenantPolicy.model_validate({"requests_per_minuet": 10})


def test_camel_case_aliases_and_field_names_both_validate() -> None:
    by_alias = TenantPolicy.model_validate({"requestsPerMinute": 50, "maxConcurrentRequests": 2})
    by_name = TenantPolicy.model_validate({"requests_per_minute": 50, "max_concurrent_requests": 2})
    assert by_alias == by_name


@pytest.mark.parametrize("field, value", [
    ("requests_per_minute", 0), ("tokens_per_minute", -1), ("max_concurrent_requests", 0), ("token_budget", 0),
    ("kv_quota", 0.0), ("kv_quota", 1.5), ("max_tokens_cap", 0), ("max_n", 17), ("priority_class", "urgent"),
    ("budget_period", "week"), ("allowed_models", [""]),
])
def test_out_of_range_values_are_rejected(field: str, value: object) -> None:
    with pytest.raises(ValidationError):
        TenantPolicy.model_validate({field: value})


def test_priority_classes_map_to_ordered_vllm_priorities() -> None:
    # vLLM runs the lowest value first: critical before batch, and a demoted class after every normal one.
    order = ["critical", "high", "normal", "low", "batch"]
    values = [TenantPolicy(priority_class=c).priority for c in order]  # type: ignore[arg-type]
    assert values == sorted(values) and len(set(values)) == len(values)
    assert values == [PRIORITY_VALUES[c] for c in order]
    assert PRIORITY_VALUES["critical"] + DEMOTION_STEP > PRIORITY_VALUES["batch"]


def test_allowed_models_restricts() -> None:
    policy = TenantPolicy(allowed_models=["a", "b"])
    assert policy.allows_model("a") and not policy.allows_model("c")
    assert not TenantPolicy(allowed_models=[]).allows_model("a")


def test_updated_changes_only_the_given_fields_by_name_or_alias() -> None:
    policy = TenantPolicy(requests_per_minute=10, priority_class="high")
    changed = policy.updated({"tokensPerMinute": 500, "requests_per_minute": 20})
    assert changed.requests_per_minute == 20 and changed.tokens_per_minute == 500
    assert changed.priority_class == "high"
    assert policy.requests_per_minute == 10  # the original is untouched


def test_updated_can_clear_a_limit() -> None:
    assert TenantPolicy(requests_per_minute=10).updated({"requestsPerMinute": None}).requests_per_minute is None


def test_updated_rejects_unknown_fields_listing_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown policy field.*rpm.*valid:.*requests_per_minute"):
        TenantPolicy().updated({"rpm": 5})


def test_updated_validates_values() -> None:
    with pytest.raises(ValidationError):
        TenantPolicy().updated({"kvQuota": 2.0})


@pytest.mark.parametrize("name", ["a", "acme", "team-7", "x" * 63])
def test_valid_tenant_names(name: str) -> None:
    assert validate_tenant_name(name) == name


@pytest.mark.parametrize("name", ["", "-a", "a-", "Acme", "a_b", "a.b", "x" * 64, "a b", "tenant:1"])
def test_invalid_tenant_names(name: str) -> None:
    with pytest.raises(ValueError, match="invalid"):
        validate_tenant_name(name)
