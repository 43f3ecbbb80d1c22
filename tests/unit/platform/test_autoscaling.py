"""Engine autoscaling from config to Serve (engine/autoscaling.py, engine/autoscaling_policy.py): validation,
the mapping onto the installed Ray's own AutoscalingConfig, and the policy under Serve's own wrapper (its
delays and bounds). The whole loop runs on a multi-node Ray cluster in tests/integration/ray."""

from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import ValidationError

from tessera.engine.autoscaling import (
    POLICY_IMPORT_PATH,
    SHUTDOWN_SLACK_S,
    SIGNALS,
    AutoscalingConfig,
    ReplicaLoad,
    replica_count_options,
    replica_signals,
    serve_shutdown_options,
    signal_key,
)
from tessera.engine.autoscaling_policy import EngineSignalPolicy, desired_replicas
from tessera.engine.config import EngineConfig


def scaling(**fields: Any) -> AutoscalingConfig:
    return AutoscalingConfig.model_validate({"maxReplicas": 4, **fields})


# ---- validation ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"minReplicas": 3, "maxReplicas": 2}, "autoscaling.minReplicas=3 must be <= maxReplicas=2"),
        ({"initialReplicas": 5}, "autoscaling.initialReplicas=5 must be within minReplicas=1 and maxReplicas=4"),
        ({"minReplicas": 2, "initialReplicas": 1}, "initialReplicas=1 must be within minReplicas=2"),
        ({"metricsIntervalS": 30.0}, "metricsIntervalS=30.0 must be below lookBackPeriodS=30.0"),
        ({"minReplicas": 0}, "greater than or equal to 1"),
        ({"targetOngoingRequests": 0}, "greater than 0"),
        ({"targetKvCacheUsage": 1.5}, "less than or equal to 1"),
        ({"metric": "gpuUtilization"}, "'ongoingRequests', 'queueDepth' or 'kvCacheUsage'"),
        ({"targetOngoingRequest": 4}, "Extra inputs are not permitted"),
    ],
)
def test_invalid_blocks_are_refused_naming_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        scaling(**fields)


def test_max_replicas_is_required() -> None:
    with pytest.raises(ValidationError, match="maxReplicas"):
        AutoscalingConfig.model_validate({})


def test_engine_config_carries_the_block_in_camel_case() -> None:
    engine = EngineConfig.model_validate({"model": "/m", "autoscaling": {"maxReplicas": 3, "upscaleDelayS": 0},
                                          "drainTimeoutS": 5})
    assert engine.autoscaling == AutoscalingConfig(max_replicas=3, upscale_delay_s=0)
    assert engine.drain_timeout_s == 5
    dumped = engine.model_dump(by_alias=True)
    assert dumped["autoscaling"]["maxReplicas"] == 3 and dumped["drainTimeoutS"] == 5
    assert EngineConfig.model_validate(dumped, strict=True) == engine  # what build_app hands the replicas
    assert EngineConfig.model_validate({"model": "/m"}).autoscaling is None


# ---- the mapping onto Serve --------------------------------------------------------------------------------


def test_to_serve_is_accepted_by_the_installed_ray_with_every_field_as_given() -> None:
    from ray.serve.config import AutoscalingConfig as ServeAutoscaling

    ours = scaling(minReplicas=2, maxReplicas=6, initialReplicas=3, metric="queueDepth", targetQueueDepth=3,
                   targetOngoingRequests=5, upscaleDelayS=1, downscaleDelayS=7, lookBackPeriodS=4,
                   metricsIntervalS=0.5)
    serve = ServeAutoscaling(**ours.to_serve())
    assert (serve.min_replicas, serve.max_replicas, serve.initial_replicas) == (2, 6, 3)
    assert serve.target_ongoing_requests == 5
    assert (serve.upscale_delay_s, serve.downscale_delay_s) == (1, 7)
    assert (serve.look_back_period_s, serve.metrics_interval_s) == (4, 0.5)
    assert serve.policy.policy_function == POLICY_IMPORT_PATH
    assert serve.policy.policy_kwargs == {"metric": "tessera_queue_depth", "target": 3.0}
    # Serve's controller instantiates the class once with these kwargs (autoscaling_state._resolve_policy_callable).
    policy = serve.policy.get_policy()(**serve.policy.policy_kwargs)
    assert isinstance(policy, EngineSignalPolicy)
    assert "initial_replicas" not in scaling().to_serve()


