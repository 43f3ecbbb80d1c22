"""vLLM's metrics of a replica live in the replica's own registry (vllm_metrics.py): vLLM's logger classes
are swapped for ones bound to it, never the process-wide REGISTRY that a second engine would clear."""

from __future__ import annotations

from prometheus_client import REGISTRY

from tessera.engine.vllm_metrics import VllmMetrics


def _names(registry: object) -> set[str]:
    return {sample.name for family in registry.collect() for sample in family.samples}  # type: ignore[attr-defined]


def _vllm_samples(registry: object) -> set[tuple[str, tuple[tuple[str, str], ...], float]]:
    """Every vllm: sample with its labels and value (only those: the process's CPU and GC series move)."""
    return {(sample.name, tuple(sorted(sample.labels.items())), sample.value)
            for family in registry.collect() for sample in family.samples  # type: ignore[attr-defined]
            if sample.name.startswith("vllm:")}


def test_each_replicas_metric_classes_register_in_its_own_registry() -> None:
    # Compared, not assumed empty: another test in this worker process may have run vLLM's default logger.
    process_wide_before = _vllm_samples(REGISTRY)
    first, second = VllmMetrics(), VllmMetrics()
    logger = first.stat_logger
    logger._gauge_cls("vllm:num_requests_running", "Running", labelnames=["model_name", "engine"],
                      multiprocess_mode="mostrecent").labels("m", "0").set(2)
    logger._histogram_cls("vllm:time_to_first_token_seconds", "TTFT", labelnames=["engine"],
                          buckets=[0.1, 1.0]).labels("0").observe(0.5)
    spec_counter = logger._spec_decoding_cls._counter_cls("vllm:spec_decode_num_drafts", "Drafts")
    spec_counter.inc()
    assert {"vllm:num_requests_running", "vllm:time_to_first_token_seconds_count",
            "vllm:spec_decode_num_drafts_total"} <= _names(first.registry)
    assert _names(second.registry) == set()
    assert _vllm_samples(REGISTRY) == process_wide_before
    assert b'vllm:num_requests_running{engine="0",model_name="m"} 2.0' in first.render()
