"""Engine autoscaling: the ``autoscaling`` block of ``EngineConfig``, the load signals a replica reports, and
the Ray Serve options both map to (pure; tests/unit/platform/test_autoscaling.py).

Why Serve's own policy cannot drive the engines: Serve counts the requests that pass through its proxy or
its handles, and Tessera's tokens never do (the gateway streams from each replica's own HTTP port, see
deployment.py). Serve's ``total_num_requests`` for an engine deployment is therefore always 0. Instead:

- every replica reports its load to Serve (``EngineReplica.record_autoscaling_stats``): the requests
  open on its endpoint, vLLM's waiting queue and its KV cache usage, keyed by ``SIGNALS``;
- a policy (engine/autoscaling_policy.py) turns the chosen signal into a replica count: the sum over the
  running replicas divided by the per-replica target;
- Serve's wrapper around every policy applies min/max, upscale/downscale delays and the scaling factors
  (ray/serve/autoscaling_policy.py ``_apply_autoscaling_config``).

Scale-down drains: Serve calls the removed replica's destructor, the replica leaves the engine registry
(the gateways stop routing to it), keeps serving what it has for up to ``drainTimeoutS`` and only then stops
(engine/drain.py). ``serve_shutdown_options`` gives Serve a kill deadline that leaves room for that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

# The policy Serve's controller imports (cloudpickled by value when the application is built).
POLICY_IMPORT_PATH = "tessera.engine.autoscaling_policy:EngineSignalPolicy"

AutoscalingMetric = Literal["ongoingRequests", "queueDepth", "kvCacheUsage"]

# Serve's own drain loop period. It only sees requests that pass through Serve (the discovery call), never
# the streams, so it is short: the engine's drain (engine/drain.py) is what waits for the streams.
SERVE_DRAIN_LOOP_S = 0.5
# Added to drainTimeoutS for Serve's kill deadline: Serve's drain loop, then vLLM's shutdown (its engine
# process and ZMQ sockets) after the last stream ended.
SHUTDOWN_SLACK_S = 15.0


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What one replica reports to Serve's autoscaler, read from the host at one instant."""

    ongoing_requests: int  # /generate requests open on the replica's endpoint (queued in vLLM or running)
    queue_depth: int  # requests vLLM has accepted but not yet scheduled
    kv_cache_usage: float  # share of the KV cache in use, 0..1


# Signal name (the config's ``metric``) -> the key the replica reports it under (Serve's custom metrics).
SIGNALS: dict[str, str] = {
    "ongoingRequests": "tessera_ongoing_requests",
    "queueDepth": "tessera_queue_depth",
    "kvCacheUsage": "tessera_kv_cache_usage",
}


def replica_signals(load: ReplicaLoad) -> dict[str, float]:
    """``record_autoscaling_stats``'s answer: every signal, whichever the policy reads (they cost nothing)."""
    return {
        SIGNALS["ongoingRequests"]: float(load.ongoing_requests),
        SIGNALS["queueDepth"]: float(load.queue_depth),
        SIGNALS["kvCacheUsage"]: float(load.kv_cache_usage),
    }


def signal_key(metric: str) -> str:
    """The reported key of ``metric``; an unknown name raises ``ValueError`` listing the valid ones."""
    try:
        return SIGNALS[metric]
    except KeyError:
        raise ValueError(f"unknown autoscaling metric {metric!r}; valid: {sorted(SIGNALS)}") from None


