"""Every Grafana panel queries metrics the code emits: the names in the dashboard's PromQL expressions
against the metric families the gateway and the KV-eviction controller register, and the ``vllm:`` families
vLLM 0.32 registers in an engine replica (tessera.engine.vllm_metrics, the same logger a replica runs).
tests/integration/platform/test_engine_host.py checks the dashboard's vLLM names on a real replica's /metrics."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import CollectorRegistry

from tessera.gateway.metrics import GatewayMetrics
from tessera_operators.kvcontrol.metrics import ControllerMetrics
from tests.support.dashboard import DASHBOARD, expressions, metric_names

# The sample names a metric family exports (a counter's _total, a histogram's _bucket/_sum/_count).
SAMPLE_SUFFIXES = ("", "_total", "_created", "_bucket", "_sum", "_count")


def emitted(*registries: CollectorRegistry) -> set[str]:
    families = {family.name for registry in registries for family in registry.collect()}
    return {family + suffix for family in families for suffix in SAMPLE_SUFFIXES}


def vllm_registry(model_dir: Path) -> CollectorRegistry:
    """The vLLM families a replica of this model registers: vLLM's own Prometheus logger, made as AsyncLLM
    makes it, from a config (no engine starts)."""
    from vllm.config import ModelConfig, VllmConfig

    from tessera.engine.vllm_metrics import VllmMetrics

    metrics = VllmMetrics()
    metrics.stat_logger(vllm_config=VllmConfig(model_config=ModelConfig(model=str(model_dir))), engine_indexes=[0])
    return metrics.registry


def test_metric_names_of_an_expression() -> None:
    expr = 'histogram_quantile(0.99, sum by (le, tenant) (rate(a_bucket{tenant=~"$t"}[$__rate_interval]))) / b'
    assert metric_names(expr) == {"a_bucket", "b"}
    assert metric_names("max by (instance) (vllm:kv_cache_usage_perc)") == {"vllm:kv_cache_usage_perc"}


def test_every_panel_queries_a_metric_the_code_emits(small_model_dir: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = expressions(dashboard)
    assert exprs, "no PromQL expressions found"
    known = emitted(GatewayMetrics().registry, ControllerMetrics().registry, vllm_registry(small_model_dir))
    missing = {(name, expr) for expr in exprs for name in metric_names(expr) if name not in known}
    assert not missing, f"dashboard metrics no code emits: {sorted(missing)}"
    assert any(name.startswith("vllm:") for expr in exprs for name in metric_names(expr))
