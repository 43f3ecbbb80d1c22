"""The engine replica's Prometheus metrics: what runs (KV dtype, capacity, speculative method) and its load.

Rendered per scrape from the host's snapshot, so nothing is kept twice; prometheus_client only formats.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tessera.engine.stats import EngineLoad
from tessera.telemetry.gc_heap import process_gc_pauses


def render_engine_metrics(engine_id: str, model: str, load: EngineLoad, facts: dict[str, Any]) -> tuple[bytes, str]:
    registry = CollectorRegistry()
    registry.register(process_gc_pauses())
    labels = {"engine_id": engine_id, "model": model}
    info = Gauge("tessera_engine_info", "What this replica runs (1 per replica); labels carry the effective "
                 "and requested KV cache dtype and the speculative method",
                 [*labels, "kv_cache_dtype", "kv_cache_dtype_requested", "speculative_method"], registry=registry)
    info.labels(**labels, kv_cache_dtype=facts["kv_cache_dtype"],
                kv_cache_dtype_requested=facts["kv_cache_dtype_requested"],
                speculative_method=facts["speculative_method"]).set(1)
    values = {
        "tessera_engine_fallbacks": ("Settings running differently from the config (see /stats)",
                                     len(facts["fallbacks"])),
        "tessera_engine_kv_capacity_tokens": ("KV cache capacity, tokens", facts["kv_capacity_tokens"]),
        "tessera_engine_kv_blocks": ("KV cache blocks", load.num_gpu_blocks),
        "tessera_engine_kv_block_size_tokens": ("Tokens per KV block", load.block_size),
        "tessera_engine_kv_cache_usage_ratio": ("Share of KV blocks in use", load.kv_cache_usage),
        "tessera_engine_running_requests": ("Requests running", load.num_running),
        "tessera_engine_waiting_requests": ("Requests waiting", load.num_waiting),
    }
    for name, (help_text, value) in values.items():
        Gauge(name, help_text, list(labels), registry=registry).labels(**labels).set(value)
    return generate_latest(registry), CONTENT_TYPE_LATEST