class AutoscalingConfig(BaseModel):
    """Serve autoscaling of one model's engine replicas (Ray Serve ``autoscaling_config``).

    Each replica reports ``metric``; Serve runs ceil(sum over replicas / its target) replicas, within
    [minReplicas, maxReplicas], after the signal has asked for more for ``upscaleDelayS`` or for fewer for
    ``downscaleDelayS``. A removed replica drains (EngineConfig.drainTimeoutS)."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)

    min_replicas: int = Field(
        default=1, ge=1,
        description="Fewest replicas. At least 1: the load signal comes from the replicas themselves (the "
        "gateway does not go through Serve), so a model at zero replicas would never be scaled up.",
    )
    max_replicas: int = Field(
        ge=1, description="Most replicas. Each one holds tensorParallelSize GPUs: the worker group must be able "
        "to have maxReplicas x tensorParallelSize GPUs (the chart checks it).",
    )
    initial_replicas: int | None = Field(
        default=None, ge=1, description="Replicas started on deploy; default minReplicas.",
    )
    metric: AutoscalingMetric = Field(
        default="ongoingRequests",
        description="The load signal: 'ongoingRequests' (requests open on a replica, queued or running; target "
        "targetOngoingRequests), 'queueDepth' (requests vLLM has not scheduled yet; target targetQueueDepth) or "
        "'kvCacheUsage' (share of the KV cache in use; target targetKvCacheUsage).",
    )
    target_ongoing_requests: float = Field(
        default=16.0, gt=0.0,
        description="Open requests per replica the autoscaler aims for (metric ongoingRequests). Around "
        "maxNumSeqs/2 keeps a replica batching well without queueing.",
    )
    target_queue_depth: float = Field(
        default=2.0, gt=0.0, description="Waiting requests per replica aimed for (metric queueDepth).",
    )
    target_kv_cache_usage: float = Field(
        default=0.7, gt=0.0, le=1.0, description="KV cache usage per replica aimed for (metric kvCacheUsage).",
    )
    upscale_delay_s: float = Field(
        default=30.0, ge=0.0, description="How long the signal must ask for more replicas before one is added, s.",
    )
    downscale_delay_s: float = Field(
        default=600.0, ge=0.0,
        description="How long the signal must ask for fewer replicas before one is removed, s. Long: a removed "
        "replica's model has to load again when load comes back.",
    )
    look_back_period_s: float = Field(
        default=30.0, gt=0.0, description="Window the signal is averaged over, s (Serve's look_back_period_s).",
    )
    metrics_interval_s: float = Field(
        default=10.0, gt=0.0,
        description="How often a replica sends its signal to Serve's controller, s; below lookBackPeriodS.",
    )

    @model_validator(mode="after")
    def _check(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"autoscaling.minReplicas={self.min_replicas} must be <= maxReplicas={self.max_replicas}")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"autoscaling.initialReplicas={self.initial_replicas} must be within minReplicas="
                             f"{self.min_replicas} and maxReplicas={self.max_replicas}")
        if self.metrics_interval_s >= self.look_back_period_s:
            raise ValueError(f"autoscaling.metricsIntervalS={self.metrics_interval_s} must be below lookBackPeriodS="
                             f"{self.look_back_period_s}: the window would hold at most one report per replica")
        return self

    @property
    def target(self) -> float:
        """The per-replica target of the chosen metric."""
        return {"ongoingRequests": self.target_ongoing_requests, "queueDepth": self.target_queue_depth,
                "kvCacheUsage": self.target_kv_cache_usage}[self.metric]

    def to_serve(self) -> dict[str, Any]:
        """Ray Serve's ``autoscaling_config`` (field names of ray.serve.config.AutoscalingConfig, Ray 2.60)."""
        serve: dict[str, Any] = {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            # Serve's field; informative only, the policy below reads its own target.
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "look_back_period_s": self.look_back_period_s,
            "metrics_interval_s": self.metrics_interval_s,
            "policy": {"policy_function": POLICY_IMPORT_PATH,
                       "policy_kwargs": {"metric": signal_key(self.metric), "target": self.target}},
        }
        if self.initial_replicas is not None:
            serve["initial_replicas"] = self.initial_replicas
        return serve


def serve_shutdown_options(drain_timeout_s: float) -> dict[str, float]:
    """Serve's graceful-shutdown options for a replica that drains for up to ``drain_timeout_s``: Serve
    kills the replica's actor only after its destructor (the drain) has had that long, plus slack."""
    return {"graceful_shutdown_wait_loop_s": SERVE_DRAIN_LOOP_S,
            "graceful_shutdown_timeout_s": drain_timeout_s + SHUTDOWN_SLACK_S}


def replica_count_options(autoscaling: AutoscalingConfig | None, replicas: int | None) -> dict[str, Any]:
    """``num_replicas`` or ``autoscaling_config`` for ``Deployment.options``: a fixed count and autoscaling
    are mutually exclusive (``ValueError`` naming both); neither given means one replica."""
    if autoscaling is not None and replicas is not None:
        raise ValueError(f"replicas={replicas} and engine.autoscaling are mutually exclusive: with autoscaling, "
                         "Serve owns the count (set autoscaling.minReplicas/maxReplicas/initialReplicas instead)")
    if autoscaling is not None:
        return {"autoscaling_config": autoscaling.to_serve()}
    return {"num_replicas": 1 if replicas is None else replicas}