@pytest.mark.parametrize(("metric", "target_field", "key"), [
    ("ongoingRequests", "targetOngoingRequests", "tessera_ongoing_requests"),
    ("queueDepth", "targetQueueDepth", "tessera_queue_depth"),
    ("kvCacheUsage", "targetKvCacheUsage", "tessera_kv_cache_usage"),
])
def test_each_metric_reads_its_own_target(metric: str, target_field: str, key: str) -> None:
    config = scaling(metric=metric, **{target_field: 0.5})
    assert config.target == 0.5
    assert config.to_serve()["policy"]["policy_kwargs"] == {"metric": key, "target": 0.5}


def test_a_replica_reports_every_signal_under_its_key() -> None:
    reported = replica_signals(ReplicaLoad(ongoing_requests=5, queue_depth=2, kv_cache_usage=0.25))
    assert reported == {"tessera_ongoing_requests": 5.0, "tessera_queue_depth": 2.0, "tessera_kv_cache_usage": 0.25}
    assert set(reported) == set(SIGNALS.values())
    assert all(isinstance(v, float) for v in reported.values())  # Serve disables a non-number on first sight


def test_unknown_metric_name_lists_the_valid_ones() -> None:
    valid = r"\['kvCacheUsage', 'ongoingRequests', 'queueDepth'\]"
    with pytest.raises(ValueError, match=rf"unknown autoscaling metric 'gpu'; valid: {valid}"):
        signal_key("gpu")


def test_fixed_count_and_autoscaling_are_mutually_exclusive() -> None:
    assert replica_count_options(None, None) == {"num_replicas": 1}
    assert replica_count_options(None, 3) == {"num_replicas": 3}
    assert replica_count_options(scaling(), None) == {"autoscaling_config": scaling().to_serve()}
    with pytest.raises(ValueError, match=r"replicas=2 and engine\.autoscaling are mutually exclusive"):
        replica_count_options(scaling(), 2)


def test_serve_kills_a_replica_only_after_its_drain_had_its_time() -> None:
    options = serve_shutdown_options(30.0)
    assert options["graceful_shutdown_timeout_s"] == 30.0 + SHUTDOWN_SLACK_S
    assert options["graceful_shutdown_wait_loop_s"] < 1.0


def test_build_app_deploys_the_autoscaling_config_and_the_drain_deadline() -> None:
    from tessera.engine.deployment import build_app

    engine = {"model": "/m", "accelerator": "cpu", "drainTimeoutS": 12,
              "autoscaling": {"minReplicas": 1, "maxReplicas": 2, "lookBackPeriodS": 2, "metricsIntervalS": 0.5}}
    deployment = build_app({"engine": engine}).__dict__["_bound_deployment"]
    config = deployment._deployment_config
    assert config.autoscaling_config.max_replicas == 2
    assert config.autoscaling_config.policy.policy_function == POLICY_IMPORT_PATH
    assert config.graceful_shutdown_timeout_s == 12 + SHUTDOWN_SLACK_S
    # What reaches Serve's controller (a protobuf): the policy and its kwargs survive the trip.
    from ray.serve._private.config import DeploymentConfig

    arrived = DeploymentConfig.from_proto_bytes(config.to_proto_bytes()).autoscaling_config.policy
    policy = arrived.get_policy()(**arrived.policy_kwargs)
    assert (policy.metric, policy.target) == ("tessera_ongoing_requests", 16.0)
    fixed = build_app({"engine": {"model": "/m", "accelerator": "cpu"}, "replicas": 3}).__dict__["_bound_deployment"]
    assert fixed._deployment_config.num_replicas == 3 and fixed._deployment_config.autoscaling_config is None
    with pytest.raises(ValueError, match="mutually exclusive"):
        build_app({"engine": engine, "replicas": 1})


