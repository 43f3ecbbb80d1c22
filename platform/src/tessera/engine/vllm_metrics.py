"""vLLM's own Prometheus metrics (``vllm:*``) of one engine replica, served on the replica's ``/metrics``
beside Tessera's ``tessera_engine_*`` (endpoints.py).

Where they come from (vLLM 0.32, V1 engine): the engine-core process sends its scheduler and iteration
stats with each batch of outputs; ``AsyncLLM``'s output handler, in the replica's own process, passes them
to ``StatLoggerManager``, whose ``PrometheusStatLogger`` updates prometheus_client metrics there. So no
multiprocess directory is needed: vLLM sets up ``PROMETHEUS_MULTIPROC_DIR`` only for ``vllm serve`` with
several API-server processes, which Tessera never runs.

NOTE: vLLM's logger registers its metrics in prometheus_client's global ``REGISTRY`` and, when an engine
starts, unregisters every ``vllm:`` collector there, so in a process with two engines (the integration
tests start several hosts in one process) the first engine's series would vanish and its /metrics would
show the other engine's. Each replica therefore gives vLLM a ``PrometheusStatLogger`` whose metric classes
register in a registry of the replica's own: the class attributes vLLM's ``RayPrometheusStatLogger``
swaps the same way, to send the same metrics to Ray instead.
"""

from __future__ import annotations

from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorProm
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.perf import PerfMetricsProm
from vllm.v1.spec_decode.metrics import SpecDecodingProm

__all__ = ["VLLM_METRIC_PREFIX", "VllmMetrics"]

VLLM_METRIC_PREFIX = "vllm:"
M = TypeVar("M", bound=MetricWrapperBase)


class VllmMetrics:
    """One replica's vLLM metrics: ``stat_logger`` is the class to hand ``AsyncLLM`` (``stat_loggers=``),
    ``render`` their Prometheus text. vLLM then adds no logger of its own to the global registry (it adds
    its default Prometheus logger only when no ``PrometheusStatLogger`` subclass is given)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.stat_logger = _stat_logger_for(self.registry)

    def render(self) -> bytes:
        """The ``vllm:*`` families in Prometheus text (empty before the engine is built)."""
        return generate_latest(self.registry)


def _bound(metric: type[M], registry: CollectorRegistry) -> type[M]:
    """``metric`` registering in ``registry``. Its labelled children (``.labels(...)``, made with the same
    class) are never registered, as with prometheus_client's own classes."""

    class Bound(metric):  # type: ignore[valid-type, misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["registry"] = registry
            super().__init__(*args, **kwargs)

    Bound.__name__ = Bound.__qualname__ = f"Replica{metric.__name__}"
    return Bound


def _stat_logger_for(registry: CollectorRegistry) -> type[PrometheusStatLogger]:
    gauge, counter, histogram = _bound(Gauge, registry), _bound(Counter, registry), _bound(Histogram, registry)

    class ReplicaSpecDecodingProm(SpecDecodingProm):
        _counter_cls = counter

    class ReplicaKVConnectorProm(KVConnectorProm):
        _gauge_cls = gauge
        _counter_cls = counter
        _histogram_cls = histogram

    class ReplicaECConnectorProm(ECConnectorProm):
        _gauge_cls = gauge
        _counter_cls = counter
        _histogram_cls = histogram

    class ReplicaPerfMetricsProm(PerfMetricsProm):
        _counter_cls = counter

    class ReplicaPrometheusStatLogger(PrometheusStatLogger):
        _gauge_cls = gauge
        _counter_cls = counter
        _histogram_cls = histogram
        _spec_decoding_cls = ReplicaSpecDecodingProm
        _kv_connector_cls = ReplicaKVConnectorProm
        _ec_connector_cls = ReplicaECConnectorProm
        _perf_metrics_cls = ReplicaPerfMetricsProm

    return ReplicaPrometheusStatLogger
