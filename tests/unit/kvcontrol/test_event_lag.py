"""The controller reports how far behind its engines' KV events it runs: every applied batch counts its
events and observes its event-to-ledger lag (the batch's publish time to the ledger having applied it)."""

from __future__ import annotations

import time
from typing import Any, cast

from tessera.registry import EngineRecord
from tessera.routing.kv_events import DecodedBatch
from tessera_operators.kvcontrol.directory import DemotionBook
from tessera_operators.kvcontrol.loop import EngineControlLoop, LoopContext
from tessera_operators.kvcontrol.metrics import ControllerMetrics
from tessera_operators.kvcontrol.policy import PolicyConfig


def sample(metrics: ControllerMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_each_batch_counts_its_events_and_its_lag() -> None:
    metrics = ControllerMetrics()
    ctx = LoopContext(redis=cast(Any, None), http=cast(Any, None), tenants=cast(Any, None),
                      demotions=DemotionBook(), metrics=metrics, policy=PolicyConfig())
    loop = EngineControlLoop(EngineRecord("e1", "http://e1", "m", 16, 64, 512, "tcp://e1:1"), ctx)
    stored: list[tuple[int, int | None, list[int], str | None]] = [(11, None, [], "salt"), (12, 11, [], None)]
    loop.on_batch(DecodedBatch(0, time.time() - 0.25, [("store", 11), ("store", 12)], stored))
    loop.on_batch(DecodedBatch(1, time.time(), [("clear", 0)]))

    assert sample(metrics, "tessera_kvcontrol_events_total") == 3
    assert sample(metrics, "tessera_kvcontrol_event_batches_total", engine="e1") == 2
    assert sample(metrics, "tessera_kvcontrol_event_lag_seconds_count") == 2
    # One batch a quarter of a second late, one on time.
    assert sample(metrics, "tessera_kvcontrol_event_lag_seconds_bucket", le="0.01") == 1
    assert sample(metrics, "tessera_kvcontrol_event_lag_seconds_bucket", le="0.2") == 1
    assert sample(metrics, "tessera_kvcontrol_event_lag_seconds_bucket", le="0.5") == 2
    assert 0.25 <= sample(metrics, "tessera_kvcontrol_event_lag_seconds_sum") < 0.5
