"""Engines split among controller shards by a stable hash of their id (kvcontrol/sharding.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest
from pydantic import ValidationError

from tessera_operators.kvcontrol.settings import KVControlSettings
from tessera_operators.kvcontrol.sharding import shard_of


def test_one_shard_controls_everything() -> None:
    assert {shard_of(f"engine-{i}", 1) for i in range(100)} == {0}


def test_the_shard_is_the_same_in_another_process() -> None:
    # str hashes are salted per process: a shard map built on hash() would differ between controllers.
    ids = [f"tessera-engine-{i:04d}" for i in range(50)]
    here = [shard_of(engine_id, 7) for engine_id in ids]
    code = ("from tessera_operators.kvcontrol.sharding import shard_of; "
            f"print([shard_of(e, 7) for e in {ids!r}])")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert there == str(here)


def test_engines_spread_evenly_over_shards() -> None:
    counts = Counter(shard_of(f"replica-{i:05d}", 4) for i in range(1000))
    assert set(counts) == {0, 1, 2, 3}
    assert max(counts.values()) <= 300 and min(counts.values()) >= 200, counts


def test_a_shard_outside_the_count_is_refused_with_what_to_fix() -> None:
    with pytest.raises(ValidationError, match="only 2 shards"):
        KVControlSettings(redis_url="redis://127.0.0.1:1/0", kvcontrol_shard=2, kvcontrol_shards=2)
    with pytest.raises(ValueError, match="at least 1"):
        shard_of("e", 0)
