"""The Serve autoscaling policy of the engine deployments: the replica count Tessera's own load signal asks
for (engine/autoscaling.py says why Serve's request count cannot be used).

NOTE: Serve cloudpickles this module *by value* into its controller (``AutoscalingPolicy.serialize_policy``),
so it imports nothing of Tessera and nothing heavy: only the standard library.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any


def desired_replicas(per_replica: Iterable[float], target: float) -> float:
    """The replica count at which each replica would carry ``target`` of the signal: the sum of what the
    running replicas report, divided by the target. Serve rounds it up (after its scaling factors) and
    clips it to [minReplicas, maxReplicas]; a fraction is kept so the factors act on the exact error."""
    assert target > 0, "the target is validated positive in AutoscalingConfig"
    return math.fsum(per_replica) / target


class EngineSignalPolicy:
    """Serve's class-callable policy: built once per deployment with ``policy_kwargs`` (``metric``: the key
    replicas report the chosen signal under, ``target``: per replica), then called every control tick with
    Serve's ``AutoscalingContext``. Returns (replicas wanted, policy state) before Serve's delays and bounds.
    """

    def __init__(self, metric: str, target: float) -> None:
        if target <= 0:
            raise ValueError(f"autoscaling target must be positive, got {target}")
        self.metric = metric
        self.target = float(target)

    def decide(self, reported: Mapping[Any, float] | None, current_target: int) -> float:
        """``reported``: replica -> its signal averaged over the look-back window, for the running replicas
        that have reported. None or empty (no report yet, e.g. every replica still starting): hold."""
        if not reported:
            return float(current_target)
        return desired_replicas(reported.values(), self.target)

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        metrics: Mapping[str, Mapping[Any, float]] = ctx.aggregated_metrics or {}
        return self.decide(metrics.get(self.metric), ctx.target_num_replicas), {}
