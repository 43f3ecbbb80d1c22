"""The controller's configuration surface (environment, flags) and its Prometheus metrics."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tessera_operators.kvcontrol import KVControlSettings, _parse
from tessera_operators.kvcontrol.metrics import ControllerMetrics


def test_policy_from_the_environment_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_KVCONTROL_POLICY", '{"highWatermark": 0.8, "enable_abort": false}')
    monkeypatch.setenv("TESSERA_KVCONTROL_METRICS_PORT", "9555")
    settings = KVControlSettings()
    assert settings.kvcontrol_policy.high_watermark == 0.8 and not settings.kvcontrol_policy.enable_abort
    assert settings.kvcontrol_metrics_port == 9555 and settings.kvcontrol_poll_interval_s == 0.2


def test_a_typo_in_the_policy_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_KVCONTROL_POLICY", '{"highWatermarks": 0.8}')
    with pytest.raises(ValidationError, match="highWatermarks"):
        KVControlSettings()


def test_command_line_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_KVCONTROL_METRICS_PORT", "9555")
    settings = _parse(["--metrics-port", "0", "--policy", '{"lowWatermark": 0.5}', "--observe-only",
                       "--model", "m", "--poll-interval", "0.5", "--redis-url", "redis://x:1/0"])
    assert settings.kvcontrol_metrics_port == 0 and settings.kvcontrol_observe_only
    assert settings.kvcontrol_policy.low_watermark == 0.5 and settings.kvcontrol_model == "m"
    assert settings.kvcontrol_poll_interval_s == 0.5 and settings.redis_url == "redis://x:1/0"


def test_metrics_names_and_forgetting() -> None:
    metrics = ControllerMetrics()
    metrics.set_tenant_blocks("e1", {"alice": 3, "bob": 2})
    metrics.set_tenant_blocks("e1", {"alice": 4})  # bob's blocks were all evicted: 0, not a stale 2
    metrics.actions.labels("e1", "demote", "alice").inc()
    metrics.pressure.labels("e1").set(1)
    text = metrics.render()[0].decode()
    assert 'tessera_kv_tenant_blocks{engine="e1",tenant="alice"} 4.0' in text
    assert 'tessera_kv_tenant_blocks{engine="e1",tenant="bob"} 0.0' in text
    assert 'tessera_kvcontrol_actions_total{action="demote",engine="e1",tenant="alice"} 1.0' in text
    metrics.forget_engine("e1")
    text = metrics.render()[0].decode()
    assert 'tenant="alice"} 4.0' not in text and 'tessera_engine_kv_pressure{engine="e1"}' not in text