# ---- the policy ----------------------------------------------------------------------------------------------


def test_desired_replicas_is_the_sum_over_replicas_divided_by_the_target() -> None:
    assert desired_replicas([6.0, 2.0], 2.0) == 4.0
    assert desired_replicas([0.9, 0.5], 0.7) == pytest.approx(2.0)  # KV usage: 2 replicas' worth at 70 %
    assert desired_replicas([], 2.0) == 0.0


def test_policy_holds_while_no_replica_has_reported() -> None:
    policy = EngineSignalPolicy("tessera_ongoing_requests", 2.0)
    assert policy.decide(None, current_target=3) == 3.0
    assert policy.decide({}, current_target=3) == 3.0
    assert policy.decide({"r1": 5.0}, current_target=3) == 2.5
    with pytest.raises(ValueError, match="positive"):
        EngineSignalPolicy("tessera_ongoing_requests", 0)


def _serve_tick(config: AutoscalingConfig, reported: dict[str, float], running: int, target: int,
                state: dict[str, Any], now: float) -> tuple[int, dict[str, Any]]:
    """One decision of Serve's controller: our policy inside Serve's own wrapper (factors, delays, bounds)."""
    import time
    from unittest import mock

    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig as ServeAutoscaling
    from ray.serve.config import AutoscalingContext

    serve = ServeAutoscaling(**config.to_serve())
    wrapped = _apply_autoscaling_config(_resolve_policy_callable(serve.policy))
    metric = config.to_serve()["policy"]["policy_kwargs"]["metric"]
    ctx = AutoscalingContext(
        deployment_id=None, deployment_name="engine", app_name="app", current_num_replicas=running,
        target_num_replicas=target, running_replicas=list(reported), total_num_requests=0.0,
        total_queued_requests=0.0, aggregated_metrics={metric: reported},
        raw_metrics={}, capacity_adjusted_min_replicas=serve.min_replicas,
        capacity_adjusted_max_replicas=serve.max_replicas, policy_state=state, last_scale_up_time=None,
        last_scale_down_time=None, current_time=now, config=serve)
    # Serve's delay logic reads the wall clock; the clock is the one thing made up here.
    with mock.patch.object(time, "time", return_value=now):
        decision, new_state = wrapped(ctx)
    return max(serve.min_replicas, min(serve.max_replicas, math.ceil(decision))), new_state


def test_under_serve_a_burst_scales_up_after_the_delay_and_idle_scales_down_after_its_own() -> None:
    config = scaling(minReplicas=1, maxReplicas=2, targetOngoingRequests=2, upscaleDelayS=1, downscaleDelayS=5,
                     lookBackPeriodS=2, metricsIntervalS=0.5)
    # Serve's own request count is 0 throughout (the tokens go past Serve); only our signal moves it.
    replicas, state = _serve_tick(config, {"r1": 6.0}, running=1, target=1, state={}, now=100.0)
    assert replicas == 1  # upscale delay not yet over
    replicas, state = _serve_tick(config, {"r1": 6.0}, running=1, target=1, state=state, now=101.0)
    assert replicas == 2  # 6 open / 2 per replica = 3, clipped to maxReplicas
    replicas, state = _serve_tick(config, {"r1": 1.0, "r2": 1.0}, running=2, target=2, state=state, now=110.0)
    assert replicas == 2  # one replica's worth of load (2 / 2), but the downscale delay has just started
    replicas, state = _serve_tick(config, {"r1": 1.0, "r2": 1.0}, running=2, target=2, state=state, now=115.0)
    assert replicas == 1
