"""The controller's decisions: a pure function from one engine's snapshot to the actions to take.

Levers, mildest first:

1. **Demote** a tenant that holds more of this engine's KV blocks than its quota (``kv_quota`` x blocks)
   while it is active here (a request in flight, or blocks stored within ``active_window_s``: requests
   can finish between two polls): the gateway adds ``DEMOTION_STEP`` to the priority of its new requests, so
   vLLM's priority scheduler serves everyone else first and preempts the demoted tenant first. Restored
   once its blocks fall to ``restore_fraction`` of the quota (hysteresis, so the flag does not flap).
2. **Pressure flag** when the engine's KV usage reaches ``high_watermark``; cleared once usage has stayed at
   or below ``low_watermark`` for ``pressure_hold_s`` (an engine between two requests is not relieved).
   Routing ranks flagged engines last; the gateway sheds low/batch-class requests with 503 + Retry-After
   while *every* engine of the model is flagged (see docs/tracing.md, "What the controller does").
3. **Abort**, the last resort: when free blocks are at most ``abort_free_blocks``, requests are waiting, a
   running request has a strictly worse priority than another one here, and some other engine of the model
   is not under pressure, abort the worst-priority, youngest request; the gateway continues it on another
   engine from the tokens it already streamed. At most one abort per ``abort_cooldown_s``.

Usage counts the blocks running requests hold (vLLM's ``kv_cache_usage``); cached blocks nobody holds are
free to vLLM and are evicted LRU. Quotas count the blocks a tenant's chains occupy in the cache (the
ledger), which is what pushes the other tenants' prefixes out.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel


class PolicyConfig(BaseModel):
    """Thresholds of the control loop (``TESSERA_KVCONTROL_POLICY`` as JSON, camelCase or snake_case)."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)

    high_watermark: float = Field(
        default=0.90, gt=0.0, le=1.0, description="KV usage at or above which the engine's pressure flag is set."
    )
    low_watermark: float = Field(
        default=0.70, ge=0.0, lt=1.0, description="KV usage at or below which the pressure flag is cleared."
    )
    active_window_s: float = Field(
        default=10.0, ge=0.0,
        description="A tenant that stored blocks this recently counts as active (may be demoted) even with no "
        "request in flight at the poll.",
    )
    restore_fraction: float = Field(
        default=0.8, gt=0.0, le=1.0,
        description="A demoted tenant is restored when its blocks fall to this share of its quota.",
    )
    pressure_hold_s: float = Field(
        default=1.0, ge=0.0, description="How long usage must stay at or below low_watermark before the flag clears."
    )
    enable_demotion: bool = Field(default=True, description="Demote over-quota tenants.")
    enable_pressure: bool = Field(default=True, description="Set the engine's pressure flag.")
    enable_abort: bool = Field(default=True, description="Abort as a last resort.")
    abort_free_blocks: int = Field(
        default=2, ge=0, description="Free blocks at or below which the last-resort abort may fire."
    )
    abort_cooldown_s: float = Field(default=2.0, ge=0.0, description="Least time between two aborts on an engine.")
    resync_max_s: float = Field(
        default=60.0, gt=0.0,
        description="After lost KV events the engine's ledger starts over and holds demotions, restores and "
        "aborts until the engine's cache has turned over or was cleared, or for at most this long, seconds "
        "(kvcontrol/resync.py).",
    )
    abort_min_age_s: float = Field(
        default=0.5, ge=0.0, description="Requests younger than this are not aborted (they may not even run yet)."
    )

    @model_validator(mode="after")
    def _ordered(self) -> PolicyConfig:
        if self.low_watermark >= self.high_watermark:
            raise ValueError(f"low_watermark={self.low_watermark} must be below high_watermark={self.high_watermark}")
        return self


@dataclass(frozen=True, slots=True)
class TenantUsage:
    tenant: str
    num_blocks: int
    quota_blocks: int
    num_in_flight: int
    demoted: bool  # demoted because of *this* engine
    seconds_since_store: float | None = None  # since the tenant last stored a block here (None: never)

    def active(self, window_s: float) -> bool:
        return self.num_in_flight > 0 or (self.seconds_since_store is not None and self.seconds_since_store <= window_s)


@dataclass(frozen=True, slots=True)
class InFlightRequest:
    request_id: str
    tenant: str
    priority: int
    age_s: float
    traceparent: str = ""


