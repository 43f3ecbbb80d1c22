"""A tenant's policy: the limits admission enforces, the priority the engine schedules by, and the KV
quota the KV-eviction controller enforces. Stored in Redis as JSON; every change is validated here."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

PriorityClass = Literal["critical", "high", "normal", "low", "batch"]

# vLLM's priority scheduler runs the *lowest* value first.
PRIORITY_VALUES: dict[str, int] = {"critical": 0, "high": 10, "normal": 20, "low": 30, "batch": 40}
# The controller demotes an over-quota tenant's new requests by this much (still ordered among themselves).
DEMOTION_STEP = 100

TENANT_NAME_PATTERN = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


class TenantPolicy(BaseModel):
    """Limits of one tenant. ``None`` means unlimited for that limit."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)

    requests_per_minute: int | None = Field(default=None, ge=1, description="Admitted requests per 60 s window.")
    tokens_per_minute: int | None = Field(
        default=None, ge=1, description="Prompt + output tokens per 60 s window (max_tokens reserved up front)."
    )
    max_concurrent_requests: int | None = Field(default=None, ge=1, description="Requests in flight at once.")
    token_budget: int | None = Field(default=None, ge=1, description="Tokens allowed per budget period.")
    budget_period: Literal["hour", "day", "month"] = Field(default="month", description="Budget period.")
    priority_class: PriorityClass = Field(default="normal", description="Maps to the vLLM request priority.")
    kv_quota: float = Field(
        default=1.0, gt=0.0, le=1.0, description="Share of each engine's KV blocks the tenant may hold."
    )
    allowed_models: list[str] | None = Field(
        default=None, description="Served model names this tenant may call; None: all served models."
    )
    max_tokens_cap: int = Field(default=4096, ge=1, description="Largest max_tokens a request may ask for.")
    max_prompt_tokens: int | None = Field(default=None, ge=1, description="Largest prompt, tokens.")
    max_n: int = Field(default=1, ge=1, le=16, description="Largest `n` (choices per request).")
    prefix_cache_isolation: bool = Field(
        default=True,
        description="Salt the tenant's prefix cache so no other tenant can hit it (a timing side channel).",
    )

    @field_validator("allowed_models")
    @classmethod
    def _non_empty_names(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not name for name in value):
            raise ValueError("allowed_models entries must be non-empty model names")
        return value

    @property
    def priority(self) -> int:
        return PRIORITY_VALUES[self.priority_class]

    def allows_model(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models

    def updated(self, changes: Mapping[str, Any]) -> TenantPolicy:
        """This policy with some fields changed; keys may be field names or their camelCase aliases.
        Raises ``ValueError`` for an unknown field, pydantic's ``ValidationError`` for a bad value."""
        names: dict[str, str] = {}
        for name, info in type(self).model_fields.items():
            names[name] = name
            if info.alias:
                names[info.alias] = name
        unknown = sorted(k for k in changes if k not in names)
        if unknown:
            raise ValueError(f"unknown policy field(s) {', '.join(unknown)}; valid: "
                             f"{', '.join(type(self).model_fields)}")
        data = self.model_dump()
        data.update({names[k]: v for k, v in changes.items()})
        return type(self).model_validate(data)


def validate_tenant_name(name: str) -> str:
    if not TENANT_NAME_PATTERN.match(name):
        raise ValueError(
            f"tenant name {name!r} is invalid: use 1-63 lowercase letters, digits and '-', "
            "starting and ending with a letter or digit"
        )
    return name
