"""The garbage collector in long-running processes (tessera.telemetry.gc_heap): the startup heap frozen, each pause
counted per generation and served as a Prometheus histogram."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tessera.telemetry import gc_heap
from tessera.telemetry.gc_heap import PAUSE_BUCKETS_S, GcPauses, GenerationPauses

FREEZE_PROBE = """
import gc, json, time
from tessera.telemetry.gc_heap import freeze_startup_heap
heap = [[i] for i in range(200_000)]  # what a process holds once started
frozen = freeze_startup_heap()
started = time.perf_counter(); gc.collect(); full_s = time.perf_counter() - started
print(json.dumps({"frozen": frozen, "full_collection_s": full_s, "young_threshold": gc.get_threshold()[0]}))
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


def test_once_started_the_young_generation_is_collected_less_often() -> None:
    # A request's thousands of short-lived objects: at Python's 700 the young generation was walked several times a
    # request (gc_heap.YOUNG_THRESHOLD).
    assert _probe()["young_threshold"] == gc_heap.YOUNG_THRESHOLD > 700
    assert _probe(TESSERA_GC_FREEZE="0")["young_threshold"] == gc_heap.YOUNG_THRESHOLD
    assert _probe(TESSERA_GC_YOUNG_THRESHOLD="700")["young_threshold"] == 700


@pytest.mark.parametrize("raw", ["lots", "-5", "0", "1.5"])
def test_a_young_threshold_that_is_no_count_says_what_to_give(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gc_heap.YOUNG_THRESHOLD_ENV, raw)
    monkeypatch.setenv(gc_heap.FREEZE_ENV, "0")  # (this test process's heap stays unfrozen)
    before = gc.get_threshold()
    with pytest.raises(ValueError, match="whole number of allocations"):
        gc_heap.freeze_startup_heap()
    assert gc.get_threshold() == before


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


def _counting_freeze_count(monkeypatch: pytest.MonkeyPatch, frozen: int) -> list[int]:
    """``gc.get_freeze_count`` replaced by one that records each call: the real one walks every frozen
    object (~50 ms for an engine replica's ~700,000)."""
    calls: list[int] = []

    def count() -> int:
        calls.append(frozen)
        return frozen

    monkeypatch.setattr(gc, "get_freeze_count", count)
    monkeypatch.setattr(gc_heap, "_frozen_at_start", None)
    return calls


def _scrape(pauses: GcPauses) -> str:
    registry = CollectorRegistry()
    registry.register(pauses)
    return generate_latest(registry).decode()


def test_scrapes_serve_the_frozen_count_noted_at_the_freeze_without_counting_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting_freeze_count(monkeypatch, 654_321)
    assert gc_heap.note_frozen_heap() == 654_321  # where the process froze its heap (or Serve did, for it)
    texts = [_scrape(GcPauses()) for _ in range(3)]
    assert len(calls) == 1
    assert all("tessera_gc_frozen_objects 654321.0" in text for text in texts)


def test_a_process_that_noted_nothing_counts_once_on_its_first_scrape(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting_freeze_count(monkeypatch, 4_321)
    texts = [_scrape(GcPauses()) for _ in range(3)]
    assert len(calls) == 1
    assert all("tessera_gc_frozen_objects 4321.0" in text for text in texts)


def test_kept_pauses_are_taken_once_in_order() -> None:
    pauses = GcPauses(keep_pending=True).install()
    try:
        gc.collect(2)
        gc.collect(1)
    finally:
        pauses.uninstall()
    taken = pauses.take_pending()
    assert taken[0][0] == 2 and taken[0][1] > 0 and any(generation == 1 for generation, _ in taken)
    assert pauses.take_pending() == []
    assert pauses.generations[2].num_collections >= 1  # counted as well


# A worker's metrics as the gateway keeps them: multiprocess values (one non-reentrant lock per process),
# new labelled children (a new tenant) created while the collector runs at nearly every allocation.
_LOCK_SCENARIO = """
import gc, sys
from prometheus_client import CollectorRegistry, Counter, generate_latest, multiprocess
from tessera.gateway.metrics import gc_pause_exporter
from tessera.telemetry.gc_heap import process_gc_pauses
pauses = process_gc_pauses(keep_pending=True)
export = gc_pause_exporter()
requests = Counter("scenario_requests_total", "requests", ["tenant"], registry=None)
gc.set_threshold(1)
for i in range(300):
    requests.labels(f"tenant-{i}").inc()
    if i % 10 == 0:
        export(pauses.take_pending())
gc.set_threshold(700)
export(pauses.take_pending())
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry, sys.argv[1])
print(generate_latest(registry).decode())
"""


def test_a_collection_inside_the_metrics_lock_does_not_deadlock_the_worker(tmp_path: Path) -> None:
    """The collector can start inside prometheus_client's multiprocess lock (a new labelled child allocates
    while holding it). The pause callback once observed into a multiprocess histogram from there and the
    worker's thread waited on its own lock for ever: a gateway worker that neither answered nor closed its
    connections. The pauses now leave the callback as plain data and reach the histogram from the worker's
    tick. (Run in a child process: a deadlock is a timeout here, not a hung test run.)"""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", _LOCK_SCENARIO, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'scenario_requests_total{tenant="tenant-299"} 1.0' in done.stdout
    counts = [float(line.rsplit(" ", 1)[1]) for line in done.stdout.splitlines()
              if line.startswith("tessera_gc_pause_seconds_count")]
    assert sum(counts) > 0, "the pauses reached the workers' histogram"
