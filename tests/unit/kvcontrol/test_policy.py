"""The controller's decisions, one lever at a time (pure function over a snapshot)."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from tessera_operators.kvcontrol.policy import (
    Abort,
    ClearPressure,
    ControlSnapshot,
    Demote,
    InFlightRequest,
    PolicyConfig,
    Restore,
    SetPressure,
    TenantUsage,
    decide,
)

CONFIG = PolicyConfig()


def snapshot(free: int = 50, total: int = 100, **overrides: object) -> ControlSnapshot:
    base = ControlSnapshot(engine_id="e1", num_gpu_blocks=total, num_free_blocks=free, num_running=1,
                           num_waiting=0, under_pressure=False, tenants=(), requests=(), num_relief_engines=1,
                           seconds_since_abort=None)
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


def test_over_quota_tenant_that_is_active_is_demoted_and_an_idle_one_is_not() -> None:
    tenants = (TenantUsage("noisy", 60, 50, 2, False), TenantUsage("idle", 80, 50, 0, False),
               TenantUsage("calm", 20, 50, 1, False), TenantUsage("stale", 90, 50, 0, False, 30.0),
               TenantUsage("recent", 70, 50, 0, False, 2.0))
    actions = decide(snapshot(tenants=tenants), CONFIG)
    # "recent" has nothing in flight at this poll but stored blocks 2 s ago: its requests are short.
    assert actions == [Demote("noisy", 60, 50, "over_kv_quota: 60 > 50 blocks"),
                       Demote("recent", 70, 50, "over_kv_quota: 70 > 50 blocks")]


def test_restore_has_hysteresis() -> None:
    still_high = (TenantUsage("noisy", 45, 50, 1, True),)  # under quota, above 0.8 x quota
    assert decide(snapshot(tenants=still_high), CONFIG) == []
    low = (TenantUsage("noisy", 40, 50, 0, True),)
    (action,) = decide(snapshot(tenants=low), CONFIG)
    assert isinstance(action, Restore) and action.tenant == "noisy"


def test_pressure_flag_between_the_watermarks() -> None:
    assert decide(snapshot(free=10), CONFIG) == [SetPressure(0.9, "kv_usage 0.90 >= high_watermark 0.9")]
    assert decide(snapshot(free=20, under_pressure=True), CONFIG) == []  # 0.8: stays set
    # Below the low watermark, the flag clears only once it has stayed there for pressure_hold_s.
    assert decide(snapshot(free=30, under_pressure=True, seconds_below_low=0.2), CONFIG) == []
    (clear,) = decide(snapshot(free=30, under_pressure=True, seconds_below_low=1.0), CONFIG)
    assert isinstance(clear, ClearPressure)
    assert decide(snapshot(free=20), CONFIG) == []  # 0.8 and not set: stays clear


REQUESTS = (InFlightRequest("gold", "a", 0, 5.0), InFlightRequest("bulk-old", "b", 40, 9.0),
            InFlightRequest("bulk-new", "b", 40, 3.0), InFlightRequest("fresh", "b", 40, 0.1))


def starving(**overrides: object) -> ControlSnapshot:
    values: dict[str, object] = {"free": 1, "num_waiting": 2, "requests": REQUESTS, **overrides}
    return snapshot(**values)  # type: ignore[arg-type]


def abort_only() -> PolicyConfig:
    return PolicyConfig(enable_demotion=False, enable_pressure=False)


def test_abort_picks_the_worst_priority_youngest_request_old_enough() -> None:
    (action,) = decide(starving(), abort_only())
    assert isinstance(action, Abort) and action.request.request_id == "bulk-new"


@pytest.mark.parametrize("overrides", [
    {"free": 3},                                     # not exhausted
    {"num_waiting": 0},                              # nobody waits
    {"num_relief_engines": 0},                       # nowhere to continue
    {"seconds_since_abort": 1.0},                    # cooldown
    {"requests": REQUESTS[1:3]},                     # all equal priority: nobody better to make room for
    {"requests": (REQUESTS[0], REQUESTS[3])},        # the only worse one is too young
])
def test_abort_is_a_last_resort(overrides: dict[str, object]) -> None:
    assert decide(starving(**overrides), abort_only()) == []


def test_levers_can_be_switched_off_and_order_is_mildest_first() -> None:
    tenants = (TenantUsage("noisy", 90, 50, 2, False),)
    actions = decide(starving(tenants=tenants), CONFIG)
    assert [type(a) for a in actions] == [Demote, SetPressure, Abort]
    off = PolicyConfig(enable_demotion=False, enable_pressure=False, enable_abort=False)
    assert decide(starving(tenants=tenants), off) == []


def test_config_is_strict() -> None:
    with pytest.raises(ValidationError):
        PolicyConfig(high_watermark=0.5, low_watermark=0.6)
    with pytest.raises(ValidationError):
        PolicyConfig.model_validate({"highWatermrk": 0.5})
    assert PolicyConfig.model_validate({"highWatermark": 0.8}).high_watermark == 0.8
