"""The garbage collector in long-running processes (tessera.telemetry.gc_heap): the startup heap frozen, each pause
counted per generation and served as a Prometheus histogram."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

from prometheus_client import CollectorRegistry, generate_latest

from tessera.telemetry.gc_heap import PAUSE_BUCKETS_S, GcPauses, GenerationPauses

FREEZE_PROBE = """
import gc, json, time
from tessera.telemetry.gc_heap import freeze_startup_heap
heap = [[i] for i in range(200_000)]  # what a process holds once started
frozen = freeze_startup_heap()
started = time.perf_counter(); gc.collect(); full_s = time.perf_counter() - started
print(json.dumps({"frozen": frozen, "full_collection_s": full_s}))
"""


def _probe(**env: str) -> dict[str, float]:
    # A process of its own: freezing this test process's heap would keep its cyclic garbage for good.
    out = subprocess.run([sys.executable, "-c", FREEZE_PROBE], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    import json

    return dict(json.loads(out.strip().splitlines()[-1]))


def test_the_startup_heap_is_frozen_and_a_full_collection_no_longer_walks_it() -> None:
    frozen = _probe()
    assert frozen["frozen"] >= 200_000
    unfrozen = _probe(TESSERA_GC_FREEZE="0")
    assert unfrozen["frozen"] == 0
    # Not a timing goal (benchmarks measure time): the frozen heap's full collection skips 200,000 objects,
    # which on any machine is many times less work than walking them.
    assert frozen["full_collection_s"] < unfrozen["full_collection_s"]


def test_pauses_fall_in_their_buckets_cumulatively() -> None:
    pauses = GenerationPauses()
    for pause_s in (0.00005, 0.0003, 0.3, 5.0):
        pauses.add(pause_s)
    assert pauses.num_collections == 4 and pauses.total_s == sum((0.00005, 0.0003, 0.3, 5.0))
    assert pauses.bucket_counts[0] == 1 and pauses.bucket_counts[1] == 1
    assert pauses.bucket_counts[PAUSE_BUCKETS_S.index(0.5)] == 1 and pauses.bucket_counts[-1] == 1


def test_each_collection_is_timed_by_generation_and_served() -> None:
    pauses = GcPauses().install()
    try:
        gc.collect(2)
        gc.collect(1)
    finally:
        pauses.uninstall()
    assert pauses.generations[2].num_collections >= 1 and pauses.generations[1].num_collections >= 1
    assert pauses.generations[2].total_s > 0
    counted = pauses.generations[2].num_collections
    gc.collect(2)  # uninstalled: no longer counted
    assert pauses.generations[2].num_collections == counted

    registry = CollectorRegistry()
    registry.register(pauses)
    text = generate_latest(registry).decode()
    assert f'tessera_gc_pause_seconds_count{{generation="2"}} {float(counted)}' in text
    assert 'tessera_gc_pause_seconds_bucket{generation="2",le="+Inf"}' in text
    assert "tessera_gc_frozen_objects " in text


def test_a_recorder_of_its_own_gets_each_pause_instead() -> None:
    """The gateway's workers record into a multiprocess histogram (summed from files): the pauses go there
    only, not also into this process's own counts."""
    seen: list[tuple[int, float]] = []
    pauses = GcPauses(on_pause=lambda generation, pause_s: seen.append((generation, pause_s))).install()
    try:
        gc.collect(2)
        gc.collect(1)
    finally:
        pauses.uninstall()
    assert seen[0][0] == 2 and seen[0][1] > 0 and any(generation == 1 for generation, _ in seen)
    assert all(g.num_collections == 0 for g in pauses.generations)
