"""The pod table's rows summed per engine (routing/pod_sums.py): the Python walk and the numpy sums agree exactly
on random tables (wrapped stamps, unknown engines, zeros and negatives included), a table of many entries is
summed with numpy, and only requests above an engine's heartbeat load reach a decision."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from tessera.routing import pod_in_flight
from tessera.routing.pod_in_flight import PodInFlight
from tessera.routing.pod_sums import INTS_PER_ENTRY, PodEngines, engine_key, sum_vectorized, sum_walked


def random_table(rng: random.Random, engine_ids: list[str]) -> tuple[np.ndarray, list[int]]:
    num_rows, entries = rng.randrange(1, 5), 200
    table = np.zeros((num_rows, 1 + entries * INTS_PER_ENTRY), dtype=np.int32)
    counts = []
    for r in range(num_rows):
        n = rng.choice((0, rng.randrange(1, 30), rng.randrange(1, entries + 1)))
        counts.append(n)
        for e in range(n):
            known = rng.random() < 0.8
            key = engine_key(rng.choice(engine_ids)) if known else rng.randrange(-2**31, 2**31)
            stamp = 0 if rng.random() < 0.2 else rng.randrange(-2**31, 2**31)
            tokens = rng.choice((0, -5, rng.randrange(1, 4000)))
            table[r, 1 + e * 4:1 + (e + 1) * 4] = (key, rng.randrange(-1, 6), tokens, stamp)
    return table, counts


def test_the_walk_and_the_numpy_sums_agree_exactly_on_random_tables() -> None:
    rng = random.Random(7)
    nonempty = 0
    for _ in range(400):
        engine_ids = [f"engine-{i}" for i in range(rng.randrange(1, 80))]
        loads = {e: rng.randrange(0, 6) for e in engine_ids if rng.random() < 0.7}
        engines = PodEngines(engine_ids, loads)
        table, counts = random_table(rng, engine_ids)
        # Near the reader's now, so waits come out both signs, across the stamps' wrap too.
        now = rng.choice((rng.randrange(-2**31, 2**31), 2**31 - 1000, -2**31 + 1000))
        rows = [memoryview(table[r]) for r in range(len(table))]
        walked = sum_walked(rows, counts, engines, now)
        summed = sum_vectorized(table, counts, engines, now)
        assert walked.requests == summed.requests
        assert walked.tokens == summed.tokens
        assert walked.waits == summed.waits  # the same float additions, in the same order
        nonempty += bool(walked.requests) + bool(walked.waits)
    assert nonempty > 300


def test_requests_at_or_under_the_heartbeat_load_are_left_out_and_prefill_is_not() -> None:
    engines = PodEngines(["a", "b", "c"], {"a": 2, "b": 1})
    table = np.zeros((2, 1 + 8 * INTS_PER_ENTRY), dtype=np.int32)
    table[0, :9] = (2, engine_key("a"), 1, 100, 0, engine_key("b"), 1, 0, 0)
    table[1, :9] = (2, engine_key("a"), 1, 0, 0, engine_key("b"), 1, 0, 0)
    table[1, 0] = 3
    table[1, 9:13] = (engine_key("c"), 1, 50, 0)
    rows = [memoryview(table[r]) for r in range(2)]
    for totals in (sum_walked(rows, [2, 3], engines, 0), sum_vectorized(table, [2, 3], engines, 0)):
        # a: 2 in flight, heartbeat 2 (no decision changes); b: 2 against 1; c: 1 against none
        assert totals.requests == {"b": 2, "c": 1}
        assert totals.tokens == {"a": 100, "c": 50}


@pytest.mark.parametrize("many", [False, True])
def test_a_table_of_many_entries_is_summed_with_numpy_and_a_small_one_walked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, many: bool) -> None:
    path = tmp_path / "pod.table"
    pod_in_flight.create(path, 2)
    first, second = PodInFlight.attach(path), PodInFlight.attach(path)
    assert first is not None and second is not None
    used: list[str] = []
    monkeypatch.setattr(pod_in_flight, "sum_walked", lambda *a: used.append("walked") or sum_walked(*a))
    monkeypatch.setattr(pod_in_flight, "sum_vectorized", lambda *a: used.append("numpy") or sum_vectorized(*a))
    try:
        engine_ids = [f"engine-{i}" for i in range(300)]
        for i, engine_id in enumerate(engine_ids[:200 if many else 20]):
            (first if i % 2 else second).add(engine_id, 1, 10)
        totals = first.totals(PodEngines(engine_ids), 0.0)
        assert len(totals.requests) == len(totals.tokens) == (200 if many else 20)
        assert used == ["numpy" if many else "walked"]
    finally:
        first.close()
        second.close()