@dataclass(frozen=True, slots=True)
class ControlSnapshot:
    engine_id: str
    num_gpu_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    under_pressure: bool
    tenants: tuple[TenantUsage, ...]
    requests: tuple[InFlightRequest, ...]
    # Live engines serving the same model, other than this one, without the pressure flag.
    num_relief_engines: int
    seconds_since_abort: float | None
    # How long usage has stayed at or below the low watermark without a break (0: it is above now).
    seconds_below_low: float = 0.0

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_gpu_blocks if self.num_gpu_blocks else 0.0


@dataclass(frozen=True, slots=True)
class Demote:
    tenant: str
    num_blocks: int
    quota_blocks: int
    cause: str


@dataclass(frozen=True, slots=True)
class Restore:
    tenant: str
    num_blocks: int
    quota_blocks: int
    cause: str


@dataclass(frozen=True, slots=True)
class SetPressure:
    usage: float
    cause: str


@dataclass(frozen=True, slots=True)
class ClearPressure:
    usage: float
    cause: str


@dataclass(frozen=True, slots=True)
class Abort:
    request: InFlightRequest
    cause: str


Action = Demote | Restore | SetPressure | ClearPressure | Abort

ACTION_NAMES: dict[type, str] = {
    Demote: "demote", Restore: "restore", SetPressure: "pressure_set", ClearPressure: "pressure_clear",
    Abort: "abort",
}


def action_name(action: Action) -> str:
    return ACTION_NAMES[type(action)]


def decide(snapshot: ControlSnapshot, config: PolicyConfig) -> list[Action]:
    """Actions for this tick, in the order they should be applied (mildest first)."""
    actions: list[Action] = []
    if config.enable_demotion:
        actions += _quota_actions(snapshot, config)
    if config.enable_pressure:
        actions += _pressure_actions(snapshot, config)
    if config.enable_abort and (abort := _abort_action(snapshot, config)) is not None:
        actions.append(abort)
    return actions


def _quota_actions(snapshot: ControlSnapshot, config: PolicyConfig) -> list[Action]:
    actions: list[Action] = []
    for usage in snapshot.tenants:
        if not usage.demoted and usage.active(config.active_window_s) and usage.num_blocks > usage.quota_blocks:
            actions.append(Demote(usage.tenant, usage.num_blocks, usage.quota_blocks,
                                  f"over_kv_quota: {usage.num_blocks} > {usage.quota_blocks} blocks"))
        elif usage.demoted and usage.num_blocks <= config.restore_fraction * usage.quota_blocks:
            actions.append(Restore(usage.tenant, usage.num_blocks, usage.quota_blocks,
                                   f"under_kv_quota: {usage.num_blocks} <= {config.restore_fraction:g} x "
                                   f"{usage.quota_blocks} blocks"))
    return actions


def _pressure_actions(snapshot: ControlSnapshot, config: PolicyConfig) -> list[Action]:
    usage = snapshot.usage
    if not snapshot.under_pressure and usage >= config.high_watermark:
        return [SetPressure(usage, f"kv_usage {usage:.2f} >= high_watermark {config.high_watermark:g}")]
    if snapshot.under_pressure and usage <= config.low_watermark and \
            snapshot.seconds_below_low >= config.pressure_hold_s:
        return [ClearPressure(usage, f"kv_usage {usage:.2f} <= low_watermark {config.low_watermark:g} "
                                     f"for {snapshot.seconds_below_low:.1f} s")]
    return []


def _abort_action(snapshot: ControlSnapshot, config: PolicyConfig) -> Abort | None:
    if snapshot.num_free_blocks > config.abort_free_blocks or snapshot.num_waiting == 0:
        return None
    if snapshot.num_relief_engines == 0:
        return None  # nowhere to continue it: aborting would only fail the request
    if snapshot.seconds_since_abort is not None and snapshot.seconds_since_abort < config.abort_cooldown_s:
        return None
    candidates = [r for r in snapshot.requests if r.age_s >= config.abort_min_age_s]
    if not candidates:
        return None
    # vLLM's own preemption order: worst priority first, then the latest arrival.
    victim = max(candidates, key=lambda r: (r.priority, -r.age_s))
    best = min(r.priority for r in snapshot.requests)
    if best >= victim.priority:
        return None  # nobody better to make room for
    return Abort(victim, f"kv_exhausted: {snapshot.num_free_blocks} free blocks, {snapshot.num_waiting} waiting; "
                         f"priority {victim.priority} yields to {best}")
