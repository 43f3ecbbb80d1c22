"""Prometheus targets for the engine replicas, from the engine registry: every live replica's /metrics
(Tessera's tessera_engine_* and vLLM's vllm:*), in Prometheus' HTTP service-discovery format
(https://prometheus.io/docs/prometheus/latest/http_sd/).

NOTE: why service discovery and not a PodMonitor on the engine pods: a replica serves on a port it picks
from rayService.engineWorkers.replicaPorts when it starts (engine/ports.py), and a pod holds as many
replicas as fit its GPUs, so no pod spec can name those ports. The registry can: each replica heartbeats
the address the gateway calls it at. The chart's ScrapeConfig points Prometheus at the operator's
``SCRAPE_TARGETS_PATH`` (discovery.py serves it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from tessera.registry import EngineRecord

JSON = dict[str, Any]

SCRAPE_TARGETS_PATH = "/engine-targets"
# Labels Prometheus drops after relabelling (the __meta_ prefix); the ScrapeConfig copies what it keeps.
ENGINE_ID_LABEL = "__meta_tessera_engine_id"
MODEL_LABEL = "__meta_tessera_model"


def build_scrape_targets(engines: Iterable[EngineRecord]) -> list[JSON]:
    """One target group per replica, sorted by engine id: ``host:port`` of its registered URL and its engine
    id and served model as meta labels. A replica registered twice (a restart under the same id within its
    TTL) appears once."""
    groups: dict[str, JSON] = {}
    for engine in engines:
        address = urlsplit(engine.url)
        assert address.hostname and address.port, f"engine {engine.engine_id} registered {engine.url!r}"
        groups[engine.engine_id] = {
            "targets": [f"{address.hostname}:{address.port}"],
            "labels": {ENGINE_ID_LABEL: engine.engine_id, MODEL_LABEL: engine.model},
        }
    return [groups[engine_id] for engine_id in sorted(groups)]
