"""Prometheus HTTP-SD target groups from the engine registry (scrape_targets.py)."""

from __future__ import annotations

import pytest

from tessera.registry import EngineRecord
from tessera_operators.operator.scrape_targets import build_scrape_targets


def _engine(engine_id: str, url: str, model: str = "llama") -> EngineRecord:
    return EngineRecord(engine_id=engine_id, url=url, model=model, block_size=16, num_gpu_blocks=100,
                        max_model_len=2048)


def test_one_group_per_replica_with_its_address_and_meta_labels() -> None:
    groups = build_scrape_targets([
        _engine("engine-b", "http://10.0.0.7:41234", "qwen"),
        _engine("engine-a", "http://10.0.0.7:35000"),
        _engine("engine-a", "http://10.0.0.9:35001"),  # re-registered after a restart: the latest wins
    ])
    assert groups == [
        {"targets": ["10.0.0.9:35001"],
         "labels": {"__meta_tessera_engine_id": "engine-a", "__meta_tessera_model": "llama"}},
        {"targets": ["10.0.0.7:41234"],
         "labels": {"__meta_tessera_engine_id": "engine-b", "__meta_tessera_model": "qwen"}},
    ]
    assert build_scrape_targets([]) == []


def test_a_url_without_a_port_is_an_invariant_violation() -> None:
    with pytest.raises(AssertionError, match="engine-a"):
        build_scrape_targets([_engine("engine-a", "http://10.0.0.7")])
